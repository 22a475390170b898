"""Vision-tower attention over packed images or windows, in one attention call per layer.

The Qwen2-VL family's vision towers (and their kin: GLM-4V, Qwen3-VL, ...) pack every image's
patches into one sequence and attend within segments given by ``cu_seqlens`` (whole images, or
windows of one). transformers' flash-attention path runs that as one varlen call; every other
path (SDPA, eager) splits q, k and v into one piece per segment and calls attention per piece:
at Qwen2.5-VL-3B's shape, 8 images of 448 x 448, 128 windows in each of 28 window layers, some
3600 small attention calls a forward and as many in the backward, so the step follows the host.

Here the segments are gathered into one batch [segments, heads, longest, head_dim] and attended
in ONE call of the model's attention function; segments of one length (the windows of an image
whose grid the window divides, the usual case) need no mask and no copy, others are padded and
their padding keys masked. The padded query rows are dropped. The segment lengths are read to
the host once per ``cu_seqlens`` tensor (the family reads them once per layer), as the split did.
"""

from __future__ import annotations

import sys
import weakref

import torch

from .mrope import apply_vision_rotary_pos_emb

# The last cu_seqlens seen and its lengths: every window layer of a forward gets the same tensor.
_LAST: list = [None, -1, ()]  # weakref to the tensor, its version, the lengths


def segment_lengths(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    """The segments' lengths, read to the host once per cu_seqlens tensor (a new tensor, or one
    written in place since, is read again)."""
    ref, version, lengths = _LAST
    if ref is not None and ref() is cu_seqlens and version == cu_seqlens._version:
        return lengths
    lengths = tuple(int(x) for x in (cu_seqlens[1:] - cu_seqlens[:-1]).tolist())
    _LAST[:] = [weakref.ref(cu_seqlens), cu_seqlens._version, lengths]
    return lengths


def _call_keywords(module) -> dict:
    """What the family hands its attention function besides q, k, v and the mask."""
    dropout = 0.0 if not module.training else module.attention_dropout
    return {"scaling": module.scaling, "dropout": dropout, "is_causal": False}


def packed_attention(module, q, k, v, cu_seqlens, attention, kwargs) -> torch.Tensor:
    """softmax(q k^T · scaling) v within each segment; q, k, v [S, H, D] -> [S, H, D], through
    `attention` (transformers' attention-function signature) in one call."""
    lengths = segment_lengths(cu_seqlens)
    n, s = len(lengths), q.shape[0]
    longest = max(lengths)
    mask = None
    if all(length == longest for length in lengths):
        # [S, H, D] -> [segments, H, L, D]: a view of the packed rows, no copy
        q, k, v = (t.reshape(n, longest, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
    else:
        starts = cu_seqlens[:-1].to(torch.long)
        steps = torch.arange(longest, device=q.device)
        valid = steps[None, :] < torch.tensor(lengths, device=q.device)[:, None]  # [n, L]
        index = torch.where(valid, starts[:, None] + steps[None, :], s - 1)
        q, k, v = (t[index].transpose(1, 2) for t in (q, k, v))  # [n, H, L, D]
        # an additive mask: eager adds it, SDPA takes it as it is; padding keys get -inf-ish
        mask = torch.zeros(n, 1, longest, longest, dtype=q.dtype, device=q.device)
        mask.masked_fill_(~valid[:, None, None, :], torch.finfo(q.dtype).min)
    out = attention(module, q, k, v, attention_mask=mask, **_call_keywords(module), **kwargs)[0]
    # out: [segments, longest, H, D]
    if mask is None:
        return out.reshape(s, *out.shape[2:])
    return out[valid]


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
