"""The tensor-parallel and ZeRO-3 training scripts (scripts/train_tp.py, train_deepspeed.py) on
two CPU ranks with --tiny: the same script a 2-GPU machine runs, kernels bound, losses equal to
eager's over three AdamW steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.distributed.launch import KERNEL_REPO, ROOT
from tests.sweep import sweep_only


def _torchrun(script: str, setup: str, model_dir, tmp_path) -> dict:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        LOCAL_KERNELS=f"kernels-lab/training={KERNEL_REPO}",
        DS_ACCELERATOR="cpu",
    )
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--standalone", str(ROOT / "scripts" / script), "--setup", setup, "--tiny",
        "--steps", "3", "--batch", "2", "--seq", "16", "--model-dir", str(model_dir),
    ]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert out.returncode == 0 and line, f"exit {out.returncode}\n{out.stderr[-3000:]}"
    return json.loads(line[len("RESULT ") :])


@sweep_only("scripts/train_tp.py and train_deepspeed.py on 2 CPU ranks")
@pytest.mark.parametrize("script", ["train_tp.py", "train_deepspeed.py"])
def test_training_script_runs_on_cpu_ranks_like_eager(script, tmp_path):
    if script == "train_deepspeed.py":
        pytest.importorskip("deepspeed", reason="ZeRO-3 needs deepspeed (pip install deepspeed)")
    model_dir = tmp_path / "model"
    eager = _torchrun(script, "eager", model_dir, tmp_path)
    ours = _torchrun(script, "ours", model_dir, tmp_path)
    assert ours["world"] == 2 and ours["bound_modules"] == 14  # tiny Qwen3: 2 x 6 + norm + head
    for a, b in zip(ours["losses"], eager["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (ours["losses"], eager["losses"])
    if script == "train_tp.py":
        assert ours["lm_head_rows_per_rank"] == 256  # the tiny vocabulary of 512, split
