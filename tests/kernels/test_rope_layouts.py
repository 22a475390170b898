"""RoPE layouts beyond full rotate-half, forward and backward on the Triton interpreter vs
float64: partial rotary (phi3 / stablelm / persimmon: the first cos.shape[-1] dims rotate, the
rest pass through) and interleaved pairs (GPT-J / Cohere / GLM)."""

from __future__ import annotations

import pytest
import torch
from _training_refs import DTYPES, check_rope, rope64


def partial64(q, k, cos, sin, unsqueeze_dim):
    d = cos.shape[-1]
    qr, kr = rope64(q[..., :d], k[..., :d], cos, sin, unsqueeze_dim)
    return torch.cat((qr, q[..., d:]), -1), torch.cat((kr, k[..., d:]), -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary, head", [(8, 32), (16, 16), (4, 16)])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_partial_rotary_matches_float64(kt, dtype, rotary, head, unsqueeze_dim):
    b, t, hq, hk = 2, 5, 4, 2
    shape = (b, hq, t, head) if unsqueeze_dim == 1 else (b, t, hq, head)
    kshape = (b, hk, t, head) if unsqueeze_dim == 1 else (b, t, hk, head)
    q = torch.randn(*shape, dtype=dtype).requires_grad_()
    k = torch.randn(*kshape, dtype=dtype).requires_grad_()
    angles = torch.randn(b, t, rotary // 2) * 3
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    qo, ko = kt.rope.apply_partial_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
    check_rope(q, k, cos, sin, qo, ko, unsqueeze_dim, dtype, ref=partial64)
    # the pass-through dims are the input, bit for bit
    assert torch.equal(qo[..., rotary:], q[..., rotary:])


def test_rotary_wider_than_the_head_is_refused(kt):
    q = k = torch.randn(1, 2, 3, 8)
    cos = sin = torch.randn(1, 3, 16)
    with pytest.raises(ValueError, match="does not fit"):
        kt.rope.apply_partial_rotary_pos_emb(q, k, cos, sin)


def interleaved64(q, k, cos_pairs, sin_pairs, unsqueeze_dim):
    d = 2 * cos_pairs.shape[-1]
    cos = cos_pairs.repeat_interleave(2, -1).unsqueeze(unsqueeze_dim)
    sin = sin_pairs.repeat_interleave(2, -1).unsqueeze(unsqueeze_dim)

    def one(x):
        r = x[..., :d]
        pairs = torch.stack((-r[..., 1::2], r[..., 0::2]), dim=-1).flatten(-2)
        return torch.cat((r * cos + pairs * sin, x[..., d:]), -1)

    return one(q), one(k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary, head", [(16, 16), (8, 16)])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_interleaved_rotary_matches_float64(kt, dtype, rotary, head, unsqueeze_dim):
    """Cohere/GLM pairs (2i, 2i+1), full and partial, forward and backward."""
    b, t, hq, hk = 2, 5, 4, 2
    shape = (b, hq, t, head) if unsqueeze_dim == 1 else (b, t, hq, head)
    kshape = (b, hk, t, head) if unsqueeze_dim == 1 else (b, t, hk, head)
    q = torch.randn(*shape, dtype=dtype).requires_grad_()
    k = torch.randn(*kshape, dtype=dtype).requires_grad_()
    angles = torch.randn(b, t, rotary // 2) * 3
    cp, sp = angles.cos().to(dtype), angles.sin().to(dtype)
    qo, ko = kt.rope.apply_interleaved_rotary_pos_emb(q, k, cp, sp, unsqueeze_dim)
    check_rope(q, k, cp, sp, qo, ko, unsqueeze_dim, dtype, ref=interleaved64)
