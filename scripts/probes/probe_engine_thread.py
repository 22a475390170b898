"""Does Python run slower in a backward on the autograd engine's device thread? A diagnosis.

    python scripts/probes/probe_engine_thread.py

An autograd.Function on a small CUDA tensor whose backward runs K rounds of plain Python (dict
stores and lookups, no torch call) and returns its gradient; fwd+bwd host microseconds per call
for several K, with the engine's device threads on (the default: a CUDA backward runs on the
device's worker thread) and off (`torch.autograd.set_multithreading_enabled(False)`: the calling
thread runs it). A constant gap between the two is the cost of handing the backward to the
worker and back; a gap that grows with K means the same Python runs slower on the worker.
Also the same K rounds called directly (no autograd), as the yardstick of what K costs.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

ROUNDS = (0, 100, 200, 400)
CALLS = 2000


def busy(k: int) -> None:
    d: dict[int, int] = {}
    for i in range(k):
        d[i & 7] = i
        _ = d.get(i & 3)


class Work(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        busy(ctx.k)
        return g, None


def per_call_us(fn, calls: int = CALLS) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> int:
    x = torch.randn(16, device="cuda", requires_grad=True)
    g = torch.ones(16, device="cuda")
    rows = []
    for k in ROUNDS:

        def step(k=k):
            torch.autograd.grad(Work.apply(x, k), [x], g)

        alone = per_call_us(lambda k=k: busy(k))
        on = per_call_us(step)
        torch.autograd.set_multithreading_enabled(False)
        try:
            off = per_call_us(step)
        finally:
            torch.autograd.set_multithreading_enabled(True)
        rows.append((k, alone, on, off))
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name()}, Python {sys.version.split()[0]}"
    )
    print("| K | busy(K) alone µs | fwd+bwd µs, engine threads on | off | on - off |")
    print("|---|---|---|---|---|")
    for k, alone, on, off in rows:
        print(f"| {k} | {alone:.1f} | {on:.1f} | {off:.1f} | {on - off:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
