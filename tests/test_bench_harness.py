"""scripts/bench_harness.py's time budget (the pieces that need no GPU): the repetitions a slow
implementation gets, the limit that stops one, and its "timeout" row; bench_logprob's
divergence cases carry the budget."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_harness  # noqa: E402
from bench_harness import Budget, Timeout, scaled_reps, time_limit  # noqa: E402


def _calls(call_s: float, rounds: int, budget: Budget | None) -> float:
    """Seconds the timings of an implementation take with these repetitions (fwd counted as a
    fwd+bwd; do_bench adds ~6 calls of its own per closure)."""
    device, wall = scaled_reps(call_s, rounds, budget)
    return call_s * (rounds * 2 * (device + 1) + 2 * (wall + 6))


def test_no_budget_keeps_the_harness_repetitions():
    assert scaled_reps(0.3, 3, None) == (bench_harness.DEVICE_REPS, bench_harness.WALL_CALLS)
    assert scaled_reps(1e-5, 3, Budget(3.0, 25.0)) == (30, 20)  # a fast op is not cut


@pytest.mark.parametrize("call_s", [0.03, 0.06, 0.1, 0.2])
def test_a_budget_bounds_the_time_of_a_slow_implementation(call_s):
    budget = Budget(per_impl_s=3.0, limit_s=25.0)
    assert _calls(call_s, 3, None) > 6.0  # what the divergence case took per implementation
    device, wall = scaled_reps(call_s, 3, budget)
    assert 3 <= device < 30 and 5 <= wall < 20
    # about the budget, never far over it until the floors (3 and 5 repetitions) are reached
    assert _calls(call_s, 3, budget) <= 1.5 * budget.per_impl_s or (device, wall) == (3, 5)


def test_the_floors_hold_for_a_very_slow_call():
    assert scaled_reps(2.0, 3, Budget(3.0, 25.0)) == (3, 5)


def test_time_limit_stops_a_python_loop_and_restores_the_timer():
    start = time.perf_counter()
    with pytest.raises(Timeout, match="timeout: over 0 s"):
        with time_limit(0.2):
            while True:
                sum(range(1000))
    assert time.perf_counter() - start < 2.0
    time.sleep(0.3)  # no alarm left behind
    with time_limit(None):
        pass


def test_timeout_passes_a_peer_s_except_exception():
    """A config search that skips a candidate on any Exception must not swallow the limit."""
    with pytest.raises(Timeout):
        with time_limit(0.1):
            for _ in range(100):
                try:
                    time.sleep(0.05)
                except Exception:  # noqa: BLE001, S112 - as a peer's own code does
                    continue


def test_a_timed_out_row_reads_timeout_in_the_table():
    ceil = bench_harness.Ceilings(copy_gbps=4000.0, matmul_tflops=700.0)
    rows = [
        {"op": "Distill JSD", "shape": "N16384", "impl": "eager (full logits)",
         "error": "timeout: over 25 s", "floor_ms": 0.0, "target_ms": None},
        {"op": "Distill JSD", "shape": "N16384", "impl": "liger", "error": "ImportError: x",
         "floor_ms": 0.0, "target_ms": None},
    ]  # fmt: skip
    text = bench_harness.format_table(rows, ceil)
    assert "| eager (full logits) | timeout: over 25 s |" in text
    assert "| liger | error: ImportError: x |" in text


def test_bench_logprob_divergence_cases_carry_the_budget():
    torch = pytest.importorskip("torch")
    del torch
    import bench_logprob

    div = [c for c in bench_logprob.cases(quick=False, only="divergence")]
    assert len(div) == 2 and all(c.budget == bench_logprob.DIVERGENCE_BUDGET for c in div)
    assert {i.name for i in div[0].impls} >= {"trl ChunkedDivergenceFunction", "liger", "ours"}
    assert all(c.budget is None for c in bench_logprob.cases(quick=False, only="logprob"))
