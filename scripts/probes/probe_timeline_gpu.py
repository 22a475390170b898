"""Where one forward+backward call's host time goes, step by step: a diagnosis, not a benchmark.

    python scripts/probes/probe_timeline_gpu.py [--calls 300] [--baseline DIR]

Wraps the training kernels' autograd.Functions (forward, backward), their plans' calls, every
bound Triton launch and torch's allocators with time stamps, runs `torch.autograd.grad(fwd(),
leaves, g)` in a loop (no sync inside), and prints, per case and with the autograd engine's device
threads on and off, the median microseconds between consecutive stamps: what the caller pays
before our forward starts, inside it, between the forward's end and the backward's start (the
engine's handoff), inside the backward, and after it. The wrappers cost ~0.3 µs a stamp; the
"total" column of the unwrapped run is beside it. torch's own ops and a do-nothing
autograd.Function run in the same loop for scale. With ``--baseline DIR`` (another copy of the
training variant folder, e.g. from ``git archive``) the unwrapped totals of both versions are
first taken in turns (5 rounds, median) before anything is wrapped.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_harness import load_training_kernels  # noqa: E402
from probe_wall_gpu import rope_anchor_case  # noqa: E402

DT = torch.bfloat16
EV: list[tuple[str, int]] = []
_now = time.perf_counter_ns


def mark(label: str) -> None:
    EV.append((label, _now()))


def _wrapped(f, label):
    def w(*a, **k):
        EV.append((label + ">", _now()))
        r = f(*a, **k)
        EV.append((label + "<", _now()))
        return r

    return w


def instrument(kt) -> None:
    """Stamp the Functions, plans, launches and allocations of the loaded training variant."""
    common = sys.modules[kt.__name__ + "._common"]
    common.BoundLaunch.__call__ = _wrapped(common.BoundLaunch.__call__, "launch")
    for name in ("rms_norm", "swiglu", "rope"):
        mod = sys.modules[f"{kt.__name__}.{name}"]
        for attr, obj in list(vars(mod).items()):
            if not isinstance(obj, type) or obj.__module__ != mod.__name__:
                continue
            if issubclass(obj, torch.autograd.Function):
                obj.forward = staticmethod(_wrapped(obj.forward, f"{attr}.fwd"))
                obj.backward = staticmethod(_wrapped(obj.backward, f"{attr}.bwd"))
            elif attr.endswith("Plan") and "__call__" in vars(obj):
                obj.__call__ = _wrapped(obj.__call__, attr)
    for name in ("empty_strided", "empty", "empty_like"):
        setattr(torch, name, _wrapped(getattr(torch, name), name))


class _Noop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, g):
        return g


def cases(kt) -> dict:
    def leaf(*shape):
        return torch.randn(*shape, device="cuda", dtype=DT).requires_grad_()

    out = {}
    x, w = leaf(4096, 1024), leaf(1024)
    gx = (torch.randn(4096, 1024, device="cuda", dtype=DT),)
    out["noop Function 4096x1024"] = (lambda: _Noop.apply(x), [x], gx)
    out["F.rms_norm 4096x1024"] = (lambda: F.rms_norm(x, (1024,), w, 1e-6), [x, w], gx)
    out["ours rms_norm 4096x1024"] = (lambda: kt.rms_norm(x, w, 1e-6), [x, w], gx)
    a, b = leaf(4096, 3072), leaf(4096, 3072)
    ga = (torch.randn(4096, 3072, device="cuda", dtype=DT),)
    out["torch silu*mul 4096x3072"] = (lambda: F.silu(a) * b, [a, b], ga)
    out["ours silu_mul 4096x3072"] = (lambda: kt.silu_mul(a, b), [a, b], ga)
    out["ours rope anchor"] = rope_anchor_case(kt)
    return out


def run(fwd, leaves, g, calls: int) -> tuple[float, dict]:
    """Median µs per call, and the median µs of each transition between consecutive stamps."""
    for _ in range(20):
        torch.autograd.grad(fwd(), leaves, g)
    torch.cuda.synchronize()
    EV.clear()
    totals = []
    for _ in range(calls):
        t0 = _now()
        mark("call")
        torch.autograd.grad(fwd(), leaves, g)
        mark("return")
        totals.append((_now() - t0) / 1e3)
    torch.cuda.synchronize()
    steps: dict[str, list[float]] = defaultdict(list)
    order: list[str] = []
    prev = None
    seen: dict[str, int] = {}
    for label, t in EV:
        if label == "call":
            prev = (label, t)
            seen.clear()
            continue
        seen[label] = seen.get(label, 0) + 1
        if seen[label] > 1:  # a second launch or allocation in the same call: its own row
            label = f"{label}#{seen[label]}"
        key = f"{prev[0]} -> {label}"
        if key not in steps:
            order.append(key)
        steps[key].append((t - prev[1]) / 1e3)
        prev = (label, t)
    return statistics.median(totals), {k: statistics.median(steps[k]) for k in order}


def compare(new: dict, base: dict, calls: int, rounds: int = 5) -> None:
    """Unwrapped µs per call of this tree's cases and the baseline's, taking turns."""
    print(f"== this tree against the baseline: median of {rounds} rounds of {calls} calls")
    print("| case | threads | baseline µs | this tree µs | change |")
    for threads in (True, False):
        torch.autograd.set_multithreading_enabled(threads)
        for name in new:
            if not name.startswith("ours"):
                continue
            times: dict[str, list[float]] = {"base": [], "new": []}
            for _ in range(rounds):
                for which, table in (("base", base), ("new", new)):
                    times[which].append(run(*table[name], calls)[0])
            b, n = statistics.median(times["base"]), statistics.median(times["new"])
            print(f"| {name} | {'on' if threads else 'off'} | {b:.1f} | {n:.1f} | "
                  f"{(n / b - 1) * 100:+.1f} % |")  # fmt: skip
    torch.autograd.set_multithreading_enabled(True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--baseline", type=Path, default=None)
    args = parser.parse_args()
    kt = load_training_kernels()
    all_cases = cases(kt)
    if args.baseline is not None:
        compare(all_cases, cases(load_training_kernels(args.baseline.resolve())), args.calls)
    plain = {}
    for threads in (True, False):
        torch.autograd.set_multithreading_enabled(threads)
        for name, (fwd, leaves, g) in all_cases.items():
            plain[name, threads] = run(fwd, leaves, g, args.calls)[0]
    instrument(kt)
    print(f"torch {torch.__version__}; median host µs per fwd+bwd call ({args.calls} calls)")
    for threads in (True, False):
        torch.autograd.set_multithreading_enabled(threads)
        for name, (fwd, leaves, g) in all_cases.items():
            total, steps = run(fwd, leaves, g, args.calls)
            print(f"\n== {name}, engine threads {'on' if threads else 'off'}: "
                  f"{plain[name, threads]:.1f} µs unwrapped, {total:.1f} µs wrapped")  # fmt: skip
            for key, us in steps.items():
                print(f"  {us:8.1f}  {key}")
    torch.autograd.set_multithreading_enabled(True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
