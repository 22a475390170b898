"""Wall time per call under CUDA graphs: the norms and RoPE sweeps' host-bound shapes (GPU only).

    python scripts/bench_graphed_wall.py --out DIR [--sweeps norms,rope]
        [--shapes "x 1024x,x 4096x,x512x,1x32x2048"] [--calls 200] [--rounds 15]

For every case of the sweeps (scripts/bench_sweeps.py) whose shape contains one of `--shapes`,
the "<impl> reduce-overhead" rows of bench_kernels --cudagraphs (torch's implementations and ours,
each inside torch.compile(mode="reduce-overhead")) and ours without graphs are timed the way a
training loop at small batch meets them: `--calls` calls back to back, one sync after the last,
the wall time divided by the calls. Host and GPU both count, nothing is flushed or queued ahead.
The implementations take turns, in reversed order every other round, and the median round
counts (the spread is printed beside it). bench_kernels' do_bench wall column flushes the L2 with
a kernel the host's work overlaps, so it cannot tell apart host costs of tens of µs.

One table last: µs per call (median, [min-max] over the rounds), the first call's seconds
(compile and, under reduce-overhead, the warm-up run; the graph is recorded on a later, untimed
call), and ours under graphs against torch's native op (F.rms_norm)
and torch.compile's (the eager module compiled) under graphs.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

DEFAULT_SHAPES = "x 1024x,x 4096x,x512x,1x32x2048"
OURS = "ours reduce-overhead"
PEERS = {"native": "F.rms_norm reduce-overhead", "compile": "eager reduce-overhead"}


def _timed_us(fn, calls: int) -> float:
    """Wall µs per call over `calls` back-to-back calls, the GPU's drain included (unlike
    bench_harness.host_us, which stops the clock before the last sync: the host's time only)."""
    import torch

    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def measure_case(case, calls: int, rounds: int) -> list[dict]:
    """One row per kept implementation of `case`: first-call s and per-round µs, fwd and fwd+bwd."""
    import torch

    keep = [i for i in case.impls if i.name.endswith(" reduce-overhead") or i.name == "ours"]
    closures, rows = {}, []
    for impl in keep:
        fwd, fwd_bwd = impl.make()
        row = {"op": case.op, "shape": case.shape, "impl": impl.name}
        for key, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            row[f"{key}_first_s"] = time.perf_counter() - t
            for _ in range(3):  # reduce-overhead records its graph on a later call
                fn()
            row[f"{key}_rounds_us"] = []
        closures[impl.name] = (fwd, fwd_bwd)
        rows.append(row)
    gc.collect()
    gc.disable()  # a collection inside a round would land on whichever implementation ran then
    try:
        for r in range(rounds):
            for row in rows if r % 2 == 0 else reversed(rows):
                fwd, fwd_bwd = closures[row["impl"]]
                row["fwd_rounds_us"].append(_timed_us(fwd, calls))
                row["fwd_bwd_rounds_us"].append(_timed_us(fwd_bwd, calls))
    finally:
        gc.enable()
    for row in rows:
        for key in ("fwd", "fwd_bwd"):
            row[f"{key}_us"] = statistics.median(row[f"{key}_rounds_us"])
    closures.clear()
    torch.cuda.empty_cache()
    return rows


def verdicts(rows: list[dict]) -> None:
    """Mark ours under graphs against each peer under graphs: ratio of the medians, per pass."""
    by = {r["impl"]: r for r in rows}
    ours = by.get(OURS)
    if ours is None:
        return
    for kind, name in PEERS.items():
        peer = by.get(name)
        if peer is not None:
            for key in ("fwd", "fwd_bwd"):
                ours[f"{key}_vs_{kind}"] = ours[f"{key}_us"] / peer[f"{key}_us"]


def _cell(row: dict, key: str) -> str:
    spread = row[f"{key}_rounds_us"]
    return f"{row[f'{key}_us']:.1f} [{min(spread):.1f}-{max(spread):.1f}]"


def _ratio(row: dict, key: str) -> str:
    parts = [f"{row[f'{key}_vs_{k}']:.3f}x {k}" for k in PEERS if f"{key}_vs_{k}" in row]
    return ", ".join(parts)


def table(rows: list[dict]) -> str:
    lines = [
        "| op | shape | impl | fwd µs/call [min-max] | fwd+bwd µs/call [min-max] | first call s "
        "(fwd, fwd+bwd) | ours under graphs, fwd | ours under graphs, fwd+bwd |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        first = f"{r['fwd_first_s']:.2f}, {r['fwd_bwd_first_s']:.2f}"
        lines.append(
            f"| {r['op']} | {r['shape']} | {r['impl']} | {_cell(r, 'fwd')} | {_cell(r, 'fwd_bwd')} "
            f"| {first} | {_ratio(r, 'fwd')} | {_ratio(r, 'fwd_bwd')} |"
        )
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """Per pass: in how many cases ours under graphs is at or below the better of its peers."""
    ours = [r for r in rows if r["impl"] == OURS]
    out = []
    for key in ("fwd", "fwd_bwd"):
        ratios = [
            min((r[f"{key}_vs_{k}"] for k in PEERS if f"{key}_vs_{k}" in r), default=math.nan)
            for r in ours
        ]
        at_or_below = sum(x <= 1.0 for x in ratios)
        worst = max((x for x in ratios if not math.isnan(x)), default=math.nan)
        out.append(
            f"{key}: ours under graphs at or below the better peer under graphs in {at_or_below} "
            f"of {len(ratios)} cases; worst ratio {worst:.3f}x"
        )
    firsts = [max(r["fwd_first_s"], r["fwd_bwd_first_s"]) for r in rows]
    out.append(f"slowest first call: {max(firsts, default=math.nan):.2f} s")
    return "\n".join(out)


def host_bound_cases(sweeps: str, shapes: str) -> list:
    """The cases of the comma-separated bench_sweeps names `sweeps` whose shape contains one of
    the comma-separated `shapes`, built now (after any bench_cases_elementwise switches)."""
    from bench_sweeps import SWEEPS

    wanted = [s.strip() for s in shapes.split(",") if s.strip()]
    return [
        case
        for sweep in sweeps.split(",")
        for case in SWEEPS[sweep.strip()]()
        if any(s in case.shape for s in wanted)
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweeps", default="norms,rope")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated shape substrings")
    p.add_argument("--calls", type=int, default=200, help="calls per timed round")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("bench_graphed_wall: needs a CUDA GPU", file=sys.stderr)
        return 2
    import bench_cases_elementwise
    from bench_harness import allow_many_compiles
    from bench_kernels import environment

    allow_many_compiles()
    bench_cases_elementwise.set_cudagraphs(True)
    cases = host_bound_cases(args.sweeps, args.shapes)
    rows = []
    for case in cases:
        case_rows = measure_case(case, args.calls, args.rounds)
        verdicts(case_rows)
        rows += case_rows
        print(f"{case.op} {case.shape}: done", flush=True)
    env = environment()
    header = " ".join(f"{k} {v};" for k, v in env.items())
    header += f" {args.calls} calls per round, {args.rounds} rounds, median round."
    text = f"{header}\n\n{table(rows)}\n\n{summary(rows)}\n"
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "graphed-wall.md").write_text(text)
        (args.out / "graphed-wall.json").write_text(
            json.dumps({"env": env, "rows": rows}, indent=1)
        )
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
