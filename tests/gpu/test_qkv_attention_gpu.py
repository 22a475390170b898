"""FusedQKVAttention on a CUDA GPU at Phi-3-mini's attention shape (hidden 3072, 32 heads of 96,
no GQA), 2x2048 tokens, bf16, sdpa with Phi-3's sliding-window mask: the output and gradients
against the family's own forward in float64 (bf16 tolerance, 1e-2), the rope kernel launched in
the forward and the backward, and the memory the forward keeps for the backward two [tokens,
hidden] blocks under the family's (q's and k's thirds of qkv, which v's slice kept alive). Run in
its own pytest process: ``python -m pytest tests/gpu/test_qkv_attention_gpu.py``."""

from __future__ import annotations

import importlib
import importlib.util
import types

import pytest
import torch

from tests.gpu.launches import TritonLaunches
from tests.gpu.variant import load_variant
from tests.gpu.variant import rel_err as _rel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

B, T, HIDDEN, HEADS = 2, 2048, 3072, 32


@pytest.fixture(scope="module")
def kt():
    return load_variant("_kernels_training_qkv_gpu_test")


def _attention(dtype, rotary: float = 1.0):
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3Attention, Phi3RotaryEmbedding

    config = Phi3Config(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        sliding_window=T - 1, attention_dropout=0.0, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": rotary},
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    attn = Phi3Attention(config, layer_idx=0).to("cuda", dtype)
    rope = Phi3RotaryEmbedding(config).to("cuda")
    return attn, rope


def _inputs(attn, rope, dtype):
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(B, T, HIDDEN, device="cuda", dtype=dtype, generator=gen)
    pos = torch.arange(T, device="cuda")[None].expand(B, -1)
    cos, sin = rope(x, pos)
    i = torch.arange(T, device="cuda")
    # Phi-3's sliding-window causal mask (window T - 1: the first key drops out of the last row)
    mask = ((i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < T - 1))[None, None]
    return x.requires_grad_(), (cos.to(dtype), sin.to(dtype)), mask.expand(B, 1, T, T)


def _bind(kt, attn):
    attn.forward = types.MethodType(kt.layers.FusedQKVAttention.forward, attn)
    return attn


@pytest.mark.parametrize("rotary", [1.0, 0.75], ids=["full", "partial"])
def test_matches_the_family_forward_in_float64(kt, rotary):
    attn, rope = _attention(torch.bfloat16, rotary)
    x, pe, mask = _inputs(attn, rope, torch.bfloat16)
    dy = torch.randn(B, T, HIDDEN, device="cuda", dtype=torch.bfloat16)
    ref_attn = _attention(torch.float64, rotary)[0]
    ref_attn.load_state_dict(attn.state_dict())
    x64 = x.detach().double().requires_grad_()
    y64 = ref_attn(x64, tuple(t.double() for t in pe), mask)[0]
    ref = (y64, *torch.autograd.grad(y64, [x64, ref_attn.qkv_proj.weight], dy.double()))
    rope_mod = importlib.import_module(f"{kt.__name__}.rope")
    with TritonLaunches(rope_mod, device=True) as launches:
        y = _bind(kt, attn)(x, pe, mask)[0]
        got = (y, *torch.autograd.grad(y, [x, attn.qkv_proj.weight], dy))
    launches.assert_launched("_rope_kernel", BACKWARD=False)
    launches.assert_launched("_rope_kernel", BACKWARD=True)
    launches.assert_device_matches()
    for g, r, what in zip(got, ref, ("y", "dx", "d qkv_proj.weight"), strict=True):
        assert g.dtype == torch.bfloat16
        assert _rel(g, r) <= 1e-2, (what, _rel(g, r))


def test_the_forward_keeps_two_blocks_less(kt):
    """Memory held between the forward and the backward: the family's forward keeps qkv (v is
    a slice of it) next to the rotated q and k; the layer keeps q, k and v alone."""
    attn, rope = _attention(torch.bfloat16)
    x, pe, mask = _inputs(attn, rope, torch.bfloat16)
    block = B * T * HIDDEN * 2

    def held(module):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = module(x, pe, mask)[0]
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - before
        y.sum().backward()
        return kept

    family = held(attn)
    ours = held(_bind(kt, attn))
    assert family - ours >= 1.9 * block, (family / block, ours / block)
