"""scripts/merge_kernel_runs.py: a later run replaces a case's rows, each op names its run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from merge_kernel_runs import merge, table  # noqa: E402


def _row(op, shape, impl, ms):
    return {
        "op": op, "shape": shape, "impl": impl, "fwd_ms": ms / 3, "fwd_gbps": 1000.0,
        "fwd_bwd_ms": ms, "fwd_bwd_gbps": 2000.0, "floor_ms": 0.1, "target_ms": None,
    }  # fmt: skip


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text(json.dumps({"env": {}, "ceilings": {}, "rows": rows, "notes": []}))
    return path


def test_later_run_replaces_a_case_and_keeps_the_others(tmp_path):
    old = _write(
        tmp_path / "run1-bench.json",
        [
            _row("RoPE", "q 1", "liger", 0.30),
            _row("RoPE", "q 1", "ours", 0.20),
            _row("RMSNorm", "x 2", "ours", 0.50),
        ],
    )
    new = _write(
        tmp_path / "run2-bench-rope.json",
        [_row("RoPE", "q 1", "liger", 0.25), _row("RoPE", "q 1", "ours", 0.27)],
    )
    rows = merge([old, new])
    # RMSNorm sorts before RoPE; RoPE's rows all come from run 2, none from run 1
    assert [(r["op"], r["impl"], r["run"]) for r in rows] == [
        ("RMSNorm", "ours", "run1"),
        ("RoPE", "liger", "run2"),
        ("RoPE", "ours", "run2"),
    ]
    lines = table(rows).splitlines()
    assert lines[2].startswith("| RMSNorm (run 1) | x 2 | **ours** | 0.167 |")
    assert lines[3].endswith("| best |") and "liger" in lines[3]  # 0.25 beats ours' 0.27
    assert not lines[4].endswith("| best |")


def test_a_later_file_replaces_even_under_the_same_run_label(tmp_path):
    first = _write(tmp_path / "run3-a.json", [_row("RoPE", "q 1", "ours", 0.20)])
    second = _write(tmp_path / "run3-b.json", [_row("RoPE", "q 1", "ours", 0.19)])
    assert [r["fwd_bwd_ms"] for r in merge([first, second])] == [0.19]
    assert [r["fwd_bwd_ms"] for r in merge([first, first])] == [0.20]  # no duplicate rows


def test_sweep_out_writes_the_merged_sweep_with_the_verdicts(tmp_path):
    """A sweep run in two parts: one JSON (every run's date), one table with device and wall
    time and the verdict column, of the later part's rows for a case run twice."""
    from merge_kernel_runs import main

    def run(name, date, rows):
        env = {"date": date, "gpu": "H200"}
        ceilings = {"copy_gbps": 4000.0, "matmul_tflops": 700.0}
        path = tmp_path / name
        path.write_text(json.dumps({"env": env, "ceilings": ceilings, "rows": rows, "notes": []}))
        return path

    def row(shape, impl, ms, wall):
        return {**_row("Linear+CE", shape, impl, ms), "fwd_wall_ms": ms, "fwd_bwd_wall_ms": wall,
                "extra_mib": 10.0}  # fmt: skip

    first = run("a.json", "day 1", [row("V1", "ours", 5.0, 5.0), row("V1", "liger", 4.0, 4.0),
                                     row("V2", "ours", 1.0, 1.0), row("V2", "liger", 2.0, 2.0)])  # fmt: skip
    second = run("b.json", "day 2", [row("V1", "ours", 3.0, 3.2), row("V1", "liger", 4.0, 3.0)])
    assert main([str(first), str(second), "--sweep-out", str(tmp_path / "sweep")]) == 0
    merged = json.loads((tmp_path / "sweep.json").read_text())
    assert merged["dates"] == ["day 1", "day 2"]
    assert [(r["shape"], r["fwd_bwd_ms"]) for r in merged["rows"]] == [
        ("V1", 3.0), ("V1", 4.0), ("V2", 1.0), ("V2", 2.0)
    ]  # fmt: skip
    md = (tmp_path / "sweep.md").read_text()
    assert md.startswith("runs day 1, day 2; gpu H200;")
    ours = [line for line in md.splitlines() if "| ours |" in line]
    assert ours[0].endswith("| wall 1.07x liger |") and ours[1].endswith("| ok |")
