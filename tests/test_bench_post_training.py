"""scripts/bench_post_training.py: the table (on hand-made rows), and the whole run on the CPU
with --smoke under KERNELS_SWEEP=1 (a few minutes: one process per workload and setup)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_post_training as bench  # noqa: E402

from tests.sweep import sweep_only  # noqa: E402


def _row(workload, setup, ms, peak, **extra):
    return {"workload": workload, "setup": setup, "step_ms": ms, "tokens_per_s": 8192 / ms * 1e3,
            "peak_gib": peak, "losses": [0.6931], "head": "report: bound", **extra}  # fmt: skip


def test_table_relates_every_setup_to_plain_trl_of_its_workload():
    rows = [
        _row("dpo", "trl", 400.0, 40.0),
        _row("dpo", "ours", 320.0, 30.0),
        {"workload": "dpo", "setup": "trl-liger", "error": "No module named 'liger_kernel'"},
        _row("grpo", "trl", 100.0, 20.0),
        _row("grpo", "ours", 125.0, 10.0),
    ]
    lines = bench.table(rows, steps=20, warmup=5).splitlines()
    assert lines[0].startswith("| workload | setup | step (median of steps 6-20) |")
    ours_dpo = next(line for line in lines if line.startswith("| dpo | ours |"))
    assert "| 320.0 ms |" in ours_dpo and "| 1.25x | 0.75x |" in ours_dpo
    ours_grpo = next(line for line in lines if line.startswith("| grpo | ours |"))
    assert "| 0.80x | 0.50x |" in ours_grpo  # vs grpo's trl, not dpo's
    assert any("error: No module named 'liger_kernel'" in line for line in lines)


@sweep_only("the benchmark's CPU smoke run")
def test_smoke_run_on_the_cpu(tmp_path):
    out = subprocess.run(
        [sys.executable, str(Path(bench.__file__)), "--smoke", "--setups", "trl,ours",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    table = (tmp_path / "post_training.md").read_text()
    for workload in bench.WORKLOADS:
        assert f"| {workload} | trl |" in table and f"| {workload} | ours |" in table
    assert "error" not in table
