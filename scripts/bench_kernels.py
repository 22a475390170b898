"""Benchmark the training kernels against their peers in one run (GPU only).

Collects `cases(small)` from the modules in CASE_MODULES (a module not written yet is skipped),
measures the copy and matmul ceilings, times every implementation of every case, and prints one
markdown table last. With --out DIR it also writes kernels.json, kernels.md (date, GPU, versions)
and kernels.png.

    python scripts/bench_kernels.py --ops rmsnorm,rope --out docs/benchmarks
    python scripts/bench_kernels.py --sweep norms --out docs/benchmarks/sweeps/norms

``--cudagraphs`` adds rows for torch's implementations and ours inside
``torch.compile(mode="reduce-overhead")`` (CUDA graphs), compared with each other, so the
host-bound norm and RoPE shapes are timed without the host work per launch:

    python scripts/bench_kernels.py --sweep norms --cudagraphs --out DIR

``--sweep NAME`` runs one of the shape sweeps of scripts/bench_sweeps.py instead of the anchor
cases (``--op`` then filters its cases too). Every row has device and wall time side by side and
the extra peak memory; the table's last column says where ours is behind the best peer.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

CASE_MODULES = ["bench_cases_elementwise", "bench_cases_losses"]
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --dtype: torch's names


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def collect(small: bool, ops: list[str]) -> tuple[list, list[str]]:
    """Cases from every available module, filtered by op (case-insensitive substring)."""
    found, notes = [], []
    for name in CASE_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            notes.append(f"{name}: not present, skipped")
            continue
        for case in module.cases(small):
            key = case.op.lower().replace(" ", "")
            if not ops or any(o in key for o in ops):
                found.append(case)
    return found, notes


def _picked_configs() -> dict:
    """The kernel configs our ops chose by timing during this run (for the record)."""
    common = [
        m
        for n, m in sys.modules.items()
        if n.startswith("_kernels_training_bench") and n.endswith("._common")
    ]
    return {str(k[:3]): v for m in common for k, v in m._CHOICES.items()}


def environment() -> dict:
    import torch

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "liger-kernel": _version("liger-kernel"),
    }


def write_results(out: Path, env, ceil, rows, notes, header: str, table: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "kernels.json", "w") as fh:
        json.dump(
            {"env": env, "ceilings": ceil.__dict__, "rows": rows, "notes": notes}, fh, indent=1
        )
    (out / "kernels.md").write_text(f"{header}\n\n{table}\n")
    try:
        plot(rows, out / "kernels.png")
    except ImportError as exc:
        if f"no plot: {exc}" not in notes:
            notes.append(f"no plot: {exc}")


def plot(rows: list[dict], path: Path) -> None:
    """Grouped bars, one panel for device time and one for wall time (fwd+bwd): each
    implementation's speed relative to the fastest of its case (1.0 = the fastest)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys((r["op"], r["shape"]) for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    ok = [r for r in rows if "error" not in r]
    height = 0.8 / len(impls)
    tall = 0.55 * len(cases) * max(1, len(impls) / 3) + 1.5
    fig, axes = plt.subplots(1, 2, figsize=(16, tall), sharey=True)
    for ax, key, title in zip(
        axes, ("fwd_bwd_ms", "fwd_bwd_wall_ms"), ("device time", "wall time"), strict=True
    ):
        best = {}
        for r in ok:
            if r.get(key):
                case = (r["op"], r["shape"])
                best[case] = min(best.get(case, float("inf")), r[key])
        for j, impl in enumerate(impls):
            ys, xs = [], []
            for i, case in enumerate(cases):
                for r in ok:
                    if (r["op"], r["shape"]) == case and r["impl"] == impl and r.get(key):
                        ys.append(i + j * height)
                        xs.append(best[case] / r[key])
            ax.barh(ys, xs, height=height, label=impl)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_xlim(0, 1.05)
        ax.set_xlabel(f"fastest / this, fwd+bwd {title} (1.0 = the fastest of the case)")
    axes[0].set_yticks([i + 0.4 - height / 2 for i in range(len(cases))])
    axes[0].set_yticklabels([f"{op}\n{shape}" for op, shape in cases], fontsize=7)
    axes[0].invert_yaxis()
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--ops", "--op", default="", help="comma-separated op filter, e.g. rmsnorm,rope"
    )
    parser.add_argument(
        "--sweep",
        choices=["norms", "norms-large", "addnorms", "rope", "glu", "ce", "flce", "dtypes"],
        help="run this shape sweep (scripts/bench_sweeps.py) instead of the anchor cases",
    )
    parser.add_argument(
        "--out", type=Path, help="folder for kernels.json / kernels.md / kernels.png"
    )
    parser.add_argument("--small", action="store_true", help="only the small, launch-bound shapes")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bf16",
        help="the inputs' dtype (bf16 unless set); other dtypes label every shape with it",
    )
    parser.add_argument(
        "--cudagraphs",
        action="store_true",
        help="also time torch's implementations and ours inside torch.compile(mode=\"reduce-"
        'overhead") (CUDA graphs: no host work per launch), rows "<impl> reduce-overhead"',
    )
    parser.add_argument(
        "--shapes",
        default="",
        help="comma-separated substrings: only the cases whose shape contains one, e.g. V50257",
    )
    args = parser.parse_args(argv)

    import torch
    from bench_harness import allow_many_compiles, format_table, measure_ceilings, run_case

    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    allow_many_compiles()

    if args.dtype != "bf16":
        import bench_cases_elementwise
        import bench_cases_losses

        for module in (bench_cases_elementwise, bench_cases_losses):
            module.set_dtype(getattr(torch, DTYPES[args.dtype]))
    if args.cudagraphs:
        import bench_cases_elementwise

        bench_cases_elementwise.set_cudagraphs(True)
    ops = [o.strip().lower().replace(" ", "") for o in args.ops.split(",") if o.strip()]
    if args.sweep:
        from bench_sweeps import SWEEPS

        cases, notes = SWEEPS[args.sweep](), [f"sweep {args.sweep}"]
        cases = [
            c for c in cases if not ops or any(o in c.op.lower().replace(" ", "") for o in ops)
        ]
    else:
        cases, notes = collect(args.small, ops)
    shapes = [p.strip() for p in args.shapes.split(",") if p.strip()]
    if shapes:
        cases = [c for c in cases if any(p in c.shape for p in shapes)]
        notes.append(f"shapes containing {', '.join(shapes)}")
    if args.dtype != "bf16":
        for case in cases:
            case.shape = f"{case.shape} {args.dtype}"
            case.target_ms = None  # the targets are bf16 times
        notes.append(f"inputs {args.dtype}")
    env = environment()
    ceil = measure_ceilings()
    header = " ".join(f"{k} {v};" for k, v in env.items())
    rows = []
    for case in cases:
        case_rows = run_case(case, ceil)
        rows += case_rows
        for r in case_rows:
            t = r.get("error") or (
                f"fwd {r['fwd_ms']:.3f} ms (wall {r['fwd_wall_ms']:.3f}), fwd+bwd "
                f"{r['fwd_bwd_ms']:.3f} ms (wall {r['fwd_bwd_wall_ms']:.3f}), "
                f"extra {r['extra_mib']:.0f} MiB"
            )
            first = f", first call {r['first_call_s']:.2f} s" if "first_call_s" in r else ""
            print(f"{case.op} | {case.shape} | {r['impl']}: {t}{first}", flush=True)
        if args.out:  # after every case, so a run cut short still leaves its results
            write_results(args.out, env, ceil, rows, notes, header, format_table(rows, ceil))
    table = format_table(rows, ceil)
    picks = _picked_configs()
    if picks:
        print("launch configs picked by timing:", picks)
    for note in notes:
        print(note)
    print(header)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
