"""``training_kernel_config`` survives being shared by several loads, as TRL's trainers share
it between the policy and the reference model (``model_init_kwargs``).

transformers accepts a KernelConfig only for accelerator devices; to run its load path on the
CPU, the device transformers infers while it rewrites the mapping is reported as "cuda" (the
kernels then find no CPU entry and bind nothing). tests/gpu/test_post_training_gpu.py runs the
real thing: DPO with the config in ``model_init_kwargs``."""

from __future__ import annotations

import kernels
import pytest
from transformers import AutoModelForCausalLM, KernelConfig

from .trl_runs import save_checkpoint


@pytest.fixture
def as_if_on_a_gpu(monkeypatch):
    from transformers.utils import kernel_config

    monkeypatch.setattr(kernel_config, "infer_device", lambda model: "cuda")


def test_one_config_loads_two_models(local_kernels, as_if_on_a_gpu, tmp_path):
    ckpt = save_checkpoint(tmp_path / "ckpt", "qwen3")
    config = kernels.training_kernel_config(str(ckpt))
    spec = dict(config.kernel_mapping)
    first = AutoModelForCausalLM.from_pretrained(ckpt, use_kernels=True, kernel_config=config)
    second = AutoModelForCausalLM.from_pretrained(ckpt, use_kernels=True, kernel_config=config)
    assert first.kernel_config is not second.kernel_config
    for model in (first, second):
        nested = model.kernel_config.kernel_mapping
        assert set(nested) == set(spec) and all("cuda" in v for v in nested.values())
        model.train()  # transformers kernelizes again with the model's own config
    assert {k: v[0] for k, v in config.kernel_mapping.items()} == spec  # still a load's form


def test_a_plain_kernel_config_cannot_be_shared(local_kernels, as_if_on_a_gpu, tmp_path):
    """What the above guards against (transformers 5.24): the second load fails."""
    ckpt = save_checkpoint(tmp_path / "ckpt", "qwen3")
    config = KernelConfig(kernel_mapping=kernels.training_kernel_mapping(str(ckpt)))
    AutoModelForCausalLM.from_pretrained(ckpt, use_kernels=True, kernel_config=config)
    with pytest.raises(AttributeError, match="partition"):
        AutoModelForCausalLM.from_pretrained(ckpt, use_kernels=True, kernel_config=config)
