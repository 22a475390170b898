"""scripts/bench_moe.py on the CPU: shared weights, progress lines, the e2e setup timeout."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import bench_moe  # noqa: E402


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_every_implementation_holds_the_one_shared_set_of_weights(monkeypatch, family):
    import torch

    monkeypatch.setattr(bench_moe, "DEVICE", "cpu")
    e, k, h, i = 4, 2, 32, 16
    weights = bench_moe.shared_weights(family, e, k, h, i)
    assert weights and all(p.dtype == torch.bfloat16 for p in weights.values())
    x = torch.randn(8, h, dtype=torch.bfloat16)
    idx = torch.randint(0, e, (8, k))
    w = torch.full((8, k), 0.5, dtype=torch.bfloat16)
    outs = []
    for impl in ("eager", "grouped_mm"):
        module = bench_moe.experts_module(family, e, k, h, i, impl, weights)
        # the very Parameter objects: one copy of the weights and of their gradients per shape
        assert dict(module.named_parameters()) == weights
        assert all(a is b for a, b in zip(module.parameters(), weights.values(), strict=True))
        outs.append(module(x, idx, w).float())
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-2, atol=1e-2)


def test_check_only_prints_a_line_per_implementation_as_it_finishes():
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_moe.py"), "--check-only", "--device", "cpu",
         "--shapes", "tiny", "--tokens", "64", "--impls", "eager,grouped_mm,ours"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    progress = [line for line in proc.stderr.splitlines() if line.startswith("[")]
    firsts = [line.split("] ", 1)[1].split(":")[0] for line in progress if "first fwd+bwd" in line]
    assert firsts == ["tiny T64 eager", "tiny T64 grouped_mm", "tiny T64 ours"]
    assert any("tiny T64: fp32 reference" in line for line in progress)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| tiny T64 |")]
    assert [r.split(" | ")[1] for r in rows] == ["eager", "grouped_mm", "ours"]
    assert all("error" not in r for r in rows)


def test_a_setup_past_its_timeout_is_killed_and_reported():
    cmd = [
        sys.executable,
        "-c",
        "import sys, time; print('tuning', file=sys.stderr); time.sleep(60)",
    ]
    t = time.perf_counter()
    row = bench_moe.run_child("slow", cmd, timeout_s=2)
    assert time.perf_counter() - t < 30
    assert row == {"setup": "slow", "error": "killed after --setup-timeout 2 s"}


def test_e2e_one_line_setup_binds_experts_and_the_loss_head():
    """ours-all is the one-line way (apply_training_kernels); a run where the experts or the fused
    loss head did not bind is refused, not timed."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_moe.py"), "--e2e", "--tiny", "--device", "cpu",
         "--setups", "ours-all", "--steps", "1", "--setup-timeout", "240"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "bound: MoEExperts, MoEForCausalLM, RMSNorm, rotary_pos_emb" in proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ours-all |")]
    assert len(rows) == 1 and "error" not in rows[0], proc.stdout[-2000:]
