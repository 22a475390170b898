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
