"""Rotary position embedding for q and k (HF ``rotate_half`` convention), forward and backward.

Same contract as transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``:
q [B, Hq, T, D] and k [B, Hk, T, D] (any strides, typically transposed views of [B, T, H, D]),
cos/sin [B or 1, T, D]; with ``unsqueeze_dim=2`` q and k are [B, T, H, D]. Outputs are new
tensors laid out like q and k. One program rotates every q and k head of a few tokens, so cos and
sin are read once per token; the full D of cos and sin is read, so no ``cat(freqs, freqs)``
layout is assumed. The backward is the same rotation with the sine negated and its halves
swapped; only cos and sin are kept for it. cos and sin get no gradient (HF never trains them).
"""

import torch
import triton
import triton.language as tl

from ._common import next_pow2, op_name, pick_config, use_triton


@triton.jit
def _rotate_heads(
    X, XO, sx_h, sxo_h, H: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
    d, dmask, tok, n_tokens, c1, c2, s1, s2,
):  # fmt: skip
    h = tl.arange(0, BLOCK_H)
    # The token test is broadcast to a vector: the interpreter rejects scalar-and-vector masks.
    mask = ((h < H) & (h * 0 + tok < n_tokens))[:, None] & dmask[None, :]
    p = X + h[:, None] * sx_h + d[None, :]
    x1 = tl.load(p, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * c1[None, :] - x2 * s1[None, :]
    o2 = x2 * c2[None, :] + x1 * s2[None, :]
    po = XO + h[:, None] * sxo_h + d[None, :]
    tl.store(po, o1.to(XO.dtype.element_ty), mask=mask)
    tl.store(po + HALF, o2.to(XO.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, QO, KO, COS, SIN, n_tokens, T,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t,
    sqo_b, sqo_h, sqo_t, sko_b, sko_h, sko_t,
    sc_b, sc_t, ss_b, ss_t,
    HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr, BACKWARD: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    for i in tl.static_range(BLOCK_T):
        tok = pid * BLOCK_T + i
        b = (tok // T).to(tl.int64)
        t = (tok % T).to(tl.int64)
        cm = dmask & (d * 0 + tok < n_tokens)
        pc = COS + b * sc_b + t * sc_t + d
        ps = SIN + b * ss_b + t * ss_t + d
        c1 = tl.load(pc, mask=cm, other=0.0).to(tl.float32)
        c2 = tl.load(pc + HALF, mask=cm, other=0.0).to(tl.float32)
        s1 = tl.load(ps, mask=cm, other=0.0).to(tl.float32)
        s2 = tl.load(ps + HALF, mask=cm, other=0.0).to(tl.float32)
        if BACKWARD:
            # The transpose of [[c1, -s1], [s2, c2]] is [[c1, s2], [-s1, c2]].
            s1, s2 = -s2, -s1
        _rotate_heads(
            Q + b * sq_b + t * sq_t, QO + b * sqo_b + t * sqo_t, sq_h, sqo_h, HQ, BLOCK_HQ, HALF,
            d, dmask, tok, n_tokens, c1, c2, s1, s2,
        )  # fmt: skip
        _rotate_heads(
            K + b * sk_b + t * sk_t, KO + b * sko_b + t * sko_t, sk_h, sko_h, HK, BLOCK_HK, HALF,
            d, dmask, tok, n_tokens, c1, c2, s1, s2,
        )  # fmt: skip


def rope_candidates(hq: int, hk: int, d: int) -> list[dict]:
    """Tokens per program and warps worth timing (the first is the default)."""
    per_token = (next_pow2(hq) + next_pow2(hk)) * next_pow2(d)
    block_t = max(1, min(4, 4096 // per_token))
    pairs = [(1, 4), (1, 8), (2, 8), (2, 4), (2, 2), (4, 4), (4, 2)]
    return [{"BLOCK_T": t * block_t, "num_warps": w} for t, w in pairs]


def _to_bhtd(x: torch.Tensor, unsqueeze_dim: int) -> torch.Tensor:
    return x if unsqueeze_dim == 1 else x.transpose(1, 2)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def triton_supported(q, k, cos, sin, unsqueeze_dim: int) -> bool:
    """Whether the Triton kernel covers this call (else the caller uses the torch composite)."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False
    if unsqueeze_dim not in (1, 2) or not (use_triton(q) and q.device == k.device == cos.device):
        return False
    qv, kv = _to_bhtd(q, unsqueeze_dim), _to_bhtd(k, unsqueeze_dim)
    b, _, t, d = qv.shape
    return (
        d % 2 == 0
        and kv.shape[0] == b
        and kv.shape[2:] == (t, d)
        and cos.shape[0] in (1, b)
        and cos.shape[1:] == (t, d)
    )


def rotate(q, k, cos, sin, unsqueeze_dim, backward, cfg=None):
    """Triton rotation of q and k (the inverse rotation when `backward`)."""
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    qv, kv = _unit_last(_to_bhtd(q, unsqueeze_dim)), _unit_last(_to_bhtd(k, unsqueeze_dim))
    qov, kov = _to_bhtd(qo, unsqueeze_dim), _to_bhtd(ko, unsqueeze_dim)
    b, hq, t, d = qv.shape
    hk = kv.shape[1]
    cos = _unit_last(cos).expand(b, t, d)
    sin = _unit_last(sin).expand(b, t, d)
    if qov.stride(-1) != 1 or kov.stride(-1) != 1:
        raise ValueError("rotary_pos_emb needs q and k with a unit stride along head_dim")
    n_tokens = b * t
    if n_tokens == 0 or hq + hk == 0:
        return qo, ko
    half = d // 2

    def launch(c):
        _rope_kernel[(triton.cdiv(n_tokens, c["BLOCK_T"]),)](
            qv, kv, qov, kov, cos, sin, n_tokens, t,
            qv.stride(0), qv.stride(1), qv.stride(2), kv.stride(0), kv.stride(1), kv.stride(2),
            qov.stride(0), qov.stride(1), qov.stride(2), kov.stride(0), kov.stride(1), kov.stride(2),
            cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
            HQ=hq, HK=hk, HALF=half,
            BLOCK_HQ=next_pow2(max(hq, 1)), BLOCK_HK=next_pow2(max(hk, 1)), BLOCK_D=next_pow2(half),
            BLOCK_T=c["BLOCK_T"], BACKWARD=backward, num_warps=c["num_warps"],
        )  # fmt: skip

    if cfg is None:
        key = ("rope", n_tokens.bit_length(), hq, hk, d, q.dtype, cos.dtype, q.device)
        cfg = pick_config(key, rope_candidates(hq, hk, d), launch)
    launch(cfg)
    return qo, ko


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def composite(q, k, cos, sin, unsqueeze_dim: int = 1):
    """The transformers formula in plain torch ops (autograd by torch): the CPU and fallback path."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


@torch.library.custom_op(op_name("rope"), mutates_args=())
def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int,
    backward: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    # Only reached for calls that triton_supported() accepts (see apply_rotary_pos_emb).
    return rotate(q, k, cos, sin, unsqueeze_dim, backward)


@rope.register_fake
def _(q, k, cos, sin, unsqueeze_dim, backward):
    return torch.empty_like(q), torch.empty_like(k)


def _setup_context(ctx, inputs, output):
    _q, _k, cos, sin, unsqueeze_dim, backward = inputs
    ctx.save_for_backward(cos, sin)
    ctx.unsqueeze_dim = unsqueeze_dim
    ctx.backward = backward


def _backward(ctx, dq, dk):
    cos, sin = ctx.saved_tensors
    dq, dk = rope(dq, dk, cos, sin, ctx.unsqueeze_dim, not ctx.backward)
    return dq, dk, None, None, None, None


rope.register_autograd(_backward, setup_context=_setup_context)


class _RopeFunction(torch.autograd.Function):
    """The eager path: the same kernel without the custom-op dispatch cost on every call."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim):
        ctx.save_for_backward(cos, sin)
        ctx.unsqueeze_dim = unsqueeze_dim
        return rotate(q, k, cos, sin, unsqueeze_dim, False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = rotate(dq, dk, cos, sin, ctx.unsqueeze_dim, True)
        return dq, dk, None, None, None


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' apply_rotary_pos_emb; the Triton kernel where it applies, else torch ops."""
    if not triton_supported(q, k, cos, sin, unsqueeze_dim):
        return composite(q, k, cos, sin, unsqueeze_dim)
    if torch.compiler.is_compiling():
        return rope(q, k, cos, sin, unsqueeze_dim, False)
    return _RopeFunction.apply(q, k, cos, sin, unsqueeze_dim)
