"""The one-line path on a CUDA GPU: ``from_pretrained(path, use_kernels=True,
kernel_config=kernels.training_kernel_config(path))`` for one model type per structure, in
bf16, 3 AdamW steps next to the plain model (losses and gradient norms within 2e-2). The
whole registry in bf16 is ``python scripts/sweep_models.py --device cuda --dtype bf16``.
Run in its own pytest process.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import kernels
import pytest
import torch

from tests.models.registry import VOCAB, build, train_steps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        reason="TRITON_INTERPRET is set: run tests/gpu in its own pytest process",
    ),
]

HUB_KERNELS = Path(__file__).resolve().parents[2] / "hub_kernels"
TYPES = [
    "llama",
    "gemma2",
    "phi3",
    "olmo2",
    "cohere",
    "granite",
    "stablelm",
    "glm4",
    "mixtral",
    "gpt2",
    # Liger parity: complex (freqs_cis) rotary with bf16 q/k and fp32 cos/sin on the kernel,
    # Falcon-H1's muP-scaled MLP and loss head
    "llama4_text",
    "deepseek_v2",
    "falcon_h1",
]


@pytest.fixture
def mirror(hub):
    hub.build(HUB_KERNELS)
    return hub


@pytest.mark.parametrize("model_type", TYPES)
def test_kernel_config_from_the_path_trains_like_the_plain_model(mirror, tmp_path, model_type):
    from transformers import AutoModelForCausalLM

    build(model_type).save_pretrained(tmp_path / "ckpt")
    path = str(tmp_path / "ckpt")
    config = kernels.training_kernel_config(path)
    planned = set(config.kernel_mapping)
    load = dict(device_map="cuda", dtype=torch.bfloat16, attn_implementation="eager")
    ours = AutoModelForCausalLM.from_pretrained(
        path, use_kernels=True, kernel_config=copy.deepcopy(config), **load
    )
    plain = AutoModelForCausalLM.from_pretrained(path, **load)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (4, 64), generator=gen).cuda() for _ in range(3)]
    got, want = train_steps(ours, batches), train_steps(plain, batches)
    report = kernels.last_report(ours)
    bound = {e.layer_name for e in report if e.status == "bound"}
    assert planned <= bound, str(report)  # bound through train(), not only at load
    for (loss, norm), (loss_ref, norm_ref) in zip(got, want, strict=True):
        assert loss == pytest.approx(loss_ref, rel=2e-2), str(report)
        assert norm == pytest.approx(norm_ref, rel=2e-2), str(report)
