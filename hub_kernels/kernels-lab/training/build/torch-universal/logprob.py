"""Fused linear log-prob head: per-token log-probabilities of the labels, and optionally the
entropy, ``log sum p^2``, the mean logit and whether the label is the argmax, of
``hidden @ weight.T (+ bias)``, without ever holding the [N, V] logits.

Per token, with x the projection (bias included), the transform is TRL's, in its order:

    z = softcap * tanh(logit_scale * x / softcap) / temperature      (no softcap: logit_scale * x / T)
    log_z = logsumexp(z); log_probs = z_y - log_z; entropy = log_z - sum p z
    log_sum_sq_probs = log sum p^2; mean_logits = mean z; is_top1 = z_y is the first maximum

all in fp32. Rows whose label is ``ignore_index`` give 0 in every field and a zero gradient; a
label outside [0, V) otherwise gives a NaN log-prob (loud, no host sync).

How the work is laid out. The logits are made in tiles of [rows, cols] by cuBLAS matmuls in the
inputs' dtype. Rows are all tokens whenever a tile of ``MIN_TILE_COLS`` columns fits the memory
budget (``MAX_TILE_BYTES``), which it does for every usual batch: then each vocabulary chunk's
d(weight) rows come from ONE matmul over all tokens (fp32 accumulation inside cuBLAS, rounded once,
written straight into the gradient, no [V, H] fp32 buffer), and only d(hidden) [N, H] is summed
over vocabulary chunks, in fp32. One Triton pass per tile folds it into online statistics (one
read; the sums are kept per lane and reduced once per row, so a block costs one max reduction);
the last chunk writes the outputs. The backward recomputes each tile (the per-token upstream
gradients are unknown in the forward), overwrites it in place with d(output)/d(logits) in one
pass, and feeds it to the d(hidden) and d(weight) matmuls: 4 matmuls of N·H·V in all, like TRL's.
Under no_grad nothing is kept for a backward.

With ``keep_logits`` (or when the [N, V] logits fit ``KERNELS_LOGPROB_KEEP_BYTES``, 0 by default)
the forward keeps the logits (made whole-row) and the backward reads them instead of recomputing
their tiles: 3 matmuls, the count of a head that materialises its logits, for N·V more bytes held
between the passes. The backward writes d(out)/d(logits) into one tile buffer, so the kept logits
stay intact (a second backward with ``retain_graph`` reads them again).

CUDA tensors run Triton; CPU tensors run the same chunked loop with torch formulas in fp32, or the
Triton kernels under TRITON_INTERPRET=1. Registered as torch.library custom ops (fake and autograd
registrations) so torch.compile traces a call without a graph break.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import NamedTuple, Optional

import torch

from ._common import (
    cached_config,
    cdiv,
    fast_launch,
    needs_grad,
    next_pow2,
    op_name,
    pick_config,
    use_triton,
)
from ._triton import tl, triton
from .vocab_parallel import is_vocab_sharded

OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
# Bits of the op's `outputs` argument, one per optional field (log_probs is always computed).
ENTROPY, SUM_SQ, MEAN, TOP1 = 1, 2, 4, 8
_BITS = {"entropy": ENTROPY, "log_sum_sq_probs": SUM_SQ, "mean_logits": MEAN, "is_top1": TOP1}

# The logits tile's budget. Extra memory of a fwd+bwd is this tile plus d(hidden) in fp32
# (4·N·H bytes, only when the vocabulary takes more than one tile) plus O(N) statistics.
MAX_TILE_BYTES = 512 * 2**20
# Narrowest vocabulary chunk taken before the tokens are split too: a chunk this wide keeps the
# three matmuls per tile long enough in every dimension to run near the device's peak rate.
MIN_TILE_COLS = 4096
# Vocabulary chunks are whole multiples of this (the last one takes the remainder), so every
# row stride and matmul dimension of a tile is aligned.
COL_ALIGN = 256

# Logits up to this many bytes are kept for the backward when the caller does not say
# (fused_linear_logprob's keep_logits=None): 0, never, the lean default; a user with the memory
# trades N·V bytes for one matmul of N·H·V.
KEEP_LOGITS_BYTES = int(os.environ.get("KERNELS_LOGPROB_KEEP_BYTES", "0") or 0)

# `torch.mm(..., out_dtype=torch.float32)` from bf16/fp16 inputs, CUDA only (torch >= 2.8).
_MM_OUT_DTYPE = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 8)


class LogProbOutputs(NamedTuple):
    """Per-token fields, each [N] (fp32; is_top1 bool), None where not asked for."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    log_sum_sq_probs: torch.Tensor | None
    mean_logits: torch.Tensor | None
    is_top1: torch.Tensor | None


def tile_shape(n: int, vocab: int, itemsize: int, max_bytes: int = MAX_TILE_BYTES) -> tuple:
    """(rows, cols) of the logits tile for n tokens: every token and the widest aligned
    vocabulary chunk that fits `max_bytes`, chunks evened out; tokens are split only when even
    MIN_TILE_COLS columns of all of them would not fit."""
    n, vocab = max(1, n), max(1, vocab)
    if n * vocab * itemsize <= max_bytes:
        return n, vocab
    cols = max_bytes // (n * itemsize) // COL_ALIGN * COL_ALIGN
    if cols >= min(vocab, MIN_TILE_COLS):
        # Even the chunks out: 151936 columns in 10 chunks of 15360 (the last 13696), not 9 of
        # 16384 and a short 4480.
        chunks = cdiv(vocab, cols)
        return n, min(cols, cdiv(cdiv(vocab, chunks), COL_ALIGN) * COL_ALIGN)
    cols = min(vocab, MIN_TILE_COLS)
    rows = max(1, max_bytes // (cols * itemsize))
    return cdiv(n, cdiv(n, rows)), cols


# --- Triton kernels ---------------------------------------------------------------------------


@triton.jit
def _transform(x, scale, cap, inv_t, HAS_SOFTCAP: tl.constexpr):
    """TRL's order: logit scale, then soft-capping, then temperature (fp32 in and out)."""
    y = x * scale
    if HAS_SOFTCAP:
        # tanh(u) = 1 - 2 / (exp(2u) + 1): exact limits at +-inf, no libdevice needed.
        y = cap * (1.0 - 2.0 / (tl.exp(2.0 * y / cap) + 1.0))
    return y * inv_t


@fast_launch
@triton.jit
def _fwd_kernel(
    tile_ptr, stride_t, labels_ptr, bias_ptr, stats_ptr, stride_s,
    lp_ptr, ent_ptr, sq_ptr, mean_ptr, top1_ptr, logz_ptr,
    col0, n_cols, vocab, ignore_index, scale, cap, inv_t,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ENT: tl.constexpr,
    HAS_SQ: tl.constexpr, HAS_MEAN: tl.constexpr, HAS_TOP1: tl.constexpr,
    FIRST: tl.constexpr, LAST: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Fold one tile row (columns col0 .. col0 + n_cols of the vocabulary) into the row's running
    statistics; the first chunk starts them, the last writes the outputs instead.

    stats rows (stride_s apart): max, sum e, sum e·z, sum e², sum z, max before the label,
    label logit, where e = exp(z - max). Within the tile the sums are kept per lane, rescaled
    by a scalar when the max moves, and reduced once at the end."""
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(labels_ptr + row).to(tl.int64)
    local = label - col0
    base = tile_ptr + row * stride_t
    offs = tl.arange(0, BLOCK)
    m = -float("inf")
    s_v = tl.zeros((BLOCK,), tl.float32)
    xs_v = tl.zeros((BLOCK,), tl.float32)
    sq_v = tl.zeros((BLOCK,), tl.float32)
    zs_v = tl.zeros((BLOCK,), tl.float32)
    mbt_v = tl.full((BLOCK,), -float("inf"), tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        mask = cols < n_cols
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            x += tl.load(bias_ptr + col0 + cols, mask=mask, other=0.0).to(tl.float32)
        z = _transform(x, scale, cap, inv_t, HAS_SOFTCAP)
        zm = tl.where(mask, z, -float("inf"))
        m_new = tl.maximum(m, tl.max(zm, axis=0))
        r = tl.exp(m - m_new)
        e = tl.exp(zm - m_new)
        s_v = s_v * r + e
        if HAS_ENT:
            xs_v = xs_v * r + e * z
        if HAS_SQ:
            sq_v = sq_v * (r * r) + e * e
        if HAS_MEAN:
            zs_v += tl.where(mask, z, 0.0)
        if HAS_TOP1:
            mbt_v = tl.maximum(mbt_v, tl.where(cols < local, zm, -float("inf")))
        m = m_new
    s = tl.sum(s_v, axis=0)
    xs = tl.sum(xs_v, axis=0)
    sq = tl.sum(sq_v, axis=0)
    zs = tl.sum(zs_v, axis=0)
    mbt = tl.max(mbt_v, axis=0)
    # The label's logit, where this chunk holds it (NaN until some chunk does).
    hit = (local >= 0) & (local < n_cols)
    xt = tl.load(base + local, mask=hit, other=0.0).to(tl.float32)
    if HAS_BIAS:
        xt += tl.load(bias_ptr + label, mask=hit, other=0.0).to(tl.float32)
    zt = tl.where(hit, _transform(xt, scale, cap, inv_t, HAS_SOFTCAP), float("nan"))
    st = stats_ptr + row
    if not FIRST:  # merge the earlier chunks' statistics
        m_old = tl.load(st)
        m_all = tl.maximum(m_old, m)
        a_old = tl.exp(m_old - m_all)
        a_new = tl.exp(m - m_all)
        s = tl.load(st + stride_s) * a_old + s * a_new
        if HAS_ENT:
            xs = tl.load(st + 2 * stride_s) * a_old + xs * a_new
        if HAS_SQ:
            sq = tl.load(st + 3 * stride_s) * (a_old * a_old) + sq * (a_new * a_new)
        if HAS_MEAN:
            zs += tl.load(st + 4 * stride_s)
        if HAS_TOP1:
            mbt = tl.maximum(mbt, tl.load(st + 5 * stride_s))
        zt = tl.where(hit, zt, tl.load(st + 6 * stride_s))
        m = m_all
    if LAST:
        valid = label != ignore_index
        log_z = m + tl.log(s)
        tl.store(logz_ptr + row, log_z)
        tl.store(lp_ptr + row, tl.where(valid, zt - log_z, 0.0))
        if HAS_ENT:
            tl.store(ent_ptr + row, tl.where(valid, log_z - xs / s, 0.0))
        if HAS_SQ:
            tl.store(sq_ptr + row, tl.where(valid, tl.log(sq) - 2.0 * tl.log(s), 0.0))
        if HAS_MEAN:
            tl.store(mean_ptr + row, tl.where(valid, zs / vocab, 0.0))
        if HAS_TOP1:
            tl.store(top1_ptr + row, (valid & (zt >= m) & (zt > mbt)).to(tl.int8))
    else:
        tl.store(st, m)
        tl.store(st + stride_s, s)
        if HAS_ENT:
            tl.store(st + 2 * stride_s, xs)
        if HAS_SQ:
            tl.store(st + 3 * stride_s, sq)
        if HAS_MEAN:
            tl.store(st + 4 * stride_s, zs)
        if HAS_TOP1:
            tl.store(st + 5 * stride_s, mbt)
        tl.store(st + 6 * stride_s, zt)


@fast_launch
@triton.jit
def _bwd_kernel(
    tile_ptr, stride_t, out_ptr, stride_o, labels_ptr, bias_ptr, logz_ptr, ent_ptr, glp_ptr,
    gent_ptr, col0, n_cols, ignore_index, scale, cap, inv_t,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_GLP: tl.constexpr,
    HAS_GENT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Overwrite one block of a tile row (the recomputed logits) with d(out)/d(logits):
    g_lp·([j = y] - p_j) - g_ent·p_j·(log p_j + H), times the transform's derivative. (out is
    the tile itself; another buffer only while configs are timed.)"""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    label = tl.load(labels_ptr + row).to(tl.int64)
    valid = label != ignore_index
    a = 0.0
    b = 0.0
    if HAS_GLP:
        a = tl.where(valid, tl.load(glp_ptr + row).to(tl.float32), 0.0)
    if HAS_GENT:
        b = tl.where(valid, tl.load(gent_ptr + row).to(tl.float32), 0.0)
        h = tl.load(ent_ptr + row)
    log_z = tl.load(logz_ptr + row)
    x = tl.load(tile_ptr + row * stride_t + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(bias_ptr + col0 + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * scale
    if HAS_SOFTCAP:
        t = 1.0 - 2.0 / (tl.exp(2.0 * y / cap) + 1.0)
        z = cap * t * inv_t
    else:
        z = y * inv_t
    logp = z - log_z
    p = tl.exp(logp)
    if HAS_GENT:
        g = -p * (a + b * (logp + h))
    else:
        g = -p * a
    g = tl.where(cols == label - col0, g + a, g)
    g = g * (scale * inv_t)
    if HAS_SOFTCAP:
        g = g * (1.0 - t * t)
    tl.store(out_ptr + row * stride_o + cols, g.to(out_ptr.dtype.element_ty), mask=mask)


# Launch geometries, (BLOCK, num_warps): the first is the default (and the interpreter's); on a
# GPU the fastest for a key is timed once per process (pick_config, L2 flushed before each
# launch). A wider block puts more bytes in flight per program; more warps spread its registers.
FWD_CONFIGS = [(2048, 8), (4096, 8), (4096, 16), (1024, 4), (8192, 16)]
BWD_CONFIGS = [(4096, 8), (2048, 4), (2048, 8), (8192, 16), (1024, 4)]
# Rows of a tile the backward's configs are timed on (out of place, into a scratch buffer).
TUNE_ROWS = 4096


def configs(candidates: list, n_cols: int) -> list[dict]:
    """The candidates whose block a row of `n_cols` fills at least half of (the narrowest
    otherwise), as launch keywords."""
    cap = next_pow2(n_cols)
    fit = [(b, w) for b, w in candidates if b <= cap] or [(min(b for b, _ in candidates), 4)]
    return [{"BLOCK": min(b, cap), "num_warps": w} for b, w in dict.fromkeys(fit)]


def choose(key: tuple, candidates: list[dict], launch, device: torch.device, tunable: bool):
    """The config for `key`: timed on the GPU when `launch` may be repeated (it writes what one
    launch would), else the one timed earlier for the key, else the default."""
    if device.type == "cuda" and tunable and len(candidates) > 1:
        return pick_config(key, candidates, launch, cold=device)
    return cached_config(key) or candidates[0]


def _fwd_tile_triton(tile, labels, bias, stats, outs, col0, vocab, o, first, last):
    n, n_cols = tile.shape
    lp, ent, sq, mean, top1, log_z = outs
    flags = {
        "HAS_BIAS": bias is not None, "HAS_SOFTCAP": o.has_softcap,
        "HAS_ENT": o.bits & ENTROPY != 0, "HAS_SQ": o.bits & SUM_SQ != 0,
        "HAS_MEAN": o.bits & MEAN != 0, "HAS_TOP1": o.bits & TOP1 != 0,
    }  # fmt: skip

    def launch(cfg):
        _fwd_kernel[(n,)](
            tile, tile.stride(0), labels, bias if bias is not None else tile,
            stats if stats is not None else lp, stats.stride(0) if stats is not None else 0,
            lp, ent if ent.numel() else lp, sq if sq.numel() else lp,
            mean if mean.numel() else lp, top1.view(torch.int8) if top1.numel() else lp, log_z,
            col0, n_cols, vocab, o.ignore_index, o.scale, o.cap, o.inv_t,
            FIRST=first, LAST=last, **flags, **cfg,
        )  # fmt: skip

    # The first chunk's launch reads only the tile, so timing may repeat it.
    key = ("logprob_fwd", tile.dtype, tile.device, next_pow2(n_cols), *flags.values())
    launch(choose(key, configs(FWD_CONFIGS, n_cols), launch, tile.device, first))


def _bwd_tile_triton(tile, labels, bias, log_z, ent, glp, gent, col0, o, dest=None):
    """d(out)/d(logits) of one tile, into `dest` (the tile itself when None)."""
    n, n_cols = tile.shape
    dest = tile if dest is None else dest
    flags = {
        "HAS_BIAS": bias is not None, "HAS_SOFTCAP": o.has_softcap, "HAS_GLP": glp is not None,
        "HAS_GENT": gent is not None,
    }  # fmt: skip

    def launch(cfg, rows=n, out=dest):
        _bwd_kernel[(rows, cdiv(n_cols, cfg["BLOCK"]))](
            tile, tile.stride(0), out, out.stride(0), labels,
            bias if bias is not None else tile, log_z, ent if ent is not None else log_z,
            glp if glp is not None else log_z, gent if gent is not None else log_z,
            col0, n_cols, o.ignore_index, o.scale, o.cap, o.inv_t, **flags, **cfg,
        )  # fmt: skip

    key = ("logprob_bwd", tile.dtype, tile.device, next_pow2(n_cols), *flags.values())
    candidates = configs(BWD_CONFIGS, n_cols)
    cfg = cached_config(key)
    if cfg is None and tile.is_cuda and len(candidates) > 1:
        # In place, a launch consumes its input: the configs are timed on the first rows,
        # written to a scratch buffer.
        rows = min(n, TUNE_ROWS)
        scratch = torch.empty(rows, n_cols, dtype=tile.dtype, device=tile.device)
        cfg = choose(key, candidates, lambda c: launch(c, rows, scratch), tile.device, True)
        del scratch
    launch(cfg or candidates[0])


# --- The same per tile in torch (CPU without the interpreter) ---------------------------------


def _torch_z(tile, bias, col0, o):
    x = tile.float()
    if bias is not None:
        x = x + bias[col0 : col0 + tile.shape[1]].float()
    y = x * o.scale
    if o.has_softcap:
        t = torch.tanh(y / o.cap)
        return o.cap * t * o.inv_t, t
    return y * o.inv_t, None


def _fwd_tile_torch(tile, labels, bias, stats, outs, col0, vocab, o, first, last):
    z, _ = _torch_z(tile, bias, col0, o)
    n_cols = z.shape[1]
    local = labels - col0
    hit = (local >= 0) & (local < n_cols)
    m = z.amax(1)
    e = torch.exp(z - m[:, None])
    s = e.sum(1)
    xs = (e * z).sum(1)
    sq = (e * e).sum(1)
    zs = z.sum(1)
    before = torch.arange(n_cols, device=z.device)[None, :] < local[:, None]
    mbt = z.masked_fill(~before, -torch.inf).amax(1)
    zt = z.gather(1, local.clamp(0, n_cols - 1)[:, None])[:, 0]
    zt = torch.where(hit, zt, torch.nan)
    if not first:
        m_old = stats[0]
        m_all = torch.maximum(m_old, m)
        a_old, a_new = torch.exp(m_old - m_all), torch.exp(m - m_all)
        s = stats[1] * a_old + s * a_new
        xs = stats[2] * a_old + xs * a_new
        sq = stats[3] * a_old**2 + sq * a_new**2
        zs = zs + stats[4]
        mbt = torch.maximum(mbt, stats[5])
        zt = torch.where(hit, zt, stats[6])
        m = m_all
    if not last:
        for i, v in enumerate((m, s, xs, sq, zs, mbt, zt)):
            stats[i].copy_(v)
        return
    lp, ent, sq_out, mean, top1, log_z = outs
    valid = labels != o.ignore_index
    lz = m + torch.log(s)
    log_z.copy_(lz)
    lp.copy_(torch.where(valid, zt - lz, 0.0))
    if ent.numel():
        ent.copy_(torch.where(valid, lz - xs / s, 0.0))
    if sq_out.numel():
        sq_out.copy_(torch.where(valid, torch.log(sq) - 2 * torch.log(s), 0.0))
    if mean.numel():
        mean.copy_(torch.where(valid, zs / vocab, 0.0))
    if top1.numel():
        top1.copy_(valid & (zt >= m) & (zt > mbt))


def _bwd_tile_torch(tile, labels, bias, log_z, ent, glp, gent, col0, o, dest=None):
    z, t = _torch_z(tile, bias, col0, o)
    valid = labels != o.ignore_index
    logp = z - log_z[:, None]
    p = torch.exp(logp)
    a = torch.where(valid, glp.float(), 0.0) if glp is not None else torch.zeros_like(log_z)
    g = -p * a[:, None]
    if gent is not None:
        b = torch.where(valid, gent.float(), 0.0)
        g = g - p * b[:, None] * (logp + ent[:, None])
    cols = torch.arange(col0, col0 + z.shape[1], device=z.device)
    g = g + torch.where(cols[None, :] == labels[:, None], a[:, None], 0.0)
    g = g * (o.scale * o.inv_t)
    if t is not None:
        g = g * (1 - t * t)
    (tile if dest is None else dest).copy_(g)


# --- The chunked drivers ----------------------------------------------------------------------


class _Opts(NamedTuple):
    scale: float
    cap: float
    inv_t: float
    has_softcap: bool
    bits: int
    ignore_index: int
    tile: tuple[int, int]  # (0, 0): from MAX_TILE_BYTES


def _opts(temperature, softcap, logit_scale, bits, ignore_index, tile_rows, tile_cols) -> _Opts:
    return _Opts(
        float(logit_scale), float(softcap) if softcap else 1.0, 1.0 / float(temperature),
        bool(softcap), int(bits), int(ignore_index), (int(tile_rows), int(tile_cols)),
    )  # fmt: skip


def _tile(o: _Opts, n: int, vocab: int, itemsize: int) -> tuple[int, int]:
    rows, cols = o.tile
    if rows > 0 and cols > 0:
        return min(rows, max(1, n)), min(cols, vocab)
    return tile_shape(n, vocab, itemsize)


def _mm_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    """out (fp32) = or += a @ b, the product summed in fp32 and never rounded to a's dtype."""
    if a.dtype != torch.float32 and a.is_cuda and _MM_OUT_DTYPE:
        if accumulate:
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        else:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
        return
    if a.dtype != torch.float32:
        a, b = a.float(), b.float()
    if accumulate:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


def back_matmuls(g, w, h, r0, c0, c1, dh, acc, dw, dw_acc, db) -> None:
    """Multiply one d(logits) tile `g` (token rows from r0, vocabulary columns c0:c1) back: into
    d(hidden) (`dh`, this tile's rows, or the fp32 `acc` summed over vocabulary chunks),
    d(weight) (`dw`'s chunk rows, or the fp32 `dw_acc` summed over token chunks) and d(bias); a
    None target is not needed."""
    if dh is not None:
        if acc is None:  # one vocabulary chunk: no sum across chunks
            torch.mm(g, w, out=dh)
        else:
            _mm_f32(g, w, acc, accumulate=c0 > 0)
    if dw is not None:
        if dw_acc is not None:
            _mm_f32(g.t(), h, dw_acc[c0:c1], accumulate=r0 > 0)
        elif dw.dtype == g.dtype:
            torch.mm(g.t(), h, out=dw[c0:c1])
        else:  # an fp32 product rounded to the weight's lower precision once
            dw[c0:c1].copy_(g.t() @ h)
    if db is not None:
        db[c0:c1] += g.sum(0, dtype=torch.float32)


def _buffer(rows: int, cols: int, dtype, device) -> torch.Tensor:
    return torch.empty(rows, cols, dtype=dtype, device=device)


def _tiles(n: int, vocab: int, rows: int, cols: int) -> Iterator[tuple[int, int, int, int]]:
    """(r0, r1, c0, c1) per logits tile, tokens outer, vocabulary inner."""
    for r0 in range(0, n, rows):
        for c0 in range(0, vocab, cols):
            yield r0, min(n, r0 + rows), c0, min(vocab, c0 + cols)


def forward(hidden, weight, bias, labels, o: _Opts, keep: bool = False):
    """(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1, log_z, kept), fields not
    asked for empty; log_z is kept for the backward, and with `keep` the logits too (flat
    [N·V]; empty without). Kept logits are made whole-row: one matmul and one fold per block
    of rows, no statistics carried across vocabulary chunks."""
    n, vocab = hidden.shape[0], weight.shape[0]
    dev, cdtype = hidden.device, hidden.dtype
    f32 = {"dtype": torch.float32, "device": dev}
    lp, log_z = torch.empty(n, **f32), torch.empty(n, **f32)
    ent = torch.empty(n if o.bits & ENTROPY else 0, **f32)
    sq = torch.empty(n if o.bits & SUM_SQ else 0, **f32)
    mean = torch.empty(n if o.bits & MEAN else 0, **f32)
    top1 = torch.empty(n if o.bits & TOP1 else 0, dtype=torch.bool, device=dev)
    outs = (lp, ent, sq, mean, top1, log_z)
    kept = torch.empty(n * vocab if keep else 0, dtype=cdtype, device=dev)
    if n == 0:
        return (*outs, kept)
    rows, cols = _tile(o, n, vocab, hidden.element_size())
    if keep:
        cols = vocab
    stats = torch.empty(7, n, **f32) if cols < vocab else None
    fold = _fwd_tile_triton if use_triton(hidden) else _fwd_tile_torch
    buf = None if keep else _buffer(min(rows, n), cols, cdtype, dev)
    for r0, r1, c0, c1 in _tiles(n, vocab, rows, cols):
        tile = kept.view(n, vocab)[r0:r1] if keep else buf[: r1 - r0, : c1 - c0]
        part = tuple(t[r0:r1] if t.numel() else t for t in outs)
        st = None if stats is None else stats[:, r0:r1]
        torch.mm(hidden[r0:r1], weight[c0:c1].to(cdtype).t(), out=tile)
        fold(tile, labels[r0:r1], bias, st, part, c0, vocab, o, c0 == 0, c1 == vocab)
    return (*outs, kept)


def backward(hidden, weight, bias, labels, log_z, ent, glp, gent, need, o: _Opts, kept=None):
    """(d hidden, d weight, d bias), each None where `need` says no: the tiles recomputed (or
    read from `kept`, the forward's logits, left intact), made d(out)/d(logits) and multiplied
    back (fp32 accumulation throughout)."""
    need_x, need_w, need_b = need
    n, vocab = hidden.shape[0], weight.shape[0]
    dev, cdtype = hidden.device, hidden.dtype
    dh = torch.empty_like(hidden) if need_x else None
    dw = None
    if need_w:  # no tokens: nothing is summed into it
        dw = torch.zeros_like(weight) if n == 0 else torch.empty_like(weight)
    db = torch.zeros(vocab, dtype=torch.float32, device=dev) if need_b else None
    rows, cols = _tile(o, n, vocab, hidden.element_size())
    split_rows, split_cols = rows < n, cols < vocab
    # d(hidden) sums over vocabulary chunks, d(weight) over token chunks: in fp32, into the
    # gradient itself where that is fp32, else into an fp32 buffer rounded once at the end.
    # With all tokens in one tile (the usual case) d(weight) needs no sum: each chunk's rows
    # come from one matmul, summed in fp32 by cuBLAS and rounded once.
    dh_acc = None
    if need_x and split_cols and cdtype != torch.float32:
        dh_acc = torch.empty(min(rows, n), hidden.shape[1], dtype=torch.float32, device=dev)
    dw_acc = None
    if need_w and (split_rows or (weight.dtype == torch.float32 and cdtype != torch.float32)):
        dw_acc = dw if weight.dtype == torch.float32 else torch.empty_like(dw, dtype=torch.float32)
    grad = _bwd_tile_triton if use_triton(hidden) else _bwd_tile_torch
    glp = None if glp is None else glp.float().contiguous()
    gent = None if gent is None else gent.float().contiguous()
    buf = _buffer(min(rows, n), cols, cdtype, dev) if n else None
    logits = kept.view(n, vocab) if kept is not None and kept.numel() else None
    acc = None
    for r0, r1, c0, c1 in _tiles(n, vocab, rows, cols):
        view = None if logits is None else logits[r0:r1, c0:c1]  # rows V apart
        h = hidden[r0:r1]
        if c0 == 0:
            acc = None
            if need_x and split_cols:
                acc = dh[r0:r1] if dh_acc is None else dh_acc[: r1 - r0]
        w = weight[c0:c1].to(cdtype)
        tile = buf[: r1 - r0, : c1 - c0]
        if view is None:
            torch.mm(h, w.t(), out=tile)
        grad(
            tile if view is None else view, labels[r0:r1], bias, log_z[r0:r1],
            None if ent is None else ent[r0:r1], None if glp is None else glp[r0:r1],
            None if gent is None else gent[r0:r1], c0, o, tile,
        )  # fmt: skip
        back_matmuls(tile, w, h, r0, c0, c1, None if dh is None else dh[r0:r1], acc,
                     dw, dw_acc, db)  # fmt: skip
        if dh_acc is not None and c1 == vocab:
            dh[r0:r1].copy_(acc)
    if dw_acc is not None and dw_acc is not dw:
        dw.copy_(dw_acc)
    return dh, dw, None if db is None else db.to(bias.dtype)


# --- Custom ops (torch.compile) and the eager autograd Function -------------------------------


def _empty_outputs(hidden, weight, bits, keep):
    n = hidden.shape[0]
    f32 = {"dtype": torch.float32}
    return (
        hidden.new_empty(n, **f32),
        hidden.new_empty(n if bits & ENTROPY else 0, **f32),
        hidden.new_empty(n if bits & SUM_SQ else 0, **f32),
        hidden.new_empty(n if bits & MEAN else 0, **f32),
        hidden.new_empty(n if bits & TOP1 else 0, dtype=torch.bool),
        hidden.new_empty(n, **f32),
        hidden.new_empty(n * weight.shape[0] if keep else 0),
    )


@torch.library.custom_op(op_name("logprob_fwd"), mutates_args=())
def logprob_fwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],  # noqa: UP045 - torch.library parses typing.Optional
    labels: torch.Tensor,
    temperature: float,
    softcap: Optional[float],  # noqa: UP045
    logit_scale: float,
    outputs: int,
    ignore_index: int,
    tile_rows: int,
    tile_cols: int,
    keep: bool,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:
    o = _opts(temperature, softcap, logit_scale, outputs, ignore_index, tile_rows, tile_cols)
    with torch.autocast(hidden.device.type, enabled=False):
        return forward(hidden, weight, bias, labels, o, keep)


@logprob_fwd.register_fake
def _(hidden, weight, bias, labels, temperature, softcap, logit_scale, outputs, ignore_index,
      tile_rows, tile_cols, keep):  # fmt: skip
    return _empty_outputs(hidden, weight, outputs, keep)


@torch.library.custom_op(op_name("logprob_bwd"), mutates_args=())
def logprob_bwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],  # noqa: UP045
    labels: torch.Tensor,
    log_z: torch.Tensor,
    entropy: Optional[torch.Tensor],  # noqa: UP045
    grad_log_probs: Optional[torch.Tensor],  # noqa: UP045
    grad_entropy: Optional[torch.Tensor],  # noqa: UP045
    temperature: float,
    softcap: Optional[float],  # noqa: UP045
    logit_scale: float,
    ignore_index: int,
    tile_rows: int,
    tile_cols: int,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
    kept: Optional[torch.Tensor],  # noqa: UP045
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    o = _opts(temperature, softcap, logit_scale, 0, ignore_index, tile_rows, tile_cols)
    with torch.autocast(hidden.device.type, enabled=False):
        dh, dw, db = backward(
            hidden, weight, bias, labels, log_z, entropy, grad_log_probs, grad_entropy,
            (need_hidden, need_weight, need_bias and bias is not None), o, kept,
        )  # fmt: skip
    return (
        hidden.new_empty(0) if dh is None else dh,
        weight.new_empty(0) if dw is None else dw,
        hidden.new_empty(0) if db is None else db,
    )


@logprob_bwd.register_fake
def _(hidden, weight, bias, labels, log_z, entropy, grad_log_probs, grad_entropy, temperature,
      softcap, logit_scale, ignore_index, tile_rows, tile_cols, need_hidden, need_weight,
      need_bias, kept):  # fmt: skip
    return (
        torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
        torch.empty_like(weight) if need_weight else weight.new_empty(0),
        torch.empty_like(bias) if need_bias and bias is not None else hidden.new_empty(0),
    )


def _live(g: torch.Tensor | None) -> torch.Tensor | None:
    """An upstream gradient, or None where there is none (a compiled graph passes an empty or
    a missing one for an unused output)."""
    return None if g is None or g.numel() == 0 else g


def _op_setup(ctx, inputs, output):
    hidden, weight, bias, labels, temperature, softcap, logit_scale, bits, ignore, tr, tc, keep = (
        inputs
    )
    _lp, ent, _sq, _mean, _top1, log_z, kept = output
    ctx.save_for_backward(hidden, weight, bias, labels, log_z, ent if bits & ENTROPY else None,
                          kept if keep else None)  # fmt: skip
    ctx.args = (temperature, softcap, logit_scale, ignore, tr, tc)


def _op_backward(ctx, glp, gent, *_unused):
    hidden, weight, bias, labels, log_z, ent, kept = ctx.saved_tensors
    glp, gent = _live(glp), _live(gent) if ent is not None else None
    need = ctx.needs_input_grad[:3]
    if (glp is None and gent is None) or not any(need):
        return (None,) * 12
    temperature, softcap, logit_scale, ignore, tr, tc = ctx.args
    dh, dw, db = logprob_bwd(
        hidden, weight, bias, labels, log_z, ent, glp, gent, temperature, softcap, logit_scale,
        ignore, tr, tc, need[0], need[1], bool(need[2]) and bias is not None, kept,
    )  # fmt: skip
    return (
        dh if need[0] else None,
        dw if need[1] else None,
        db if need[2] and bias is not None else None,
        *(None,) * 9,
    )


logprob_fwd.register_autograd(_op_backward, setup_context=_op_setup)


class _LogProbFunction(torch.autograd.Function):
    """The eager path: the same drivers without the custom-op dispatch on every call."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, o: _Opts, save: bool, keep: bool):
        lp, ent, sq, mean, top1, log_z, kept = forward(
            hidden, weight, bias, labels, o, keep and save
        )
        ctx.set_materialize_grads(False)  # an output without a gradient costs no zero-filled one
        ctx.o = o
        if save:
            ctx.save_for_backward(hidden, weight, bias, labels, log_z,
                                  ent if o.bits & ENTROPY else None,
                                  kept if kept.numel() else None)  # fmt: skip
        ctx.mark_non_differentiable(sq, mean, top1)
        if not o.bits & ENTROPY:
            ctx.mark_non_differentiable(ent)
        return lp, ent, sq, mean, top1

    @staticmethod
    def backward(ctx, glp, gent, *_unused):
        if glp is None and gent is None:
            return (None,) * 7
        hidden, weight, bias, labels, log_z, ent, kept = ctx.saved_tensors
        need = tuple(ctx.needs_input_grad[:3])
        need = (need[0], need[1], need[2] and bias is not None)
        if ent is None:
            gent = None
        with torch.autocast(hidden.device.type, enabled=False):
            dh, dw, db = backward(
                hidden, weight, bias, labels, log_z, ent, glp, gent, need, ctx.o, kept
            )
        return dh, dw, db, None, None, None, None


def _bits(outputs) -> int:
    if isinstance(outputs, str):
        outputs = (outputs,)
    unknown = [name for name in outputs if name not in OUTPUTS]
    if unknown:
        raise ValueError(f"outputs must be among {OUTPUTS}, got {unknown}")
    return sum(_BITS[name] for name in set(outputs) if name in _BITS)


def fused_linear_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    outputs: tuple[str, ...] = ("log_probs",),
    ignore_index: int = -100,
    tile: tuple[int, int] | None = None,
    keep_logits: bool | None = None,
) -> LogProbOutputs:
    """Per-token log-probabilities of `labels` under ``hidden[..., H] @ weight[V, H].T (+ bias)``
    with TRL's transform (logit_scale, softcap, then temperature), and the other fields named in
    `outputs`; each shaped like `labels`, None where not asked for. log_probs and entropy carry
    gradients to hidden, weight and bias; the others none. `tile` = (rows, cols) overrides the
    logits tile (tests, tuning). `keep_logits` holds the [N, V] logits for the backward, which
    then skips a matmul (None: when they fit KERNELS_LOGPROB_KEEP_BYTES)."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal hidden shape without its last "
            f"dimension, {tuple(hidden.shape[:-1])}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be [V, H] with H = hidden.shape[-1] = {hidden.shape[-1]}, "
            f"got {tuple(weight.shape)}"
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    if not temperature or temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if is_vocab_sharded(weight):  # a colwise (tensor-parallel) head: each rank keeps its rows
        from .vocab_parallel_logprob import vocab_parallel_logprob

        return vocab_parallel_logprob(
            hidden, weight, labels, bias, temperature=temperature, softcap=softcap,
            logit_scale=logit_scale, outputs=outputs, ignore_index=ignore_index,
        )  # fmt: skip
    bits = _bits(outputs)
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        # The logits are made in autocast's dtype, as F.linear would; the weight is cast per
        # vocabulary chunk inside the op (no full copy of it).
        hidden = hidden.to(torch.get_autocast_dtype(device_type))
    if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"hidden must be fp32, bf16 or fp16, got {hidden.dtype}")
    rows = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    flat_labels = labels.reshape(-1).to(device=hidden.device, dtype=torch.int64).contiguous()
    weight = weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    tr, tc = tile if tile is not None else (0, 0)
    cap = float(softcap) if softcap else None
    if keep_logits is None:
        keep_logits = 0 < rows.shape[0] * weight.shape[0] * rows.element_size() <= KEEP_LOGITS_BYTES
    if torch.compiler.is_compiling():
        lp, ent, sq, mean, top1, *_ = logprob_fwd(
            rows, weight, bias, flat_labels, float(temperature), cap, float(logit_scale), bits,
            int(ignore_index), int(tr), int(tc), bool(keep_logits),
        )  # fmt: skip
        sq, mean = sq.detach(), mean.detach()  # no gradient, as in the eager path
    else:
        o = _opts(temperature, cap, logit_scale, bits, ignore_index, tr, tc)
        save = needs_grad(rows, weight, bias)
        lp, ent, sq, mean, top1 = _LogProbFunction.apply(
            rows, weight, bias, flat_labels, o, save, bool(keep_logits)
        )
    shape = labels.shape
    return LogProbOutputs(
        lp.view(shape),
        ent.view(shape) if bits & ENTROPY else None,
        sq.view(shape) if bits & SUM_SQ else None,
        mean.view(shape) if bits & MEAN else None,
        top1.view(shape) if bits & TOP1 else None,
    )


TRL_OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def trl_chunked_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    chunk_size: int,
    final_logit_softcapping: float | None = None,
    logit_scale: float = 1.0,
    outputs: tuple[str, ...] = TRL_OPTIONAL_OUTPUTS,
) -> tuple:
    """Stands in for TRL 1.16's ``ChunkedLogProbFunction.apply`` (same arguments, same 5-tuple
    (log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1), None where not asked for).
    `chunk_size` (TRL's vocabulary tile width) is not needed: the tile comes from the memory
    budget. A target of -100 gives zeros (TRL's callers never pass one)."""
    del chunk_size
    return tuple(
        fused_linear_logprob(
            hidden, weight, targets, bias, temperature=temperature,
            softcap=final_logit_softcapping, logit_scale=logit_scale,
            outputs=("log_probs", *outputs),
        )
    )  # fmt: skip
