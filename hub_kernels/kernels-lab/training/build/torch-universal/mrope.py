"""Multimodal rotary position embeddings (the Qwen2-VL family's and its kin's), forward only.

A multimodal rotary embedding gives each token three positions (time, height, width: text tokens
repeat one value thrice, image tokens count their grid cell) and hands each rotary frequency the
position of one axis: Qwen2-VL and GLM-4V cut the frequencies into three sections (t, h, w),
Qwen3-VL interleaves them (t h w t h w ..., the rest t). transformers computes every frequency
for every axis ([3, B, T, D/2] angles, cos and sin of all three), picks a section from each, and
concatenates: about a dozen ops and three times the trigonometry. Here one program per few
tokens reads each column's axis and frequency from a small table, computes the angle once, and
writes cos and sin in the output dtype: the same fp32 products, the same final rounding.

The table (axis and frequency index per output column) is made on the host once per section
list and layout (``chunked`` or ``interleaved`` sections; columns as two ``halves`` [f, f] or as
repeated ``pairs`` [f0, f0, f1, f1, ...]). cos and sin take no gradient: the positions are
integers and the inverse frequencies a buffer nobody trains (a trainable one takes the torch
formula, which autograd differentiates).

``apply_vision_rotary_pos_emb`` is the vision towers' ``apply_rotary_pos_emb_vision``: q and k
[S, H, D] rotated by cos/sin [S, D] in fp32 and rounded once to their dtype, on the RoPE kernel
(rope.py) with a leading batch of one.
"""

from __future__ import annotations

import functools

import torch

from ._common import cdiv, fast_launch, next_pow2, op_name, use_triton
from ._triton import tl, triton
from .rope import apply_rotary_pos_emb

LAYOUTS = ("chunked", "interleaved")


@fast_launch
@triton.jit
def _mrope_kernel(
    POS, INV, AXIS, FREQ, COS, SIN, n_tokens, stride_axis, scaling,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, BLOCK_D)
    tmask = t < n_tokens
    jmask = j < D
    axis = tl.load(AXIS + j, mask=jmask, other=0).to(tl.int64)
    inv = tl.load(INV + tl.load(FREQ + j, mask=jmask, other=0), mask=jmask, other=0.0)
    mask = tmask[:, None] & jmask[None, :]
    t64 = t.to(tl.int64)[:, None]
    pos = tl.load(POS + axis[None, :] * stride_axis + t64, mask=mask, other=0).to(tl.float32)
    angle = pos * inv.to(tl.float32)[None, :]
    out = t64 * D + j[None, :]
    tl.store(COS + out, (tl.cos(angle) * scaling).to(COS.dtype.element_ty), mask=mask)
    tl.store(SIN + out, (tl.sin(angle) * scaling).to(SIN.dtype.element_ty), mask=mask)


def column_table(sections: tuple[int, ...], layout: str, pairs: bool) -> tuple[list, list]:
    """(axis, frequency index) of every output column for these sections: ``chunked``
    frequencies take axis ``k % 3`` in their k-th section; ``interleaved`` frequency i takes
    axis 1 where i % 3 == 1 and i < 3 * sections[1], axis 2 where i % 3 == 2 and
    i < 3 * sections[2], else axis 0. Columns are the frequencies twice: [f, f] (``halves``) or
    each repeated (``pairs``)."""
    half = sum(sections)
    if layout == "chunked":
        axis = [k % 3 for k, n in enumerate(sections) for _ in range(n)]
    elif layout == "interleaved":
        axis = [0] * half
        for a in (1, 2):
            for i in range(a, min(3 * sections[a], half), 3):
                axis[i] = a
    else:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    freqs = list(range(half))
    if pairs:
        return [a for a in axis for _ in (0, 1)], [f for f in freqs for _ in (0, 1)]
    return axis + axis, freqs + freqs


@functools.lru_cache(maxsize=64)
def _table(sections: tuple[int, ...], layout: str, pairs: bool, device: torch.device):
    axis, freq = column_table(sections, layout, pairs)
    return (
        torch.tensor(axis, dtype=torch.int32, device=device),
        torch.tensor(freq, dtype=torch.int32, device=device),
    )


def _positions(position_ids: torch.Tensor) -> torch.Tensor:
    """[3, B, T] positions (a [B, T] one is every axis's), as transformers' forward expands."""
    if position_ids.dim() == 2:
        return position_ids.expand(3, -1, -1)
    return position_ids


def reference(position_ids, inv_freq, sections, layout, pairs, scaling, dtype):
    """The torch formula (transformers' composition, any layout here): cos and sin [B, T, D]."""
    axis, freq = column_table(tuple(sections), layout, pairs)
    pos = _positions(position_ids).float()
    angles = pos[..., None] * inv_freq.float()  # [3, B, T, D/2]
    cols = torch.stack(
        [angles[a, ..., f] for a, f in zip(axis, freq, strict=True)], dim=-1
    )  # [B, T, D]
    return (cols.cos() * scaling).to(dtype), (cols.sin() * scaling).to(dtype)


def _launch(position_ids, inv_freq, sections, layout, pairs, scaling, dtype):
    pos = _positions(position_ids)
    _, b, t = pos.shape
    pos = pos.reshape(3, b * t)
    if pos.stride(1) != 1:
        pos = pos.contiguous()
    axis, freq = _table(tuple(sections), layout, pairs, pos.device)
    d = axis.numel()
    cos = torch.empty(b, t, d, dtype=dtype, device=pos.device)
    sin = torch.empty_like(cos)
    n = b * t
    if n:
        block_d = next_pow2(d)
        block_t = max(1, min(16, 4096 // block_d))
        _mrope_kernel[(cdiv(n, block_t),)](
            pos, inv_freq.contiguous(), axis, freq, cos, sin, n, pos.stride(0), float(scaling),
            D=d, BLOCK_D=block_d, BLOCK_T=block_t,
        )  # fmt: skip
    return cos, sin


@torch.library.custom_op(op_name("mrope_cos_sin"), mutates_args=())
def mrope_cos_sin_op(
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    sections: list[int],
    layout: str,
    pairs: bool,
    scaling: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(inv_freq):
        return _launch(position_ids, inv_freq, sections, layout, pairs, scaling, dtype)
    return reference(position_ids, inv_freq, sections, layout, pairs, scaling, dtype)


@mrope_cos_sin_op.register_fake
def _(position_ids, inv_freq, sections, layout, pairs, scaling, dtype):
    pos = _positions(position_ids)
    shape = (pos.shape[1], pos.shape[2], 2 * sum(sections))
    return pos.new_empty(shape, dtype=dtype), pos.new_empty(shape, dtype=dtype)


def mrope_cos_sin(
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    sections,
    layout: str = "chunked",
    pairs: bool = False,
    scaling: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, T, 2 * sum(sections)] of a multimodal rotary embedding: positions
    [3, B, T] (or [B, T], one for all axes), inv_freq [sum(sections)], ``scaling`` the
    embedding's attention scaling, in ``dtype``. A trainable inv_freq takes the torch formula
    (autograd through it); the op itself has no backward: nothing it reads takes a gradient."""
    sections = [int(s) for s in sections]
    if sum(sections) != inv_freq.numel():
        raise ValueError(f"sections {sections} do not cover {inv_freq.numel()} frequencies")
    if inv_freq.requires_grad and torch.is_grad_enabled():
        return reference(position_ids, inv_freq, sections, layout, pairs, scaling, dtype)
    return mrope_cos_sin_op(position_ids, inv_freq, sections, layout, pairs, float(scaling), dtype)


def apply_vision_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' apply_rotary_pos_emb_vision: q, k [S, H, D] (or with a leading batch,
    [B, S, H, D]), cos/sin [S, D] (or [B, S, D]); rotate-half in fp32, each output rounded once
    to its input's dtype."""
    squeeze = q.dim() == 3
    if squeeze:
        q, k = q.unsqueeze(0), k.unsqueeze(0)
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    # fp32 cos/sin: the rotation is computed in fp32 whatever q's dtype (the kernel promotes,
    # the torch fallback too) and rounded once to q's dtype
    q_out, k_out = apply_rotary_pos_emb(q, k, cos.float(), sin.float(), 2)
    q_out, k_out = q_out.to(q.dtype), k_out.to(k.dtype)
    if squeeze:
        return q_out.squeeze(0), k_out.squeeze(0)
    return q_out, k_out
