"""The vocab-parallel loss on two GPUs (NCCL), bf16 at Qwen3's vocabulary, against the
single-device fused loss: needs two CUDA devices, skipped otherwise. Run in its own process:
``python -m pytest tests/gpu/test_distributed_gpu.py`` (docs/distributed.md)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (a 2-GPU machine)"
)


def test_vocab_parallel_loss_on_two_gpus_matches_one_gpu_and_holds_no_full_weight(tmp_path):
    scenario = {"name": "vp-cuda", "kind": "vocab_parallel_bf16"}
    ranks = run_ranks(2, [scenario], tmp_path, interpret=False, backend="nccl")["vp-cuda"]
    for res in ranks:
        assert abs(res["loss"] - res["ref_loss"]) <= 1e-3 * abs(res["ref_loss"]), res
        assert res["dx_err"] <= 1e-2 and res["dw_err"] <= 1e-2, res  # bf16
        # this rank's d(weight) (half the weight) and 256-row tiles: under the full weight
        assert res["peak"] < res["full_weight_bytes"] < res["full_logits_bytes"], res
