"""scripts/bench_compile.py: the target verdict and table on hand-made rows, the harness's
verdict under CUDA graphs (bench_kernels --cudagraphs), and the --smoke run end to end on the
CPU (sweep: minutes of Dynamo tracing on two cores)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_compile  # noqa: E402

from tests.sweep import sweep_only  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _row(setup, tokens, peak, run="qwen3-8x2048"):
    return {"setup": setup, "run": run, "shape": "Qwen3-0.6B (28 layers)", "batch": 8,
            "seq": 2048, "tokens_per_s": tokens, "peak_gib": peak, "run_peak_gib": peak,
            "step_ms": 1.0, "first_step_s": 1.0, "graphs": 1, "graph_breaks": 0}  # fmt: skip


def test_compile_with_kernels_meets_the_target_only_above_both_and_within_memory():
    ours, compiled = _row("ours", 100.0, 20.0), _row("compile", 80.0, 60.0)
    assert bench_compile.verdict(_row("ours-compile", 101.0, 21.0), ours, compiled) == "met"
    slow = bench_compile.verdict(_row("ours-compile", 90.0, 20.0), ours, compiled)
    assert slow.startswith("tokens/s 0.90x")
    heavy = bench_compile.verdict(_row("ours-compile-cudagraphs", 120.0, 21.5), ours, compiled)
    assert heavy == "peak 1.07x ours"
    assert bench_compile.verdict(_row("liger", 50.0, 20.0), ours, compiled) == ""
    # CUDA graphs: the timed steps allocate nothing, the pool recorded in the warm-up counts
    graphed = _row("ours-compile-cudagraphs", 120.0, 6.0) | {"mode": "reduce-overhead",
                                                              "run_peak_gib": 22.0}  # fmt: skip
    assert bench_compile.verdict(graphed, ours, compiled) == "peak 1.10x ours"
    # ... against eager + kernels' whole run as well; a default-mode row keeps the timed peaks
    ours_run = ours | {"run_peak_gib": 21.5}
    assert bench_compile.verdict(graphed, ours_run, compiled) == "met"
    default = _row("ours-compile", 120.0, 20.5) | {"mode": "default", "run_peak_gib": 30.0}
    assert bench_compile.verdict(default, ours_run, compiled) == "met"


def test_table_lists_every_setup_and_errors():
    rows = [_row("ours", 100.0, 20.0), _row("compile", 80.0, 60.0),
            _row("ours-compile", 110.0, 20.5),
            {"setup": "liger", "run": "qwen3-8x2048", "error": "liger_kernel not importable"}]  # fmt: skip
    text = bench_compile.table(rows, "qwen3-8x2048")
    assert "| ours-compile | 0.1 k |" in text and "1.10x , 1.38x | met |" in text
    assert "| liger | error: liger_kernel not importable |" in text


def test_rounds_merge_to_the_median_per_setup_with_every_round_listed():
    def timed(setup, tokens, peak, step_ms, run_peak):
        return _row(setup, tokens, peak) | {"step_ms": step_ms, "run_peak_gib": run_peak}

    rows = [timed("ours", 100_000.0, 20.0, 10.0, 20.0),
            timed("ours-compile", 97_000.0, 20.4, 12.0, 21.0),
            timed("ours-compile", 104_000.0, 20.6, 9.0, 20.6),
            timed("ours", 99_000.0, 20.1, 11.0, 22.0),
            timed("ours", 101_000.0, 19.9, 9.5, 19.9),
            timed("ours-compile", 103_000.0, 20.5, 9.8, 20.5)]  # fmt: skip
    merged = {r["setup"]: r for r in bench_compile.merge_rounds(rows)}
    assert merged["ours"]["tokens_per_s"] == 100_000.0 and merged["ours"]["peak_gib"] == 20.1
    assert merged["ours"]["step_ms"] == 10.0 and merged["ours"]["run_peak_gib"] == 22.0
    assert merged["ours-compile"]["tokens_per_s"] == 103_000.0
    assert merged["ours-compile"]["per_round"] == ["97.0 k", "104.0 k", "103.0 k"]
    text = bench_compile.table(rows, "qwen3-8x2048")
    assert "1.03x , - | met | 97.0 k, 104.0 k, 103.0 k |" in text
    # a round that failed leaves the others' median; a setup no round measured stays an error
    failed = {"setup": "compile", "run": "qwen3-8x2048", "error": "timeout"}
    merged = bench_compile.merge_rounds([failed, _row("compile", 80.0, 60.0), dict(failed)])
    assert merged[0]["tokens_per_s"] == 80.0 and merged[0]["per_round"] == [
        "error",
        "0.1 k",
        "error",
    ]
    assert bench_compile.merge_rounds([failed])[0]["error"] == "timeout"


def test_harness_compares_graphed_rows_with_graphed_peers():
    import bench_harness

    group = [
        {"impl": "eager", "fwd_bwd_ms": 1.0, "fwd_bwd_wall_ms": 0.2, "extra_mib": 0.0},
        {"impl": "eager reduce-overhead", "fwd_bwd_ms": 1.0, "fwd_bwd_wall_ms": 0.05,
         "extra_mib": 0.0},
        {"impl": "ours", "fwd_bwd_ms": 1.0, "fwd_bwd_wall_ms": 0.1, "extra_mib": 0.0},
        {"impl": "ours reduce-overhead", "fwd_bwd_ms": 1.0, "fwd_bwd_wall_ms": 0.1,
         "extra_mib": 0.0},
    ]  # fmt: skip
    assert bench_harness.verdict(group, group[2]) == "ok"  # against plain eager only
    assert bench_harness.verdict(group, group[3]) == "wall 2.00x eager reduce-overhead"


@sweep_only("bench_compile --smoke (every setup, a tiny Qwen3 on the CPU)")
def test_smoke_runs_every_setup(tmp_path):
    run = subprocess.run(
        [sys.executable, "scripts/bench_compile.py", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    text = (tmp_path / "compile.md").read_text()
    for setup in ("| ours |", "| compile |", "| ours-compile |", "| ours-compile-cudagraphs |"):
        assert setup in text
    assert "error" not in text.replace("| liger | error: liger_kernel not importable", "")
