"""scripts/bench_generate.py: the table on hand-made rows (wall time against eager's, the share
of generated tokens equal to eager's, a GPU column that says when it was not measured)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_generate  # noqa: E402


def _row(setup, batch, wall, tokens, busy=None):
    return {"setup": setup, "batch": batch, "wall_ms_per_token": wall, "busy_ms_per_token": busy,
            "first_s": 1.0, "spread": [wall, wall], "tokens": tokens}  # fmt: skip


def test_table_relates_each_setup_to_eager_at_its_batch():
    rows = [_row("eager", 1, 40.0, [[1, 2, 3, 4]], busy=3.0),
            _row("ours", 1, 30.0, [[1, 2, 9, 9]], busy=1.5),
            _row("eager", 2, 50.0, [[1, 1], [2, 2]]),
            _row("ours", 2, 60.0, [[1, 1], [2, 3]])]  # fmt: skip
    text = bench_generate.table(rows, [1, 2])
    assert "| 1 | ours | 30.000 (30.000-30.000) | 1.500 | 0.750x | 50% | 1.0 |" in text
    assert "| 2 | ours | 60.000 (60.000-60.000) | n/a | 1.200x | 75% | 1.0 |" in text
    assert "| 1 | eager | 40.000 (40.000-40.000) | 3.000 | 1.000x | 100% |" in text


def test_a_batch_without_eager_has_no_ratio():
    text = bench_generate.table([_row("ours", 4, 10.0, [[1]])], [4])
    assert "| 4 | ours | 10.000 (10.000-10.000) | n/a | - | - | 1.0 |" in text
