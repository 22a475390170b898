"""Chunked distillation divergences between a student head and a teacher head, per token, without
either model's [N, V] logits.

Each model's logits go through TRL's transform (logit scale, soft-capping, then the shared
temperature); with p_s, p_t their softmaxes, per token:

    forward_kl  KL(p_t || p_s)                       (TRL's beta = 0)
    reverse_kl  KL(p_s || p_t)                       (TRL's beta = 1)
    jsd         beta KL(p_t || m) + (1 - beta) KL(p_s || m),  m = (1 - beta) p_s + beta p_t
    tvd         0.5 sum |p_s - p_t|

as TRL 1.16's ``ChunkedDivergenceFunction`` (and its GKD trainer's ``generalized_jsd_loss``)
defines them, in fp32, with the student's entropy alongside (no gradient). The gradient flows to
the student's hidden states, weight and bias only; rows marked in ``ignore_mask`` give 0 and a
zero gradient. No temperature² factor (TRL has none).

The layout is logprob.py's: fp32 logit tiles (as TRL's: a bf16 rounding of the logits would
show in a divergence between close distributions) of all tokens x an aligned vocabulary chunk,
sized from ``MAX_TILE_BYTES`` for the two of them. A first pass folds both models' tiles into
online statistics (the KLs finish there: sum p_t (z_t - z_s) and its mirror fold online); the
JSD and the TVD need both normalisers per element, so they take a second pass. The backward
recomputes both tiles, writes d(divergence)/d(student logits) in the inputs' dtype and feeds it
to the d(hidden) and d(weight) matmuls (d(weight) from one matmul per vocabulary chunk when all
tokens fit one tile: fp32 sums inside cuBLAS, no [V, H] fp32 buffer).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ._common import cdiv, fast_launch, needs_grad, next_pow2, op_name, use_triton
from ._triton import tl, triton
from .logprob import _MM_OUT_DTYPE, _transform, back_matmuls, choose, configs, tile_shape

KINDS = ("forward_kl", "reverse_kl", "jsd", "tvd")
FKL, RKL, JSD, TVD = 0, 1, 2, 3
# Both fp32 tiles together (TRL's pair of 4096 x 32768 fp32 tiles is the same 1 GiB).
MAX_TILE_BYTES = 1024 * 2**20


@triton.jit
def _load_z(ptr, bias_ptr, col0, cols, mask, scale, cap, inv_t,
            HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr):  # fmt: skip
    x = tl.load(ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(bias_ptr + col0 + cols, mask=mask, other=0.0).to(tl.float32)
    return _transform(x, scale, cap, inv_t, HAS_SOFTCAP)


@fast_launch
@triton.jit
def _stats_kernel(
    s_ptr, t_ptr, stride, sb_ptr, tb_ptr, ign_ptr, st_ptr, stride_st,
    div_ptr, ent_ptr, slz_ptr, tlz_ptr,
    col0, n_cols, s_scale, s_cap, t_scale, t_cap, inv_t,
    MODE: tl.constexpr, S_BIAS: tl.constexpr, T_BIAS: tl.constexpr, S_SOFTCAP: tl.constexpr,
    T_SOFTCAP: tl.constexpr, HAS_IGNORE: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Fold one row of both tiles into online statistics: per model max and sum e (e = exp(z -
    max)), the student's sum e_s z_s (entropy) and, for the KLs, sum e_t (z_t - z_s) or
    sum e_s (z_s - z_t). Stats rows: s max, s sum, s sum e z, t max, t sum, gap."""
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * stride
    t_row = t_ptr + row * stride
    offs = tl.arange(0, BLOCK)
    ms = -float("inf")
    mt = -float("inf")
    ss_v = tl.zeros((BLOCK,), tl.float32)
    sx_v = tl.zeros((BLOCK,), tl.float32)
    st_v = tl.zeros((BLOCK,), tl.float32)
    gap_v = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        mask = cols < n_cols
        zs = _load_z(s_row, sb_ptr, col0, cols, mask, s_scale, s_cap, inv_t, S_BIAS, S_SOFTCAP)
        zt = _load_z(t_row, tb_ptr, col0, cols, mask, t_scale, t_cap, inv_t, T_BIAS, T_SOFTCAP)
        zsm = tl.where(mask, zs, -float("inf"))
        ztm = tl.where(mask, zt, -float("inf"))
        ms_new = tl.maximum(ms, tl.max(zsm, axis=0))
        mt_new = tl.maximum(mt, tl.max(ztm, axis=0))
        rs = tl.exp(ms - ms_new)
        rt = tl.exp(mt - mt_new)
        es = tl.exp(zsm - ms_new)
        et = tl.exp(ztm - mt_new)
        ss_v = ss_v * rs + es
        sx_v = sx_v * rs + es * zs
        st_v = st_v * rt + et
        if MODE == 0:
            gap_v = gap_v * rt + et * (zt - zs)
        if MODE == 1:
            gap_v = gap_v * rs + es * (zs - zt)
        ms = ms_new
        mt = mt_new
    ss = tl.sum(ss_v, axis=0)
    sx = tl.sum(sx_v, axis=0)
    st = tl.sum(st_v, axis=0)
    gap = tl.sum(gap_v, axis=0)
    p = st_ptr + row
    if not FIRST:
        ms_old = tl.load(p)
        mt_old = tl.load(p + 3 * stride_st)
        ms_all = tl.maximum(ms_old, ms)
        mt_all = tl.maximum(mt_old, mt)
        as_old = tl.exp(ms_old - ms_all)
        as_new = tl.exp(ms - ms_all)
        at_old = tl.exp(mt_old - mt_all)
        at_new = tl.exp(mt - mt_all)
        ss = tl.load(p + stride_st) * as_old + ss * as_new
        sx = tl.load(p + 2 * stride_st) * as_old + sx * as_new
        st = tl.load(p + 4 * stride_st) * at_old + st * at_new
        if MODE == 0:
            gap = tl.load(p + 5 * stride_st) * at_old + gap * at_new
        if MODE == 1:
            gap = tl.load(p + 5 * stride_st) * as_old + gap * as_new
        ms = ms_all
        mt = mt_all
    if LAST:
        valid = True
        if HAS_IGNORE:
            valid = tl.load(ign_ptr + row) == 0
        s_lz = ms + tl.log(ss)
        t_lz = mt + tl.log(st)
        tl.store(slz_ptr + row, s_lz)
        tl.store(tlz_ptr + row, t_lz)
        tl.store(ent_ptr + row, tl.where(valid, s_lz - sx / ss, 0.0))
        if MODE == 0:
            tl.store(div_ptr + row, tl.where(valid, gap / st - t_lz + s_lz, 0.0))
        if MODE == 1:
            tl.store(div_ptr + row, tl.where(valid, gap / ss - s_lz + t_lz, 0.0))
    else:
        tl.store(p, ms)
        tl.store(p + stride_st, ss)
        tl.store(p + 2 * stride_st, sx)
        tl.store(p + 3 * stride_st, mt)
        tl.store(p + 4 * stride_st, st)
        if MODE <= 1:
            tl.store(p + 5 * stride_st, gap)


@triton.jit
def _log_mix(log_ps, log_pt, log_1mb, log_b):
    """log m = log((1 - beta) p_s + beta p_t), from the two log-probabilities."""
    a = log_ps + log_1mb
    b = log_pt + log_b
    top = tl.maximum(a, b)
    return top + tl.log(tl.exp(a - top) + tl.exp(b - top))


@fast_launch
@triton.jit
def _second_kernel(
    s_ptr, t_ptr, stride, sb_ptr, tb_ptr, ign_ptr, slz_ptr, tlz_ptr, div_ptr, aux_ptr,
    col0, n_cols, beta, log_1mb, log_b, s_scale, s_cap, t_scale, t_cap, inv_t,
    MODE: tl.constexpr, S_BIAS: tl.constexpr, T_BIAS: tl.constexpr, S_SOFTCAP: tl.constexpr,
    T_SOFTCAP: tl.constexpr, HAS_IGNORE: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """The second pass of the JSD (divergence, and KL(p_s || m) for the backward) or the TVD
    (divergence, and sum sign(p_s - p_t) p_s for the backward), summed over chunks."""
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * stride
    t_row = t_ptr + row * stride
    s_lz = tl.load(slz_ptr + row)
    t_lz = tl.load(tlz_ptr + row)
    offs = tl.arange(0, BLOCK)
    d_v = tl.zeros((BLOCK,), tl.float32)
    a_v = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        mask = cols < n_cols
        zs = _load_z(s_row, sb_ptr, col0, cols, mask, s_scale, s_cap, inv_t, S_BIAS, S_SOFTCAP)
        zt = _load_z(t_row, tb_ptr, col0, cols, mask, t_scale, t_cap, inv_t, T_BIAS, T_SOFTCAP)
        log_ps = zs - s_lz
        log_pt = zt - t_lz
        ps = tl.where(mask, tl.exp(log_ps), 0.0)
        pt = tl.where(mask, tl.exp(log_pt), 0.0)
        if MODE == 2:
            log_m = _log_mix(log_ps, log_pt, log_1mb, log_b)
            kl_s = ps * (log_ps - log_m)
            d_v += beta * pt * (log_pt - log_m) + (1.0 - beta) * kl_s
            a_v += kl_s
        else:
            diff = ps - pt
            d_v += 0.5 * tl.abs(diff)
            a_v += tl.where(diff > 0, ps, tl.where(diff < 0, -ps, 0.0))
    d = tl.sum(d_v, axis=0)
    a = tl.sum(a_v, axis=0)
    if not FIRST:
        d += tl.load(div_ptr + row)
        a += tl.load(aux_ptr + row)
    if LAST and HAS_IGNORE:
        d = tl.where(tl.load(ign_ptr + row) == 0, d, 0.0)
    tl.store(div_ptr + row, d)
    tl.store(aux_ptr + row, a)


@fast_launch
@triton.jit
def _bwd_kernel(
    s_ptr, t_ptr, stride, g_ptr, g_stride, sb_ptr, tb_ptr, ign_ptr, slz_ptr, tlz_ptr, aux_ptr,
    gdiv_ptr, col0, n_cols, beta, log_1mb, log_b, s_scale, s_cap, t_scale, t_cap, inv_t,
    MODE: tl.constexpr, S_BIAS: tl.constexpr, T_BIAS: tl.constexpr, S_SOFTCAP: tl.constexpr,
    T_SOFTCAP: tl.constexpr, HAS_IGNORE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """d(divergence)/d(student logits) for one block of a row, times the row's upstream
    gradient, written to g (the student tile itself, or a buffer in the inputs' dtype)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g_row = tl.load(gdiv_ptr + row).to(tl.float32)
    if HAS_IGNORE:
        g_row = tl.where(tl.load(ign_ptr + row) == 0, g_row, 0.0)
    x = tl.load(s_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    if S_BIAS:
        x += tl.load(sb_ptr + col0 + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * s_scale
    if S_SOFTCAP:
        th = 1.0 - 2.0 / (tl.exp(2.0 * y / s_cap) + 1.0)
        zs = s_cap * th * inv_t
    else:
        zs = y * inv_t
    zt = _load_z(t_ptr + row * stride, tb_ptr, col0, cols, mask, t_scale, t_cap, inv_t,
                 T_BIAS, T_SOFTCAP)  # fmt: skip
    log_ps = zs - tl.load(slz_ptr + row)
    log_pt = zt - tl.load(tlz_ptr + row)
    ps = tl.exp(log_ps)
    if MODE == 0:
        grad = ps - tl.exp(log_pt)
    elif MODE == 1:
        grad = ps * (log_ps - log_pt - tl.load(aux_ptr + row))
    elif MODE == 2:
        log_m = _log_mix(log_ps, log_pt, log_1mb, log_b)
        grad = (1.0 - beta) * ps * (log_ps - log_m - tl.load(aux_ptr + row))
    else:
        diff = ps - tl.exp(log_pt)
        sgn = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
        grad = 0.5 * ps * (sgn - tl.load(aux_ptr + row))
    grad = grad * (g_row * inv_t * s_scale)
    if S_SOFTCAP:
        grad = grad * (1.0 - th * th)
    tl.store(g_ptr + row * g_stride + cols, grad.to(g_ptr.dtype.element_ty), mask=mask)


# (BLOCK, num_warps) candidates, timed on the GPU as logprob.py's (two tiles are read per
# element here, so the smaller blocks come first).
STATS_CONFIGS = [(2048, 8), (1024, 4), (4096, 16), (2048, 4)]
BWD_CONFIGS = [(2048, 8), (4096, 8), (1024, 4), (4096, 16)]


class _Opts(NamedTuple):
    mode: int
    beta: float
    inv_t: float
    s_scale: float
    s_cap: float
    s_has_cap: bool
    t_scale: float
    t_cap: float
    t_has_cap: bool
    tile: tuple[int, int]


def _opts(mode, beta, temperature, s_scale, s_cap, t_scale, t_cap, tile_rows, tile_cols):
    return _Opts(
        int(mode), float(beta), 1.0 / float(temperature), float(s_scale),
        float(s_cap) if s_cap else 1.0, bool(s_cap), float(t_scale),
        float(t_cap) if t_cap else 1.0, bool(t_cap), (int(tile_rows), int(tile_cols)),
    )  # fmt: skip


def _mix_logs(o: _Opts) -> tuple[float, float]:
    """log(1 - beta), log(beta) for the JSD's mixture (finite placeholders elsewhere)."""
    import math

    if o.mode != JSD:
        return 0.0, 0.0
    return math.log1p(-o.beta), math.log(o.beta)


def _kernel_common(o: _Opts, sb, tb, ign):
    return {
        "MODE": o.mode, "S_BIAS": sb is not None, "T_BIAS": tb is not None,
        "S_SOFTCAP": o.s_has_cap, "T_SOFTCAP": o.t_has_cap, "HAS_IGNORE": ign is not None,
    }  # fmt: skip


def _scalars(o: _Opts):
    return (o.s_scale, o.s_cap, o.t_scale, o.t_cap, o.inv_t)


def _key(name, tile, o, sb, tb, ign, n_cols):
    return (name, tile.device, next_pow2(n_cols), *_kernel_common(o, sb, tb, ign).values())


def _stats_triton(s_tile, t_tile, sb, tb, ign, stats, outs, col0, o, first, last):
    n, n_cols = s_tile.shape
    div, ent, s_lz, t_lz = outs

    def launch(cfg):
        _stats_kernel[(n,)](
            s_tile, t_tile, s_tile.stride(0), sb if sb is not None else s_tile,
            tb if tb is not None else s_tile, ign if ign is not None else s_tile,
            stats if stats is not None else div, stats.stride(0) if stats is not None else 0,
            div, ent, s_lz, t_lz, col0, n_cols, *_scalars(o), **_kernel_common(o, sb, tb, ign),
            FIRST=first, LAST=last, **cfg,
        )  # fmt: skip

    key = _key("divergence_stats", s_tile, o, sb, tb, ign, n_cols)
    launch(choose(key, configs(STATS_CONFIGS, n_cols), launch, s_tile.device, first))


def _second_triton(s_tile, t_tile, sb, tb, ign, s_lz, t_lz, div, aux, col0, o, first, last):
    n, n_cols = s_tile.shape

    def launch(cfg):
        _second_kernel[(n,)](
            s_tile, t_tile, s_tile.stride(0), sb if sb is not None else s_tile,
            tb if tb is not None else s_tile, ign if ign is not None else s_tile, s_lz, t_lz,
            div, aux, col0, n_cols, o.beta, *_mix_logs(o), *_scalars(o),
            **_kernel_common(o, sb, tb, ign), FIRST=first, LAST=last, **cfg,
        )  # fmt: skip

    key = _key("divergence_second", s_tile, o, sb, tb, ign, n_cols)
    launch(choose(key, configs(STATS_CONFIGS, n_cols), launch, s_tile.device, first))


def _bwd_triton(s_tile, t_tile, g, sb, tb, ign, s_lz, t_lz, aux, gdiv, col0, o):
    n, n_cols = s_tile.shape

    def launch(cfg):
        _bwd_kernel[(n, cdiv(n_cols, cfg["BLOCK"]))](
            s_tile, t_tile, s_tile.stride(0), g, g.stride(0), sb if sb is not None else s_tile,
            tb if tb is not None else s_tile, ign if ign is not None else s_tile, s_lz, t_lz,
            aux, gdiv, col0, n_cols, o.beta, *_mix_logs(o), *_scalars(o),
            **_kernel_common(o, sb, tb, ign), **cfg,
        )  # fmt: skip

    # Timed only where the gradient goes to its own buffer (a repeated launch then writes the
    # same); fp32 inputs take it in place, with the default or a config timed earlier.
    key = _key("divergence_bwd", g, o, sb, tb, ign, n_cols) + (g.dtype,)
    launch(choose(key, configs(BWD_CONFIGS, n_cols), launch, s_tile.device, g is not s_tile))


# --- The same per tile in torch (CPU without the interpreter) ---------------------------------


def _z(tile, bias, col0, scale, cap, has_cap, inv_t):
    x = tile if bias is None else tile + bias[col0 : col0 + tile.shape[1]].float()
    y = x * scale
    if has_cap:
        t = torch.tanh(y / cap)
        return cap * t * inv_t, t
    return y * inv_t, None


def _zs(s_tile, sb, col0, o):
    return _z(s_tile, sb, col0, o.s_scale, o.s_cap, o.s_has_cap, o.inv_t)


def _zt(t_tile, tb, col0, o):
    return _z(t_tile, tb, col0, o.t_scale, o.t_cap, o.t_has_cap, o.inv_t)[0]


def _stats_torch(s_tile, t_tile, sb, tb, ign, stats, outs, col0, o, first, last):
    zs, _ = _zs(s_tile, sb, col0, o)
    zt = _zt(t_tile, tb, col0, o)
    ms, mt = zs.amax(1), zt.amax(1)
    es, et = torch.exp(zs - ms[:, None]), torch.exp(zt - mt[:, None])
    ss, sx, st = es.sum(1), (es * zs).sum(1), et.sum(1)
    gap = torch.zeros_like(ss)
    if o.mode == FKL:
        gap = (et * (zt - zs)).sum(1)
    elif o.mode == RKL:
        gap = (es * (zs - zt)).sum(1)
    if not first:
        ms_all, mt_all = torch.maximum(stats[0], ms), torch.maximum(stats[3], mt)
        as_old, as_new = torch.exp(stats[0] - ms_all), torch.exp(ms - ms_all)
        at_old, at_new = torch.exp(stats[3] - mt_all), torch.exp(mt - mt_all)
        ss = stats[1] * as_old + ss * as_new
        sx = stats[2] * as_old + sx * as_new
        st = stats[4] * at_old + st * at_new
        if o.mode == FKL:
            gap = stats[5] * at_old + gap * at_new
        elif o.mode == RKL:
            gap = stats[5] * as_old + gap * as_new
        ms, mt = ms_all, mt_all
    if not last:
        for i, v in enumerate((ms, ss, sx, mt, st, gap)):
            stats[i].copy_(v)
        return
    div, ent, s_lz_out, t_lz_out = outs
    valid = torch.ones_like(ss, dtype=torch.bool) if ign is None else ign == 0
    s_lz, t_lz = ms + torch.log(ss), mt + torch.log(st)
    s_lz_out.copy_(s_lz)
    t_lz_out.copy_(t_lz)
    ent.copy_(torch.where(valid, s_lz - sx / ss, 0.0))
    if o.mode == FKL:
        div.copy_(torch.where(valid, gap / st - t_lz + s_lz, 0.0))
    elif o.mode == RKL:
        div.copy_(torch.where(valid, gap / ss - s_lz + t_lz, 0.0))


def _second_torch(s_tile, t_tile, sb, tb, ign, s_lz, t_lz, div, aux, col0, o, first, last):
    log_ps = _zs(s_tile, sb, col0, o)[0] - s_lz[:, None]
    log_pt = _zt(t_tile, tb, col0, o) - t_lz[:, None]
    ps, pt = torch.exp(log_ps), torch.exp(log_pt)
    if o.mode == JSD:
        lb1, lb = _mix_logs(o)
        log_m = torch.logaddexp(log_ps + lb1, log_pt + lb)
        kl_s = ps * (log_ps - log_m)
        d = (o.beta * pt * (log_pt - log_m) + (1 - o.beta) * kl_s).sum(1)
        a = kl_s.sum(1)
    else:
        d = 0.5 * (ps - pt).abs().sum(1)
        a = (torch.sign(ps - pt) * ps).sum(1)
    if not first:
        d, a = d + div, a + aux
    if last and ign is not None:
        d = torch.where(ign == 0, d, 0.0)
    div.copy_(d)
    aux.copy_(a)


def _bwd_torch(s_tile, t_tile, g, sb, tb, ign, s_lz, t_lz, aux, gdiv, col0, o):
    zs, th = _zs(s_tile, sb, col0, o)
    log_ps = zs - s_lz[:, None]
    log_pt = _zt(t_tile, tb, col0, o) - t_lz[:, None]
    ps, pt = torch.exp(log_ps), torch.exp(log_pt)
    if o.mode == FKL:
        grad = ps - pt
    elif o.mode == RKL:
        grad = ps * (log_ps - log_pt - aux[:, None])
    elif o.mode == JSD:
        lb1, lb = _mix_logs(o)
        log_m = torch.logaddexp(log_ps + lb1, log_pt + lb)
        grad = (1 - o.beta) * ps * (log_ps - log_m - aux[:, None])
    else:
        grad = 0.5 * ps * (torch.sign(ps - pt) - aux[:, None])
    gr = gdiv.float() if ign is None else torch.where(ign == 0, gdiv.float(), 0.0)
    grad = grad * (gr * o.inv_t * o.s_scale)[:, None]
    if th is not None:
        grad = grad * (1 - th * th)
    g.copy_(grad)


# --- The chunked drivers ----------------------------------------------------------------------


def _project(tile: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> None:
    """tile (fp32) = h @ w.T, the product never rounded to h's dtype."""
    if h.dtype == torch.float32:
        torch.mm(h, w.t(), out=tile)
    elif h.is_cuda and _MM_OUT_DTYPE:
        torch.mm(h, w.t(), out_dtype=torch.float32, out=tile)
    else:
        torch.mm(h.float(), w.float().t(), out=tile)


def _tile(o: _Opts, n: int, vocab: int) -> tuple[int, int]:
    rows, cols = o.tile
    if rows > 0 and cols > 0:
        return min(rows, max(1, n)), min(cols, vocab)
    return tile_shape(n, vocab, 8, MAX_TILE_BYTES)  # two fp32 tiles


def forward(h_s, w_s, b_s, h_t, w_t, b_t, ign, o: _Opts):
    """(divergence, student entropy, student log_z, teacher log_z, aux) per token; aux is what
    the backward needs besides the normalisers (the KL, KL(p_s || m), or sum sign·p_s)."""
    n, vocab = h_s.shape[0], w_s.shape[0]
    dev = h_s.device
    f32 = {"dtype": torch.float32, "device": dev}
    div, ent = torch.zeros(n, **f32), torch.empty(n, **f32)
    s_lz, t_lz = torch.empty(n, **f32), torch.empty(n, **f32)
    aux = div if o.mode in (FKL, RKL) else torch.zeros(n, **f32)
    if n == 0:
        return div, ent, s_lz, t_lz, aux
    rows, cols = _tile(o, n, vocab)
    triton_path = use_triton(h_s)
    stats_fn = _stats_triton if triton_path else _stats_torch
    second_fn = _second_triton if triton_path else _second_torch
    stats = torch.empty(6, n, **f32) if cols < vocab else None
    s_buf = torch.empty(min(rows, n), cols, **f32)
    t_buf = torch.empty(min(rows, n), cols, **f32)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        sl = slice(r0, r1)
        hs, ht = h_s[sl], h_t[sl]
        ig = None if ign is None else ign[sl]
        st = None if stats is None else stats[:, sl]
        outs = (div[sl], ent[sl], s_lz[sl], t_lz[sl])
        for c0 in range(0, vocab, cols):
            c1 = min(vocab, c0 + cols)
            s_tile, t_tile = s_buf[: r1 - r0, : c1 - c0], t_buf[: r1 - r0, : c1 - c0]
            _project(s_tile, hs, w_s[c0:c1].to(hs.dtype))
            _project(t_tile, ht, w_t[c0:c1].to(ht.dtype))
            stats_fn(s_tile, t_tile, b_s, b_t, ig, st, outs, c0, o, c0 == 0, c1 == vocab)
        if o.mode in (JSD, TVD):  # the normalisers are known now: the second pass
            for c0 in range(0, vocab, cols):
                c1 = min(vocab, c0 + cols)
                s_tile, t_tile = s_buf[: r1 - r0, : c1 - c0], t_buf[: r1 - r0, : c1 - c0]
                _project(s_tile, hs, w_s[c0:c1].to(hs.dtype))
                _project(t_tile, ht, w_t[c0:c1].to(ht.dtype))
                second_fn(s_tile, t_tile, b_s, b_t, ig, s_lz[sl], t_lz[sl], div[sl], aux[sl],
                          c0, o, c0 == 0, c1 == vocab)  # fmt: skip
    return div, ent, s_lz, t_lz, aux


def backward(h_s, w_s, b_s, h_t, w_t, b_t, ign, s_lz, t_lz, aux, gdiv, need, o: _Opts):
    """(d h_s, d w_s, d b_s), None where `need` says no (fp32 accumulation throughout)."""
    need_x, need_w, need_b = need
    n, vocab = h_s.shape[0], w_s.shape[0]
    dev, cdtype = h_s.device, h_s.dtype
    dh = torch.empty_like(h_s) if need_x else None
    dw = None
    if need_w:
        dw = torch.zeros_like(w_s) if n == 0 else torch.empty_like(w_s)
    db = torch.zeros(vocab, dtype=torch.float32, device=dev) if need_b else None
    rows, cols = _tile(o, n, vocab)
    split_rows, split_cols = rows < n, cols < vocab
    dh_acc = None
    if need_x and split_cols and cdtype != torch.float32:
        dh_acc = torch.empty(min(rows, n), h_s.shape[1], dtype=torch.float32, device=dev)
    dw_acc = None
    if need_w and (split_rows or (w_s.dtype == torch.float32 and cdtype != torch.float32)):
        dw_acc = dw if w_s.dtype == torch.float32 else torch.empty_like(dw, dtype=torch.float32)
    grad_fn = _bwd_triton if use_triton(h_s) else _bwd_torch
    gdiv = gdiv.float().contiguous()
    if n:
        s_buf = torch.empty(min(rows, n), cols, dtype=torch.float32, device=dev)
        t_buf = torch.empty_like(s_buf)
        # The gradient tile in the inputs' dtype for the matmuls (the fp32 tile itself in fp32).
        g_buf = s_buf if cdtype == torch.float32 else torch.empty_like(s_buf, dtype=cdtype)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        sl = slice(r0, r1)
        hs, ht = h_s[sl], h_t[sl]
        acc = None
        if need_x and split_cols:
            acc = dh[sl] if dh_acc is None else dh_acc[: r1 - r0]
        for c0 in range(0, vocab, cols):
            c1 = min(vocab, c0 + cols)
            w = w_s[c0:c1].to(cdtype)
            s_tile, t_tile = s_buf[: r1 - r0, : c1 - c0], t_buf[: r1 - r0, : c1 - c0]
            g = g_buf[: r1 - r0, : c1 - c0]
            _project(s_tile, hs, w)
            _project(t_tile, ht, w_t[c0:c1].to(ht.dtype))
            grad_fn(s_tile, t_tile, g, b_s, b_t, None if ign is None else ign[sl], s_lz[sl],
                    t_lz[sl], aux[sl], gdiv[sl], c0, o)  # fmt: skip
            back_matmuls(g, w, hs, r0, c0, c1, None if dh is None else dh[sl], acc,
                         dw, dw_acc, db)  # fmt: skip
        if dh_acc is not None:
            dh[sl].copy_(acc)
    if dw_acc is not None and dw_acc is not dw:
        dw.copy_(dw_acc)
    return dh, dw, None if db is None else db.to(b_s.dtype)


# --- Custom ops (torch.compile) and the eager autograd Function -------------------------------


@torch.library.custom_op(op_name("divergence_fwd"), mutates_args=())
def divergence_fwd(
    h_s: torch.Tensor,
    w_s: torch.Tensor,
    b_s: Optional[torch.Tensor],  # noqa: UP045 - torch.library parses typing.Optional
    h_t: torch.Tensor,
    w_t: torch.Tensor,
    b_t: Optional[torch.Tensor],  # noqa: UP045
    ignore: Optional[torch.Tensor],  # noqa: UP045
    mode: int,
    beta: float,
    temperature: float,
    s_scale: float,
    s_cap: Optional[float],  # noqa: UP045
    t_scale: float,
    t_cap: Optional[float],  # noqa: UP045
    tile_rows: int,
    tile_cols: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    o = _opts(mode, beta, temperature, s_scale, s_cap, t_scale, t_cap, tile_rows, tile_cols)
    with torch.autocast(h_s.device.type, enabled=False):
        div, ent, s_lz, t_lz, aux = forward(h_s, w_s, b_s, h_t, w_t, b_t, ignore, o)
    return div, ent, s_lz, t_lz, aux.clone() if aux is div else aux


@divergence_fwd.register_fake
def _(h_s, w_s, b_s, h_t, w_t, b_t, ignore, mode, beta, temperature, s_scale, s_cap, t_scale,
      t_cap, tile_rows, tile_cols):  # fmt: skip
    return tuple(h_s.new_empty(h_s.shape[0], dtype=torch.float32) for _ in range(5))


@torch.library.custom_op(op_name("divergence_bwd"), mutates_args=())
def divergence_bwd(
    h_s: torch.Tensor,
    w_s: torch.Tensor,
    b_s: Optional[torch.Tensor],  # noqa: UP045
    h_t: torch.Tensor,
    w_t: torch.Tensor,
    b_t: Optional[torch.Tensor],  # noqa: UP045
    ignore: Optional[torch.Tensor],  # noqa: UP045
    s_lz: torch.Tensor,
    t_lz: torch.Tensor,
    aux: torch.Tensor,
    grad: torch.Tensor,
    mode: int,
    beta: float,
    temperature: float,
    s_scale: float,
    s_cap: Optional[float],  # noqa: UP045
    t_scale: float,
    t_cap: Optional[float],  # noqa: UP045
    tile_rows: int,
    tile_cols: int,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    o = _opts(mode, beta, temperature, s_scale, s_cap, t_scale, t_cap, tile_rows, tile_cols)
    with torch.autocast(h_s.device.type, enabled=False):
        dh, dw, db = backward(
            h_s, w_s, b_s, h_t, w_t, b_t, ignore, s_lz, t_lz, aux, grad,
            (need_hidden, need_weight, need_bias and b_s is not None), o,
        )  # fmt: skip
    return (
        h_s.new_empty(0) if dh is None else dh,
        w_s.new_empty(0) if dw is None else dw,
        h_s.new_empty(0) if db is None else db,
    )


@divergence_bwd.register_fake
def _(h_s, w_s, b_s, h_t, w_t, b_t, ignore, s_lz, t_lz, aux, grad, mode, beta, temperature,
      s_scale, s_cap, t_scale, t_cap, tile_rows, tile_cols, need_hidden, need_weight,
      need_bias):  # fmt: skip
    return (
        torch.empty_like(h_s) if need_hidden else h_s.new_empty(0),
        torch.empty_like(w_s) if need_weight else w_s.new_empty(0),
        torch.empty_like(b_s) if need_bias and b_s is not None else h_s.new_empty(0),
    )


def _op_setup(ctx, inputs, output):
    h_s, w_s, b_s, h_t, w_t, b_t, ignore, *scalars = inputs
    _div, _ent, s_lz, t_lz, aux = output
    ctx.save_for_backward(h_s, w_s, b_s, h_t, w_t, b_t, ignore, s_lz, t_lz, aux)
    ctx.scalars = scalars  # mode, beta, temperature, s_scale, s_cap, t_scale, t_cap, rows, cols


def _op_backward(ctx, gdiv, *_unused):
    h_s, w_s, b_s, h_t, w_t, b_t, ignore, s_lz, t_lz, aux = ctx.saved_tensors
    need = ctx.needs_input_grad[:3]
    if gdiv is None or gdiv.numel() == 0 or not any(need):
        return (None,) * 16
    dh, dw, db = divergence_bwd(
        h_s, w_s, b_s, h_t, w_t, b_t, ignore, s_lz, t_lz, aux, gdiv, *ctx.scalars,
        need[0], need[1], bool(need[2]) and b_s is not None,
    )  # fmt: skip
    return (
        dh if need[0] else None,
        dw if need[1] else None,
        db if need[2] and b_s is not None else None,
        *(None,) * 13,
    )


divergence_fwd.register_autograd(_op_backward, setup_context=_op_setup)


class _DivergenceFunction(torch.autograd.Function):
    """The eager path: the same drivers without the custom-op dispatch on every call."""

    @staticmethod
    def forward(ctx, h_s, w_s, b_s, h_t, w_t, b_t, ign, o: _Opts, save: bool):
        div, ent, s_lz, t_lz, aux = forward(h_s, w_s, b_s, h_t, w_t, b_t, ign, o)
        ctx.set_materialize_grads(False)
        ctx.o = o
        if save:  # the KLs' aux is the divergence itself (an output, saved as TRL saves it)
            ctx.save_for_backward(h_s, w_s, b_s, h_t, w_t, b_t, ign, s_lz, t_lz, aux)
        ctx.mark_non_differentiable(ent)
        return div, ent

    @staticmethod
    def backward(ctx, gdiv, _gent):
        if gdiv is None:
            return (None,) * 9
        h_s, w_s, b_s, h_t, w_t, b_t, ign, s_lz, t_lz, aux = ctx.saved_tensors
        need = tuple(ctx.needs_input_grad[:3])
        need = (need[0], need[1], need[2] and b_s is not None)
        with torch.autocast(h_s.device.type, enabled=False):
            dh, dw, db = backward(
                h_s, w_s, b_s, h_t, w_t, b_t, ign, s_lz, t_lz, aux, gdiv, need, ctx.o
            )
        return dh, dw, db, None, None, None, None, None, None


def _mode(kind: str, beta: float) -> int:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind == "jsd":
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {beta}")
        # TRL's reading of beta: 0 is the forward KL, 1 the reverse KL
        return FKL if beta == 0.0 else RKL if beta == 1.0 else JSD
    return KINDS.index(kind)


def _rows(t: torch.Tensor, name: str, n_rows: int | None = None) -> torch.Tensor:
    if t.dim() < 1:
        raise ValueError(f"{name} must have a hidden dimension, got shape {tuple(t.shape)}")
    rows = t.reshape(-1, t.shape[-1])
    if n_rows is not None and rows.shape[0] != n_rows:
        raise ValueError(f"{name} has {rows.shape[0]} tokens, the student {n_rows}")
    return rows.contiguous()


def fused_linear_divergence(
    h_s: torch.Tensor,
    w_s: torch.Tensor,
    h_t: torch.Tensor,
    w_t: torch.Tensor,
    *,
    kind: str = "jsd",
    beta: float = 0.5,
    temperature: float = 1.0,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    student_logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    student_softcap: float | None = None,
    teacher_softcap: float | None = None,
    ignore_mask: torch.Tensor | None = None,
    return_entropy: bool = False,
    tile: tuple[int, int] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token divergence `kind` ("forward_kl", "reverse_kl", "jsd" with TRL's `beta`,
    "tvd") between ``h_s[..., Hs] @ w_s[V, Hs].T`` (+ bias) and the teacher's
    ``h_t[..., Ht] @ w_t[V, Ht].T``, shaped like h_s without its last dimension, fp32, with a
    gradient to h_s, w_s and the student bias (the teacher gets none). `ignore_mask` (bool, True
    = ignore) rows give 0. ``return_entropy=True`` also returns the student's entropy (no
    gradient). `tile` = (rows, cols) overrides the logits tiles (tests, tuning)."""
    mode = _mode(kind, float(beta))
    if not temperature or temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    shape = h_s.shape[:-1]
    hs = _rows(h_s, "h_s")
    n = hs.shape[0]
    ht = _rows(h_t, "h_t", n)
    vocab = w_s.shape[0]
    if w_s.dim() != 2 or w_s.shape[1] != hs.shape[1]:
        raise ValueError(f"w_s must be [V, Hs] with Hs = {hs.shape[1]}, got {tuple(w_s.shape)}")
    if w_t.dim() != 2 or w_t.shape != (vocab, ht.shape[1]):
        raise ValueError(
            f"w_t must be [V, Ht] = [{vocab}, {ht.shape[1]}] (the student's vocabulary), "
            f"got {tuple(w_t.shape)}"
        )
    for b, name in ((student_bias, "student_bias"), (teacher_bias, "teacher_bias")):
        if b is not None and b.shape != (vocab,):
            raise ValueError(f"{name} must be [V] = [{vocab}], got {tuple(b.shape)}")
    ign = None
    if ignore_mask is not None:
        if ignore_mask.shape != shape:
            raise ValueError(f"ignore_mask shape {tuple(ignore_mask.shape)} must be {tuple(shape)}")
        ign = ignore_mask.reshape(-1).to(device=hs.device, dtype=torch.int8).contiguous()
    device_type = hs.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hs, ht = hs.to(dtype), ht.to(dtype)
    # The teacher is a constant here (TRL's function gives it no gradient either).
    ht, w_t = ht.detach(), w_t.detach().contiguous()
    b_t = None if teacher_bias is None else teacher_bias.detach().contiguous()
    w_s = w_s.contiguous()
    b_s = None if student_bias is None else student_bias.contiguous()
    tr, tc = tile if tile is not None else (0, 0)
    s_cap = float(student_softcap) if student_softcap else None
    t_cap = float(teacher_softcap) if teacher_softcap else None
    scalars = (mode, float(beta), float(temperature), float(student_logit_scale), s_cap,
               float(teacher_logit_scale), t_cap, int(tr), int(tc))  # fmt: skip
    if torch.compiler.is_compiling():
        div, ent, *_ = divergence_fwd(hs, w_s, b_s, ht, w_t, b_t, ign, *scalars)
        ent = ent.detach()
    else:
        save = needs_grad(hs, w_s, b_s)
        o = _opts(*scalars)
        div, ent = _DivergenceFunction.apply(hs, w_s, b_s, ht, w_t, b_t, ign, o, save)
    div = div.view(shape)
    return (div, ent.view(shape)) if return_entropy else div


def trl_chunked_divergence(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    student_bias: torch.Tensor | None,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    teacher_bias: torch.Tensor | None,
    beta: float,
    temperature: float = 1.0,
    student_logit_scale: float = 1.0,
    student_final_logit_softcapping: float | None = None,
    teacher_logit_scale: float = 1.0,
    teacher_final_logit_softcapping: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stands in for TRL 1.16's ``ChunkedDivergenceFunction.apply`` (same arguments; returns
    (per_token_divergence, per_token_entropy), the entropy without gradient)."""
    return fused_linear_divergence(
        student_hidden, student_weight, teacher_hidden, teacher_weight, kind="jsd", beta=beta,
        temperature=temperature, student_bias=student_bias, teacher_bias=teacher_bias,
        student_logit_scale=student_logit_scale, teacher_logit_scale=teacher_logit_scale,
        student_softcap=student_final_logit_softcapping,
        teacher_softcap=teacher_final_logit_softcapping, return_entropy=True,
    )  # fmt: skip
