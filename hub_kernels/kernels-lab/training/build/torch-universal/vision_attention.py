"""Vision-tower attention over packed images or windows, in one attention call per layer.

The Qwen2-VL family's vision towers (and their kin: GLM-4V, Qwen3-VL, ...) pack every image's
patches into one sequence and attend within segments given by ``cu_seqlens`` (whole images, or
windows of one). transformers' flash-attention path runs that as one varlen call; every other
path (SDPA, eager) splits q, k and v into one piece per segment and calls attention per piece:
at Qwen2.5-VL-3B's shape, 8 images of 448 x 448, 128 windows in each of 28 window layers, some
3600 small attention calls a forward and as many in the backward, so the step follows the host.

Here segments of one length are attended as one batch [segments, heads, length, head_dim] in
ONE call of the model's attention function: no mask, no padding, the family's own numerics.
When all segments have one length (the windows of images whose grid the window divides, the
usual case) the batch is a view of the packed rows; otherwise each distinct length gathers its
segments' rows, and the results are put back in place (an image's edge windows, images of
several sizes: a handful of calls). The segments are read to the host once per ``cu_seqlens``
tensor (the family reads them once per layer) and their row indices kept with them.
"""

from __future__ import annotations

import sys
import weakref
from typing import NamedTuple

import torch

from .mrope import apply_vision_rotary_pos_emb

# The last cu_seqlens seen and its plan: every window layer of a forward gets the same tensor.
_LAST: list = [None, -1, None]  # weakref to the tensor, its version, the plan


class SegmentPlan(NamedTuple):
    """The segments of one cu_seqlens: their lengths, and per distinct length the rows of the
    segments of that length ([segments, length] on the tensor's device)."""

    lengths: tuple[int, ...]
    groups: tuple[tuple[int, torch.Tensor], ...]


@torch.compiler.disable  # a host read (the family's split breaks the graph there too); traced,
# the cached plan would be baked into the graph for later cu_seqlens of the same shape
def segment_plan(cu_seqlens: torch.Tensor) -> SegmentPlan:
    """The plan of `cu_seqlens`, read to the host once per tensor (a new tensor, or one written
    in place since, is read again): the family reads the lengths once per layer."""
    ref, version, plan = _LAST
    if ref is not None and ref() is cu_seqlens and version == cu_seqlens._version:
        return plan
    bounds = [int(x) for x in cu_seqlens.tolist()]
    lengths = tuple(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    starts: dict[int, list[int]] = {}
    for start, length in zip(bounds[:-1], lengths, strict=True):
        starts.setdefault(length, []).append(start)
    groups = tuple(
        (length, (torch.tensor(firsts)[:, None] + torch.arange(length)).to(cu_seqlens.device))
        for length, firsts in starts.items()
        if length > 0
    )
    plan = SegmentPlan(lengths, groups)
    _LAST[:] = [weakref.ref(cu_seqlens), cu_seqlens._version, plan]
    return plan


def _call_keywords(module) -> dict:
    """What the family hands its attention function besides q, k, v and the mask."""
    dropout = 0.0 if not module.training else module.attention_dropout
    return {"scaling": module.scaling, "dropout": dropout, "is_causal": False}


def packed_attention(module, q, k, v, cu_seqlens, attention, kwargs) -> torch.Tensor:
    """softmax(q k^T · scaling) v within each segment; q, k, v [S, H, D] -> [S, H, D], through
    `attention` (transformers' attention-function signature): one call per distinct segment
    length, no mask and no padding (segments of one length, the usual windows, in one call on a
    view of the packed rows)."""
    plan = segment_plan(cu_seqlens)
    keywords = {**_call_keywords(module), **kwargs}
    if len(plan.groups) == 1 and len(plan.lengths) * plan.groups[0][0] == q.shape[0]:
        length = plan.groups[0][0]
        # [S, H, D] -> [segments, H, L, D]: a view, no copy
        q, k, v = (t.reshape(-1, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        out = attention(module, q, k, v, attention_mask=None, **keywords)[0]  # [n, L, H, D]
        return out.reshape(-1, *out.shape[2:])
    out = q.new_zeros(q.shape)
    for _, rows in plan.groups:
        parts = (t[rows].transpose(1, 2) for t in (q, k, v))  # [m, H, L, D]
        part = attention(module, *parts, attention_mask=None, **keywords)[0]  # [m, L, H, D]
        out = out.index_copy(0, rows.reshape(-1), part.reshape(-1, *part.shape[2:]))
    return out


def vision_attention(module, hidden_states, cu_seqlens, position_embeddings, max_seqlen, kwargs):
    """The vision attention block: ``qkv`` (one Linear making [q | k | v] per head), the vision
    rotary on q and k, attention within each segment, ``proj``. The child names come from the
    class attribute ``kernels_qkv_projections`` (the loader's probe sets it). A flash
    implementation is one varlen call already: it gets the family's own arguments."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.utils.generic import get_max_seqlen, is_flash_attention_requested

    qkv_name, out_name = getattr(module, "kernels_qkv_projections", ("qkv", "proj"))
    s = hidden_states.shape[0]
    q, k, v = (
        getattr(module, qkv_name)(hidden_states)
        .reshape(s, 3, module.num_heads, -1)
        .permute(1, 0, 2, 3)
        .unbind(0)
    )
    cos, sin = position_embeddings
    q, k = apply_vision_rotary_pos_emb(q, k, cos, sin)
    # the family's eager function is its module's (the classifier checked it is there)
    eager = sys.modules[type(module).__module__].eager_attention_forward
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, eager)
    if is_flash_attention_requested(module.config):
        max_seqlen = get_max_seqlen(cu_seqlens, module.config, kwargs={"max_seqlen": max_seqlen})
        out = attention(
            module,
            *(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
            attention_mask=None,
            cu_seq_lens_q=cu_seqlens,
            cu_seq_lens_k=cu_seqlens,
            max_length_q=max_seqlen,
            max_length_k=max_seqlen,
            **_call_keywords(module),
            **kwargs,
        )[0]
    else:
        out = packed_attention(module, q, k, v, cu_seqlens, attention, kwargs)
    return getattr(module, out_name)(out.reshape(s, -1).contiguous())
