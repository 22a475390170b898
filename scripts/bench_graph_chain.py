"""Per-op time inside a CUDA graph of many calls: the norms and RoPE sweeps' host-bound shapes (GPU).

    python scripts/bench_graph_chain.py --out DIR [--sweeps norms,rope]
        [--shapes "x 1024x,x 4096x,x512x,1x32x2048"] [--ops-per-graph 32] [--replays 20]
        [--rounds 15]

A whole training step under CUDA graphs replays every op of the step from one graph: no host
work per op and no per-op wrapper. bench_graphed_wall times one op per torch.compile
(reduce-overhead) call, where the CUDA-graph-tree wrapper and its input copies (70-180 µs forward)
outweigh the op; this script takes the wrapper out. For every implementation of a case (torch's
module eager and compiled, F.rms_norm, Liger, ours, ours inside torch.compile) it records
`--ops-per-graph` back-to-back calls of the forward (and, in a second graph, of forward +
backward) into one `torch.cuda.CUDAGraph`, after three warm-up calls outside it, then replays
it `--replays` times per round. The implementations take turns, the order reversed every other
round; the median round counts. Reported per op: wall µs (the host loop of replays, one sync
after the last; the GPU's drain included) and device µs (CUDA events around the same replays).

One table last, and per pass in how many cases ours (the faster of its two rows) is at or below
the better of torch's native op (F.rms_norm) and torch.compile's under the same graph.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_graphed_wall import DEFAULT_SHAPES, host_bound_cases  # noqa: E402

TORCH_PEERS = ("F.rms_norm", "torch.compile")
OURS_ROWS = ("ours", "ours torch.compile")
PASSES = ("fwd", "fwd_bwd")


def record(fn, ops: int, stream):
    """(a CUDAGraph holding `ops` calls of `fn`, the last call's output as the graph writes it),
    after three warm-up calls outside it (autotuning and compiles happen there). All on `stream`,
    where the caller also built fn's inputs: autograd then finds every node of fn's graph on the
    capturing stream (a view made on the default stream fails the capture of its backward)."""
    import torch

    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(ops):
            out = fn()
    torch.cuda.synchronize()
    return graph, out


def replay_matches(graph, out, fn) -> float:
    """Largest |replayed - eager| over the outputs, relative to the eager output's largest |value|:
    a graph that replays stale or foreign memory is not timed as if it were right."""
    import torch

    graph.replay()
    torch.cuda.synchronize()
    want = fn()
    got, want = (out, want) if isinstance(want, tuple) else ((out,), (want,))
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        scale = w.detach().float().abs().max().clamp_min(1e-30)
        worst = max(worst, ((g.float() - w.float()).abs().max() / scale).item())
    return worst


def timed(graph, replays: int, ops: int) -> tuple[float, float]:
    """(wall µs, device µs) per op over `replays` back-to-back replays."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) * 1e6
    return wall / (replays * ops), start.elapsed_time(end) * 1e3 / (replays * ops)


def measure_case(case, ops: int, replays: int, rounds: int, impls=None) -> list[dict]:
    """One row per implementation: per-round wall and device µs per op, fwd and fwd+bwd, or the
    error that kept it from being recorded."""
    import torch

    graphs, rows = {}, []
    for impl in [i for i in case.impls if impls is None or i.name in impls]:
        row = {"op": case.op, "shape": case.shape, "impl": impl.name}
        rows.append(row)
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                # The closures hold the inputs the graphs read: kept alive with the graphs.
                closures = dict(zip(PASSES, impl.make(), strict=True))
            graphs[impl.name] = {
                key: (*record(fn, ops, stream), fn) for key, fn in closures.items()
            }
        except Exception as exc:  # reported in the table: a row that cannot be recorded
            traceback.print_exc()
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            torch.cuda.synchronize()
            continue
        for key in PASSES:
            row[f"{key}_wall"], row[f"{key}_dev"] = [], []
    live = [r for r in rows if "error" not in r]
    gc.collect()
    gc.disable()  # a collection inside a round would land on whichever implementation ran then
    try:
        for r in range(rounds):
            for row in live if r % 2 == 0 else reversed(live):
                for key in PASSES:
                    wall, dev = timed(graphs[row["impl"]][key][0], replays, ops)
                    row[f"{key}_wall"].append(wall)
                    row[f"{key}_dev"].append(dev)
    finally:
        gc.enable()
    for row in live:  # checked after every graph was recorded and replayed
        for key in PASSES:
            row[f"{key}_replay_err"] = replay_matches(*graphs[row["impl"]][key])
            row[f"{key}_wall_us"] = statistics.median(row[f"{key}_wall"])
            row[f"{key}_dev_us"] = statistics.median(row[f"{key}_dev"])
    graphs.clear()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return rows


def verdict(rows: list[dict]) -> dict:
    """Per pass: the better of ours' rows against the better of torch's, by median wall per op."""
    by = {r["impl"]: r for r in rows if "error" not in r}
    out = {}
    for key in PASSES:
        ours = [by[n][f"{key}_wall_us"] for n in OURS_ROWS if n in by]
        peers = [by[n][f"{key}_wall_us"] for n in TORCH_PEERS if n in by]
        if ours and peers:
            out[key] = min(ours) / min(peers)
    return out


def _cell(row: dict, key: str) -> str:
    if "error" in row:
        return "not recorded"
    spread = row[f"{key}_wall"]
    return (
        f"{row[f'{key}_wall_us']:.2f} [{min(spread):.2f}-{max(spread):.2f}] / "
        f"{row[f'{key}_dev_us']:.2f}"
    )


def table(cases: list[tuple[list[dict], dict]]) -> str:
    lines = [
        "| op | shape | impl | fwd µs per op: wall [min-max] / device | fwd+bwd µs per op: wall "
        "[min-max] / device | replay vs eager, max rel. err (fwd, fwd+bwd) | ours / better of torch's "
        "(fwd, fwd+bwd) |",
        "|---|---|---|---|---|---|---|",
    ]
    for rows, ratios in cases:
        for i, r in enumerate(rows):
            last = ""
            if i == len(rows) - 1 and ratios:
                last = ", ".join(f"{ratios[k]:.3f}x" for k in PASSES if k in ratios)
            note = f" ({r['error']})" if "error" in r else ""
            err = ", ".join(f"{r[f'{k}_replay_err']:.0e}" for k in PASSES if f"{k}_replay_err" in r)
            lines.append(
                f"| {r['op']} | {r['shape']} | {r['impl']}{note} | {_cell(r, 'fwd')} "
                f"| {_cell(r, 'fwd_bwd')} | {err} | {last} |"
            )
    return "\n".join(lines)


def summary(cases: list[tuple[list[dict], dict]]) -> str:
    out = []
    for key in PASSES:
        ratios = [ratios[key] for _, ratios in cases if key in ratios]
        at_or_below = sum(x <= 1.0 for x in ratios)
        worst = max(ratios, default=math.nan)
        middle = statistics.median(ratios) if ratios else math.nan
        out.append(
            f"{key}: ours at or below the better of torch's rows in {at_or_below} of "
            f"{len(ratios)} cases; worst ratio {worst:.3f}x, median {middle:.3f}x"
        )
    failed = [
        f"{r['op']} {r['shape']} {r['impl']}" for rows, _ in cases for r in rows if "error" in r
    ]
    out.append(f"not recorded: {', '.join(failed) if failed else 'none'}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweeps", default="norms,rope")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated shape substrings")
    p.add_argument("--ops-per-graph", type=int, default=32)
    p.add_argument("--replays", type=int, default=20, help="graph replays per timed round")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", type=Path)
    p.add_argument("--impls", help="comma-separated implementation names (default: all)")
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("bench_graph_chain: needs a CUDA GPU", file=sys.stderr)
        return 2
    import bench_cases_elementwise
    from bench_harness import allow_many_compiles
    from bench_kernels import environment

    allow_many_compiles()
    bench_cases_elementwise.set_compiled_ours(True)
    cases = host_bound_cases(args.sweeps, args.shapes)
    impls = args.impls.split(",") if args.impls else None
    results = []
    for case in cases:
        rows = measure_case(case, args.ops_per_graph, args.replays, args.rounds, impls)
        results.append((rows, verdict(rows)))
        print(f"{case.op} {case.shape}: done", flush=True)
    env = environment()
    header = " ".join(f"{k} {v};" for k, v in env.items())
    header += (
        f" {args.ops_per_graph} calls per graph, {args.replays} replays per round, "
        f"{args.rounds} rounds, median round."
    )
    text = f"{header}\n\n{table(results)}\n\n{summary(results)}\n"
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "graph-chain.md").write_text(text)
        rows = [r for rs, _ in results for r in rs]
        (args.out / "graph-chain.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
