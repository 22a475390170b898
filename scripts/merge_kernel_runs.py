"""Merge bench_kernels.py result files into one side-by-side table and plot (no GPU needed).

    python3 scripts/merge_kernel_runs.py docs/benchmarks/kernels-h200-2026-11-30/run4-bench.json \\
        ... --plot docs/benchmarks/kernels.png

Files are given oldest first: a case (op, shape) in a later file replaces that case's rows from
earlier ones. Each op is labelled with the run it came from (the file name up to its first
'-'). Prints the markdown table of docs/benchmarks/kernels.md.

``--sweep-out PREFIX`` instead writes PREFIX.json (the merged rows, with the environment and
ceilings of the last file, and every file's date), PREFIX.md (bench_harness's table with device
and wall time and the verdict column) and PREFIX.png, for a sweep run in several parts.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_harness import Ceilings, fmt, format_table, rate_cell  # noqa: E402
from bench_kernels import plot  # noqa: E402

OP_ORDER = ["RMSNorm", "AddRMSNorm", "LayerNorm", "RoPE", "SwiGLU", "SiLU", "GeGLU"]


def merge(paths: list[Path]) -> list[dict]:
    """Rows of the latest file holding each case, ordered by OP_ORDER, then by shape as found."""
    cases: dict[tuple[str, str], tuple[int, list[dict]]] = {}  # case -> (file index, rows)
    for i, path in enumerate(paths):
        run = path.name.split("-")[0]
        for row in json.loads(path.read_text())["rows"]:
            key = (row["op"], row["shape"])
            if key not in cases or cases[key][0] != i:
                cases[key] = (i, [])  # a later file replaces the case
            cases[key][1].append({**row, "run": run})

    def rank(key: tuple[str, str]) -> int:
        first = key[0].split()[0]
        return OP_ORDER.index(first) if first in OP_ORDER else len(OP_ORDER)

    return [r for key in sorted(cases, key=rank) for r in cases[key][1]]


def table(rows: list[dict]) -> str:
    lines = [
        "| op | shape | impl | fwd ms | fwd GB/s | fwd+bwd ms | fwd+bwd GB/s | floor ms "
        "| target ms | best? |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_case: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if "error" not in r:
            by_case.setdefault((r["op"], r["shape"]), []).append(r)
    for (op, shape), group in by_case.items():
        best = min(r["fwd_bwd_ms"] for r in group)
        for r in group:
            impl = "**ours**" if r["impl"] == "ours" else r["impl"]
            mark = "best" if r["fwd_bwd_ms"] == best else ""
            run = r["run"].replace("run", "run ")
            lines.append(
                f"| {op} ({run}) | {shape} | {impl} | {r['fwd_ms']:.3f} "
                f"| {fmt(r.get('fwd_gbps'), '.0f')} | {r['fwd_bwd_ms']:.3f} | {rate_cell(r)} "
                f"| {fmt(r.get('floor_ms'), '.3f')} | {fmt(r.get('target_ms'), '.2f')} | {mark} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="bench_kernels JSON, oldest first")
    parser.add_argument("--plot", type=Path, help="write the merged plot here")
    parser.add_argument("--sweep-out", type=Path, help="write PREFIX.json, .md and .png")
    args = parser.parse_args(argv)
    rows = merge(args.results)
    if args.sweep_out:
        runs = [json.loads(p.read_text()) for p in args.results]
        last = runs[-1]
        ceil = Ceilings(**last["ceilings"])
        merged = {**last, "rows": rows, "dates": [r["env"]["date"] for r in runs]}

        def out(suffix: str) -> Path:  # not with_suffix: a prefix like "sweep-v1.2" keeps ".2"
            return args.sweep_out.parent / (args.sweep_out.name + suffix)

        out(".json").write_text(json.dumps(merged, indent=1))
        header = " ".join(f"{k} {v};" for k, v in last["env"].items() if k != "date")
        dates = ", ".join(merged["dates"])
        out(".md").write_text(f"runs {dates}; {header}\n\n{format_table(rows, ceil)}\n")
        try:
            plot(rows, out(".png"))
        except ImportError as exc:  # matplotlib is not a dependency of the package
            print(f"no plot: {exc}", file=sys.stderr)
        return 0
    if args.plot:
        plot(rows, args.plot)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
