"""ReLU² (Nemotron's activation) and Nemotron's MLP, fwd+bwd on one GPU: eager, torch.compile,
Liger 0.8.5 and ours, side by side in one run (time, bandwidth or TFLOP/s, extra peak memory).

    python scripts/bench_relu2.py                      # prints the table
    python scripts/bench_relu2.py --out DIR            # also DIR/relu2.json and DIR/relu2.md

Cases (bf16, random inputs):
- ReLU² alone, x 16384x14336: transformers' ReLUSquaredActivation, Liger's
  LigerReLUSquaredFunction, ours in place (d(x) over x, as the MLP layer's composed path runs it)
  and out of place (the functional default).
- The MLP down(relu(up(x))^2), Nemotron-Mini-4B dims (hidden 3072, intermediate 9216) at 16384
  tokens: NemotronMLP as it is, with Liger's ReLU² as its act_fn (what Liger's nemotron patch
  does), and with ours (the ReLUSquaredMLP layer, which keeps up(x) alone for the backward).

Needs CUDA; on a machine without it, says so and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

DT = torch.bfloat16
B2 = 2  # bytes per bf16 element


def _liger_relu_squared():
    """Liger's ReLU² autograd function's apply, or the ImportError text (reported per row)."""
    try:
        from liger_kernel.ops.relu_squared import LigerReLUSquaredFunction
    except ImportError as exc:
        return f"liger-kernel missing: {exc}"

    def apply(x):
        out = LigerReLUSquaredFunction.apply(x)
        return out[0] if isinstance(out, tuple) else out  # some versions also return x

    return apply


def _randn(*shape, requires_grad=True):
    return torch.randn(*shape, device="cuda", dtype=DT, requires_grad=requires_grad)


def relu2_case(m: int, n: int):
    from bench_cases_elementwise import _impls
    from bench_harness import Case, load_training_kernels
    from transformers.activations import ReLUSquaredActivation

    kt, liger = load_training_kernels(), _liger_relu_squared()

    def eager():
        act, x = ReLUSquaredActivation(), _randn(m, n)
        return (lambda: act(x)), [x]

    def ours():
        x = _randn(m, n)
        return (lambda: kt.relu_squared(x, in_place=True)), [x]

    def ours_out_of_place():
        x = _randn(m, n)
        return (lambda: kt.relu_squared(x)), [x]

    def liger_impl():
        if isinstance(liger, str):
            raise RuntimeError(liger)
        x = _randn(m, n)
        return (lambda: liger(x)), [x]

    elems = m * n
    return Case(
        op="ReLU² relu(x)^2",
        shape=f"x {m}x{n}",
        impls=_impls(eager, ours, liger_impl, extra={"ours out of place": ours_out_of_place}),
        bytes_fwd=2 * B2 * elems,  # read x, write y
        bytes_fwd_bwd=5 * B2 * elems,  # + read dy and x, write dx
    )


def mlp_case(tokens: int, hidden: int, inter: int):
    from bench_cases_elementwise import _impls
    from bench_harness import Case, load_training_kernels
    from transformers import NemotronConfig
    from transformers.models.nemotron.modeling_nemotron import NemotronMLP

    kt, liger = load_training_kernels(), _liger_relu_squared()
    config = NemotronConfig(hidden_size=hidden, intermediate_size=inter, mlp_bias=False)

    def build():
        mlp = NemotronMLP(config).to(device="cuda", dtype=DT)
        x = _randn(tokens, hidden)
        return mlp, x, [x, mlp.up_proj.weight, mlp.down_proj.weight]

    def eager():
        mlp, x, leaves = build()
        return (lambda: mlp(x)), leaves

    def liger_impl():
        if isinstance(liger, str):
            raise RuntimeError(liger)
        mlp, x, leaves = build()
        mlp.act_fn.forward = liger  # Liger's nemotron patch swaps the activation only
        return (lambda: mlp(x)), leaves

    def ours():
        mlp, x, leaves = build()
        mlp.forward = types.MethodType(kt.layers.ReLUSquaredMLP.forward, mlp)
        return (lambda: mlp(x)), leaves

    return Case(
        op="Nemotron MLP down(relu(up(x))^2)",
        shape=f"T {tokens} H {hidden} I {inter}",
        impls=_impls(eager, ours, liger_impl),
        flops_fwd_bwd=12 * tokens * hidden * inter,  # 2 matmuls forward, 4 backward
        notes=["extra MiB: peak above inputs, weights and the returned gradients"],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="", help="folder for relu2.json and relu2.md")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_relu2: needs a CUDA GPU; nothing measured")
        return 0
    from bench_harness import dump, format_table, measure_ceilings, run_case

    ceil = measure_ceilings()
    rows = []
    for case in (relu2_case(16384, 14336), mlp_case(16384, 3072, 9216)):
        rows += run_case(case, ceil, rounds=args.rounds)
    from importlib.metadata import PackageNotFoundError, version

    import transformers
    import triton

    try:
        liger_version = version("liger-kernel")
    except PackageNotFoundError:
        liger_version = "missing"
    head = (
        f"{datetime.date.today()}, {torch.cuda.get_device_name()}, {platform.machine()}; "
        f"torch {torch.__version__}, triton {triton.__version__}, transformers "
        f"{transformers.__version__}, liger-kernel {liger_version}"
    )
    text = head + "\n\n" + format_table(rows, ceil)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        dump(rows, ceil, str(out / "relu2.json"))
        (out / "relu2.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
