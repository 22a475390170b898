"""Rotary position embedding for q and k (HF ``rotate_half`` convention), forward and backward.

Same contract as transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``:
q [B, Hq, T, D] and k [B, Hk, T, D] (any strides, typically transposed views of [B, T, H, D]),
cos/sin [B or 1, T, D]; with ``unsqueeze_dim=2`` q and k are [B, T, H, D]. In eager mode the
rotation is written over q's and k's own memory where that is safe (see "In place" below; the
outputs then alias q and k, so read the returned tensors, not q and k, after the call), else
into new tensors laid out like q and k. One program rotates every q and k head of a few
tokens, so cos and sin are read once per token. Any cos/sin works: a one-launch check, kept per cos/sin pair, finds
whether every row repeats its first half (transformers' ``cat(freqs, freqs)``); then the kernel
skips reading the second halves. Its answer is copied to the host without waiting; until it lands
the kernel reads it from the device (on the check's stream; on another, both halves are read). The rotation is computed in the inputs' dtype, as
transformers' eager code does (two roundings in 16-bit floats where eager has three). The backward
is the same rotation with the sine negated and its halves swapped; only cos and sin are kept for
it. cos and sin get no gradient (HF never trains them).
"""

import functools
import weakref

import torch

from . import tensor_parallel
from ._common import (
    PlanCache,
    as_rows,
    cached_config,
    cdiv,
    config_is_final,
    fast_launch,
    graph_is_freed,
    needs_grad,
    next_pow2,
    op_name,
    pick_config,
    use_triton,
)
from ._triton import tl, triton


@triton.jit
def _head_mask(H: tl.constexpr, BLOCK_H: tl.constexpr, dmask, tok, n_tokens, EVEN_T: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    if EVEN_T:
        return (h < H)[:, None] & dmask[None, :]
    # The token test is broadcast to a vector: the interpreter rejects scalar-and-vector masks.
    return ((h < H) & (h * 0 + tok < n_tokens))[:, None] & dmask[None, :]


@triton.jit
def _store_rotated(P, x1, x2, c1, c2, s1, s2, mask, HALF: tl.constexpr):
    """Writes [x1*c1 - x2*s1, x2*c2 + x1*s2] at P (first halves) and P + HALF."""
    o1 = x1 * c1[None, :] - x2 * s1[None, :]
    o2 = x2 * c2[None, :] + x1 * s2[None, :]
    tl.store(P, o1.to(P.dtype.element_ty), mask=mask)
    tl.store(P + HALF, o2.to(P.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _rope_kernel(
    Q, K, QO, KO, COS, SIN, REPEATS, n_tokens, T,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t,
    sqo_b, sqo_h, sqo_t, sko_b, sko_h, sko_t,
    sc_b, sc_t, ss_b, ss_t,
    HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr, BACKWARD: tl.constexpr, EVEN_T: tl.constexpr,
    REPEATED: tl.constexpr, FLAGGED: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    hq = tl.arange(0, BLOCK_HQ)[:, None]
    hk = tl.arange(0, BLOCK_HK)[:, None]
    for i in tl.static_range(BLOCK_T):
        tok = pid * BLOCK_T + i
        b = (tok // T).to(tl.int64)
        t = (tok % T).to(tl.int64)
        qm = _head_mask(HQ, BLOCK_HQ, dmask, tok, n_tokens, EVEN_T)
        km = _head_mask(HK, BLOCK_HK, dmask, tok, n_tokens, EVEN_T)
        # q and k first: their loads must not queue behind the flag the cos halves wait on.
        pq = Q + b * sq_b + t * sq_t + hq * sq_h + d[None, :]
        pk = K + b * sk_b + t * sk_t + hk * sk_h + d[None, :]
        q1 = tl.load(pq, mask=qm, other=0.0)
        q2 = tl.load(pq + HALF, mask=qm, other=0.0)
        k1 = tl.load(pk, mask=km, other=0.0)
        k2 = tl.load(pk + HALF, mask=km, other=0.0)
        if EVEN_T:
            cm = dmask
        else:
            cm = dmask & (d * 0 + tok < n_tokens)
        pc = COS + b * sc_b + t * sc_t + d
        ps = SIN + b * ss_b + t * ss_t + d
        c1 = tl.load(pc, mask=cm, other=0.0)
        s1 = tl.load(ps, mask=cm, other=0.0)
        if REPEATED:  # every row of cos and of sin repeats its first half
            c2 = c1
            s2 = s1
        elif FLAGGED:  # the same answer, still on the device: REPEATS holds 1 or 0
            repeats = d * 0 + tl.load(REPEATS) != 0
            c2 = tl.where(repeats, c1, tl.load(pc + HALF, mask=cm & ~repeats, other=0.0))
            s2 = tl.where(repeats, s1, tl.load(ps + HALF, mask=cm & ~repeats, other=0.0))
        else:
            c2 = tl.load(pc + HALF, mask=cm, other=0.0)
            s2 = tl.load(ps + HALF, mask=cm, other=0.0)
        # No upcast: in 16-bit floats the products run as packed pairs, half the instructions
        # per element, and this kernel is short enough on bandwidth for that to show. The
        # interpreter keeps bfloat16 as raw integers, so there (only) bfloat16 is upcast.
        if UPCAST:
            q1, q2, k1, k2 = (
                q1.to(tl.float32),
                q2.to(tl.float32),
                k1.to(tl.float32),
                k2.to(tl.float32),
            )
            c1, c2, s1, s2 = (
                c1.to(tl.float32),
                c2.to(tl.float32),
                s1.to(tl.float32),
                s2.to(tl.float32),
            )
        if BACKWARD:
            # The transpose of [[c1, -s1], [s2, c2]] is [[c1, s2], [-s1, c2]].
            s1, s2 = -s2, -s1
        pqo = QO + b * sqo_b + t * sqo_t + hq * sqo_h + d[None, :]
        pko = KO + b * sko_b + t * sko_t + hk * sko_h + d[None, :]
        _store_rotated(pqo, q1, q2, c1, c2, s1, s2, qm, HALF)
        _store_rotated(pko, k1, k2, c1, c2, s1, s2, km, HALF)


# The most elements of one head tile (heads x half head_dim) `_rope_kernel` takes. Its tiles hold
# every head of a token at once (next_pow2(heads) x next_pow2(head_dim / 2)), which at Liger's
# test shape (73 q and 213 k heads, head_dim 92) is a 128 x 64 and a 256 x 64 tile: with few
# warps, thousands of values per thread, spilled, and ptxas took minutes per config (345 s for
# 2 warps, compiled for sm_90 on a CPU: scripts/probes/probe_rope_first_call.py --one-tile 2).
# Wider calls take `_rope_heads_kernel`, which loops over tiles of at most this many elements.
# Every model and sweep shape benchmarked fits (64 q heads x 64 is 4096): their kernel and
# candidates are unchanged.
MAX_TILE = 4096
# Values per thread (both halves of q's and k's tiles, times the tokens a program takes) a
# candidate may hold where the tiles are ragged (a head count not a power of two, or half
# head_dim not a multiple of 16: padded rows, narrow vector loads). Above it ptxas took 6-25 s
# per config (41 heads, head_dim 40, 1 warp) against 2 s at 2 warps; power-of-two shapes at the
# same size build in 2-3 s and keep every candidate.
RAGGED_VALUES = 128


@fast_launch
@triton.jit
def _rope_heads_kernel(
    Q, K, QO, KO, COS, SIN, REPEATS, n_tokens, T,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t,
    sqo_b, sqo_h, sqo_t, sko_b, sko_h, sko_t,
    sc_b, sc_t, ss_b, ss_t, HQ, HK,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr,
    REPEATED: tl.constexpr, FLAGGED: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """`_rope_kernel` for many heads: one token per program, its heads in tiles of BLOCK_H
    (a loop, not unrolled), so the registers a program needs do not grow with the head count.
    The head counts are runtime arguments: one compiled kernel serves every count."""
    tok = tl.program_id(0)
    b = (tok // T).to(tl.int64)
    t = (tok % T).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    pc = COS + b * sc_b + t * sc_t + d
    ps = SIN + b * ss_b + t * ss_t + d
    c1 = tl.load(pc, mask=dmask, other=0.0)
    s1 = tl.load(ps, mask=dmask, other=0.0)
    if REPEATED:
        c2 = c1
        s2 = s1
    elif FLAGGED:
        repeats = d * 0 + tl.load(REPEATS) != 0
        c2 = tl.where(repeats, c1, tl.load(pc + HALF, mask=dmask & ~repeats, other=0.0))
        s2 = tl.where(repeats, s1, tl.load(ps + HALF, mask=dmask & ~repeats, other=0.0))
    else:
        c2 = tl.load(pc + HALF, mask=dmask, other=0.0)
        s2 = tl.load(ps + HALF, mask=dmask, other=0.0)
    if UPCAST:
        c1, c2, s1, s2 = c1.to(tl.float32), c2.to(tl.float32), s1.to(tl.float32), s2.to(tl.float32)
    if BACKWARD:
        s1, s2 = -s2, -s1
    h = tl.arange(0, BLOCK_H)
    for h0 in range(0, HQ, BLOCK_H):
        m = ((h0 + h) < HQ)[:, None] & dmask[None, :]
        p = Q + b * sq_b + t * sq_t + (h0 + h)[:, None] * sq_h + d[None, :]
        x1 = tl.load(p, mask=m, other=0.0)
        x2 = tl.load(p + HALF, mask=m, other=0.0)
        if UPCAST:
            x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
        po = QO + b * sqo_b + t * sqo_t + (h0 + h)[:, None] * sqo_h + d[None, :]
        _store_rotated(po, x1, x2, c1, c2, s1, s2, m, HALF)
    for h0 in range(0, HK, BLOCK_H):
        m = ((h0 + h) < HK)[:, None] & dmask[None, :]
        p = K + b * sk_b + t * sk_t + (h0 + h)[:, None] * sk_h + d[None, :]
        x1 = tl.load(p, mask=m, other=0.0)
        x2 = tl.load(p + HALF, mask=m, other=0.0)
        if UPCAST:
            x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
        po = KO + b * sko_b + t * sko_t + (h0 + h)[:, None] * sko_h + d[None, :]
        _store_rotated(po, x1, x2, c1, c2, s1, s2, m, HALF)


@fast_launch
@triton.jit
def _halves_differ_kernel(
    C, S, FLAG, n_rows, sc_r, ss_r,
    HALF: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """Clears FLAG if a row of C or S (bit patterns) differs between its two halves."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    m = (r < n_rows)[:, None] & (d < HALF)[None, :]
    pc = C + r[:, None].to(tl.int64) * sc_r + d[None, :]
    ps = S + r[:, None].to(tl.int64) * ss_r + d[None, :]
    differ = (tl.load(pc, mask=m, other=0) != tl.load(pc + HALF, mask=m, other=0)) | (
        tl.load(ps, mask=m, other=0) != tl.load(ps + HALF, mask=m, other=0)
    )
    if tl.max(tl.max(differ.to(tl.int32), 1), 0) > 0:
        tl.store(FLAG, 0)


def head_tiles(hq: int, hk: int, d: int) -> int | None:
    """Heads per tile of `_rope_heads_kernel` when a call's head tiles would exceed MAX_TILE
    elements in `_rope_kernel`, else None (`_rope_kernel` takes the call)."""
    block_d = next_pow2(d // 2)
    if max(next_pow2(max(hq, 1)), next_pow2(max(hk, 1))) * block_d <= MAX_TILE:
        return None
    return max(1, MAX_TILE // block_d)


@functools.lru_cache(maxsize=256)  # asked on every call; shared, never mutated
def rope_candidates(hq: int, hk: int, d: int) -> list[dict]:
    """Tokens per program and warps worth timing (the first is the default). For the wide
    head counts `_rope_heads_kernel` takes: one token per program, 4 or 8 warps (tiles of
    MAX_TILE elements, 8 to 16 per thread)."""
    if head_tiles(hq, hk, d) is not None:
        return [{"BLOCK_T": 1, "num_warps": 4}, {"BLOCK_T": 1, "num_warps": 8}]
    per_token = (next_pow2(hq) + next_pow2(hk)) * next_pow2(d)
    block_t = max(1, min(4, 4096 // per_token))
    # One token per program timed best under a flushed L2 at the benchmark shapes (1 warp at
    # 2048 tokens, 8 at 16384); more tokens per program pay off only for tiny heads.
    pairs = [(1, 4), (1, 8), (1, 2), (1, 1), (2, 4), (2, 8)]
    out = [{"BLOCK_T": t * block_t, "num_warps": w} for t, w in pairs]
    pow2 = lambda n: n & (n - 1) == 0  # noqa: E731
    if not (pow2(hq) and pow2(hk) and (d // 2) % 16 == 0):  # ragged tiles: see RAGGED_VALUES
        out = [c for c in out if c["BLOCK_T"] * per_token <= RAGGED_VALUES * 32 * c["num_warps"]]
    return out


# Below this many cos elements per call the check costs more launches than the reads it saves.
MIN_CHECKED_ELEMENTS = 1 << 16
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _check_halves(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Device int32 [1]: 1 when every row of cos and of sin repeats its first half, bit for bit."""
    d = cos.shape[-1]
    c = as_rows(cos, d).view(_BITS[cos.element_size()])
    s = as_rows(sin, d).view(_BITS[sin.element_size()])
    flag = torch.ones(1, dtype=torch.int32, device=cos.device)
    rows = 32
    _halves_differ_kernel[(cdiv(c.shape[0], rows),)](
        c, s, flag, c.shape[0], c.stride(0), s.stride(0),
        HALF=d // 2, BLOCK_D=next_pow2(d // 2), ROWS=rows,
    )  # fmt: skip
    return flag


def _state(cos: torch.Tensor, sin: torch.Tensor) -> tuple:
    """What a kept answer depends on besides identity: the version counters (in-place ops) and
    the memory viewed (``.data =`` and ``swap_tensors`` keep the object but change it; the
    data pointer includes the storage offset). Flat, without a generator: asked on every call."""
    return (cos._version, cos.data_ptr(), cos.shape, cos.stride(),
            sin._version, sin.data_ptr(), sin.shape, sin.stride())  # fmt: skip


class _HalvesCheck:
    """One cos/sin pair's check: the device flag, copied to the host without waiting for it."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, key: tuple[int, int]) -> None:
        def forget(_ref, key=key):
            _CHECKS.pop(key, None)

        self.refs = (weakref.ref(cos, forget), weakref.ref(sin, forget))
        self.state = _state(cos, sin)
        self.value: bool | None = None
        self.landed = self.stream = None
        if not cos.is_cuda:
            self.flag = self.host = _check_halves(cos, sin)
            return
        with torch.cuda.device(cos.device):  # the check, its copy and event on cos's device
            self.flag = _check_halves(cos, sin)
            self.stream = torch.cuda.current_stream()
            self.host = torch.empty(1, dtype=torch.int32, pin_memory=True)
            self.host.copy_(self.flag, non_blocking=True)
            self.landed = torch.cuda.Event()
            self.landed.record(self.stream)

    def holds_for(self, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        return self.refs[0]() is cos and self.refs[1]() is sin and self.state == _state(cos, sin)

    def answer(self) -> bool | torch.Tensor | None:
        if self.value is None and (self.landed is None or self.landed.query()):
            self.value = bool(self.host.item())
        if self.value is not None:
            return self.value
        # Still on the device: only a kernel queued behind the check may read the flag.
        return self.flag if torch.cuda.current_stream() == self.stream else None


# (id(cos), id(sin)) -> the check of that pair while both tensors live
_CHECKS: dict[tuple[int, int], _HalvesCheck] = {}


def halves_repeat(cos: torch.Tensor, sin: torch.Tensor) -> bool | torch.Tensor | None:
    """Whether every row of cos and of sin repeats its first half, checked once per pair and version.

    True or False once the answer is on the host; while its copy is in flight, the device flag
    (the kernel reads it); None, read both halves, where a kept answer could go stale unseen:
    inference tensors have no version counter, and a CUDA graph replays without asking again.
    A write that bypasses the version counter (through ``.data``, a DLPack or numpy view, a
    custom kernel) is not seen: the kept answer assumes cos/sin change only through torch ops.
    """
    if cos.numel() < MIN_CHECKED_ELEMENTS or cos.is_inference() or sin.is_inference():
        return None
    if cos.element_size() not in _BITS or sin.element_size() not in _BITS:
        return None  # no integer view to compare bits with (1-byte floats)
    if cos.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    key = (id(cos), id(sin))
    check = _CHECKS.get(key)
    if check is None or not check.holds_for(cos, sin):
        check = _CHECKS[key] = _HalvesCheck(cos, sin, key)
    value = check.value  # answer()'s first test, without its call once the answer landed
    return value if value is not None else check.answer()


def _to_bhtd(x: torch.Tensor, unsqueeze_dim: int) -> torch.Tensor:
    return x if unsqueeze_dim == 1 else x.transpose(1, 2)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def triton_supported(q, k, cos, sin, unsqueeze_dim: int) -> bool:
    """Whether the Triton kernel covers this call (else the caller uses the torch composite)."""
    return use_triton(q) and _layouts_supported(q, k, cos, sin, unsqueeze_dim)


def _layouts_supported(q, k, cos, sin, unsqueeze_dim: int) -> bool:
    """triton_supported but for `use_triton` (which reads the environment for CPU tensors): a
    function of the shapes, devices and unsqueeze_dim alone."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False
    if unsqueeze_dim not in (1, 2) or not q.device == k.device == cos.device:
        return False
    time_dim = 2 if unsqueeze_dim == 1 else 1  # [B, H, T, D], or [B, T, H, D]; no views made
    b, t, d = q.shape[0], q.shape[time_dim], q.shape[3]
    kb, kt, kd = k.shape[0], k.shape[time_dim], k.shape[3]
    cb, ct, cd = cos.shape
    return d % 2 == 0 and (kb, kt, kd) == (b, t, d) and cb in (1, b) and (ct, cd) == (t, d)


_ASK = object()


def _out_like(x: torch.Tensor, device: str | None = None) -> torch.Tensor:
    """The rotated output for `x`: x's layout where head_dim has unit stride (the layout the
    transformers formula's elementwise ops give), else contiguous. empty_like alone follows any
    stride order, e.g. a k whose time dim is innermost, which the kernel cannot write. With
    ``device="meta"``, the same strides without memory (a plan reads them)."""
    if x.stride(-1) == 1:
        return torch.empty_like(x, device=device)
    return torch.empty(x.shape, dtype=x.dtype, device=device or x.device)


def rotate(q, k, cos, sin, unsqueeze_dim, backward, cfg=None, repeats=_ASK, out=(None, None)):
    """Triton rotation of q and k (the inverse rotation when `backward`).

    `repeats`: what halves_repeat answers (asked by default): True, False, None or a device flag.
    `out`: per tensor, where to write: None for a new tensor laid out like the input; a tensor
    shaped like it with unit head_dim stride (a view into one fused buffer); or the input itself,
    to rotate in place (no two elements at one address; each program reads its elements before
    it writes them). The caller owns any aliasing and the version counters. A call without `cfg`
    runs the plan its key maps to (see `_RotatePlan`).
    """
    if cfg is not None:
        return _RotatePlan(q, k, cos, sin, unsqueeze_dim, backward, out)(q, k, cos, sin, repeats,
                                                                         out, cfg)  # fmt: skip
    return _rotate_plan(q, k, cos, sin, unsqueeze_dim, backward, out)(q, k, cos, sin, repeats, out)


def _rotate_plan(q, k, cos, sin, unsqueeze_dim, backward, out) -> "_RotatePlan":
    """The kept plan of a rotate call without `cfg` (made and kept on its key's first call)."""
    oq, ok = out
    # Everything the plan's constants derive from: the layouts and dtypes of q, k, cos, sin and
    # of any given outputs (and whether they are q and k themselves), device and direction.
    key = (q.shape, q.stride(), k.shape, k.stride(), cos.shape, cos.stride(), sin.shape,
           sin.stride(), q.dtype, k.dtype, cos.dtype, sin.dtype, q.device, unsqueeze_dim,
           backward, oq is None or (oq is q, oq.stride(), oq.dtype),
           ok is None or (ok is k, ok.stride(), ok.dtype))  # fmt: skip
    plan = _ROTATE_PLANS.get(key)
    if plan is None:
        plan = _RotatePlan(q, k, cos, sin, unsqueeze_dim, backward, out)
        _ROTATE_PLANS.keep(key, plan)
    return plan


class _RotatePlan:
    """What a rotate call's key fixes: output layouts, which inputs need a unit head_dim copy,
    every stride the kernel takes, the constexprs; per kind of `repeats` answer (True, False or
    None, a device flag), the config and the bound launch once chosen."""

    __slots__ = ("ud", "backward", "empty", "qo_strides", "ko_strides", "copy", "scalars",
                 "constexprs", "tune_key", "candidates", "n_tokens", "launches",
                 "kernel")  # fmt: skip

    def __init__(self, q, k, cos, sin, unsqueeze_dim, backward, out) -> None:
        self.ud, self.backward = unsqueeze_dim, backward
        # The outputs' layouts (empty_like's, which no stride formula here would match for
        # every size-1 dim), read off meta tensors: every call allocates its own outputs, so
        # two threads making a shape's first calls never share a buffer.
        qo = _out_like(q, "meta") if out[0] is None else out[0]
        ko = _out_like(k, "meta") if out[1] is None else out[1]
        self.qo_strides, self.ko_strides = qo.stride(), ko.stride()
        qv, kv = _unit_last(_to_bhtd(q, unsqueeze_dim)), _unit_last(_to_bhtd(k, unsqueeze_dim))
        qov, kov = _to_bhtd(qo, unsqueeze_dim), _to_bhtd(ko, unsqueeze_dim)
        b, hq, t, d = qv.shape
        hk = kv.shape[1]
        n_tokens = self.n_tokens = b * t
        self.empty = n_tokens == 0 or hq + hk == 0
        # Which of q, k, cos, sin the call copies to a unit head_dim stride.
        self.copy = tuple(x.stride(-1) != 1 for x in (q, k, cos, sin))
        cos, sin = _unit_last(cos), _unit_last(sin)
        sq, sk, sqo, sko, sc, ss = (x.stride() for x in (qv, kv, qov, kov, cos, sin))
        # A cos/sin batch of 1 is broadcast with a zero batch stride.
        sc_b = sc[0] if cos.shape[0] == b else 0
        ss_b = ss[0] if sin.shape[0] == b else 0
        self.scalars = (n_tokens, t, sq[0], sq[1], sq[2], sk[0], sk[1], sk[2],
                        sqo[0], sqo[1], sqo[2], sko[0], sko[1], sko[2],
                        sc_b, sc[1], ss_b, ss[1])  # fmt: skip
        half = d // 2
        # On the CPU the Triton path runs only in the interpreter, which keeps bfloat16 as
        # integers.
        upcast = not q.is_cuda and torch.bfloat16 in (q.dtype, k.dtype, cos.dtype, sin.dtype)
        block_h = head_tiles(hq, hk, d)
        if block_h is None:
            self.kernel = _rope_kernel
            self.constexprs = {"HQ": hq, "HK": hk, "HALF": half,
                               "BLOCK_HQ": next_pow2(max(hq, 1)), "BLOCK_HK": next_pow2(max(hk, 1)),
                               "BLOCK_D": next_pow2(half), "BACKWARD": backward,
                               "UPCAST": upcast}  # fmt: skip
        else:  # many heads: tiles of block_h heads, the head counts passed at run time
            self.kernel = _rope_heads_kernel
            self.scalars += (hq, hk)
            self.constexprs = {"HALF": half, "BLOCK_H": block_h, "BLOCK_D": next_pow2(half),
                               "BACKWARD": backward, "UPCAST": upcast}  # fmt: skip
        self.tune_key = ("rope", n_tokens.bit_length(), hq, hk, d, q.dtype, cos.dtype, q.device)
        self.candidates = rope_candidates(hq, hk, d)
        self.launches: dict = {}

    def __call__(self, q, k, cos, sin, repeats, out, cfg=None):
        ud = self.ud
        qo, ko = out
        if qo is None:
            qo = torch.empty_strided(q.shape, self.qo_strides, dtype=q.dtype, device=q.device)
        if ko is None:
            ko = torch.empty_strided(k.shape, self.ko_strides, dtype=k.dtype, device=k.device)
        if self.empty:
            return qo, ko
        # Asked of the caller's tensors: a copy made below would be new each call.
        if repeats is _ASK:
            repeats = halves_repeat(cos, sin)
        copy_q, copy_k, copy_c, copy_s = self.copy
        # The kernel takes base pointers and strides: q itself stands for its [B, H, T, D] view.
        qv = _to_bhtd(q, ud).contiguous() if copy_q else q
        kv = _to_bhtd(k, ud).contiguous() if copy_k else k
        if copy_c:
            cos = cos.contiguous()
        if copy_s:
            sin = sin.contiguous()
        flagged = isinstance(repeats, torch.Tensor)
        # Each kernel variant gets its own timing; None and False launch the same one.
        kind = "flag" if flagged else repeats is True
        launch = self.launches.get(kind)
        if launch is None or cfg is not None:
            launch = self._choose(kind, q, k, qv, kv, qo, ko, cos, sin, repeats, cfg)
        launch(qv, kv, qo, ko, cos, sin, repeats if flagged else cos, *self.scalars)
        return qo, ko

    def _kwargs(self, c, kind) -> dict:
        flags = {"REPEATED": kind is True, "FLAGGED": kind == "flag", "num_warps": c["num_warps"]}
        if self.kernel is _rope_heads_kernel:  # one token per program
            return {**self.constexprs, **flags}
        return {**self.constexprs, "BLOCK_T": c["BLOCK_T"],
                "EVEN_T": self.n_tokens % c["BLOCK_T"] == 0, **flags}  # fmt: skip

    def _choose(self, kind, q, k, qv, kv, qo, ko, cos, sin, repeats, cfg):
        """The bound launch for `cfg`, or for the config picked for this key and `kind` (timed
        on a GPU's first call); kept when the pick is final."""
        ud = self.ud
        grid_of = lambda c: (cdiv(self.n_tokens, c["BLOCK_T"]),)  # noqa: E731
        flag = repeats if kind == "flag" else cos
        keep = cfg is None
        if cfg is None:

            def launch(c, qd=qo, kd=ko, sqo=self.scalars[8:11], sko=self.scalars[11:14]):
                s = self.scalars
                self.kernel[grid_of(c)](
                    qv, kv, qd, kd, cos, sin, flag, *s[:8], *sqo, *sko, *s[14:],
                    **self._kwargs(c, kind),
                )  # fmt: skip

            tune = launch
            if qo is q or ko is k:
                # In place: every timing launch would rotate q and k once more. The tuner times
                # launches into scratch outputs instead, made only when it launches (a shape's
                # first call), and the winner runs here.
                scratch = []

                def tune(c):
                    if not scratch:
                        qs, ks = (_to_bhtd(_out_like(x), ud) for x in (q, k))
                        scratch.extend((qs, ks, qs.stride()[:3], ks.stride()[:3]))
                    launch(c, *scratch)

            if kind == "flag":
                # The device flag is read only until the host copy of the answer lands (a
                # shape's first call or two): not worth compiling and timing every candidate
                # for. The config timed for another kind, else the default; not kept.
                cfg = (
                    cached_config((*self.tune_key, True))
                    or cached_config((*self.tune_key, False))
                    or self.candidates[0]
                )
                keep = False
            else:
                key = (*self.tune_key, kind)
                cfg = pick_config(key, self.candidates, tune, cold=q.device)
                keep = config_is_final(key, self.candidates)
        bound = self.kernel.bound(grid_of(cfg), self._kwargs(cfg, kind))
        if keep:
            self.launches[kind] = bound
        return bound


_ROTATE_PLANS = PlanCache()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def composite(q, k, cos, sin, unsqueeze_dim: int = 1):
    """The transformers formula in plain torch ops (autograd by torch): the CPU and fallback path.
    Like the kernel, it returns q's and k's dtypes: OLMo 2 keeps cos/sin in fp32 and casts the
    fp32 products back (its attention refuses an fp32 q next to a bf16 v)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_out = q * cos + _rotate_half(q) * sin
    k_out = k * cos + _rotate_half(k) * sin
    return q_out.to(q.dtype), k_out.to(k.dtype)


@torch.library.custom_op(op_name("rope"), mutates_args=())
def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int,
    backward: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    # Only reached for calls whose layouts the kernel covers (see apply_rotary_pos_emb). Under
    # torch.compile both halves are read: Inductor may reuse a buffer object for another tensor,
    # writing it with its own kernels, which a kept answer would not notice.
    if use_triton(q):
        return rotate(q, k, cos, sin, unsqueeze_dim, backward, repeats=None)
    # The torch formula (CPU without the interpreter): the same graph on every device, and
    # outputs laid out as the fake registration says (`_out_like`).
    if backward:  # the transposed rotation: the sine's halves swapped and negated
        s1, s2 = sin.chunk(2, dim=-1)
        sin = -torch.cat((s2, s1), dim=-1)
    qr, kr = composite(q, k, cos, sin, unsqueeze_dim)
    return _out_like(q).copy_(qr), _out_like(k).copy_(kr)


@rope.register_fake
def _(q, k, cos, sin, unsqueeze_dim, backward):
    return _out_like(q), _out_like(k)


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


# --- In place (eager path) ------------------------------------------------------------------
#
# The forward writes the rotation over q and k where it may, and the backward writes the
# gradient over the incoming one where nothing else can read it, so a fwd+bwd allocates nothing
# (Liger's RoPE does the same, without the checks). The outputs returned to autograd are aliases
# of q and k (autograd views an unmodified input it gets back), so the graph stays
# q -> rope -> output; q's version counter (shared by every view of its storage) is bumped, so
# anything that saved q, or any view of its memory, for its backward raises autograd's
# "modified by an inplace operation" error instead of computing a gradient from rotated values.
# What the counter cannot see is a later *forward* read of the old q object: callers must use
# the returned tensors, not q and k, after the call (transformers' call sites rebind the names).


def _storage_count_alone() -> int | None:
    """The storage use count this torch reports for a tensor that alone holds its storage, or
    None when the private counters the in-place checks read are missing or do not count holders
    the way the checks need. Measured, not assumed: torch 2.5 to 2.9 count the tensors holding
    the storage (1), 2.10 and later also the Python storage object that ``untyped_storage()``
    returns (2); see docs/compatibility.md."""
    try:
        count = torch._C._storage_Use_Count
        overlap = torch._debug_has_internal_overlap
        # Plain CPU tensors with autograd's view tracking, whatever mode imports this module.
        with torch.inference_mode(False):
            base = torch.empty(4, device="cpu")
            alone = count(base.untyped_storage()._cdata)
            uses = [base._use_count()]  # its Python object's reference
            view = base.view(2, 2)
            uses.append(base._use_count())  # and the view's
            del base  # the view's _base keeps it: two holders
            with_base = count(view.untyped_storage()._cdata)
            sibling = view._base.view(4)
            with_sibling = count(view.untyped_storage()._cdata)
            dense, expanded = overlap(sibling), overlap(sibling[:1].expand(4))
    except (AttributeError, RuntimeError, TypeError):
        return None
    sane = (
        alone in (1, 2)
        and (with_base, with_sibling) == (alone + 1, alone + 2)
        and uses == [1, 2]
        and (dense, expanded) == (0, 1)
    )
    return alone if sane else None


def _gradient_uses_alone() -> int | None:
    """The use count of an unshared gradient as an autograd Function's backward receives it,
    or None where it cannot be measured. torch 2.13 hands the gradient over (1); torch 2.5 to
    2.12 keep a reference of their own to it while the backward runs (2)."""
    uses = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            uses.append(g._use_count())
            return g

    try:
        with torch.inference_mode(False), torch.enable_grad():
            x = torch.zeros(2, device="cpu", requires_grad=True)
            # Mul's backward makes the gradient Probe receives: a new tensor, held by no one.
            torch.autograd.backward(Probe.apply(x) * 2.0, torch.ones(2, device="cpu"))
    except (AttributeError, RuntimeError, TypeError):
        return None
    return uses[0] if len(uses) == 1 and uses[0] in (1, 2) else None


# Decided once per process: the checks below run on every eager call.
_ALONE = _storage_count_alone()
_GRAD_USES = _gradient_uses_alone() if _ALONE is not None else None


def _own_memory(x: torch.Tensor) -> bool:
    """Whether x's memory may take its rotation: no other tensor holds x's storage (only x and
    the tensor it views), x is no leaf that requires grad, nor a view of one (a parameter or an
    input the user holds), not an inference tensor (no version counter to bump), and dense with
    a unit head_dim stride (each element once, where the kernel writes); nor a parameter or a
    view of one, even frozen. A Python reference the caller keeps to q's base (the projection's
    output) is not seen: that tensor reads the rotated values after the call."""
    if _ALONE is None or x.stride(-1) != 1 or x.is_inference():
        return False
    if (x.requires_grad and x.is_leaf) or isinstance(x, torch.nn.Parameter):
        return False
    base = x._base
    if base is not None and (
        (base.requires_grad and base.is_leaf) or isinstance(base, torch.nn.Parameter)
    ):
        return False
    # Holders of the storage: x, its base, and the storage object made here where this torch
    # counts it (_ALONE). Any other is a tensor that could read the memory after the rotation:
    # an op that saved its output for its backward (a sigmoid; MemoryEfficientRMSNorm as
    # q_norm), a sibling view (a split of a fused qkv, whose outputs autograd forbids to change
    # under a bumped version counter), a view the caller kept. In place would turn their
    # backward into autograd's error: a new buffer then.
    holders = _ALONE if base is None else _ALONE + 1
    if torch._C._storage_Use_Count(x.untyped_storage()._cdata) != holders:
        return False
    return torch._debug_has_internal_overlap(x) == 0  # 0: no two elements share an address


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two dense tensors' memory ranges meet (q and k carved from one buffer)."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _private_grad(g: torch.Tensor) -> bool:
    """Whether the incoming gradient g may be overwritten: the test autograd's engine applies
    before it accumulates into a gradient in place (no references to g's tensor but those an
    unshared gradient arrives with, _GRAD_USES; one tensor on its storage), and dense with a
    unit head_dim stride. A root gradient the caller passed (``backward(g)``), a gradient
    another node still waits for (``a + q_rot`` hands one tensor to both), a view of a larger
    gradient or an expanded one all fail it. A Python reference kept by a tensor hook is not
    counted, as for the engine's own in-place accumulation: a hook that keeps a gradient must
    clone it."""
    if _GRAD_USES is None or g._use_count() != _GRAD_USES or g.stride(-1) != 1:
        return False
    # No holder but g itself.
    if torch._C._storage_Use_Count(g.untyped_storage()._cdata) != _ALONE:
        return False
    return torch._debug_has_internal_overlap(g) == 0


class _EagerPlan:
    """What the layouts of an eager call's q, k, cos and sin fix (its key, `_eager_key`): whether
    the Triton kernel covers the call (`triton_supported` but for `use_triton`, which reads the
    environment for CPU tensors and is asked per call), and the forward's rotate plans, one per
    in-place choice. The in-place checks themselves still run on every call: they read
    per-call facts. The backward looks its rotate plan up by rotate's own key."""

    __slots__ = ("triton", "forward")

    def __init__(self, q, k, cos, sin, unsqueeze_dim) -> None:
        self.triton = _layouts_supported(q, k, cos, sin, unsqueeze_dim)
        self.forward: list = [None] * 4  # index 2 * (q in place) + (k in place)


def _eager_key(q, k, cos, sin, unsqueeze_dim) -> tuple:
    """Everything `_EagerPlan` derives from: the rotate key's inputs part plus the devices
    `triton_supported` compares."""
    return (q.shape, q.stride(), k.shape, k.stride(), cos.shape, cos.stride(), sin.shape,
            sin.stride(), q.dtype, k.dtype, cos.dtype, sin.dtype, q.device, k.device, cos.device,
            unsqueeze_dim)  # fmt: skip


_EAGER_PLANS = PlanCache()


def _eager_forward(q, k, cos, sin, unsqueeze_dim, plan):
    """(q rotated, k rotated, halves_repeat's answer): the eager forward's kernel, over q and k
    themselves where that is safe (see above)."""
    repeats = halves_repeat(cos, sin)
    in_q, in_k = _own_memory(q), _own_memory(k)
    if in_q and in_k and _overlap(q, k):
        in_q = in_k = False
    out = (q if in_q else None, k if in_k else None)
    # The plan rotate would find: the eager key fixes all of rotate's key but `out`.
    index = 2 * in_q + in_k
    rotation = plan.forward[index]
    if rotation is None:
        rotation = plan.forward[index] = _rotate_plan(q, k, cos, sin, unsqueeze_dim, False, out)
    qo, ko = rotation(q, k, cos, sin, repeats, out)
    # The Triton kernel wrote behind autograd's back: bump the counters it would have.
    if in_q:
        torch.autograd.graph.increment_version(q)
    if in_k:
        torch.autograd.graph.increment_version(k)
    return qo, ko, repeats


class _RopeFunction(torch.autograd.Function):
    """The eager path: the same kernel without the custom-op dispatch cost on every call, in
    place where that is safe (see above). `plan` is the call's `_EagerPlan`."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim, plan):
        ctx.save_for_backward(cos, sin)
        ctx.unsqueeze_dim = unsqueeze_dim
        qo, ko, repeats = _eager_forward(q, k, cos, sin, unsqueeze_dim, plan)
        # A host answer holds for the backward too: cos and sin are saved tensors, so autograd
        # refuses the backward if an in-place op changed them. A device flag may still be in
        # flight on another stream by then, so the backward asks again.
        ctx.repeats = repeats if isinstance(repeats, bool) else _ASK
        return qo, ko

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        # retain_graph (the graph runs again) or create_graph (the gradients are themselves
        # in a graph): new buffers, as the other in-place backwards do.
        freed = graph_is_freed()
        out = (
            dq if freed and _private_grad(dq) else None,
            dk if freed and _private_grad(dk) else None,
        )
        # One tensor for both (``q_embed + k_embed`` hands the sum's gradient to each): written
        # over for both, q and k would get one buffer as their two gradients.
        if out[0] is not None and out[1] is not None and _overlap(dq, dk):
            out = (None, None)
        # rotate's own key, of the tensors in hand: the saved cos and sin may come back from a
        # saved-tensor hook (activation offloading) in another layout than the forward's.
        dq, dk = rotate(dq, dk, cos, sin, ctx.unsqueeze_dim, True, repeats=ctx.repeats, out=out)
        return dq, dk, None, None, None, None


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' apply_rotary_pos_emb; the Triton kernel where it applies, else torch ops.

    In eager mode the rotation may be written over q and k themselves (where safe; see the
    module docstring): read the returned tensors, not q and k, after the call."""
    if tensor_parallel.is_dtensor(q) or tensor_parallel.is_dtensor(k):  # this rank's heads
        return tensor_parallel.rope(apply_rotary_pos_emb, q, k, cos, sin, unsqueeze_dim)
    if torch.compiler.is_compiling():
        # The op on every device (it runs the torch formula where Triton does not run), so the
        # compiled graph is the same on a CPU as on a GPU.
        if _layouts_supported(q, k, cos, sin, unsqueeze_dim):
            return rope(q, k, cos, sin, unsqueeze_dim, False)
        return composite(q, k, cos, sin, unsqueeze_dim)
    if not use_triton(q):  # first: a CPU call without the interpreter builds no key
        return composite(q, k, cos, sin, unsqueeze_dim)
    key = _eager_key(q, k, cos, sin, unsqueeze_dim)
    plan = _EAGER_PLANS.get(key)
    if plan is None:
        plan = _EagerPlan(q, k, cos, sin, unsqueeze_dim)
        _EAGER_PLANS.keep(key, plan)
    if not plan.triton:
        return composite(q, k, cos, sin, unsqueeze_dim)
    if not needs_grad(q, k, cos, sin):  # inference: no autograd Function's host cost
        return _eager_forward(q, k, cos, sin, unsqueeze_dim, plan)[:2]
    return _RopeFunction.apply(q, k, cos, sin, unsqueeze_dim, plan)


def apply_partial_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary_pos_emb over the first ``cos.shape[-1]`` dims of each head; the other dims
    pass through unchanged (partial rotary, as phi3/stablelm/persimmon compute it). With cos as
    wide as the head it is apply_rotary_pos_emb."""
    d = cos.shape[-1]
    if d == q.shape[-1]:
        return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
    if d > q.shape[-1] or d % 2:
        raise ValueError(f"rotary dim {d} does not fit heads of {q.shape[-1]}")
    q_rot, k_rot = apply_rotary_pos_emb(q[..., :d], k[..., :d], cos, sin, unsqueeze_dim)
    return torch.cat((q_rot, q[..., d:]), dim=-1), torch.cat((k_rot, k[..., d:]), dim=-1)


def _pairs_to_halves(x: torch.Tensor, d: int) -> torch.Tensor:
    return torch.cat((x[..., 0:d:2], x[..., 1:d:2]), dim=-1)


def _halves_to_pairs(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.stack((x[..., :half], x[..., half:]), dim=-1).flatten(-2)


def apply_interleaved_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_pairs: torch.Tensor,
    sin_pairs: torch.Tensor,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Interleaved (GPT-J / Cohere / GLM) RoPE: dims (2i, 2i+1) rotate as a pair by angle i;
    ``cos_pairs``/``sin_pairs`` [B, T, d/2] hold one value per pair; the first d dims of each
    head rotate, the rest pass. The pairs are gathered into rotate-half order, rotated by the
    rotate-half kernel, and scattered back (two extra copies of the rotated dims)."""
    d = 2 * cos_pairs.shape[-1]
    if d > q.shape[-1]:
        raise ValueError(f"rotary dim {d} does not fit heads of {q.shape[-1]}")
    cos = torch.cat((cos_pairs, cos_pairs), dim=-1)
    sin = torch.cat((sin_pairs, sin_pairs), dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb(
        _pairs_to_halves(q, d), _pairs_to_halves(k, d), cos, sin, unsqueeze_dim
    )
    q_rot, k_rot = _halves_to_pairs(q_rot), _halves_to_pairs(k_rot)
    if d == q.shape[-1]:
        return q_rot, k_rot
    return torch.cat((q_rot, q[..., d:]), dim=-1), torch.cat((k_rot, k[..., d:]), dim=-1)
