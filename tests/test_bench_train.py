"""scripts/bench_train.py: the --profile step timeline (on a hand-made chrome trace), and every
--family run end to end on the CPU with --tiny (Triton interpreter)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_train  # noqa: E402
from bench_train import gpu_timeline  # noqa: E402

from tests.sweep import sweep_marks  # noqa: E402


def _op(name, ts, dur, tid=1):
    return {"cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}


def _launch(corr, ts, tid=1, name="cudaLaunchKernel", cat="cuda_runtime"):
    return {"cat": cat, "name": name, "ts": ts, "dur": 2, "tid": tid, "args": {"correlation": corr}}


def _kernel(corr, name, ts, dur):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def test_idle_gaps_go_to_the_innermost_op_that_launched_the_awaited_kernel():
    events = [
        _op("aten::linear", 0, 100),
        _op("aten::mm", 10, 20),
        _launch(1, 15),
        _kernel(1, "nvjet_gemm", 20, 50),  # busy 20..70
        _op("MyFunctionBackward", 200, 90, tid=2),
        _launch(2, 280, tid=2, name="cuLaunchKernelEx", cat="cuda_driver"),
        _kernel(2, "_rms_norm_bwd_kernel", 300, 10),  # waited 70..300
        _launch(3, 285, tid=2, name="cuLaunchKernelEx", cat="cuda_driver"),  # the last launch
        _kernel(3, "triton_poi_fused", 312, 8),  # 2 us gap: under the threshold
        _op("cudaDeviceSynchronize", 400, 50),
    ]
    t = gpu_timeline({"traceEvents": events})
    assert t["gpu_span_ms"] == 0.3 and t["gpu_busy_ms"] == 0.07 and t["gpu_idle_ms"] == 0.23
    assert t["idle_before_op"] == [[0.23, 1, "MyFunctionBackward"]]
    assert t["gpu_ms_by_category"] == {"matmul": 0.05, "triton kernels": 0.02}
    assert t["top_kernels"][0] == [0.05, 1, "nvjet_gemm"]
    assert t["host_span_ms"] == 0.28  # first op to the last launch, not the final sync


def test_no_kernels_gives_nothing():
    assert gpu_timeline({"traceEvents": [_op("aten::add", 0, 5)]}) == {}


# --- scripts/bench_train.py --family on the CPU: every family trains, "ours" binds its kernels ---

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_train.py"

# The layers apply_training_kernels binds on each family (its norm, gated MLP, RoPE and the
# causal-LM loss head); Qwen3 runs the hand mapping of the earlier measurements.
EXPECTED_LAYERS = {
    "qwen3": {"MemoryEfficientRMSNorm", "SwiGLUMLP", "rotary_pos_emb", "ForCausalLM"},
    "gemma2": {"GemmaRMSNorm", "GeGLUMLP", "rotary_pos_emb", "ForCausalLM"},
    "gemma3": {"GemmaRMSNorm", "GeGLUMLP", "rotary_pos_emb", "ForCausalLM"},
    "phi3": {"RMSNorm", "FusedSwiGLUMLP", "FusedQKVAttention", "rotary_pos_emb", "ForCausalLM"},
}


def _run_bench(tmp_path: Path, family: str, setups: str, *extra: str, stdout: list | None = None):
    out = tmp_path / "out"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--family", family, "--tiny", "--device", "cpu",
         "--steps", "2", "--warmup", "1", "--batch", "1", "--seq", "16", "--setups", setups,
         "--out", str(out), *extra],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    if stdout is not None:
        stdout.append(proc.stdout)
    json_name, md_name, _ = bench_train.output_names(family)
    rows = json.loads((out / json_name).read_text())
    assert [r["setup"] for r in rows] == setups.split(",")
    assert [r.get("error") for r in rows] == [None] * len(rows), proc.stderr[-3000:]
    return rows, (out / md_name).read_text()


# The default run keeps phi3 here (the fused qkv and gate_up; its "ours" setup binds every kind of
# layer); KERNELS_SWEEP=1 adds the other families, and the compile test below (a whole-model
# torch.compile setup of the script: compiled models are checked by tests/models and tests/layers).
_MORE = sweep_marks("more families")
_COMPILE = sweep_marks("the bench script's whole-model compile setup")


@pytest.mark.parametrize(
    "family",
    [pytest.param("gemma2", marks=_MORE), "phi3", pytest.param("gemma3", marks=_MORE),
     pytest.param("qwen3", marks=_MORE)],
)  # fmt: skip
def test_every_family_trains_and_ours_binds_norms_mlp_rope_and_the_loss_head(tmp_path, family):
    rows, md = _run_bench(tmp_path, family, "eager,ours")
    eager, ours = rows
    assert set(ours["bound_layers"]) == EXPECTED_LAYERS[family], ours.get("kept_layers")
    assert ours["training_after"] and ours["bound_modules"] == sum(ours["bound_layers"].values())
    # the same function in bf16: the losses of the two setups agree to bf16's ~1e-2 relative
    for a, b in zip(ours["losses"], eager["losses"], strict=True):
        assert abs(a - b) <= 1e-2 * abs(b)
    assert f"tiny {family} (" in md and "tokens/s vs Liger" in md
    assert "ours bound: " in md


@pytest.mark.parametrize(
    "family",
    [
        pytest.param("gemma2", marks=_COMPILE),
        pytest.param("gemma3", marks=_MORE),
        pytest.param("phi3", marks=_MORE),
    ],
)
def test_whole_model_compile_trains_each_new_family_with_its_own_step_count(tmp_path, family):
    """torch.compile of the whole model (aot_eager here: inductor's C++ build takes minutes on
    this CPU) next to eager, the compile setup with its own --setup-steps: the same batches,
    so its first steps' losses are eager's; progress lines come with timestamps as they run."""
    stdout: list[str] = []
    rows, md = _run_bench(
        tmp_path, family, "eager,compile", "--compile-backend", "aot_eager",
        "--setup-steps", "compile=3", stdout=stdout,
    )  # fmt: skip
    eager, compiled = rows
    assert (eager["steps"], eager["warmup"]) == (2, 1) and len(eager["losses"]) == 2
    assert (compiled["steps"], compiled["warmup"]) == (3, 1) and len(compiled["losses"]) == 3
    assert compiled["training_after"] and compiled["compiled_graphs"] >= 1
    for a, b in zip(compiled["losses"][:2], eager["losses"], strict=True):
        assert abs(a - b) <= 1e-2 * abs(b)
    attention = "eager" if family == "gemma2" else "sdpa"
    assert f"{attention} attention, batch 1x16" in md and ", commit " in md
    assert "compile: 3 steps, median of steps 2-3." in md
    log = stdout[0]
    assert re.search(r"^\[\d\d:\d\d:\d\d \+ *\d+s\] compile: step 3/3 ", log, re.M), log
    assert re.search(r"^\[\d\d:\d\d:\d\d \+ *\d+s\] eager: done in ", log, re.M), log


def test_a_deadline_too_short_for_any_setup_still_writes_every_row(tmp_path):
    """--deadline: a setup that no longer fits is a row saying so, and the table is written."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--family", "gemma2", "--tiny", "--device", "cpu",
         "--setups", "eager,ours,liger", "--deadline", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((out / "train-gemma2.json").read_text())
    assert [r["setup"] for r in rows] == ["eager", "ours", "liger"]
    assert all(r["error"].startswith("not run: --deadline 1 s left 0 s") for r in rows), rows
    md = (out / "train-gemma2.md").read_text()
    assert md.count("| error: not run: --deadline 1 s") == 3


def test_setup_timeouts_are_one_for_all_or_per_setup():
    parse = bench_train.parse_setup_timeouts
    assert parse("150,compile=300", ["eager", "compile"]) == {"": 150.0, "compile": 300.0}
    assert parse("", ["eager"]) == {}
    for bad in ("0", "ours=10", "compile=", "x"):
        with pytest.raises(SystemExit, match="--setup-timeout"):
            parse(bad, ["eager", "compile"])


def test_setup_steps_are_checked():
    assert bench_train.parse_setup_steps("compile=6, liger=3", ["eager", "liger", "compile"]) == {
        "compile": 6,
        "liger": 3,
    }
    for bad in ("compile", "compile=1", "ours=4", "compile=x"):
        with pytest.raises(SystemExit, match="--setup-steps"):
            bench_train.parse_setup_steps(bad, ["eager", "compile"])


def test_the_table_relates_every_setup_to_liger():
    def row(setup, tps, peak):
        return {"setup": setup, "step_ms": 1.0, "tokens_per_s": tps, "peak_gib": peak,
                "losses": [2.0, 1.0]}  # fmt: skip

    text = bench_train.table(
        [row("eager", 50.0, 60.0), row("liger", 80.0, 20.0), row("ours", 100.0, 18.0)], 2, 1
    )
    lines = text.splitlines()
    assert lines[3].startswith("| liger |") and "| 1.00x | 1.00x |" in lines[3]
    assert lines[4].startswith("| ours |") and "| 1.25x | 0.90x |" in lines[4]
    assert "| 0.62x | 3.00x |" in lines[2]


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "phi3"])
def test_the_liger_setup_patches_each_new_family_in_place(tmp_path, family):
    """The liger setup's load (Liger's Triton kernels do not run on the CPU: this checks that its
    instance patch applies to these families on transformers 5.24 and takes their norms, MLPs
    and the causal-LM forward)."""
    pytest.importorskip("liger_kernel")
    bench_train.save_model(tmp_path / "model", True, family)
    model, _, bound = bench_train.load_for_training("liger", tmp_path / "model", "cpu", family)
    assert model.training and bound is None
    patched = {
        name.rsplit(".", 1)[-1]
        for name, m in model.named_modules()
        if "liger" in getattr(m.forward, "__func__", m.forward).__module__
    }
    assert {"", "input_layernorm", "mlp"} <= patched, patched


def test_sigterm_from_an_outer_timeout_kills_the_setup_and_still_writes_the_table(tmp_path):
    """What `timeout 190 python scripts/bench_train.py ...` does at its limit: the running
    setup's process (in a session of its own) must not outlive the run, and the rows say
    which setups did not run."""
    out = tmp_path / "out"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--family", "gemma2", "--tiny", "--device", "cpu",
         "--steps", "200", "--batch", "1", "--seq", "16", "--setups", "eager,ours",
         "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )  # fmt: skip
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "eager: step 1/200" in line:
                break
        pid = int(next(re.search(r"eager: pid (\d+)", x)[1] for x in lines if "pid" in x))
        proc.send_signal(signal.SIGTERM)
        lines += proc.stdout.readlines()
        assert proc.wait(timeout=60) == 0, "".join(lines)
    finally:
        proc.kill()
    state = Path(f"/proc/{pid}/status")
    assert not state.exists() or "zombie" in state.read_text(), "the setup outlived the run"
    rows = json.loads((out / "train-gemma2.json").read_text())
    assert rows == [{"setup": "eager", "error": "terminated (SIGTERM) while it ran"},
                    {"setup": "ours", "error": "not run: terminated"}]  # fmt: skip
    md = (out / "train-gemma2.md").read_text()
    assert "| eager | error: terminated (SIGTERM) while it ran |" in md


def test_the_liger_setup_names_the_backend_liger_picks_per_op():
    """Liger 0.8.5 dispatches each op to an implementation (Triton, or a CuTe DSL build that
    compiles on first use where `cutlass` imports): the liger setup says which, before step 1."""
    pytest.importorskip("liger_kernel")
    picks = bench_train.liger_backends("cpu")
    for op in ("rms_norm", "geglu", "rope", "fused_linear_cross_entropy"):
        assert f"{op} nvidia-triton" in picks, picks
