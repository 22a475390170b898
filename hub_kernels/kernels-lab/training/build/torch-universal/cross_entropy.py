"""Cross-entropy over [N, V] logits with the gradient computed in the forward.

Per token (row) with target y, z = softcap * tanh(x / softcap) when a softcap is set (else z = x),
lse = log(sum_j exp(z_j)), eps = label smoothing, lam = z-loss scale (``lse_square_scale``):

    loss = lse - (1 - eps) * z_y - (eps / V) * sum_j z_j + lam * lse**2
    dloss/dz_j = softmax_j * (1 + 2 * lam * lse) - eps / V - (1 - eps) * [j == y]
    dloss/dx_j = dloss/dz_j * (1 - (z_j / softcap)**2)

Rows whose target is ``ignore_index`` contribute no loss and a zero gradient. ``mean`` divides by
the number of other rows (or by ``num_items``); the division happens on the device, so nothing
waits for the host.

How the kernel moves the logits only twice through memory (one read, one write): each row is cut
into chunks that separate programs reduce at the same time (running max and sum of exponentials).
Every program publishes its partial result and bumps a per-row counter; the program that finds it
was last combines the partials into the row's log-sum-exp and then rewrites the whole row as the
gradient. Its re-read hits L2, because the row's chunks were all read moments before. No program
ever waits for another, so there is no deadlock risk and the result does not depend on which
program came last.

When a gradient is needed the logits buffer is consumed: it holds the gradient afterwards
(``inplace=True``, the default; its version counter is bumped so that autograd reports misuse).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from ._common import PlanCache, cdiv, fast_launch, next_pow2, op_name, sm_count, use_triton
from ._triton import tl, triton

REDUCTIONS = ("mean", "sum", "none")


@triton.jit
def _softcap(x, cap, HAS_SOFTCAP: tl.constexpr):
    if HAS_SOFTCAP:
        # tanh(u) = 1 - 2 / (exp(2u) + 1): exact limits at +-inf, no libdevice needed.
        x = cap * (1.0 - 2.0 / (tl.exp(2.0 * x / cap) + 1.0))
    return x


@triton.jit
def _smooth_term(z, cw_ptr, cols, mask, HAS_WEIGHT: tl.constexpr):
    """What label smoothing sums over a row's columns: z_j, or w_j z_j with class weights."""
    if HAS_WEIGHT:
        return z * tl.load(cw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return z


@triton.jit
def _grad(p, z, cols, y, scale, coef, smoothing, off_eps, cap, HAS_SOFTCAP: tl.constexpr):
    """scale * dloss/dx from the softmax p and the (capped) logits z of one block."""
    g = p * coef - off_eps
    # The target's "- (1 - eps)" is applied in fp32 before rounding to the logits dtype.
    g = tl.where(cols == y, g - (1.0 - smoothing), g)
    if HAS_SOFTCAP:
        t = z / cap
        g = g * (1.0 - t * t)
    return g * scale


@triton.jit
def _grad_weighted(
    p, z, cols, mask, y, wy, cw_ptr, sumw, ce_scale, z_scale, lse, lse_sq_scale, smoothing, V, cap,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
):  # fmt: skip
    """dloss/dx with class weights w: the cross-entropy part (weighted, as torch's) scaled by
    ce_scale, the z-loss part (unweighted, as Liger's) by z_scale."""
    g = (wy * (1.0 - smoothing)) * p
    g = tl.where(cols == y, g - wy * (1.0 - smoothing), g)
    if HAS_SMOOTHING:
        w = tl.load(cw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        g += (smoothing / V) * (sumw * p - w)
    g = g * ce_scale + (2.0 * lse_sq_scale * lse * z_scale) * p
    if HAS_SOFTCAP:
        t = z / cap
        g = g * (1.0 - t * t)
    return g


@triton.jit
def _write_grad(
    row_in,
    row_out,
    lo,
    hi,
    lse,
    y,
    scale,
    V,
    smoothing,
    lse_sq_scale,
    cap,
    wy,
    cw_ptr,
    sumw,
    z_scale,
    BLOCK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    STORE_POLICY: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
):
    """Overwrite columns [lo, hi) of one row with scale * dloss/dx, reading them again."""
    coef = 1.0 + 2.0 * lse_sq_scale * lse
    off_eps = smoothing / V
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < hi
        x = tl.load(row_in + cols, mask=mask, other=0.0).to(tl.float32)
        z = _softcap(x, cap, HAS_SOFTCAP)
        p = tl.exp2((z - lse) * 1.4426950408889634)
        if HAS_WEIGHT:
            g = _grad_weighted(
                p, z, cols, mask, y, wy, cw_ptr, sumw, scale, z_scale, lse, lse_sq_scale,
                smoothing, V, cap, HAS_SOFTCAP, HAS_SMOOTHING,
            )  # fmt: skip
        else:
            g = _grad(p, z, cols, y, scale, coef, smoothing, off_eps, cap, HAS_SOFTCAP)
        tl.store(
            row_out + cols, g.to(row_out.dtype.element_ty), mask=mask, eviction_policy=STORE_POLICY
        )


@fast_launch
@triton.jit
def _ce_fwd_kernel(
    logits_ptr,
    stride_logits,
    grad_ptr,
    stride_grad,
    target_ptr,
    loss_ptr,
    lse_ptr,
    stats_ptr,
    count_ptr,
    gscale_ptr,
    rscale_ptr,
    cw_ptr,
    sumw_ptr,
    zscale_ptr,
    pred_ptr,
    n_rows,
    V,
    ignore_index,
    smoothing,
    lse_sq_scale,
    cap,
    CHUNK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    NC_POW2: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
    SPIN: tl.constexpr,
    OWN_CHUNK: tl.constexpr,
    ONE_PASS: tl.constexpr,
    LOAD_POLICY: tl.constexpr,
    STORE_POLICY: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_PRED: tl.constexpr,
):
    # HAS_WEIGHT: class weights at cw_ptr (fp32), their sum at sumw_ptr, the z-loss gradient's
    # own scale at zscale_ptr. HAS_PRED: the row's argmax (first of ties) stored at pred_ptr.
    # OWN_CHUNK: each program writes the gradient of its own chunk, since it learns the row's
    # totals (alone on the row, or by waiting for its siblings); otherwise the last program to
    # finish writes the row. ONE_PASS: one block per chunk, kept in registers from the load to
    # the gradient store, so the logits are read exactly once.
    if SPIN:
        # Tiles in the order programs actually start, so a program only ever waits for
        # siblings that have started already or start next (never on the CPU interpreter,
        # which runs programs one after another).
        tile = tl.atomic_add(count_ptr + n_rows, 1)
    else:
        tile = tl.program_id(0)
    row = tile // NUM_CHUNKS
    chunk = tile % NUM_CHUNKS
    row_in = logits_ptr + row.to(tl.int64) * stride_logits
    row_out = grad_ptr + row.to(tl.int64) * stride_grad
    y = tl.load(target_ptr + row).to(tl.int32)
    c0 = chunk * CHUNK
    c1 = tl.minimum(c0 + CHUNK, V)
    if y == ignore_index:
        if WRITE_GRAD:
            for start in range(c0, c1, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                zero = tl.zeros([BLOCK], dtype=tl.float32).to(row_out.dtype.element_ty)
                tl.store(row_out + cols, zero, mask=cols < c1)
        if chunk == 0:
            tl.store(loss_ptr + row, 0.0)
            tl.store(lse_ptr + row, 0.0)
            if HAS_PRED:
                tl.store(pred_ptr + row, -1)
    else:
        # This program's chunk: max m and sum s of exp(z - m), in fp32 (online over blocks).
        if ONE_PASS:
            cols = c0 + tl.arange(0, BLOCK)
            mask = cols < c1
            x = tl.load(row_in + cols, mask=mask, other=0.0, eviction_policy=LOAD_POLICY)
            z = tl.where(mask, _softcap(x.to(tl.float32), cap, HAS_SOFTCAP), float("-inf"))
            m = tl.max(z, 0)
            arg = c0
            if HAS_PRED:
                arg = c0 + tl.argmax(z, 0)
            e = tl.exp2((z - m) * 1.4426950408889634)
            s = tl.sum(e, 0)
            sz = 0.0
            if HAS_SMOOTHING:
                sz = tl.sum(tl.where(mask, _smooth_term(z, cw_ptr, cols, mask, HAS_WEIGHT), 0.0), 0)
            m_own = m
        else:
            m = -1.0e30
            s = 0.0
            sz = 0.0
            arg = c0
            for start in range(c0, c1, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < c1
                x = tl.load(row_in + cols, mask=mask, other=0.0, eviction_policy=LOAD_POLICY)
                z = tl.where(mask, _softcap(x.to(tl.float32), cap, HAS_SOFTCAP), float("-inf"))
                zmax = tl.max(z, 0)
                if HAS_PRED:  # strictly greater: the first of equal maxima wins
                    arg = tl.where(zmax > m, start + tl.argmax(z, 0), arg)
                m_new = tl.maximum(m, zmax)
                s = s * tl.exp2((m - m_new) * 1.4426950408889634) + tl.sum(
                    tl.exp2((z - m_new) * 1.4426950408889634), 0
                )
                m = m_new
                if HAS_SMOOTHING:
                    sz += tl.sum(
                        tl.where(mask, _smooth_term(z, cw_ptr, cols, mask, HAS_WEIGHT), 0.0), 0
                    )
        done = True  # this program holds the row's totals
        if NUM_CHUNKS > 1:
            # Publish the partials, then count in. A CTA barrier plus the counter's acq_rel
            # atomic is the usual grid handshake: whoever sees the count complete also sees
            # every partial of the row.
            sbase = stats_ptr + (row.to(tl.int64) * NUM_CHUNKS + chunk) * 4
            tl.store(sbase, m)
            tl.store(sbase + 1, s)
            tl.store(sbase + 2, sz)
            if HAS_PRED:  # exact as fp32 below 2**24 columns
                tl.store(sbase + 3, arg.to(tl.float32))
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + row, 1, sem="acq_rel", scope="gpu")
            if SPIN:
                while arrived < NUM_CHUNKS - 1:
                    arrived = tl.atomic_add(count_ptr + row, 0, sem="acquire", scope="gpu") - 1
            else:
                done = arrived == NUM_CHUNKS - 1
            tl.debug_barrier()
            if done:
                k = tl.arange(0, NC_POW2)
                kmask = k < NUM_CHUNKS
                rbase = stats_ptr + row.to(tl.int64) * NUM_CHUNKS * 4 + k * 4
                ms = tl.load(rbase, mask=kmask, other=-1.0e30, volatile=True)
                ss = tl.load(rbase + 1, mask=kmask, other=0.0, volatile=True)
                m = tl.max(ms, 0)
                s = tl.sum(ss * tl.exp2((ms - m) * 1.4426950408889634), 0)
                if HAS_SMOOTHING:
                    sz = tl.sum(tl.load(rbase + 2, mask=kmask, other=0.0, volatile=True), 0)
                if HAS_PRED:  # the first chunk holding the row's max, then its own argmax
                    args = tl.load(rbase + 3, mask=kmask, other=0.0, volatile=True)
                    best = tl.argmax(ms, 0)
                    arg = tl.sum(tl.where(k == best, args, 0.0), 0).to(tl.int32)
        if done:
            lse = m + tl.log(s)
            valid = (y >= 0) & (y < V)
            y_safe = tl.where(valid, y, 0)
            owner = True  # the program that stores the row's loss
            if OWN_CHUNK:
                # The program whose chunk holds the target: it reads the target logit before it
                # overwrites its own chunk with the gradient. Any other program could read it
                # after the target's program already wrote the gradient there (in place).
                owner = chunk == y_safe // CHUNK
            if owner:
                if ONE_PASS:
                    # From registers: this chunk's gradient store must not race this read.
                    zy = tl.sum(tl.where(cols == y_safe, z, 0.0), 0)
                else:
                    zy = _softcap(tl.load(row_in + y_safe).to(tl.float32), cap, HAS_SOFTCAP)
                if HAS_WEIGHT:
                    # torch's weighted loss: w_y (1 - eps) (lse - z_y) + eps / V sum_j w_j (lse - z_j)
                    wy = tl.load(cw_ptr + y_safe).to(tl.float32)
                    loss = wy * (1.0 - smoothing) * (lse - zy) + lse_sq_scale * lse * lse
                    if HAS_SMOOTHING:
                        loss += smoothing / V * (tl.load(sumw_ptr) * lse - sz)
                else:
                    loss = lse - (1.0 - smoothing) * zy + lse_sq_scale * lse * lse
                    if HAS_SMOOTHING:
                        loss -= smoothing / V * sz
                if HAS_PRED:
                    tl.store(pred_ptr + row, arg.to(tl.int64))
                # A target outside [0, V) that is not ignore_index: NaN loss (no host check).
                loss = tl.where(valid, loss, float("nan"))
                tl.store(loss_ptr + row, loss)
                tl.store(lse_ptr + row, lse)
            if WRITE_GRAD:
                # In place, a fast thread's gradient store could land before a slow thread has
                # read the target logit above: every thread reads before any thread writes.
                tl.debug_barrier()
                scale = tl.load(gscale_ptr).to(tl.float32)
                z_scale = scale
                wy = 1.0
                sumw = 0.0
                if HAS_WEIGHT:
                    wy = tl.load(cw_ptr + y_safe).to(tl.float32)
                    sumw = tl.load(sumw_ptr)
                    z_scale = tl.load(zscale_ptr).to(tl.float32)
                if HAS_ROW_SCALE:
                    rs = tl.load(rscale_ptr + row).to(tl.float32)
                    scale = scale * rs
                    z_scale = z_scale * rs
                if ONE_PASS:
                    # softmax = exp(z - m_own) * exp(m_own - lse): one exp per element in all.
                    p = e * tl.exp2((m_own - lse) * 1.4426950408889634)
                    coef = 1.0 + 2.0 * lse_sq_scale * lse
                    if HAS_WEIGHT:
                        g = _grad_weighted(
                            p, z, cols, mask, y, wy, cw_ptr, sumw, scale, z_scale, lse,
                            lse_sq_scale, smoothing, V, cap, HAS_SOFTCAP, HAS_SMOOTHING,
                        )  # fmt: skip
                    else:
                        g = _grad(
                            p, z, cols, y, scale, coef, smoothing, smoothing / V, cap, HAS_SOFTCAP
                        )
                    g = g.to(row_out.dtype.element_ty)
                    tl.store(row_out + cols, g, mask=mask, eviction_policy=STORE_POLICY)
                else:
                    lo = 0
                    hi = V
                    if OWN_CHUNK:
                        lo = c0
                        hi = c1
                    _write_grad(
                        row_in,
                        row_out,
                        lo,
                        hi,
                        lse,
                        y,
                        scale,
                        V,
                        smoothing,
                        lse_sq_scale,
                        cap,
                        wy,
                        cw_ptr,
                        sumw,
                        z_scale,
                        BLOCK,
                        HAS_SOFTCAP,
                        STORE_POLICY,
                        HAS_WEIGHT,
                        HAS_SMOOTHING,
                    )


# --- The lean kernel: the plain options (smoothing, z-loss, softcap, row scales) only ----------
#
# Fewer instructions per element than _ce_fwd_kernel, which does ~16 ALU ops and two exp per
# element (close to the H200's issue rate at the copy speed): the exponent is one FMA
# (z * log2(e) - m * log2(e)); the scale folds into the softmax's FMA; only the program that
# holds the target column compares columns with it; only a row's partial first and last blocks
# are masked. A block is a [R, KW] tile whose rows are one warp wide, so the running max and sum
# are kept per tile row and reduced inside warps (no CTA barrier per block); the tile rows are
# combined once per chunk.
#
# Two schedules. ``queue``: every program takes one task from a global ticket counter, either
# "reduce chunk c of row r" (publish its max, sum) or "write chunk c of row r - LAG" (wait until
# row r - LAG is reduced, then rewrite the chunk as the gradient). A write task only ever waits
# for reduce tasks with smaller tickets, which never wait themselves, so there is no deadlock
# however the GPU schedules programs, and it also runs on the CPU interpreter (programs in
# order). The re-read of a chunk comes LAG rows after its first read, so it still hits L2.
# ``spin`` (GPU only): as _ce_fwd_kernel's spin, the programs of a row wait for each other.
#
# Rows whose byte offset is not 16-byte aligned (a vocabulary such as 50257) are read from the
# aligned address below the row start (ALIGN), so the full blocks still use 16-byte accesses.


@triton.jit
def _lean_online(z, zs, m_r, s_r, sz_r, HAS_SMOOTHING: tl.constexpr):
    """Fold one [R, L, VEC] tile into the running max m_r, sum s_r (and sum of z), [R, L]: one
    slot per thread's VEC contiguous columns, so the max and sums stay inside the thread."""
    mn = tl.maximum(m_r, tl.max(z, 2))
    e = tl.exp2(z * 1.4426950408889634 - (mn * 1.4426950408889634)[:, :, None])
    s_r = s_r * tl.exp2((m_r - mn) * 1.4426950408889634) + tl.sum(e, 2)
    if HAS_SMOOTHING:
        sz_r += tl.sum(zs, 2)
    return mn, s_r, sz_r


@triton.jit
def _lean_reduce(
    base, o0, col0, lo, hi, cap,
    R: tl.constexpr, KW: tl.constexpr, VEC: tl.constexpr, NB: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, LOAD_POLICY: tl.constexpr,
):  # fmt: skip
    """Max, sum of exp(z - max) and sum of z over columns [lo, hi) of one chunk.

    Block i of the chunk sits at base + o0 + i * R * KW (16-byte aligned) and holds columns
    col0 + i * R * KW + [0, R * KW), as R rows of KW // VEC slots of VEC columns."""
    L: tl.constexpr = KW // VEC
    rk = (
        tl.arange(0, R)[:, None, None] * KW
        + tl.arange(0, L)[None, :, None] * VEC
        + tl.arange(0, VEC)[None, None, :]
    )
    m_r = tl.full([R, L], -1.0e30, tl.float32)
    s_r = tl.zeros([R, L], tl.float32)
    sz_r = tl.zeros([R, L], tl.float32)
    for i in range(NB):
        o = o0 + i * (R * KW)
        c = col0 + i * (R * KW)
        if (c >= lo) & (c + R * KW <= hi):
            x = tl.load(base + o + rk, eviction_policy=LOAD_POLICY).to(tl.float32)
            z = _softcap(x, cap, HAS_SOFTCAP)
            m_r, s_r, sz_r = _lean_online(z, z, m_r, s_r, sz_r, HAS_SMOOTHING)
        else:
            # (names apart from the other branch's: Triton types a name across both branches)
            cols = c + rk
            mask = (cols >= lo) & (cols < hi)
            xm = tl.load(base + o + rk, mask=mask, other=0.0, eviction_policy=LOAD_POLICY)
            zm = _softcap(xm.to(tl.float32), cap, HAS_SOFTCAP)
            zs = tl.where(mask, zm, 0.0)
            zm = tl.where(mask, zm, float("-inf"))
            m_r, s_r, sz_r = _lean_online(zm, zs, m_r, s_r, sz_r, HAS_SMOOTHING)
    m = tl.max(tl.max(m_r, 1), 0)
    s = tl.sum(tl.sum(s_r * tl.exp2((m_r - m) * 1.4426950408889634), 1), 0)
    sz = tl.sum(tl.sum(sz_r, 1), 0)
    return m, s, sz


@triton.jit
def _lean_grad(x, cols, y, nl, A, B, TGT, cap, HAS_SOFTCAP: tl.constexpr, HAS_TARGET: tl.constexpr):
    """A * softmax - B (- TGT at the target column), times the softcap's derivative."""
    z = _softcap(x, cap, HAS_SOFTCAP)
    g = tl.exp2(z * 1.4426950408889634 - nl) * A - B
    if HAS_TARGET:
        g = tl.where(cols == y, g - TGT, g)
    if HAS_SOFTCAP:
        t = z / cap
        g = g * (1.0 - t * t)
    return g


@triton.jit
def _lean_write(
    base_in, base_out, o0, col0, lo, hi, y, nl, A, B, TGT, cap,
    R: tl.constexpr, KW: tl.constexpr, NB: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_TARGET: tl.constexpr, REVERSE: tl.constexpr, STORE_POLICY: tl.constexpr,
):  # fmt: skip
    """Rewrite columns [lo, hi) of one chunk as the gradient (nl = lse * log2(e))."""
    rk = tl.arange(0, R)[:, None] * KW + tl.arange(0, KW)[None, :]
    for j in range(NB):
        # REVERSE: the most recently read block first, while it is likeliest still in L2.
        i = NB - 1 - j if REVERSE else j
        o = o0 + i * (R * KW)
        c = col0 + i * (R * KW)
        cols = c + rk
        if (c >= lo) & (c + R * KW <= hi):
            x = tl.load(base_in + o + rk).to(tl.float32)
            g = _lean_grad(x, cols, y, nl, A, B, TGT, cap, HAS_SOFTCAP, HAS_TARGET)
            tl.store(
                base_out + o + rk, g.to(base_out.dtype.element_ty), eviction_policy=STORE_POLICY
            )
        else:
            mask = (cols >= lo) & (cols < hi)
            xm = tl.load(base_in + o + rk, mask=mask, other=0.0).to(tl.float32)
            gm = _lean_grad(xm, cols, y, nl, A, B, TGT, cap, HAS_SOFTCAP, HAS_TARGET)
            tl.store(
                base_out + o + rk, gm.to(base_out.dtype.element_ty), mask=mask,
                eviction_policy=STORE_POLICY,
            )  # fmt: skip


@triton.jit
def _lean_zero(base_out, o0, col0, lo, hi, R: tl.constexpr, KW: tl.constexpr, NB: tl.constexpr):
    """Zero columns [lo, hi) of one chunk (an ignored row's gradient)."""
    rk = tl.arange(0, R)[:, None] * KW + tl.arange(0, KW)[None, :]
    zero = tl.zeros([R, KW], dtype=tl.float32).to(base_out.dtype.element_ty)
    for i in range(NB):
        cols = col0 + i * (R * KW) + rk
        tl.store(base_out + o0 + i * (R * KW) + rk, zero, mask=(cols >= lo) & (cols < hi))


@triton.jit
def _lean_finish(
    logits_base, grad_base, o0, col0, lo, hi, row, y, chunk, m, s, sz,
    loss_ptr, lse_ptr, gscale_ptr, rscale_ptr, V, smoothing, lse_sq_scale, cap,
    CHUNK: tl.constexpr, R: tl.constexpr, KW: tl.constexpr, NB: tl.constexpr,
    ALIGN_SHIFT, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    WRITE_GRAD: tl.constexpr, HAS_ROW_SCALE: tl.constexpr, REVERSE: tl.constexpr,
    STORE_POLICY: tl.constexpr,
):  # fmt: skip
    """With the row's totals known: the loss (by the program holding the target column) and
    this chunk's gradient."""
    lse = m + tl.log(s)
    valid = (y >= 0) & (y < V)
    y_safe = tl.where(valid, y, 0)
    owner = chunk == (y_safe + ALIGN_SHIFT) // CHUNK
    if owner:
        zy = _softcap(
            tl.load(logits_base + (y_safe + ALIGN_SHIFT)).to(tl.float32), cap, HAS_SOFTCAP
        )
        loss = lse - (1.0 - smoothing) * zy + lse_sq_scale * lse * lse
        if HAS_SMOOTHING:
            loss -= smoothing / V * sz
        tl.store(loss_ptr + row, tl.where(valid, loss, float("nan")))
        tl.store(lse_ptr + row, lse)
    if WRITE_GRAD:
        # In place, every thread reads the target logit above before any thread overwrites it.
        tl.debug_barrier()
        scale = tl.load(gscale_ptr).to(tl.float32)
        if HAS_ROW_SCALE:
            scale = scale * tl.load(rscale_ptr + row).to(tl.float32)
        A = scale * (1.0 + 2.0 * lse_sq_scale * lse)
        B = scale * (smoothing / V)
        TGT = scale * (1.0 - smoothing)
        nl = lse * 1.4426950408889634
        if owner & valid:
            _lean_write(
                logits_base, grad_base, o0, col0, lo, hi, y, nl, A, B, TGT, cap,
                R, KW, NB, HAS_SOFTCAP, True, REVERSE, STORE_POLICY,
            )  # fmt: skip
        else:
            _lean_write(
                logits_base, grad_base, o0, col0, lo, hi, y, nl, A, B, TGT, cap,
                R, KW, NB, HAS_SOFTCAP, False, REVERSE, STORE_POLICY,
            )  # fmt: skip


@triton.jit
def _lean_totals(stats_ptr, row, NUM_CHUNKS: tl.constexpr, NC_POW2: tl.constexpr):
    """The row's max, sum of exp and sum of z from its chunks' published partials."""
    k = tl.arange(0, NC_POW2)
    kmask = k < NUM_CHUNKS
    rbase = stats_ptr + row.to(tl.int64) * NUM_CHUNKS * 4 + k * 4
    ms = tl.load(rbase, mask=kmask, other=-1.0e30, volatile=True)
    ss = tl.load(rbase + 1, mask=kmask, other=0.0, volatile=True)
    szs = tl.load(rbase + 2, mask=kmask, other=0.0, volatile=True)
    m = tl.max(ms, 0)
    s = tl.sum(ss * tl.exp2((ms - m) * 1.4426950408889634), 0)
    return m, s, tl.sum(szs, 0)


@triton.jit
def _lean_publish(stats_ptr, count_ptr, row, chunk, m, s, sz, NUM_CHUNKS: tl.constexpr):
    """Store this chunk's partials, then count in; returns the count before this arrival."""
    sbase = stats_ptr + (row.to(tl.int64) * NUM_CHUNKS + chunk) * 4
    tl.store(sbase, m)
    tl.store(sbase + 1, s)
    tl.store(sbase + 2, sz)
    # A CTA barrier, then the acq_rel atomic: whoever sees the count complete sees the partials.
    tl.debug_barrier()
    return tl.atomic_add(count_ptr + row, 1, sem="acq_rel", scope="gpu")


@triton.jit
def _lean_wait(count_ptr, row, NUM_CHUNKS: tl.constexpr):
    """Spin until all NUM_CHUNKS programs of the row have published their partials."""
    seen = tl.atomic_add(count_ptr + row, 0, sem="acquire", scope="gpu")
    while seen < NUM_CHUNKS:
        seen = tl.atomic_add(count_ptr + row, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _lean_task(
    row, chunk, is_write, logits_ptr, grad_ptr, stride, target_ptr, loss_ptr, lse_ptr,
    stats_ptr, count_ptr, gscale_ptr, rscale_ptr, n_rows, V, ignore_index, smoothing,
    lse_sq_scale, cap,
    CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr, NC_POW2: tl.constexpr,
    R: tl.constexpr, KW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    WRITE_GRAD: tl.constexpr, HAS_ROW_SCALE: tl.constexpr, QUEUE: tl.constexpr,
    ALIGN: tl.constexpr, VEC: tl.constexpr, REVERSE: tl.constexpr,
    LOAD_POLICY: tl.constexpr, STORE_POLICY: tl.constexpr,
):  # fmt: skip
    """One task on chunk `chunk` of row `row` (nothing when the row is out of range): with QUEUE
    a reduce task, or (is_write) a write task; otherwise both, spinning between them."""
    NB: tl.constexpr = CHUNK // (R * KW)
    if (row >= 0) & (row < n_rows):
        shift = 0
        row_off = row.to(tl.int64) * stride
        if ALIGN:
            # Start from the 16-byte aligned address at or below the row's first column.
            shift = (row_off % VEC).to(tl.int32)
            row_off = tl.multiple_of(row_off - shift, VEC)
        logits_base = logits_ptr + row_off
        grad_base = grad_ptr + row_off
        o0 = chunk * CHUNK
        col0 = o0 - shift
        lo = tl.maximum(col0, 0)
        hi = tl.minimum(col0 + CHUNK, V)
        y = tl.load(target_ptr + row).to(tl.int32)
        if y == ignore_index:
            if is_write:
                if WRITE_GRAD:
                    _lean_zero(grad_base, o0, col0, lo, hi, R, KW, NB)
                if chunk == 0:
                    tl.store(loss_ptr + row, 0.0)
                    tl.store(lse_ptr + row, 0.0)
        elif QUEUE:
            if is_write:
                _lean_wait(count_ptr, row, NUM_CHUNKS)
                m, s, sz = _lean_totals(stats_ptr, row, NUM_CHUNKS, NC_POW2)
                _lean_finish(
                    logits_base, grad_base, o0, col0, lo, hi, row, y, chunk, m, s, sz,
                    loss_ptr, lse_ptr, gscale_ptr, rscale_ptr, V, smoothing, lse_sq_scale, cap,
                    CHUNK, R, KW, NB, shift, HAS_SOFTCAP, HAS_SMOOTHING, WRITE_GRAD,
                    HAS_ROW_SCALE, REVERSE, STORE_POLICY,
                )  # fmt: skip
            else:
                m, s, sz = _lean_reduce(
                    logits_base, o0, col0, lo, hi, cap, R, KW, VEC, NB, HAS_SOFTCAP,
                    HAS_SMOOTHING, LOAD_POLICY,
                )  # fmt: skip
                _lean_publish(stats_ptr, count_ptr, row, chunk, m, s, sz, NUM_CHUNKS)
        else:
            m, s, sz = _lean_reduce(
                logits_base, o0, col0, lo, hi, cap, R, KW, VEC, NB, HAS_SOFTCAP,
                HAS_SMOOTHING, LOAD_POLICY,
            )  # fmt: skip
            if NUM_CHUNKS > 1:
                _lean_publish(stats_ptr, count_ptr, row, chunk, m, s, sz, NUM_CHUNKS)
                _lean_wait(count_ptr, row, NUM_CHUNKS)
                m, s, sz = _lean_totals(stats_ptr, row, NUM_CHUNKS, NC_POW2)
            _lean_finish(
                logits_base, grad_base, o0, col0, lo, hi, row, y, chunk, m, s, sz,
                loss_ptr, lse_ptr, gscale_ptr, rscale_ptr, V, smoothing, lse_sq_scale, cap,
                CHUNK, R, KW, NB, shift, HAS_SOFTCAP, HAS_SMOOTHING, WRITE_GRAD,
                HAS_ROW_SCALE, REVERSE, STORE_POLICY,
            )  # fmt: skip


@triton.jit
def _lean_tile(
    t, logits_ptr, grad_ptr, stride, target_ptr, loss_ptr, lse_ptr, stats_ptr, count_ptr,
    gscale_ptr, rscale_ptr, n_rows, V, ignore_index, smoothing, lse_sq_scale, cap,
    CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr, NC_POW2: tl.constexpr,
    R: tl.constexpr, KW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    WRITE_GRAD: tl.constexpr, HAS_ROW_SCALE: tl.constexpr, QUEUE: tl.constexpr,
    PAIR: tl.constexpr, LAG: tl.constexpr, ALIGN: tl.constexpr,
    VEC: tl.constexpr, REVERSE: tl.constexpr, LOAD_POLICY: tl.constexpr,
    STORE_POLICY: tl.constexpr,
):  # fmt: skip
    """Tile t of the schedule: the task(s) one program does when the grid has one per tile."""
    if QUEUE and PAIR:
        # One program, two tasks on the same chunk index: reduce row j, then write row j - LAG
        # (whose reduce tasks all belong to programs with smaller tickets, which did them first).
        step = t // NUM_CHUNKS
        chunk = t % NUM_CHUNKS
        _lean_task(
            step, chunk, False, logits_ptr, grad_ptr, stride, target_ptr, loss_ptr, lse_ptr,
            stats_ptr, count_ptr, gscale_ptr, rscale_ptr, n_rows, V, ignore_index, smoothing,
            lse_sq_scale, cap, CHUNK, NUM_CHUNKS, NC_POW2, R, KW, HAS_SOFTCAP, HAS_SMOOTHING,
            WRITE_GRAD, HAS_ROW_SCALE, QUEUE, ALIGN, VEC, REVERSE, LOAD_POLICY, STORE_POLICY,
        )  # fmt: skip
        _lean_task(
            step - LAG, chunk, True, logits_ptr, grad_ptr, stride, target_ptr, loss_ptr,
            lse_ptr, stats_ptr, count_ptr, gscale_ptr, rscale_ptr, n_rows, V, ignore_index,
            smoothing, lse_sq_scale, cap, CHUNK, NUM_CHUNKS, NC_POW2, R, KW, HAS_SOFTCAP,
            HAS_SMOOTHING, WRITE_GRAD, HAS_ROW_SCALE, QUEUE, ALIGN, VEC, REVERSE, LOAD_POLICY,
            STORE_POLICY,
        )  # fmt: skip
    else:
        if QUEUE:
            # Step j: the reduce tasks of row j and the write tasks of row j - LAG, alternating.
            step = t // (2 * NUM_CHUNKS)
            within = t % (2 * NUM_CHUNKS)
            is_write = (within % 2) == 1
            chunk = within // 2
            row = tl.where(is_write, step - LAG, step)
        else:
            is_write = True
            row = t // NUM_CHUNKS
            chunk = t % NUM_CHUNKS
        _lean_task(
            row, chunk, is_write, logits_ptr, grad_ptr, stride, target_ptr, loss_ptr, lse_ptr,
            stats_ptr, count_ptr, gscale_ptr, rscale_ptr, n_rows, V, ignore_index, smoothing,
            lse_sq_scale, cap, CHUNK, NUM_CHUNKS, NC_POW2, R, KW, HAS_SOFTCAP, HAS_SMOOTHING,
            WRITE_GRAD, HAS_ROW_SCALE, QUEUE, ALIGN, VEC, REVERSE, LOAD_POLICY, STORE_POLICY,
        )  # fmt: skip


@fast_launch
@triton.jit
def _ce_lean_kernel(
    logits_ptr, grad_ptr, stride, target_ptr, loss_ptr, lse_ptr, stats_ptr, count_ptr,
    gscale_ptr, rscale_ptr, n_rows, V, ignore_index, smoothing, lse_sq_scale, cap, n_tiles,
    CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr, NC_POW2: tl.constexpr,
    R: tl.constexpr, KW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    WRITE_GRAD: tl.constexpr, HAS_ROW_SCALE: tl.constexpr, QUEUE: tl.constexpr,
    PAIR: tl.constexpr, TICKET: tl.constexpr, LAG: tl.constexpr, ALIGN: tl.constexpr,
    VEC: tl.constexpr, REVERSE: tl.constexpr, LOAD_POLICY: tl.constexpr,
    STORE_POLICY: tl.constexpr, PERSIST: tl.constexpr,
):  # fmt: skip
    # PERSIST: a grid smaller than the n_tiles tiles, each program looping over them (fewer CTA
    # launches): with TICKET the next tile from the counter, so a program again only waits for
    # tiles already taken or taken next; otherwise tiles pid, pid + grid, ... (safe for a spin
    # only while the whole grid is resident and holds more programs than a row has chunks).
    if PERSIST:
        if TICKET:
            t = tl.atomic_add(count_ptr + n_rows, 1)
            while t < n_tiles:
                _lean_tile(
                    t, logits_ptr, grad_ptr, stride, target_ptr, loss_ptr, lse_ptr, stats_ptr,
                    count_ptr, gscale_ptr, rscale_ptr, n_rows, V, ignore_index, smoothing,
                    lse_sq_scale, cap, CHUNK, NUM_CHUNKS, NC_POW2, R, KW, HAS_SOFTCAP,
                    HAS_SMOOTHING, WRITE_GRAD, HAS_ROW_SCALE, QUEUE, PAIR, LAG, ALIGN, VEC,
                    REVERSE, LOAD_POLICY, STORE_POLICY,
                )  # fmt: skip
                t = tl.atomic_add(count_ptr + n_rows, 1)
        else:
            for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
                _lean_tile(
                    t, logits_ptr, grad_ptr, stride, target_ptr, loss_ptr, lse_ptr, stats_ptr,
                    count_ptr, gscale_ptr, rscale_ptr, n_rows, V, ignore_index, smoothing,
                    lse_sq_scale, cap, CHUNK, NUM_CHUNKS, NC_POW2, R, KW, HAS_SOFTCAP,
                    HAS_SMOOTHING, WRITE_GRAD, HAS_ROW_SCALE, QUEUE, PAIR, LAG, ALIGN, VEC,
                    REVERSE, LOAD_POLICY, STORE_POLICY,
                )  # fmt: skip
    else:
        if TICKET:
            t = tl.atomic_add(count_ptr + n_rows, 1)
        else:
            t = tl.program_id(0)
        _lean_tile(
            t, logits_ptr, grad_ptr, stride, target_ptr, loss_ptr, lse_ptr, stats_ptr,
            count_ptr, gscale_ptr, rscale_ptr, n_rows, V, ignore_index, smoothing,
            lse_sq_scale, cap, CHUNK, NUM_CHUNKS, NC_POW2, R, KW, HAS_SOFTCAP, HAS_SMOOTHING,
            WRITE_GRAD, HAS_ROW_SCALE, QUEUE, PAIR, LAG, ALIGN, VEC, REVERSE, LOAD_POLICY,
            STORE_POLICY,
        )  # fmt: skip


@fast_launch
@triton.jit
def _scale_kernel(
    x_ptr, numel, row_len, g_ptr, n_blocks, PER_ROW: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    """x *= g over a contiguous tensor: one g, or g[i // row_len] when PER_ROW (one per row).

    A persistent grid strides over the blocks. With one g equal to 1 every program returns
    after one scalar load, so grad_output == 1 costs a single small launch (one program per
    block would still schedule one CTA per 16 KB of gradient just to return); per row, a
    block whose factors are all 1 is skipped.
    """
    # int64 block indices (a gradient can pass 2**31 elements); on the interpreter b is an int.
    first = tl.program_id(0).to(tl.int64)
    step = tl.num_programs(0).to(tl.int64)
    cols = tl.arange(0, BLOCK).to(tl.int64)
    if PER_ROW:
        for b in range(first, n_blocks, step):
            offs = b * BLOCK + cols
            mask = offs < numel
            g = tl.load(g_ptr + offs // row_len, mask=mask, other=1.0).to(tl.float32)
            if tl.min(tl.where(g == 1.0, 1, 0), 0) == 0:
                x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                tl.store(x_ptr + offs, (x * g).to(x_ptr.dtype.element_ty), mask=mask)
    else:
        g = tl.load(g_ptr).to(tl.float32)
        if g != 1.0:
            for b in range(first, n_blocks, step):
                offs = b * BLOCK + cols
                mask = offs < numel
                x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                tl.store(x_ptr + offs, (x * g).to(x_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class CEConfig:
    """Launch shape: a row is split into ceil(V / chunk) programs that loop in `block` steps.

    ``spin``: the programs of a row wait for each other (GPU only) and each writes its own chunk
    of the gradient; otherwise the last program to finish writes the whole row.
    ``one_pass``: a chunk is one block, kept in registers from its load to its gradient store
    (needs chunk == block; used when each program writes its own chunk). On an H200 at
    8192 x 151936 it is slower than the two-read default (2.95 vs 1.66 ms, docs/losses.md), so
    only the CPU interpreter's one-chunk rows use it by default.
    ``evict``: L2 hints, keep the logits (evict_last) and stream the gradient (evict_first).

    ``lean``: the lean kernel (`_ce_lean_kernel`, fewer instructions per element) for calls
    without class weights or predicted tokens; ``queue`` picks its task-queue schedule (any
    device), else its programs spin as ``spin`` does (GPU only: on the interpreter a lean
    config falls back to the queue when a row has several chunks). ``ticket``: take tasks in
    the order programs start (a global counter) rather than by program id. ``lag``: rows
    between a chunk's reduce task and its write task (queue). ``reverse``: the gradient pass
    visits a chunk's blocks last-read first. ``pair`` (queue): each program does a reduce task
    and then the write task of the same chunk ``lag`` rows back (half the programs and
    tickets). ``maxnreg``: cap the lean kernel's registers per
    thread (GPU), so more programs fit an SM (32 lets 16 programs of 4 warps share one).
    ``persist``: launch that many lean programs per SM (0: one per tile), each looping over
    tiles, the next one from the ticket counter (``ticket``) or pid, pid + grid, ... (a spin
    then relies on the whole grid being resident at once: GPU only, opt-in).
    """

    chunk: int
    block: int
    num_warps: int
    spin: bool = False
    evict: bool = False
    one_pass: bool = False
    lean: bool = False
    queue: bool = False
    ticket: bool = True
    lag: int = 4
    reverse: bool = False
    maxnreg: int | None = None
    pair: bool = False
    persist: int = 0

    def __post_init__(self):
        if self.one_pass and self.chunk != self.block:
            raise ValueError(f"one_pass needs chunk == block, got {self.chunk} and {self.block}")
        if self.chunk % self.block:
            raise ValueError(f"chunk ({self.chunk}) must be a multiple of block ({self.block})")
        if self.lag < 1:
            # A write task of the same step as its row's reduce tasks could run first on the
            # interpreter, which runs programs in order, and wait forever.
            raise ValueError(f"lag must be at least 1, got {self.lag}")


CONFIG_ENV = "KERNELS_CE_CONFIG"


@functools.lru_cache(maxsize=16)
def parse_config(spec: str) -> CEConfig:
    """A `CEConfig` from "field=value,..." (a bare field name means True), e.g.
    ``"chunk=8192,block=2048,num_warps=4,lean,queue,maxnreg=32"``; ValueError on a bad spec."""
    fields = {f.name: f for f in dataclasses.fields(CEConfig)}
    kwargs: dict = {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in fields:
            raise ValueError(
                f"{CONFIG_ENV}={spec!r}: unknown field {key!r}; use field=value pairs of "
                f"{', '.join(fields)}"
            )
        if not value:
            kwargs[key] = True
        elif value.strip().lower() in ("true", "false"):
            kwargs[key] = value.strip().lower() == "true"
        else:
            try:
                kwargs[key] = int(value)
            except ValueError:
                raise ValueError(
                    f"{CONFIG_ENV}={spec!r}: {key}={value!r} is not an integer or true/false"
                ) from None
    missing = [k for k in ("chunk", "block", "num_warps") if k not in kwargs]
    if missing:
        raise ValueError(f"{CONFIG_ENV}={spec!r}: give {', '.join(missing)} as well")
    try:
        return CEConfig(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{CONFIG_ENV}={spec!r}: {exc}") from None


def default_config(vocab: int, device: torch.device) -> CEConfig:
    """Launch shape for a vocabulary size, or the one the environment variable KERNELS_CE_CONFIG
    spells (see `parse_config`: how the variants are tried without code).

    The lean kernel, its programs spinning, at most 40 registers per thread: the fastest of the
    probe's variants at every CE shape it swept on an H200 (docs/losses.md: 1.629 ms at
    8192 x 151936 bf16 against 1.678 for the previous default; 0.683 against 1.289 ms at the
    unaligned 8192 x 50257). Calls with class weights or predicted tokens run `_ce_fwd_kernel`
    with the same chunk and block. The CPU interpreter gets the same kernel on rows its small
    tests can split: chunks of 1024 columns (the lean kernel then takes its queue schedule, as
    programs there run one after another), and one chunk when the row fits 1024.
    """
    spec = os.environ.get(CONFIG_ENV)
    if spec:
        return parse_config(spec)
    return _default_config(vocab, device.type == "cuda")


# The lean kernel reads a block as 16-byte vectors (up to 16 elements): no block may be smaller.
MIN_BLOCK = 16


@functools.lru_cache(maxsize=64)
def _default_config(vocab: int, cuda: bool) -> CEConfig:
    # Cached: this runs on every call (per chunk in the fused linear CE).
    if not cuda:
        if vocab <= 1024:
            block = max(MIN_BLOCK, next_pow2(vocab))
            return CEConfig(
                chunk=block, block=block, num_warps=4, one_pass=True, lean=True, spin=True
            )
        return CEConfig(chunk=1024, block=512, num_warps=4, lean=True, spin=True)
    block = max(MIN_BLOCK, min(next_pow2(vocab), 2048))
    chunk = min(cdiv(vocab, block) * block, 8192)
    return CEConfig(chunk=chunk, block=block, num_warps=4, spin=True, lean=True, maxnreg=40)


class Scratch:
    """Partial-result slots and zeroed row counters for a series of `ce_rows` launches on one
    stream (the fused linear CE's chunks): one allocation and one fill for the whole series
    instead of one of each per launch, so the host issues less per chunk.

    The slots are shared: a launch writes every slot it reads, and launches on one stream do
    not overlap. Counters are not: each launch takes `n + 1` fresh zeros.
    """

    def __init__(self, launches: int) -> None:
        self.launches = max(1, launches)
        self._stats: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None
        self._used = 0

    def take(self, n_stats: int, n_counts: int, device: torch.device):
        """(fp32 slots, zeroed int32 counters) of at least the given sizes."""
        if self._stats is None or self._stats.numel() < n_stats:
            self._stats = torch.empty(n_stats, dtype=torch.float32, device=device)
        if self._counts is None or self._used + n_counts > self._counts.numel():
            # Sized by the first (largest) launch: later ones of the series fit in it.
            self._counts = torch.zeros(n_counts * self.launches, dtype=torch.int32, device=device)
            self._used = 0
        counts = self._counts[self._used : self._used + n_counts]
        self._used += n_counts
        return self._stats[:n_stats], counts


def _scratch(scratch: Scratch | None, n_stats: int, n_counts: int, device: torch.device):
    """(slots or None when n_stats is 0, zeroed counters): from `scratch`, else new tensors."""
    if scratch is not None:
        stats, counts = scratch.take(n_stats, n_counts, device)
        return (stats if n_stats else None), counts
    stats = torch.empty(n_stats, dtype=torch.float32, device=device) if n_stats else None
    return stats, torch.zeros(n_counts, dtype=torch.int32, device=device)


def ce_rows(
    logits: torch.Tensor,
    target: torch.Tensor,
    grad: torch.Tensor | None,
    grad_scale: torch.Tensor,
    *,
    row_scale: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    config: CEConfig | None = None,
    weight: torch.Tensor | None = None,
    z_scale: torch.Tensor | None = None,
    pred: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    scratch: Scratch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and log-sum-exp (fp32) of [N, V] logits; when `grad` is given, write
    ``grad_scale * row_scale[row] * dloss/dlogits`` into it (``grad`` may be ``logits`` itself).
    With `out` (two contiguous fp32 [N] tensors, e.g. slices of a caller's buffers) the loss and
    log-sum-exp are written there and returned, instead of into new tensors. With `scratch`
    the kernel's slots and counters come from it (see `Scratch`) instead of new tensors.

    `grad_scale` is a one-element fp32 device tensor, so a mean's 1/count needs no host sync.
    With class weights `weight` ([V] fp32, contiguous) the loss is torch's weighted one plus the
    unweighted z-loss, whose gradient takes `z_scale` (one-element fp32) instead of grad_scale.
    With `pred` ([N] int64) each row's argmax (first of ties; -1 for ignored rows) is stored.
    """
    n, vocab = logits.shape
    if out is None:
        loss = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    else:
        loss, lse = out
        for t in out:
            if t.shape != (n,) or t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError(f"out must be two contiguous fp32 ({n},) tensors, got {t.shape}")
    if n == 0:
        return loss, lse
    if not use_triton(logits):
        computed = _torch_ce_rows(
            logits,
            target,
            grad,
            grad_scale,
            row_scale,
            ignore_index,
            label_smoothing,
            lse_square_scale,
            softcap,
            weight,
            z_scale,
            pred,
        )
        if out is None:
            return computed
        loss.copy_(computed[0])
        lse.copy_(computed[1])
        return loss, lse
    cfg = config or default_config(vocab, logits.device)
    # The lean kernel addresses the gradient with the logits' row stride.
    same_rows = grad is None or grad.stride(0) == logits.stride(0)
    if cfg.lean and weight is None and pred is None and same_rows:
        _lean_rows(logits, target, grad, grad_scale, row_scale, loss, lse, cfg,
                   ignore_index, label_smoothing, lse_square_scale, softcap, scratch)  # fmt: skip
        return loss, lse
    num_chunks = cdiv(vocab, cfg.chunk)
    # Spin only to write a gradient, and never on the interpreter (programs run one by one).
    spin = cfg.spin and num_chunks > 1 and logits.is_cuda and grad is not None
    stats = counts = logits  # placeholders, never read when there is one chunk
    if num_chunks > 1:
        # Four slots per chunk; one arrival counter per row, and the tile ticket after them.
        stats, counts = _scratch(scratch, n * num_chunks * 4, n + 1, logits.device)
    out = logits if grad is None else grad
    _ce_fwd_kernel[(n * num_chunks,)](
        logits,
        logits.stride(0),
        out,
        out.stride(0),
        target,
        loss,
        lse,
        stats,
        counts,
        grad_scale,
        grad_scale if row_scale is None else row_scale,
        loss if weight is None else weight,  # unused stand-ins without weights
        loss if weight is None else weight.sum().reshape(1),
        grad_scale if z_scale is None else z_scale,
        loss if pred is None else pred,
        n,
        vocab,
        ignore_index,
        float(label_smoothing),
        float(lse_square_scale),
        float(softcap) if softcap else 1.0,
        CHUNK=cfg.chunk,
        NUM_CHUNKS=num_chunks,
        NC_POW2=max(2, next_pow2(num_chunks)),
        BLOCK=cfg.block,
        HAS_SOFTCAP=bool(softcap),
        HAS_SMOOTHING=label_smoothing != 0.0,
        WRITE_GRAD=grad is not None,
        HAS_ROW_SCALE=row_scale is not None,
        SPIN=spin,
        OWN_CHUNK=spin or num_chunks == 1,
        ONE_PASS=cfg.one_pass and (spin or num_chunks == 1),
        LOAD_POLICY="evict_last" if cfg.evict else "",
        STORE_POLICY="evict_first" if cfg.evict else "",
        HAS_WEIGHT=weight is not None,
        HAS_PRED=pred is not None,
        num_warps=cfg.num_warps,
    )
    return loss, lse


def _lean_rows(
    logits, target, grad, grad_scale, row_scale, loss, lse, cfg: CEConfig, ignore_index,
    smoothing, lse_sq, softcap, scratch,
):  # fmt: skip
    """`ce_rows` through `_ce_lean_kernel` (see the comment above it); the launch's constants
    come from the plan its key maps to."""
    n, vocab = logits.shape
    out = logits if grad is None else grad
    stride = logits.stride(0)
    key = (n, vocab, stride, logits.dtype, logits.device, grad is None, cfg, ignore_index,
           smoothing, lse_sq, softcap, row_scale is None)  # fmt: skip
    plan = _LEAN_PLANS.get(key)
    if plan is None:
        plan = _lean_plan(logits, grad, row_scale, cfg, ignore_index, smoothing, lse_sq, softcap)
        _LEAN_PLANS.keep(key, plan)
    launch, n_stats, counted, scalars = plan
    stats = counts = loss  # placeholders, never read with one chunk and no queue
    if counted:
        slots, counts = _scratch(scratch, n_stats, n + 1, logits.device)
        stats = loss if slots is None else slots
    launch(logits, out, stride, target, loss, lse, stats, counts, grad_scale,
           grad_scale if row_scale is None else row_scale, *scalars)  # fmt: skip


def _lean_plan(logits, grad, row_scale, cfg: CEConfig, ignore_index, smoothing, lse_sq, softcap):
    """(bound launch, stats slots, whether counters are taken, scalar arguments) of one
    `_lean_rows` key."""
    n, vocab = logits.shape
    stride = logits.stride(0)
    vec = max(1, 16 // logits.element_size())  # elements per 16-byte access
    # A row start that is not 16-byte aligned: read from the aligned address below it.
    align = stride % 16 != 0
    num_chunks = cdiv(vocab + (vec - 1 if align else 0), cfg.chunk)
    kw = min(32 * vec, cfg.block)  # one warp's 16-byte accesses per tile row
    queue = cfg.queue or (num_chunks > 1 and not logits.is_cuda)
    counted = num_chunks > 1 or queue or cfg.ticket
    n_stats = n * num_chunks * 4 if num_chunks > 1 or queue else 0
    tasks = n * num_chunks
    if queue:
        tasks = (n + cfg.lag) * num_chunks * (1 if cfg.pair else 2)
    grid = tasks
    if cfg.persist:
        if logits.is_cuda or cfg.ticket:
            # Never fewer programs than a row has chunks: spinning, they wait for each other.
            grid = min(tasks, max(cfg.persist * sm_count(logits.device), num_chunks))
        else:
            # The interpreter runs programs one after another: the tiles pid, pid + grid, ...
            # of program 0 would include write tasks that wait for later programs' reduces.
            grid = 1
    kwargs = dict(
        CHUNK=cfg.chunk,
        NUM_CHUNKS=num_chunks,
        NC_POW2=max(2, next_pow2(num_chunks)),
        R=cfg.block // kw,
        KW=kw,
        HAS_SOFTCAP=bool(softcap),
        HAS_SMOOTHING=smoothing != 0.0,
        WRITE_GRAD=grad is not None,
        HAS_ROW_SCALE=row_scale is not None,
        QUEUE=queue,
        PAIR=cfg.pair,
        TICKET=cfg.ticket,
        LAG=cfg.lag,
        ALIGN=align,
        VEC=vec,
        REVERSE=cfg.reverse,
        LOAD_POLICY="evict_last" if cfg.evict else "",
        STORE_POLICY="evict_first" if cfg.evict else "",
        PERSIST=cfg.persist > 0,
        num_warps=cfg.num_warps,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg and logits.is_cuda else {}),
    )
    scalars = (n, vocab, ignore_index, float(smoothing), float(lse_sq),
               float(softcap) if softcap else 1.0, tasks)  # fmt: skip
    return _ce_lean_kernel.bound((grid,), kwargs), n_stats, counted, scalars


_LEAN_PLANS = PlanCache()


def _torch_ce_rows(
    logits, target, grad, grad_scale, row_scale, ignore_index, smoothing, lse_sq, softcap,
    weight=None, z_scale=None, pred=None,
):  # fmt: skip
    """The same contract as the kernel, in torch, a few rows at a time (CPU without Triton)."""
    n, vocab = logits.shape
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse_out = torch.empty_like(loss)
    step = max(1, (1 << 24) // max(vocab, 1))
    for r0 in range(0, n, step):
        x = logits[r0 : r0 + step].float()
        t = target[r0 : r0 + step].long()
        z = softcap * torch.tanh(x / softcap) if softcap else x
        lse = torch.logsumexp(z, dim=1)
        ignored = t == ignore_index
        valid = (t >= 0) & (t < vocab)
        ts = torch.where(valid, t, 0)
        zy = z.gather(1, ts[:, None])[:, 0]
        if pred is not None:
            pred[r0 : r0 + step] = torch.where(ignored, -1, z.argmax(1))
        w = None if weight is None else weight.float()
        wy = 1.0 if w is None else w[ts]
        if w is None:
            row_loss = lse - (1.0 - smoothing) * zy + lse_sq * lse * lse
            if smoothing:
                row_loss = row_loss - smoothing / vocab * z.sum(1)
        else:
            row_loss = wy * (1.0 - smoothing) * (lse - zy) + lse_sq * lse * lse
            if smoothing:
                row_loss = row_loss + smoothing / vocab * (w.sum() * lse - (z * w).sum(1))
        row_loss = torch.where(valid, row_loss, float("nan"))
        loss[r0 : r0 + step] = torch.where(ignored, 0.0, row_loss)
        lse_out[r0 : r0 + step] = torch.where(ignored, 0.0, lse)
        if grad is None:
            continue
        p = torch.exp(z - lse[:, None])
        rs = 1.0 if row_scale is None else row_scale[r0 : r0 + step].float()[:, None]
        scale = grad_scale.float().reshape(1, 1) * rs
        rows = torch.arange(len(t))
        if w is None:
            g = p * (1.0 + 2.0 * lse_sq * lse)[:, None] - smoothing / vocab
            g[rows, ts] -= torch.where(valid, 1.0 - smoothing, 0.0)
            g = g * scale
        else:
            g = (wy * (1.0 - smoothing))[:, None] * p
            g[rows, ts] -= torch.where(valid, wy * (1.0 - smoothing), 0.0)
            if smoothing:
                g = g + smoothing / vocab * (w.sum() * p - w)
            zs = (grad_scale if z_scale is None else z_scale).float().reshape(1, 1) * rs
            g = g * scale + (2.0 * lse_sq * lse)[:, None] * zs * p
        if softcap:
            g = g * (1.0 - (z / softcap) ** 2)
        g = torch.where(ignored[:, None], 0.0, g)
        grad[r0 : r0 + step] = g.to(grad.dtype)
    return loss, lse_out


def scale_rows_(grad: torch.Tensor, g: torch.Tensor) -> None:
    """In place ``grad *= g`` for a contiguous ``grad``: g has one element, or one per row
    (``grad.shape[0]`` of them). Blocks whose factor is exactly 1 are skipped on the device.
    """
    if grad.numel() == 0:
        return
    per_row = g.numel() != 1
    g = g.detach().to(torch.float32).reshape(-1).contiguous()
    if not use_triton(grad):  # the kernel's numerics: an fp32 product, rounded once
        factor = g.view(-1, *[1] * (grad.dim() - 1)) if per_row else g
        grad.copy_((grad.float() * factor).to(grad.dtype))
        return
    assert grad.is_contiguous()
    launch, scalars = _scale_launch(grad.numel(), grad.shape[0], per_row, grad.device)
    launch(grad, scalars[0], scalars[1], g, scalars[2])


@functools.lru_cache(maxsize=256)  # asked per backward; a BoundLaunch is shared, never mutated
def _scale_launch(numel: int, rows: int, per_row: bool, device: torch.device):
    """(bound launch, (numel, row length, blocks)) of `_scale_kernel` for one gradient size."""
    block = 8192 if device.type == "cuda" else 1 << 16
    n_blocks = cdiv(numel, block)
    launch = _scale_kernel.bound(
        (min(n_blocks, 8 * sm_count(device)),),
        {"PER_ROW": per_row, "BLOCK": block, "num_warps": 8},
    )
    return launch, (numel, numel // rows, n_blocks)


def grad_scale_tensor(
    reduction: str,
    target: torch.Tensor,
    ignore_index: int,
    num_items: int | float | torch.Tensor | None,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The factor a row's gradient carries for `reduction`, as a one-element fp32 device tensor.

    A weighted mean divides by the kept rows' summed target weights (torch's weighted mean);
    `num_items`, when given, replaces either count. Nothing here waits for the device: the
    count stays on it, and a `num_items` held on the host is read there, not copied over
    (a copy from pageable host memory waits for the device's queue to drain).
    """
    dev = target.device
    if reduction != "mean":
        return torch.ones(1, dtype=torch.float32, device=dev)
    if num_items is None:
        keep = target != ignore_index
        if weight is None:
            count = keep.sum(dtype=torch.float32)
        else:
            rows = torch.where(keep, target, 0).clamp(0, weight.numel() - 1)
            count = (weight.float()[rows] * keep).sum()
    elif isinstance(num_items, torch.Tensor) and num_items.device.type != "cpu":
        count = num_items.detach().to(device=dev, dtype=torch.float32)
    else:  # a number, or a tensor on the host: read there, filled in on the device
        count = torch.full((), float(num_items), dtype=torch.float32, device=dev)
    return torch.reciprocal(count).reshape(1)


class TargetOutOfRange(ValueError):
    """A target outside [0, V) that is not ignore_index (found by ``check_targets=True``)."""


def check_target_range(target: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Raise TargetOutOfRange for a target outside [0, vocab) other than ignore_index.

    Costs one device-to-host sync; without it such a row's loss is NaN (no sync).
    """
    bad = ((target < 0) | (target >= vocab)) & (target != ignore_index)
    if bool(bad.any()):
        first = int(target[bad][0])
        raise TargetOutOfRange(
            f"{int(bad.sum())} target(s) outside [0, {vocab}) and not ignore_index "
            f"({ignore_index}), the first {first}: fix the labels or set them to ignore_index"
        )


def check_options(reduction: str, label_smoothing: float, softcap: float | None) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must lie in [0, 1], got {label_smoothing}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be positive or None, got {softcap}")


def reduce_rows(loss: torch.Tensor, reduction: str, grad_scale: torch.Tensor) -> torch.Tensor:
    if reduction == "none":
        return loss
    total = loss.sum()
    return total * grad_scale[0] if reduction == "mean" else total


class Extras(NamedTuple):
    """What the options ask for besides the loss (fp32, int64), computed in the same pass."""

    z_loss: torch.Tensor | None
    token_accuracy: torch.Tensor | None
    predicted_tokens: torch.Tensor | None


class CrossEntropyOutput(NamedTuple):
    """The loss and, where asked for, the z-loss, the token accuracy and the predicted tokens.

    ``z_loss``: lse_square_scale * lse**2, reduced like the loss but unweighted (already part
    of ``loss``; returned for logging, no gradient). ``token_accuracy``: the fraction of kept
    rows whose argmax is the target (per row, 0 or 1, with ``reduction="none"``).
    ``predicted_tokens``: each row's argmax (first of ties), -1 for ignored rows.
    """

    loss: torch.Tensor
    z_loss: torch.Tensor | None = None
    token_accuracy: torch.Tensor | None = None
    predicted_tokens: torch.Tensor | None = None


def reduce_with_options(
    loss: torch.Tensor,
    lse: torch.Tensor,
    target: torch.Tensor,
    pred: torch.Tensor | None,
    *,
    reduction: str,
    gscale: torch.Tensor,
    zscale: torch.Tensor | None,
    lse_square_scale: float,
    ignore_index: int,
    want_z: bool,
    want_acc: bool,
    row_factor: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Extras]:
    """The reduced loss (weighted CE over its count, z-loss over the row count when `zscale`
    differs) and the extras, from the per-row loss and log-sum-exp. `row_factor`: what each
    row's loss was multiplied by after the kernel (fused linear CE's token scaling)."""
    z_rows = None
    if want_z or zscale is not None:
        z_rows = lse_square_scale * lse * lse
        if row_factor is not None:
            z_rows = z_rows * row_factor
    if zscale is not None and reduction == "mean" and lse_square_scale:
        total = (loss - z_rows).sum() * gscale[0] + z_rows.sum() * zscale[0]
    else:
        total = reduce_rows(loss, reduction, gscale)
    z = acc = None
    if want_z:
        z = reduce_rows(z_rows, reduction, gscale if zscale is None else zscale)
    if want_acc:
        keep = target != ignore_index
        correct = ((pred == target) & keep).float()
        acc = correct if reduction == "none" else correct.sum() / keep.sum().clamp_min(1)
    return total, Extras(z, acc, pred)


def _forward(logits, target, ignore_index, label_smoothing, lse_square_scale, softcap,
             reduction, num_items, grad, weight, want):  # fmt: skip
    """The reduced loss and the extras of `logits` (the gradient written into `grad` when it is
    given), as `CrossEntropyFunction` and the custom op both compute them."""
    want_z, want_acc, want_pred = want
    w = None if weight is None else weight.detach().float().contiguous()
    gscale = grad_scale_tensor(reduction, target, ignore_index, num_items, w)
    # The z-loss is unweighted (Liger's choice): with weights its mean has its own count.
    zscale = None
    if w is not None:
        zscale = grad_scale_tensor(reduction, target, ignore_index, num_items)
    pred = None
    if want_acc or want_pred:
        pred = torch.empty(target.shape, dtype=torch.int64, device=target.device)
    loss, lse = ce_rows(
        logits,
        target,
        grad,
        gscale,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        lse_square_scale=lse_square_scale,
        softcap=softcap,
        weight=w,
        z_scale=zscale,
        pred=pred,
    )
    return reduce_with_options(
        loss, lse, target, pred, reduction=reduction, gscale=gscale, zscale=zscale,
        lse_square_scale=lse_square_scale, ignore_index=ignore_index, want_z=want_z,
        want_acc=want_acc,
    )  # fmt: skip


class CrossEntropyFunction(torch.autograd.Function):
    """Autograd wrapper (the eager path): the forward writes the gradient; the backward only
    rescales it.

    Returns (loss, z_loss, token_accuracy, predicted_tokens), the last three empty unless asked
    for and never differentiable.
    """

    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        target: torch.Tensor,
        ignore_index: int,
        label_smoothing: float,
        lse_square_scale: float,
        softcap: float | None,
        reduction: str,
        num_items,
        inplace: bool,
        need_grad: bool,
        weight: torch.Tensor | None,
        want: tuple[bool, bool, bool],
    ):
        grad = None
        if need_grad:
            grad = logits if inplace else torch.empty_like(logits)
        total, extras = _forward(logits, target, ignore_index, label_smoothing, lse_square_scale,
                                 softcap, reduction, num_items, grad, weight, want)  # fmt: skip
        if grad is not None and inplace:
            # Anyone who saved these logits for their own backward now gets autograd's
            # "modified by an inplace operation" error instead of silently wrong gradients.
            torch.autograd.graph.increment_version(logits)
        ctx.grad = grad
        empty = total.new_empty(0)
        outs = [t if t is not None else empty for t in extras]
        ctx.mark_non_differentiable(*outs)
        # No zero-filled gradients for the extras (never differentiable) on every backward.
        ctx.set_materialize_grads(False)
        return (total, *outs)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, *_extras):
        grad, ctx.grad = ctx.grad, None
        if grad is None or grad_out is None:  # None: no gradient reached the loss
            return (None,) * 12
        scale_rows_(grad, grad_out)
        return (grad,) + (None,) * 11


# --- torch.library op: what torch.compile sees ------------------------------------------------
#
# One opaque forward returning the loss, the extras and the gradient (a new buffer: under
# torch.compile the graph owns the logits, so `inplace` does not apply); the gradient is saved
# and the backward scales it by grad_output with torch ops Inductor fuses. A tensor of size 0
# stands for an output not asked for.


@torch.library.custom_op(op_name("ce_fwd"), mutates_args=())
def ce_fwd(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: Optional[torch.Tensor],  # noqa: UP045 - torch.library parses typing.Optional
    num_items: Optional[torch.Tensor],  # noqa: UP045
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: Optional[float],  # noqa: UP045
    reduction: str,
    want_z: bool,
    want_acc: bool,
    want_pred: bool,
    need_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    grad = torch.empty_like(logits) if need_grad else None
    total, extras = _forward(logits, target, ignore_index, label_smoothing, lse_square_scale,
                             softcap, reduction, num_items, grad, weight,
                             (want_z, want_acc, want_pred))  # fmt: skip
    outs = [total.new_empty(0) if t is None else t for t in (*extras, grad)]
    return (total, *outs)


@ce_fwd.register_fake
def _(logits, target, weight, num_items, ignore_index, label_smoothing, lse_square_scale,
      softcap, reduction, want_z, want_acc, want_pred, need_grad):  # fmt: skip
    # Traced for a compile: the saved gradient's scaling runs in place (compile_grad_scale.py).
    from . import compile_grad_scale

    compile_grad_scale.install()
    n = logits.shape[0]
    f32 = dict(dtype=torch.float32)
    total = logits.new_empty((n,) if reduction == "none" else (), **f32)
    nothing = lambda: logits.new_empty(0, **f32)  # noqa: E731
    z = total.new_empty(total.shape) if want_z else nothing()
    acc = total.new_empty(total.shape) if want_acc else nothing()
    pred = logits.new_empty(n, dtype=torch.int64) if want_acc or want_pred else nothing()
    grad = logits.new_empty(logits.shape) if need_grad else nothing()
    return total, z, acc, pred, grad


def _op_setup(ctx, inputs, output):
    ctx.need_grad = inputs[-1]
    ctx.save_for_backward(output[4])


def _op_backward(ctx, g_total, *_unused):
    if not ctx.need_grad:
        return (None,) * 13
    (grad,) = ctx.saved_tensors
    g = g_total.float()
    if g.dim():  # reduction="none": one factor per row
        g = g[:, None]
    return ((grad.float() * g).to(grad.dtype),) + (None,) * 12


ce_fwd.register_autograd(_op_backward, setup_context=_op_setup)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    reduction: str = "mean",
    num_items: int | float | torch.Tensor | None = None,
    inplace: bool = True,
    weight: torch.Tensor | None = None,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False,
    check_targets: bool = False,
) -> torch.Tensor | CrossEntropyOutput:
    """Cross-entropy of ``logits[..., V]`` against integer ``target[...]``; an fp32 loss.

    ``mean`` divides by the non-ignored count, or by ``num_items`` when given (transformers'
    ``num_items_in_batch``). With ``inplace=True`` and a gradient needed, the logits buffer is
    overwritten by the gradient during the forward (zero extra memory): do not read it afterwards.

    ``weight`` ([V] class weights): torch's weighted loss, its mean over the kept rows' summed
    target weights; the z-loss stays unweighted, its mean over the kept row count (Liger's).
    ``return_z_loss`` / ``return_token_accuracy`` / ``return_predicted_tokens``: return a
    `CrossEntropyOutput` instead of the loss alone (see its docstring); all come from the same
    pass over the logits. A target outside [0, V) that is not ignore_index gives a NaN loss for
    its row (no host sync); ``check_targets=True`` raises `TargetOutOfRange` instead, at the
    price of one sync.
    """
    check_options(reduction, label_smoothing, softcap)
    vocab = logits.shape[-1]
    if target.shape != logits.shape[:-1]:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal logits shape without its last "
            f"dimension, {tuple(logits.shape[:-1])}"
        )
    check_weight(weight, vocab, logits.device)
    if check_targets:
        check_target_range(target, vocab, ignore_index)
    rows = logits.reshape(-1, vocab).contiguous()  # a view unless the rows are strided
    want = (return_z_loss, return_token_accuracy, return_predicted_tokens)
    # Not ctx.needs_input_grad: that stays True under torch.no_grad(), and the logits must not
    # be consumed when no backward will come.
    need_grad = torch.is_grad_enabled() and logits.requires_grad
    if torch.compiler.is_compiling():
        if num_items is not None and not isinstance(num_items, torch.Tensor):
            # A number becomes a 0-d tensor in the graph, so a new value is no new graph.
            num_items = torch.full((), num_items, dtype=torch.float32, device=logits.device)
        loss, z, acc, pred, _ = ce_fwd(
            rows, target.reshape(-1).contiguous(), weight, num_items, ignore_index,
            float(label_smoothing), float(lse_square_scale),
            None if softcap is None else float(softcap), reduction, *want, need_grad,
        )  # fmt: skip
    else:
        loss, z, acc, pred = CrossEntropyFunction.apply(
            rows,
            target.reshape(-1).contiguous(),
            ignore_index,
            float(label_smoothing),
            float(lse_square_scale),
            softcap,
            reduction,
            num_items,
            inplace,
            need_grad,
            weight,
            want,
        )
    if reduction == "none":
        loss = loss.view(target.shape)
        acc = acc.view(target.shape) if return_token_accuracy else acc
    if not any(want):
        return loss
    return CrossEntropyOutput(
        loss,
        z.view(target.shape)
        if return_z_loss and reduction == "none"
        else (z if return_z_loss else None),
        acc if return_token_accuracy else None,
        pred.view(target.shape) if return_predicted_tokens else None,
    )


def check_weight(weight: torch.Tensor | None, vocab: int, device: torch.device) -> None:
    """Class weights must be one float per class, on the logits' device."""
    if weight is None:
        return
    if weight.shape != (vocab,) or not weight.is_floating_point() or weight.device != device:
        raise ValueError(
            f"weight must be a float tensor of shape ({vocab},) on {device}, got "
            f"{weight.dtype} {tuple(weight.shape)} on {weight.device}"
        )
