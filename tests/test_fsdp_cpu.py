"""FSDP2 (`fully_shard`) on two CPU ranks (gloo): every rank loads the kernels through the loader
from one shared cache, the kernels stay bound, and training matches the unkernelized model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _torchrun(setup: str, model_dir: Path, env: dict) -> dict:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        str(ROOT / "scripts" / "train_fsdp.py"), "--setup", setup, "--tiny",
        "--steps", "3", "--batch", "2", "--seq", "16", "--model-dir", str(model_dir),
    ]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    # rank 0 prints RESULT after the last all-reduce: it tells a crash in training from one at exit
    said = "printed RESULT" if line else "printed no RESULT"
    assert out.returncode == 0 and line, f"exit {out.returncode}, {said}\n{out.stderr[-3000:]}"
    return json.loads(line[len("RESULT ") :])


def test_two_ranks_share_one_download_and_train_like_eager(hub, tmp_path):
    hub.build(ROOT / "hub_kernels")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    model_dir = tmp_path / "model"
    eager = _torchrun("eager", model_dir, env)
    hub.reset_requests()
    ours = _torchrun("ours", model_dir, env)
    assert ours["world"] == 2
    # 2 layers x (4 norms + rotary + MLP) + the final norm + the causal-LM head
    assert ours["bound_modules"] == 14
    for a, b in zip(ours["losses"], eager["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (ours["losses"], eager["losses"])
    gets = Counter(path for method, path in hub.requests if method == "GET" and "/resolve/" in path)
    assert gets and set(gets.values()) == {1}, gets  # each file once for both ranks
    api = [path for _method, path in hub.requests if path.startswith("/api/")]
    # revision, publisher, listing, and refs (the newer-version check of a cache's first
    # version=N resolve): the requests of one process
    assert len(api) == 4, api
    assert sum(path.endswith("/refs") for path in api) == 1, api
