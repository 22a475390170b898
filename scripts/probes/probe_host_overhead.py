"""Host work per call of the training kernels' Python paths, this tree against a git revision.

    python scripts/probes/probe_host_overhead.py --baseline REV [--calls 300] [--rounds 7]

The training step is bound by the CPU that issues the work (docs/benchmarks/training.md), so
the Python around each launch counts. This measures it on the CPU: TRITON_INTERPRET=1 sends CPU
tensors down the Triton path, and every kernel launch is replaced by a no-op, so what is timed
is everything but the launch itself (argument checks, allocation, config lookup, autograd).
Tensors are small (see cases()); with the launches gone their size matters only to the CPU's
allocator. The two versions of the variant folder take turns for `--rounds`
rounds of `--calls` calls each (the garbage collector paused); the fastest round counts, since
noise on a shared machine only ever adds time. One table, microseconds per call; a
plain autograd add (forward and backward) is the yardstick. On a GPU the launch is added to
both sides alike.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: CPU tensors take Triton paths

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/: the bench harness
import torch  # noqa: E402
from bench_harness import load_training_kernels, per_call_us, variant_at  # noqa: E402
from bench_train import cpu_model  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _no_launch(self, grid):
    return lambda *args, **kwargs: None


InterpretedFunction.__getitem__ = _no_launch  # every kernel[grid](...) does nothing


class Inputs:
    """Small tensors: the CPU allocator's cost for big ones would swamp the rest (the GPU's
    caching allocator does not have it). Head counts and head_dim are Qwen3-0.6B's."""

    def __init__(self) -> None:
        b, t, hidden, inter, d = 2, 16, 256, 512, 128

        def leaf(*shape):
            return torch.randn(*shape).requires_grad_()

        self.hidden = hidden
        self.x, self.r, self.w = leaf(b, t, hidden), leaf(b, t, hidden), leaf(hidden)
        self.g = torch.randn(b, t, hidden)
        self.q = leaf(b, t, 16, d).transpose(1, 2)
        self.k = leaf(b, t, 8, d).transpose(1, 2)
        emb = torch.randn(b, t, d // 2).repeat(1, 1, 2)
        self.cos, self.sin = emb.cos(), emb.sin()
        self.gq, self.gk = torch.randn_like(self.q), torch.randn_like(self.k)
        self.a, self.c = leaf(b * t, inter), leaf(b * t, inter)
        self.ga = torch.randn(b * t, inter)


def _grad(outs, leaves, grads):
    return lambda: torch.autograd.grad(outs(), leaves, grads)


def our_cases(kt, i: Inputs) -> dict:
    """name -> a zero-argument call of one op, forward (under no_grad) or forward + backward."""
    sys.modules[kt.__name__ + ".rope"].MIN_CHECKED_ELEMENTS = 0  # as at the anchor's size
    x, r, w, g = i.x, i.r, i.w, i.g
    cases = {
        "autograd add (yardstick)": _grad(lambda: (x + r,), (x, r), (g,)),
        "rms_norm fwd": torch.no_grad()(lambda: kt.rms_norm(x, w, 1e-6)),
        "rms_norm fwd+bwd": _grad(lambda: (kt.rms_norm(x, w, 1e-6),), (x, w), (g,)),
        "rms_norm save_output fwd+bwd": _grad(
            lambda: (kt.rms_norm(x, w, 1e-6, save_output=True),), (x, w), (g,)
        ),
        "layer_norm fwd": torch.no_grad()(lambda: kt.layer_norm(x, w, w, 1e-5)),
        "layer_norm fwd+bwd": _grad(lambda: (kt.layer_norm(x, w, w, 1e-5),), (x, w), (g,)),
        "rope fwd": torch.no_grad()(lambda: kt.apply_rotary_pos_emb(i.q, i.k, i.cos, i.sin)),
        "rope fwd+bwd": _grad(
            lambda: kt.apply_rotary_pos_emb(i.q, i.k, i.cos, i.sin), (i.q, i.k), (i.gq, i.gk)
        ),
        "silu_mul fwd": torch.no_grad()(lambda: kt.silu_mul(i.a, i.c)),
        "silu_mul fwd+bwd": _grad(lambda: (kt.silu_mul(i.a, i.c),), (i.a, i.c), (i.ga,)),
    }
    if hasattr(kt, "fused_add_rms_norm"):
        cases["fused add + rms_norm fwd+bwd"] = _grad(
            lambda: kt.fused_add_rms_norm(x, r, w, 1e-6), (x, r, w), (g, g)
        )
    return cases


def liger_cases(i: Inputs) -> dict:
    """The same calls through Liger's layers and functions, where it has the op."""
    import liger_kernel.transformers as lt
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    from liger_kernel.transformers.fused_add_rms_norm import LigerFusedAddRMSNorm
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    x, r, g = i.x, i.r, i.g
    norm, ln = lt.LigerRMSNorm(i.hidden, eps=1e-6), lt.LigerLayerNorm(i.hidden)
    add_norm = LigerFusedAddRMSNorm(i.hidden, eps=1e-6)
    return {
        "autograd add (yardstick)": _grad(lambda: (x + r,), (x, r), (g,)),
        "rms_norm fwd": torch.no_grad()(lambda: norm(x)),
        "rms_norm fwd+bwd": _grad(lambda: (norm(x),), (x, norm.weight), (g,)),
        "layer_norm fwd": torch.no_grad()(lambda: ln(x)),
        "layer_norm fwd+bwd": _grad(lambda: (ln(x),), (x, ln.weight), (g,)),
        "rope fwd": torch.no_grad()(lambda: liger_rotary_pos_emb(i.q, i.k, i.cos, i.sin)),
        "rope fwd+bwd": _grad(
            lambda: liger_rotary_pos_emb(i.q, i.k, i.cos, i.sin), (i.q, i.k), (i.gq, i.gk)
        ),
        "silu_mul fwd": torch.no_grad()(lambda: LigerSiLUMulFunction.apply(i.a, i.c)),
        "silu_mul fwd+bwd": _grad(
            lambda: (LigerSiLUMulFunction.apply(i.a, i.c),), (i.a, i.c), (i.ga,)
        ),
        "fused add + rms_norm fwd+bwd": _grad(
            lambda: add_norm(x, r), (x, r, add_norm.weight), (g, g)
        ),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="git revision to compare with, e.g. HEAD~3")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()

    inputs = Inputs()
    with tempfile.TemporaryDirectory() as tmp:
        impls = {
            "baseline": our_cases(
                load_training_kernels(variant_at(args.baseline, Path(tmp))), inputs
            ),
            "this tree": our_cases(load_training_kernels(), inputs),
        }
        try:
            impls["Liger"] = liger_cases(inputs)
        except ImportError as exc:
            print(f"Liger left out: {exc}")
        names = list(impls["this tree"])
        rounds: dict[tuple[str, str], list[float]] = {}
        for name in names:
            present = {impl: fns for impl, fns in impls.items() if name in fns}
            for fns in present.values():
                fns[name]()  # warm: first-call work (checks, caches) is not counted
            for _ in range(args.rounds):
                for impl, fns in present.items():
                    rounds.setdefault((impl, name), []).append(per_call_us(fns[name], args.calls))

    rev = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", args.baseline],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    import platform

    import triton

    print(f"host work per call, µs (fastest of {args.rounds} rounds of {args.calls} calls; Triton "
          f"launches replaced by no-ops)\n{time.strftime('%Y-%m-%d')}, {cpu_model()} "
          f"({os.cpu_count()} CPUs), Python {platform.python_version()}, torch {torch.__version__}, "
          f"triton {triton.__version__}")  # fmt: skip
    liger = ""
    if "Liger" in impls:
        import importlib.metadata

        liger = f" (liger-kernel {importlib.metadata.version('liger-kernel')})"
    print(f"\n| op | baseline {rev} | this tree | change | Liger{liger} |\n|---|---|---|---|---|")

    def cell(impl: str, name: str) -> str:
        times = rounds.get((impl, name))
        return f"{min(times):.1f}" if times else "—"

    for name in names:
        change = "—"
        if ("baseline", name) in rounds:
            b, h = min(rounds[("baseline", name)]), min(rounds[("this tree", name)])
            change = f"{(h - b) / b * 100:+.0f} %"
        print(f"| {name} | {cell('baseline', name)} | {cell('this tree', name)} | {change} "
              f"| {cell('Liger', name)} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
