"""The bundled training kernels on a CUDA GPU (issue 31): offline, no mirror, an empty cache,
``from_pretrained(path, use_kernels=True, kernel_config=kernels.training_kernel_config(path))``
binds the bundled copy (through transformers' local-kernel path) and trains like the plain
model. Run in its own process."""

from __future__ import annotations

import copy
import os

import kernels
import pytest
import torch
from kernels import bundled

from tests.models.registry import VOCAB, build, train_steps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"),
]


def test_the_bundled_kernels_serve_a_kernel_config_on_the_gpu(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # and the cache of this test is empty
    build("llama").save_pretrained(tmp_path / "ckpt")
    path = str(tmp_path / "ckpt")
    config = kernels.training_kernel_config(path)
    assert config.use_local_kernel
    load = dict(device_map="cuda", dtype=torch.bfloat16, attn_implementation="eager")
    ours = AutoModelForCausalLM.from_pretrained(
        path, use_kernels=True, kernel_config=copy.deepcopy(config), **load
    )
    plain = AutoModelForCausalLM.from_pretrained(path, **load)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (4, 64), generator=gen).cuda() for _ in range(3)]
    got, want = train_steps(ours, batches), train_steps(plain, batches)
    report = kernels.last_report(ours)
    bound = [e for e in report if e.status == "bound"]
    commit = bundled.read_bundle().commit[:12]
    assert set(config.kernel_mapping) <= {e.layer_name for e in bound}, str(report)
    assert f"kernels-lab/training@{commit}" in str(report), str(report)
    for (loss, norm), (loss_ref, norm_ref) in zip(got, want, strict=True):
        assert loss == pytest.approx(loss_ref, rel=2e-2), str(report)
        assert norm == pytest.approx(norm_ref, rel=2e-2), str(report)
    assert os.listdir(os.environ["KERNELS_CACHE"])  # installed in the cache, verified
