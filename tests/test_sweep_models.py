"""scripts/sweep_models.py run as the lead runs it (its own `kernels serve` mirror on loopback,
real worker processes on the CPU): --jobs merges the rows in the registry's order, a type past
its limit is a row with the reason and a fresh worker goes on, --deadline rows, and the table
names the commit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sweep_models.py"
STAMP = r"^\[\d\d:\d\d:\d\d \+ *\d+s\] "


def _sweep(tmp_path: Path, *args: str, timeout: int = 600) -> tuple[str, str, list[list[str]]]:
    out = tmp_path / "models.md"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *args],
        capture_output=True, text=True, timeout=timeout, env=dict(os.environ),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    md = out.read_text()
    rows = [
        [c.strip() for c in line.strip("|").split(" | ")]
        for line in md.splitlines()
        if line.startswith("| ") and not line.startswith("| model type")
    ]
    return proc.stdout, md, rows


def test_jobs_merge_the_rows_in_the_order_of_the_types(tmp_path):
    # gpt2 trains faster than llama: with two workers it finishes first
    log, md, rows = _sweep(tmp_path, "--only", "llama,gpt2,bert", "--jobs", "2")
    assert [r[0] for r in rows] == ["llama", "gpt2", "bert"]
    assert [r[1] for r in rows] == ["match"] * 3, rows
    assert re.search(r"; commit [0-9a-f]{12}(\+dirty)?\)\.", md), md.splitlines()[2]
    progress = re.findall(STAMP + r"w[01] \[(\d)/3\] (\w+) +(\w+)", log, re.M)
    assert sorted(n for n, _, _ in progress) == ["1", "2", "3"], log
    assert {(t, s) for _, t, s in progress} == {("llama", "match"), ("gpt2", "match"),
                                                ("bert", "match")}  # fmt: skip
    assert re.search(STAMP + r"3 types in \d+ s with 2 worker\(s\); per type: median", log, re.M)


def test_a_type_that_does_not_answer_in_time_is_a_row_and_a_fresh_worker_goes_on(tmp_path):
    """--limit-s 0 (no alarm in the worker) and --grace-s 1: each type's worker is still
    training after 1 s, so the parent takes its stack, kills it and starts another."""
    t0 = time.monotonic()
    log, _, rows = _sweep(tmp_path, "--only", "llama,gpt2", "--limit-s", "0", "--grace-s", "1")
    assert time.monotonic() - t0 < 300
    assert [r[0] for r in rows] == ["llama", "gpt2"]
    for row in rows:
        assert row[1] == "skipped"
        assert row[3].startswith("killed after 1 s (over the per-type limit of 0 s), stuck at ")
    assert len(re.findall(STAMP + r"w0 \[\d/2\] \w+ +skipped .*killed after 1 s", log, re.M)) == 2


def test_types_not_started_before_the_deadline_are_rows(tmp_path):
    _, md, rows = _sweep(tmp_path, "--only", "llama,gpt2", "--deadline", "1")
    assert rows == [
        ["llama", "skipped", "", "not run: --deadline of 1.0 s ran out", "", ""],
        ["gpt2", "skipped", "", "not run: --deadline of 1.0 s ran out", "", ""],
    ]


def test_workers_the_device_refuses_leave_rows_that_say_so(tmp_path):
    """--device cuda on this CPU-only torch: every worker fails its first device touch, gives
    its type back and ends; the types become rows with that reason (not one error per type
    from a fresh failing worker each)."""
    log, _, rows = _sweep(tmp_path, "--only", "llama,gpt2,bert", "--device", "cuda", "--jobs", "2")
    assert [r[0] for r in rows] == ["llama", "gpt2", "bert"]
    for row in rows:
        assert row[1] == "skipped"
        assert row[3].startswith("not run: no sweep worker left to run it (2 did not start: ")
        assert "CUDA" in row[3], row[3]
    assert len(re.findall(STAMP + r"w[01] did not start: ", log, re.M)) == 2
