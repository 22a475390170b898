"""Host cost of calling an op through torch.library, by how it is registered (CPU).

Inside a default-mode compiled graph each of the kernels' ops is called as
``torch.ops.<ns>.<op>.default(...)`` on tensors that need no gradient. This times one such call,
its body only allocating two outputs (as RMSNorm's forward does), registered four ways:

  body              the Python function itself, no dispatch
  custom_op         torch.library.custom_op with register_autograd (how the kernels' ops are made)
  custom_op, no bw  custom_op without register_autograd
  Library           Library.define + impl(CompositeExplicitAutograd) + register_fake
  Library + bw      the same with torch.library.register_autograd

under no_grad and in grad mode (inputs not requiring grad). µs per call, best of 7 rounds.

    python scripts/probes/probe_custom_op_dispatch_cpu.py [--calls 20000]
"""

import argparse
import time

import torch


def body(x, w):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1])


def backward(ctx, dy, _drstd):
    return dy, None


def setup(ctx, inputs, output):
    pass


def register() -> tuple[dict, torch.library.Library]:
    """(name -> the op's overload for the four registrations, the Library holding two of them:
    its registrations last as long as it does)."""

    @torch.library.custom_op("dispatch_probe::with_bw", mutates_args=())
    def with_bw(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return body(x, w)

    with_bw.register_fake(body)
    with_bw.register_autograd(backward, setup_context=setup)

    @torch.library.custom_op("dispatch_probe::no_bw", mutates_args=())
    def no_bw(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return body(x, w)

    no_bw.register_fake(body)

    lib = torch.library.Library("dispatch_probe", "FRAGMENT")
    for name, autograd in (("lib", False), ("lib_bw", True)):
        lib.define(f"{name}(Tensor x, Tensor w) -> (Tensor, Tensor)")
        lib.impl(name, body, "CompositeExplicitAutograd")
        torch.library.register_fake(f"dispatch_probe::{name}", body, lib=lib)
        if autograd:
            torch.library.register_autograd(
                f"dispatch_probe::{name}", backward, setup_context=setup, lib=lib
            )
    ops = torch.ops.dispatch_probe
    return {"custom_op": ops.with_bw.default, "custom_op, no bw": ops.no_bw.default,
            "Library": ops.lib.default, "Library + bw": ops.lib_bw.default}, lib  # fmt: skip


def per_call_us(fn, calls: int, rounds: int = 7) -> float:
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20000)
    args = p.parse_args()
    ops, _lib = register()
    x, w = torch.randn(8, 128), torch.randn(128)
    rows = []
    for name, fn in {"body": body, **ops}.items():
        with torch.no_grad():
            nograd = per_call_us(lambda fn=fn: fn(x, w), args.calls)
        grad = per_call_us(lambda fn=fn: fn(x, w), args.calls)
        rows.append(f"| {name} | {nograd:.2f} | {grad:.2f} |")
    print(f"torch {torch.__version__}, one op call, body allocating two outputs, µs (best of 7)\n")
    print("| registration | no_grad | grad mode, inputs without grad |")
    print("|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
