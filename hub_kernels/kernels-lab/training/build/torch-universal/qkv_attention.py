"""Attention whose q, k and v come from one fused projection (Phi-3's ``qkv_proj``).

The family's forward slices q, k and v out of ``qkv = qkv_proj(x)`` ([B, T, (Hq + 2 Hk) D], the
three blocks one after the other), rotates q and k and hands all three to the attention
function. Without a KV cache v stays a slice of qkv, so whatever the attention saves for its
backward keeps the whole qkv buffer alive: (Hq + 2 Hk) / Hk times the bytes of v per layer (3x
with as many kv heads as query heads, more with grouped kv heads). And autograd's backward of
the three slices zero-fills a full-size d(qkv) buffer per slice and adds them up.

``split_qkv_rope(qkv, cos, sin, heads, kv_heads, head_dim)`` does the split and the rotation in
one autograd node that saves only cos and sin:

- forward: q and k rotated into new [B, T, H, D] buffers (the rope kernel reads qkv's strided
  blocks directly), v copied into its own buffer; nothing keeps qkv, so it is freed as soon as
  the caller drops it;
- backward: d(qkv) is written once, into one [B, T, (Hq + 2 Hk) D] buffer: dq and dk rotated
  back straight into their blocks, dv copied into its block. No zero fills, no adds.

Partial rotary (cos narrower than the head) rotates the first cos.shape[-1] dims and copies the
rest, as transformers' formula does. Tensors the Triton kernel does not take (a CPU tensor
without the interpreter, an odd rotary width) run the same formula in torch ops, still through
the one node. ``qkv_attention(module, ...)`` is the whole forward the layer class binds; under
sdpa it also hands every layer one additive mask made from the model's bool mask
(``shared_additive_mask``), where sdpa would make and keep a copy per layer.

A KV cache that holds no tokens of the layer yet (a training step of a model whose config keeps
``use_cache``, or the prefill of ``generate``) is updated with the rotated k and v as the
family's forward updates it, and the attention reads what the update returns. A cache that
already holds tokens (decoding, one or few new tokens) and torch.compile run the family's own
forward: the fused split buys nothing there.
"""

from __future__ import annotations

import inspect
import weakref

import torch

from ._common import needs_grad
from .rope import _ASK, composite, halves_repeat, rotate, triton_supported


def _blocks(x: torch.Tensor, heads: int, kv_heads: int, head_dim: int):
    """q, k, v [B, T, H, D] views of the three blocks of x [B, T, (Hq + 2 Hk) D]."""
    b, t = x.shape[0], x.shape[1]
    q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
    return (
        x[..., :q_end].view(b, t, heads, head_dim),
        x[..., q_end:k_end].view(b, t, kv_heads, head_dim),
        x[..., k_end:].view(b, t, kv_heads, head_dim),
    )


def _transposed_sin(sin: torch.Tensor) -> torch.Tensor:
    """The sine whose rotate-half rotation is the transpose of ``sin``'s: halves swapped and
    negated (for transformers' repeated [f, f] halves, just -sin)."""
    s1, s2 = sin.chunk(2, dim=-1)
    return -torch.cat((s2, s1), dim=-1)


def _kernel_takes(q, k, cos, sin) -> bool:
    rd = cos.shape[-1]
    return triton_supported(q[..., :rd], k[..., :rd], cos, sin, 2)


def _rotate_into(q, k, cos, sin, qo, ko, backward: bool, kernel: bool, repeats=_ASK) -> None:
    """qo, ko = the rotation of q, k (its transpose when `backward`) over the first
    cos.shape[-1] dims of each head; the other dims are copied. [B, T, H, D] layout.
    `kernel`: ``_kernel_takes(q, k, cos, sin)``, which the caller has asked already;
    `repeats`: the rope kernel's answer for cos/sin (asked when _ASK)."""
    rd = cos.shape[-1]
    qr, kr, qor, kor = q[..., :rd], k[..., :rd], qo[..., :rd], ko[..., :rd]
    if kernel:
        rotate(qr, kr, cos, sin, 2, backward, repeats=repeats, out=(qor, kor))
    else:
        qt, kt = composite(qr, kr, cos, _transposed_sin(sin) if backward else sin, 2)
        qor.copy_(qt)
        kor.copy_(kt)
    if rd < q.shape[-1]:
        qo[..., rd:].copy_(q[..., rd:])
        ko[..., rd:].copy_(k[..., rd:])


def _split_rotate(qkv, cos, sin, heads, kv_heads, head_dim):
    """(q rotated, k rotated, v: new contiguous tensors; halves_repeat's answer or _ASK)."""
    q, k, v = _blocks(qkv, heads, kv_heads, head_dim)
    qo = torch.empty(q.shape, dtype=qkv.dtype, device=qkv.device)
    ko = torch.empty(k.shape, dtype=qkv.dtype, device=qkv.device)
    kernel = _kernel_takes(q, k, cos, sin)
    repeats = halves_repeat(cos, sin) if kernel else _ASK
    _rotate_into(q, k, cos, sin, qo, ko, False, kernel, repeats)
    return qo, ko, v.clone(memory_format=torch.contiguous_format), repeats


class SplitQKVRope(torch.autograd.Function):
    """(qkv, cos, sin, heads, kv_heads, head_dim) -> rotated q, rotated k, v: new contiguous
    [B, T, H, D] tensors; saves cos and sin only (see the module docstring)."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, heads, kv_heads, head_dim):
        qo, ko, vo, repeats = _split_rotate(qkv, cos, sin, heads, kv_heads, head_dim)
        ctx.save_for_backward(cos, sin)
        ctx.shape = (heads, kv_heads, head_dim)
        # A host answer holds for the backward (cos and sin are saved: an in-place change is
        # refused by autograd); a device flag may be on another stream by then, so ask again.
        ctx.repeats = repeats if isinstance(repeats, bool) else _ASK
        return qo, ko, vo

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        heads, kv_heads, head_dim = ctx.shape
        b, t = dq.shape[0], dq.shape[1]
        width = (heads + 2 * kv_heads) * head_dim
        dqkv = torch.empty(b, t, width, dtype=dq.dtype, device=dq.device)
        dqo, dko, dvo = _blocks(dqkv, heads, kv_heads, head_dim)
        kernel = _kernel_takes(dq, dk, cos, sin)
        _rotate_into(dq, dk, cos, sin, dqo, dko, True, kernel, ctx.repeats)
        dvo.copy_(dv)
        return dqkv, None, None, None, None, None


def split_qkv_rope(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k rotated by transformers' rotate-half RoPE (cos/sin [B or 1, T, rotary dims]) and v,
    each a new contiguous [B, T, H, D] tensor, from qkv [B, T, (Hq + 2 Hk) D]."""
    if not needs_grad(qkv, cos, sin):  # inference: no autograd Function's host cost
        return _split_rotate(qkv, cos, sin, heads, kv_heads, head_dim)[:3]
    return SplitQKVRope.apply(qkv, cos, sin, heads, kv_heads, head_dim)


# id(bool mask) -> (a weak reference to it, its version, dtype, the additive mask made from it)
_ADDITIVE: dict[int, tuple] = {}


def shared_additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask (0 where ``mask`` is True, -inf elsewhere) made from a bool mask once per
    mask and dtype. sdpa converts a bool mask on every call and its backward keeps that copy:
    one [B, 1, T, T] tensor per layer (32 MiB a layer at 4x2048 in bf16, 1 GiB over 32 layers).
    Handed the same additive tensor, every layer keeps that one.

    On every row that keeps at least one key the attention computes what it computes from the
    bool mask (a masked score gets weight 0 either way). A fully masked row (a left-padding
    query under some masks) is backend-defined: with -inf it comes out NaN or 0 as the kernel
    decides, while cuDNN's sdpa fills a bool mask with -65504 rather than -inf, which attends
    over every key there. The model discards those rows' outputs.

    The made mask is reused while the bool mask's version counter is unchanged, so a write
    that bypasses the counter (through ``.data`` or a DLPack view) is not seen."""
    entry = _ADDITIVE.get(id(mask))
    if entry is not None and entry[0]() is mask and entry[1:3] == (mask._version, dtype):
        return entry[3]
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    additive.masked_fill_(mask.logical_not(), float("-inf"))
    key = id(mask)
    # the entry goes with the mask (the model makes a new one per forward); a backward that
    # still needs the additive mask holds it itself
    ref = weakref.ref(mask, lambda _r: _ADDITIVE.pop(key, None))
    _ADDITIVE[key] = (ref, mask._version, dtype, additive)
    return additive


def _sdpa_mask(module, mask, dtype):
    """The mask to hand transformers' sdpa function: a bool mask as the shared additive one."""
    if (
        isinstance(mask, torch.Tensor)
        and mask.dtype == torch.bool
        and not mask.is_inference()
        and module.config._attn_implementation == "sdpa"
    ):
        return shared_additive_mask(mask, dtype)
    return mask


# module class -> (its own forward, ALL_ATTENTION_FUNCTIONS, eager_attention_forward), read
# once from the globals of the module's forward (the family's modeling file)
_FAMILY: dict[type, tuple] = {}


def _family(cls: type) -> tuple:
    found = _FAMILY.get(cls)
    if found is None:
        namespace = inspect.unwrap(cls.forward).__globals__
        found = _FAMILY[cls] = (
            cls.forward,
            namespace["ALL_ATTENTION_FUNCTIONS"],
            namespace["eager_attention_forward"],
        )
    return found


# The class attribute the layer reads: (fused projection, output projection) child names. The
# loader's structure probe sets it; Phi-3's names are the default.
QKV_PROJECTIONS = "kernels_qkv_projections"


def fused_serves(module, hidden_states, position_embeddings, cache) -> bool:
    """Whether the fused path serves this call; the module's own forward runs where it does not:
    a cache already holding this layer's tokens (decoding), torch.compile (Dynamo traces the
    family's forward and its rope custom op), or inputs not [B, T, hidden] with (cos, sin) of
    [B, T, even rotary dims <= head_dim]. Each of these is expected, so none is reported."""
    if torch.compiler.is_compiling():
        return False
    if cache is not None and cache.get_seq_length(module.layer_idx) > 0:
        return False
    if hidden_states.dim() != 3 or not isinstance(position_embeddings, (tuple, list)):
        return False
    cos = position_embeddings[0]
    return cos.dim() == 3 and cos.shape[-1] % 2 == 0 and cos.shape[-1] <= module.head_dim


def qkv_attention(module, hidden_states, position_embeddings, attention_mask, cache, kwargs):
    """The family's attention forward with the split and rotation fused (see the docstring);
    the family's own forward where ``fused_serves`` says no. Returns (output, weights)."""
    own, interfaces, eager = _family(type(module))
    if cache is None:
        # the name the decoder layers passed the cache under before transformers renamed it
        cache = kwargs.pop("past_key_values", None)
    if not fused_serves(module, hidden_states, position_embeddings, cache):
        args = (hidden_states, position_embeddings, attention_mask)
        if cache is not None:
            args += (cache,)
        return own(module, *args, **kwargs)
    qkv_name, out_name = getattr(module, QKV_PROJECTIONS, ("qkv_proj", "o_proj"))
    qkv_proj, o_proj = getattr(module, qkv_name), getattr(module, out_name)
    head_dim = module.head_dim
    heads = o_proj.weight.shape[1] // head_dim
    kv_heads = (qkv_proj.weight.shape[0] - heads * head_dim) // (2 * head_dim)
    input_shape = hidden_states.shape[:-1]
    cos, sin = position_embeddings
    q, k, v = (
        t.transpose(1, 2)
        for t in split_qkv_rope(qkv_proj(hidden_states), cos, sin, heads, kv_heads, head_dim)
    )
    if cache is not None:
        # as the family's forward does: [B, H, T, D] in, the keys and values to attend to out
        k, v = cache.update(k, v, module.layer_idx, kwargs=kwargs)
    attention = interfaces.get_interface(module.config._attn_implementation, eager)
    out, weights = attention(
        module,
        q,
        k,
        v,
        _sdpa_mask(module, attention_mask, q.dtype),
        dropout=0.0 if not module.training else module.attention_dropout,
        scaling=module.scaling,
        sliding_window=getattr(module.config, "sliding_window", None),
        **kwargs,
    )
    out = out.reshape(*input_shape, -1).contiguous()
    return o_proj(out), weights
