"""Can a compiled backward skip the fused loss head's gradient scale when grad_output is 1? (CPU)

The fused linear cross-entropy computes d(hidden) and d(weight) in the forward; its backward
only multiplies them by grad_output. Eager skips that pass on the device when the factor is 1
(scale_rows_). Compiled, `flce_fwd`'s registered backward is `saved * g`, one read and one write
of d(weight) (0.49 ms a step at Llama-3-8B's 128256 x 4096 on an H200, docs/compile.md). This
probe compiles a toy op with the same structure (a forward that returns gradients, a backward
that scales them) with Inductor, in two variants of the backward:

- "mul": `saved * g`, what flce_fwd does;
- "inplace": a custom op that mutates the saved buffer, skipping the work when g is 1.

and prints each backward's generated `call` body and whether the gradients are right. In the
"inplace" variant Inductor first copies each saved buffer onto itself (the functional clone of
a backward input, landed on the donated buffer), so the pass is not avoided.

    python scripts/probes/probe_grad_scale_inplace_cpu.py
"""

from __future__ import annotations

import torch
from torch._inductor.utils import run_and_get_code

torch._inductor.config.fx_graph_cache = False  # the variants differ only in Python state
torch._functorch.config.enable_autograd_cache = False

VARIANT = {"backward": "mul"}


@torch.library.custom_op("probe_grad_scale::fwd", mutates_args=())
def fwd(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sum(x @ w.T) and its gradients, computed in the forward (as flce_fwd does)."""
    ones = torch.ones(x.shape[0], w.shape[0])
    return (x @ w.t()).sum(), ones @ w, ones.t() @ x


@fwd.register_fake
def _(x, w):
    return x.new_empty(()), torch.empty_like(x), torch.empty_like(w)


@torch.library.custom_op("probe_grad_scale::scale_", mutates_args=("t",))
def scale_(t: torch.Tensor, g: torch.Tensor) -> None:
    if g.item() != 1.0:  # eager's kernel reads the factor on the device; the CPU stands in
        t.mul_(g)


@scale_.register_fake
def _(t, g):
    return None


def _setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[2])


def _backward(ctx, g, *_):
    dx, dw = ctx.saved_tensors
    if VARIANT["backward"] == "mul":
        return dx * g, dw * g
    scale_(dx, g)
    scale_(dw, g)
    return dx, dw


fwd.register_autograd(_backward, setup_context=_setup)


def backward_code(variant: str) -> tuple[str, bool]:
    """The compiled backward's `call` body and whether x.grad and w.grad are right."""
    VARIANT["backward"] = variant
    torch._dynamo.reset()
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(128, 32, requires_grad=True)
    step = torch.compile(lambda a, b: fwd(a, b)[0], fullgraph=True)
    _, codes = run_and_get_code(lambda: step(x, w).backward())
    code = codes[-1]
    body = code[code.index("def call(") : code.index("runner = Runner")].rstrip()
    ok = torch.allclose(x.grad, torch.ones(64, 128) @ w) and torch.allclose(
        w.grad, torch.ones(128, 64) @ x
    )
    kernels = {
        name: code[code.index(f"{name} = ") :].split("'''")[1]
        for name in ("cpp_fused_0", "cpp_fused_1")
        if f"{name} = " in code
    }
    for name, src in kernels.items():
        loop = [ln.strip() for ln in src.splitlines() if "loadu" in ln or ".store(" in ln]
        body += f"\n    # {name}: " + " | ".join(loop)
    return body, ok


def main() -> int:
    print(f"torch {torch.__version__}")
    for variant in ("mul", "inplace"):
        body, ok = backward_code(variant)
        print(f"\n== backward variant {variant!r}: gradients right: {ok}\n{body}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
