"""MoEExperts (hub_kernels/kernels-lab/training moe.py) on a CUDA GPU at real expert shapes.

Run in its own pytest process (tests/kernels switches Triton to its CPU interpreter):
    pytest --noconftest tests/gpu/test_moe_gpu.py
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from tests.gpu.variant import load_variant, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        reason="TRITON_INTERPRET is set: run tests/gpu in its own pytest process",
    ),
]


# (family, experts, top-k, hidden, intermediate, tokens): Qwen3-30B-A3B's experts, and
# Mixtral-8x7B's with the intermediate size cut to a quarter to keep the fp32 reference small.
SHAPES = {
    "qwen3_moe": (128, 8, 2048, 768, 4096),
    "mixtral": (8, 2, 4096, 3584, 2048),
    "gpt_oss": (32, 4, 2880, 2880, 2048),  # gpt-oss-20b: transposed, biases, clamped gate
}


@pytest.fixture(scope="module")
def kt():
    return load_variant("_kernels_training_moe_gpu_test")


def experts(family: str, e: int, k: int, h: int, i: int, dtype):
    if family == "qwen3_moe":
        from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

        cfg = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=i, num_experts=e)
        cls = Qwen3MoeExperts
    elif family == "gpt_oss":
        from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        cfg = GptOssConfig(hidden_size=h, intermediate_size=i, num_local_experts=e)
        cls = GptOssExperts
    else:
        from transformers.models.mixtral.configuration_mixtral import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts

        cfg = MixtralConfig(hidden_size=h, intermediate_size=i, num_local_experts=e)
        cls = MixtralExperts
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    with torch.device("cuda"):
        module = cls(cfg)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02)
    return module.to(dtype)


def inputs(e, k, h, tokens, dtype):
    """Hidden states, top-k ids from a random router with expert e-1 never chosen (an empty
    group: its weight gradients must be exactly zero) and renormalised weights."""
    x = torch.randn(tokens, h, device="cuda", dtype=dtype)
    logits = torch.randn(tokens, e, device="cuda")
    logits[:, e - 1] = -math.inf
    w, idx = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return x, idx, (w / w.sum(-1, keepdim=True)).to(dtype)


def run(module, x, idx, w, dy):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    for p in module.parameters():
        p.grad = None
    out = module(x, idx, w)
    out.backward(dy)
    return [out, x.grad, w.grad] + [p.grad for p in module.parameters()]


@pytest.mark.parametrize("family", list(SHAPES))
def test_bf16_grouped_path_matches_fp32_reference(kt, family):
    """bf16 through torch._grouped_mm: output and every gradient within bf16 tolerance of the
    module's own forward in fp32, and no further from it than transformers' bf16 forward is."""
    e, k, h, i, tokens = SHAPES[family]
    ref32 = experts(family, e, k, h, i, torch.float32)
    plain = experts(family, e, k, h, i, torch.bfloat16)
    ours = experts(family, e, k, h, i, torch.bfloat16)
    ours.forward = kt.layers.MoEExperts.forward.__get__(ours)
    x, idx, w = inputs(e, k, h, tokens, torch.bfloat16)
    assert kt.moe._use_grouped_mm(x, ours.gate_up_proj, ours.down_proj)
    dy = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
    want = run(ref32, x.float(), idx, w.float(), dy.float())
    got = run(ours, x, idx, w, dy)
    theirs = run(plain, x, idx, w, dy)
    names = ["output", "d x", "d top_k_weights"] + [f"d {n}" for n, _ in ours.named_parameters()]
    for name, g, t, r in zip(names, got, theirs, want, strict=True):
        err, err_theirs = rel_err(g, r), rel_err(t, r)
        assert err <= max(1e-2, 1.5 * err_theirs), (
            f"{name}: {err:.2e} (transformers {err_theirs:.2e})"
        )
    assert all(not p[e - 1].any() for p in got[3:])  # the empty group's weights and biases


def test_fp32_loop_path_matches_the_module(kt):
    e, k, h, i, tokens = 16, 4, 512, 384, 1024
    ref = experts("qwen3_moe", e, k, h, i, torch.float32)
    ours = experts("qwen3_moe", e, k, h, i, torch.float32)
    ours.forward = kt.layers.MoEExperts.forward.__get__(ours)
    x, idx, w = inputs(e, k, h, tokens, torch.float32)
    dy = torch.randn(tokens, h, device="cuda")
    for name, g, r in zip(
        ["output", "d x", "d w", "d gate_up", "d down"], run(ours, x, idx, w, dy),
        run(ref, x, idx, w, dy), strict=True,
    ):  # fmt: skip
        assert rel_err(g, r) <= 1e-5, name


def test_sentinel_ids_and_compile(kt):
    """Ids == E (expert-parallel sentinels) contribute nothing; torch.compile(fullgraph) agrees."""
    e, k, h, i, tokens = 32, 4, 1024, 512, 2048
    ref32 = experts("mixtral", e, k, h, i, torch.float32)
    plain = experts("mixtral", e, k, h, i, torch.bfloat16)
    ours = experts("mixtral", e, k, h, i, torch.bfloat16)
    ours.forward = kt.layers.MoEExperts.forward.__get__(ours)
    x, idx, w = inputs(e, k, h, tokens, torch.bfloat16)
    idx[::5, 0] = e
    dy = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
    want = run(ref32, x.float(), idx, w.float(), dy.float())
    theirs = run(plain, x, idx, w, dy)
    got = run(ours, x, idx, w, dy)
    for g, t, r in zip(got, theirs, want, strict=True):
        assert rel_err(g, r) <= max(1e-2, 1.5 * rel_err(t, r))
    assert not got[2][::5, 0].any()
    compiled = torch.compile(ours, fullgraph=True)
    again = run(compiled, x, idx, w, dy)
    for g, r in zip(again, got, strict=True):
        assert rel_err(g, r) <= 1e-3
