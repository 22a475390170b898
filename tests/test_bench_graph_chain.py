"""scripts/bench_graph_chain.py on hand-made rows: the verdict takes the better of ours' two rows
against the better of torch's, per pass; failed rows are listed, not counted."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_graph_chain  # noqa: E402


def _row(impl, fwd, fwd_bwd):
    row = {"op": "RMSNorm", "shape": "x 8x8", "impl": impl}
    for key, us in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        row.update({f"{key}_wall_us": us, f"{key}_dev_us": us, f"{key}_wall": [us],
                    f"{key}_replay_err": 0.0})  # fmt: skip
    return row


def test_verdict_is_the_better_of_ours_against_the_better_of_torch():
    rows = [
        _row("F.rms_norm", 4.0, 20.0),
        _row("torch.compile", 3.0, 30.0),
        _row("liger", 1.0, 1.0),  # not a torch peer: never the yardstick
        _row("ours", 3.3, 12.0),
        _row("ours torch.compile", 3.6, 10.0),
    ]
    ratios = bench_graph_chain.verdict(rows)
    assert ratios["fwd"] == 3.3 / 3.0
    assert ratios["fwd_bwd"] == 10.0 / 20.0


def test_summary_counts_cases_at_or_below_and_lists_rows_not_recorded():
    tie = [_row("F.rms_norm", 2.0, 2.0), _row("ours", 2.0, 1.0)]
    behind = [_row("torch.compile", 1.0, 5.0), _row("ours", 1.5, 4.0),
              {"op": "RoPE", "shape": "q", "impl": "liger", "error": "RuntimeError: boom"}]  # fmt: skip
    cases = [(rows, bench_graph_chain.verdict(rows)) for rows in (tie, behind)]
    text = bench_graph_chain.summary(cases)
    assert (
        "fwd: ours at or below the better of torch's rows in 1 of 2 cases; worst ratio 1.500x"
        in text
    )
    assert "fwd_bwd: ours at or below the better of torch's rows in 2 of 2 cases" in text
    assert "not recorded: RoPE q liger" in text
    table = bench_graph_chain.table(cases)
    assert "liger (RuntimeError: boom) | not recorded | not recorded" in table
