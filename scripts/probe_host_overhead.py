"""Host work per call of the training kernels' Python paths, this tree against a git revision.

    python scripts/probe_host_overhead.py --baseline REV [--calls 300] [--rounds 7]

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
import gc
import importlib.util
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: CPU tensors take Triton paths

import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VARIANT = "hub_kernels/kernels-lab/training/build/torch-universal"


def _no_launch(self, grid):
    return lambda *args, **kwargs: None


InterpretedFunction.__getitem__ = _no_launch  # every kernel[grid](...) does nothing


def load(folder: Path, name: str):
    spec = importlib.util.spec_from_file_location(
        name, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def checkout(rev: str, into: Path) -> Path:
    """The variant folder as committed at `rev`, extracted under `into`."""
    data = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, VARIANT], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into / VARIANT


def cases(kt) -> dict:
    """name -> a zero-argument call of one op, forward (under no_grad) or forward + backward."""
    # Small tensors: the CPU allocator's cost for big ones would swamp the rest (the GPU's
    # caching allocator does not have it). Head counts and head_dim are Qwen3-0.6B's; the RoPE
    # halves check is on at any size, as it is at the anchor's.
    sys.modules[kt.__name__ + ".rope"].MIN_CHECKED_ELEMENTS = 0
    b, t, hidden, inter, d = 2, 16, 256, 512, 128

    def leaf(*shape):
        return torch.randn(*shape).requires_grad_()

    x, r, w = leaf(b, t, hidden), leaf(b, t, hidden), leaf(hidden)
    g = torch.randn(b, t, hidden)
    q = leaf(b, t, 16, d).transpose(1, 2)
    k = leaf(b, t, 8, d).transpose(1, 2)
    emb = torch.randn(b, t, d // 2).repeat(1, 1, 2)
    cos, sin = emb.cos(), emb.sin()
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    a, c, ga = leaf(b * t, inter), leaf(b * t, inter), torch.randn(b * t, inter)

    def grad(outs, leaves, grads):
        return lambda: torch.autograd.grad(outs(), leaves, grads)

    return {
        "autograd add (yardstick)": grad(lambda: (x + r,), (x, r), (g,)),
        "rms_norm fwd": lambda: kt.rms_norm(x.detach(), w.detach(), 1e-6),
        "rms_norm fwd+bwd": grad(lambda: (kt.rms_norm(x, w, 1e-6),), (x, w), (g,)),
        "rms_norm save_output fwd+bwd": grad(
            lambda: (kt.rms_norm(x, w, 1e-6, save_output=True),), (x, w), (g,)
        ),
        "layer_norm fwd+bwd": grad(lambda: (kt.layer_norm(x, w, w, 1e-5),), (x, w), (g,)),
        "rope fwd+bwd": grad(lambda: kt.apply_rotary_pos_emb(q, k, cos, sin), (q, k), (gq, gk)),
        "silu_mul fwd+bwd": grad(lambda: (kt.silu_mul(a, c),), (a, c), (ga,)),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def per_call_us(fn, calls: int) -> float:
    gc.collect()
    gc.disable()
    try:
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t) / calls * 1e6
    finally:
        gc.enable()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="git revision to compare with, e.g. HEAD~3")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        base = load(checkout(args.baseline, Path(tmp)), "_host_probe_baseline")
        here = load(ROOT / VARIANT, "_host_probe_current")
        impls = {"baseline": cases(base), "this tree": cases(here)}
        names = list(impls["this tree"])
        rounds: dict[tuple[str, str], list[float]] = {}
        for name in names:
            for fns in impls.values():
                fns[name]()  # warm: first-call work (checks, caches) is not counted
            for _ in range(args.rounds):
                for impl, fns in impls.items():
                    rounds.setdefault((impl, name), []).append(per_call_us(fns[name], args.calls))

    rev = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", args.baseline],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    import platform

    import triton

    print(f"host work per call, µs (fastest of {args.rounds} rounds of {args.calls} calls; Triton "
          f"launches replaced by no-ops)\n{time.strftime('%Y-%m-%d')}, {_cpu_model()} "
          f"({os.cpu_count()} CPUs), Python {platform.python_version()}, torch {torch.__version__}, "
          f"triton {triton.__version__}")  # fmt: skip
    print(f"\n| op | baseline {rev} | this tree | change |\n|---|---|---|---|")
    for name in names:
        b = min(rounds[("baseline", name)])
        h = min(rounds[("this tree", name)])
        print(f"| {name} | {b:.1f} | {h:.1f} | {(h - b) / b * 100:+.0f} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
