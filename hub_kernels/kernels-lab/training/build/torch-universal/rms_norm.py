"""RMSNorm over the last dimension, forward and backward, with Liger's casting modes and offset.

``y = x̂ · (offset + w)`` with ``x̂ = x · rstd`` and ``rstd = 1 / sqrt(mean(x²) + eps)``; the
three casting modes (Liger's names) say where results are rounded to the input dtype:

- "llama" (HF LlamaRMSNorm / Qwen3RMSNorm): rstd from x in fp32, x̂ rounded to the input dtype,
  then multiplied by ``offset + w`` (fp32) and rounded to the promoted dtype of weight and input.
- "gemma" (HF GemmaRMSNorm, with offset 1.0): everything in fp32, cast to the input dtype at the
  end.
- "none": the input dtype throughout: rstd, x̂ and y each rounded to it (sums of squares still
  accumulate in fp32, as any sane reduction does), output in the input dtype.

Without a weight, ``y = x̂`` (the offset is ignored, as in Liger) in the input dtype. The
backward computes in fp32 in every mode; dW uses the x̂ the forward multiplied (rounded in llama
and none modes). ``gemma=True`` is the legacy spelling of offset 1.0 in gemma mode.

The forward holds whole rows of a block in registers, or (one of the geometries the tuner times at
rows of 8192 columns or more) walks each row in chunks, twice. It keeps one fp32 rstd per row; a
forward no gradient will follow (no_grad, or inputs that need none) neither stores nor allocates
it, and records no autograd node. The backward needs x̂ = x·rstd: by default it keeps the input x;
with ``save_output=True`` it keeps the output y instead and recovers x̂ = y / w (as apex's
``memory_efficient`` norms do). A model's linear layers save y anyway, so that mode stores nothing
of its own but rstd; its price is that a weight entry of exactly zero makes that column's gradients
NaN (loudly wrong, never silently).

The backward is persistent: each program walks a contiguous range of rows, writes dx, and keeps
its share of dW in fp32 registers; a second small kernel sums the per-program partials, so dW is
deterministic and needs no atomics.
"""

import functools
from typing import Optional

import torch

from ._common import (
    PlanCache,
    as_rows,
    cached_config,
    cdiv,
    config_is_final,
    contiguous_strides,
    fast_launch,
    needs_grad,
    next_pow2,
    op_name,
    pick_config,
    rows_stride,
    sm_count,
    use_triton,
)
from ._triton import tl, triton
from .tensor_parallel import dtensor_rms_norm, is_dtensor

# Rows wider than this do not fit one program's registers; they take the torch path.
MAX_TRITON_N = 65536

# Casting modes, as the kernels' MODE constexpr.
LLAMA, GEMMA, NONE = 0, 1, 2
CASTING_MODES = {"llama": LLAMA, "gemma": GEMMA, "none": NONE}


def numerics(gemma) -> tuple[float, int]:
    """(offset, mode) of a `gemma` argument: the legacy bool or an (offset, mode) pair."""
    if isinstance(gemma, tuple):
        return gemma
    return (1.0, GEMMA) if gemma else (0.0, LLAMA)


def resolve_numerics(gemma: bool, offset: float, casting_mode: str | None) -> tuple[float, int]:
    """(offset, mode) of the public keywords; ``gemma=True`` means offset 1.0 in gemma mode."""
    if gemma:
        if offset not in (0.0, 1.0) or casting_mode not in (None, "gemma"):
            raise ValueError("gemma=True already sets offset=1.0, casting_mode='gemma'; pass one")
        return 1.0, GEMMA
    if casting_mode is None:
        casting_mode = "llama"
    mode = CASTING_MODES.get(casting_mode)
    if mode is None:
        raise ValueError(
            f"casting_mode must be one of {sorted(CASTING_MODES)}, got {casting_mode!r}"
        )
    return float(offset), mode


@triton.jit
def _forward_weight(W, cols, cmask, offset, HAS_OFFSET: tl.constexpr, EVEN: tl.constexpr):
    if EVEN:
        w = tl.load(W + cols).to(tl.float32)
    else:
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    if HAS_OFFSET:
        w += offset
    return w


@triton.jit
def _load_row_block(ptrs, mask, EVEN: tl.constexpr, POLICY: tl.constexpr):
    """A block of rows (zeros past the edges unless EVEN: then there are none). POLICY is an
    eviction policy, "" for none: always passed, as Triton 3.6 hands a jit function's omitted
    constexpr default on as a plain str and fails to compile the call."""
    if EVEN:
        block = tl.load(ptrs, eviction_policy=POLICY)
    else:
        block = tl.load(ptrs, mask=mask, other=0.0, eviction_policy=POLICY)
    return block


@triton.jit
def _store_row_block(ptrs, value, mask, EVEN: tl.constexpr, POLICY: tl.constexpr):
    """Stores a block of rows (inside the edges unless EVEN: then all of it is); POLICY as
    `_load_row_block`'s."""
    if EVEN:
        tl.store(ptrs, value, eviction_policy=POLICY)
    else:
        tl.store(ptrs, value, mask=mask, eviction_policy=POLICY)


@fast_launch
@triton.jit
def _rms_norm_fwd_kernel(
    X, R, W, Y, S, RSTD, M, N, stride_x, stride_r, stride_y, stride_s, eps, offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr, RESIDUAL: tl.constexpr,
    HAS_W: tl.constexpr, HAS_OFFSET: tl.constexpr, STATS: tl.constexpr,
    EVEN: tl.constexpr = False,
):  # fmt: skip
    # EVEN: N == BLOCK_N and BLOCK_M divides M (see `fwd_candidates`): no masks, and the mean a
    # multiply by the exact reciprocal of the power of two N, as Inductor's shape-specialised
    # kernels do.
    # RESIDUAL: normalise s = x + r (rounded to x's dtype, as HF's residual add) and store s too.
    # STATS: store rstd for a backward; a forward that no gradient will follow skips the store.
    # HAS_OFFSET: offset != 0. Without it the weight stays exactly a 16-bit value, so the compiler
    # multiplies x̂ by w in packed bf16 (the same rounding: both factors are exact in 16 bits);
    # a run-time `+ offset` of 0.0 hid that, and cost 2-10 % of the kernel's time on the H200.
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    if EVEN:
        mask = None
    else:
        mask = rmask[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = _load_row_block(X + r64 * stride_x + cols[None, :], mask, EVEN, "").to(tl.float32)
    # Rows of 1024 or more read the weight before the row sums, so its load overlaps x's
    # instead of waiting behind the sums' barrier: up to 8 % faster at those shapes on the
    # H200, in CUDA graphs (scripts/probes/probe_norm_fwd_load_order_gpu.py). At 128 it gained
    # nothing, and lost 4 % at 4096 x 128 while the offset add was still there: those keep the
    # load after the sums.
    if HAS_W:
        if BLOCK_N >= 1024:
            w = _forward_weight(W, cols, cmask, offset, HAS_OFFSET, EVEN)
    if RESIDUAL:
        r = _load_row_block(R + r64 * stride_r + cols[None, :], mask, EVEN, "").to(tl.float32)
        # One rounding of the exact fp32 sum: what torch's 16-bit add gives.
        x = (x + r).to(S.dtype.element_ty)
        tl.store(S + r64 * stride_s + cols[None, :], x, mask=mask)
        x = x.to(tl.float32)
    if EVEN:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) * (1.0 / BLOCK_N) + eps)
    else:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    if MODE == 2:  # none: rstd in the input dtype too
        rstd = rstd.to(X.dtype.element_ty).to(tl.float32)
    xhat = x * rstd[:, None]
    if MODE != 1:
        # HF Llama casts x * rstd back to the input dtype before the weight multiply.
        xhat = xhat.to(X.dtype.element_ty).to(tl.float32)
    if HAS_W:
        if BLOCK_N < 1024:
            w = _forward_weight(W, cols, cmask, offset, HAS_OFFSET, EVEN)
        y = xhat * w[None, :]
    else:
        y = xhat
    tl.store(Y + r64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    if STATS:
        _store_row_block(RSTD + rows, rstd, rmask, EVEN, "")


@fast_launch
@triton.jit
def _rms_norm_fwd_looped_kernel(
    X, R, W, Y, S, RSTD, M, N, stride_x, stride_r, stride_y, stride_s, eps, offset,
    BLOCK_M: tl.constexpr, LOOP: tl.constexpr, MODE: tl.constexpr, RESIDUAL: tl.constexpr,
    HAS_W: tl.constexpr, HAS_OFFSET: tl.constexpr, STATS: tl.constexpr,
    EVEN: tl.constexpr = False,
):  # fmt: skip
    # The same forward over one row per program in chunks of LOOP columns, in two passes: the sums,
    # then x̂ and y, reading the row again (kept in L2 by the first read's evict_last). Few
    # registers per thread, so more rows in flight per SM than a whole row in registers allows.
    # EVEN: LOOP divides N (no masks). BLOCK_M is 1.
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.arange(0, LOOP)
    acc = tl.zeros([LOOP], dtype=tl.float32)
    for c0 in tl.range(0, N, LOOP):
        cols = c0 + chunk
        cmask = cols < N
        x = _load_row_block(X + row * stride_x + cols, cmask, EVEN, "evict_last").to(tl.float32)
        if RESIDUAL:
            r = _load_row_block(R + row * stride_r + cols, cmask, EVEN, "").to(tl.float32)
            x = (x + r).to(S.dtype.element_ty)
            _store_row_block(S + row * stride_s + cols, x, cmask, EVEN, "evict_last")
            x = x.to(tl.float32)
        acc += x * x
    rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
    if MODE == 2:  # none: rstd in the input dtype too
        rstd = rstd.to(X.dtype.element_ty).to(tl.float32)
    for c0 in tl.range(0, N, LOOP):
        cols = c0 + chunk
        cmask = cols < N
        # The row again (the residual sum s with RESIDUAL), from L2; dropped from it after.
        if RESIDUAL:
            src = S + row * stride_s + cols
        else:
            src = X + row * stride_x + cols
        x = _load_row_block(src, cmask, EVEN, "evict_first").to(tl.float32)
        xhat = x * rstd
        if MODE != 1:
            xhat = xhat.to(X.dtype.element_ty).to(tl.float32)
        if HAS_W:
            y = xhat * _forward_weight(W, cols, cmask, offset, HAS_OFFSET, EVEN)
        else:
            y = xhat
        _store_row_block(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), cmask, EVEN, "")
    if STATS:
        tl.store(RSTD + row, rstd)


@triton.jit
def _load_rows(
    DY, X, RSTD, DS, r0, row_end, cols, cmask, stride_dy, stride_x, stride_ds,
    BLOCK_M: tl.constexpr, HAS_DS: tl.constexpr, POLICY: tl.constexpr,
):  # fmt: skip
    """One block of rows' dy, x (or y), rstd and, with HAS_DS, ds (else ds is dy, unused)."""
    rows = r0 + tl.arange(0, BLOCK_M)
    rmask = rows < row_end
    mask = rmask[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)[:, None]
    dy = tl.load(DY + r64 * stride_dy + cols[None, :], mask=mask, other=0.0, eviction_policy=POLICY)
    x = tl.load(X + r64 * stride_x + cols[None, :], mask=mask, other=0.0, eviction_policy=POLICY)
    rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
    if HAS_DS:
        ds = tl.load(
            DS + r64 * stride_ds + cols[None, :], mask=mask, other=0.0, eviction_policy=POLICY
        )
    else:
        ds = dy
    return dy, x, rstd, ds


@triton.jit
def _weight(W, cols, cmask, offset, BLOCK_N: tl.constexpr, HAS_W: tl.constexpr,
            FROM_Y: tl.constexpr):  # fmt: skip
    """(offset + w in fp32, and its reciprocal with FROM_Y, else w again); w = 1 without a
    weight (the gradient is then that of w = 1, and dW is never asked for)."""
    if HAS_W:
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32) + offset
    else:
        w = tl.full([BLOCK_N], 1.0, tl.float32)
    w_inv = w
    if FROM_Y:
        # 1/0 = inf and 0 * inf = NaN: a zero weight poisons its column instead of lying.
        w_inv = tl.where(cmask, 1.0 / w, 0.0)
    return w, w_inv


@triton.jit
def _row_terms(dy, x, rstd, w, w_inv, FROM_Y: tl.constexpr):
    """(dy, x̂, g = dy·w) in fp32 for one block of rows."""
    dy = dy.to(tl.float32)
    if FROM_Y:
        xhat = x.to(tl.float32) * w_inv[None, :]
    else:
        xhat = x.to(tl.float32) * rstd[:, None]
    return dy, xhat, dy * w[None, :]


@fast_launch
@triton.jit
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DX, DW_PART, DS, M, N, stride_dy, stride_x, stride_dx, stride_ds,
    rows_per_program, offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr,
    COMPUTE_DW: tl.constexpr, PREFETCH: tl.constexpr, ACC_2D: tl.constexpr, FROM_Y: tl.constexpr,
    HAS_DS: tl.constexpr, HAS_W: tl.constexpr, RELOAD: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    # FROM_Y: X points at the forward's output y, and x̂ = y / w.
    # HAS_DS: DS is the gradient of the residual sum s = x + r, which also flows to x (and r).
    # RELOAD (wide rows): 0 keeps a row block's dy and x in registers from the row sum to dx;
    # 1 reads them again after the sum (a cache hit: the first read was a moment ago), so only the
    # fp32 products of the sum are live across it; 2 also reads w per pass instead of keeping
    # it for the whole loop. Fewer live registers: no spills, and room for PREFETCH.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    if RELOAD < 2:
        w, w_inv = _weight(W, cols, cmask, offset, BLOCK_N, HAS_W, FROM_Y)
    # ACC_2D keeps dW per row of the tile and reduces once at the end: no cross-warp reduction
    # per iteration, which pays off for short rows (q/k norms).
    if ACC_2D:
        dw = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    if PREFETCH:
        dy_n, x_n, rstd_n, ds_n = _load_rows(
            DY, X, RSTD, DS, row_start, row_end, cols, cmask, stride_dy, stride_x, stride_ds,
            BLOCK_M, HAS_DS, "",
        )  # fmt: skip
    for r0 in tl.range(row_start, row_end, BLOCK_M, num_stages=STAGES):
        if PREFETCH:
            # Issue the next block's loads before this block's math: one HBM latency hidden.
            dy, x, rstd, ds = dy_n, x_n, rstd_n, ds_n
            dy_n, x_n, rstd_n, ds_n = _load_rows(
                DY, X, RSTD, DS, r0 + BLOCK_M, row_end, cols, cmask, stride_dy, stride_x,
                stride_ds, BLOCK_M, HAS_DS, "",
            )  # fmt: skip
        else:
            dy, x, rstd, ds = _load_rows(
                DY, X, RSTD, DS, r0, row_end, cols, cmask, stride_dy, stride_x, stride_ds,
                BLOCK_M, HAS_DS, "",
            )  # fmt: skip
        rows = r0 + tl.arange(0, BLOCK_M)
        mask = (rows < row_end)[:, None] & cmask[None, :]
        if RELOAD == 2:
            w, w_inv = _weight(W, cols, cmask, offset, BLOCK_N, HAS_W, FROM_Y)
        dy, xhat, g = _row_terms(dy, x, rstd, w, w_inv, FROM_Y)
        c = tl.sum(g * xhat, axis=1) / N
        if RELOAD > 0:
            # A second read of the same rows, from the cache. Another eviction policy makes it an
            # operation of its own, which the compiler cannot merge with the first read.
            dy, x, _rstd, ds = _load_rows(
                DY, X, RSTD, DS, r0, row_end, cols, cmask, stride_dy, stride_x, stride_ds,
                BLOCK_M, HAS_DS, "evict_first",
            )  # fmt: skip
            if RELOAD == 2:
                w, w_inv = _weight(W, cols, cmask, offset, BLOCK_N, HAS_W, FROM_Y)
            dy, xhat, g = _row_terms(dy, x, rstd, w, w_inv, FROM_Y)
        dx = (g - xhat * c[:, None]) * rstd[:, None]
        if HAS_DS:
            dx += ds.to(tl.float32)
        dx_ptr = DX + rows.to(tl.int64)[:, None] * stride_dx + cols[None, :]
        tl.store(dx_ptr, dx.to(DX.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            if MODE == 1 or FROM_Y:
                # FROM_Y: y / w is already HF's rounded x̂ up to y's own rounding; rounding it
                # again would double the error of dW.
                contrib = dy * xhat
            else:
                contrib = dy * xhat.to(X.dtype.element_ty).to(tl.float32)
            if ACC_2D:
                dw += contrib
            else:
                dw += tl.sum(contrib, axis=0)
    if COMPUTE_DW:
        if ACC_2D:
            tl.store(DW_PART + pid * N + cols, tl.sum(dw, axis=0), mask=cmask)
        else:
            tl.store(DW_PART + pid * N + cols, dw, mask=cmask)


@fast_launch
@triton.jit
def _column_sum_kernel(PART, OUT, P, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """OUT[n] = sum_p PART[p, n], cast to OUT's dtype (second stage of a dW/dB reduction)."""
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        ps = p0 + tl.arange(0, BLOCK_P)
        mask = (ps < P)[:, None] & cmask[None, :]
        acc += tl.sum(tl.load(PART + ps[:, None] * N + cols[None, :], mask=mask, other=0.0), axis=0)
    tl.store(OUT + cols, acc.to(OUT.dtype.element_ty), mask=cmask)


def column_sum(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Sum a [P, N] fp32 partial buffer over P into a new [N] tensor of `dtype`."""
    p, n = part.shape
    out = torch.empty(n, dtype=dtype, device=part.device)
    column_sum_launch(p, n, part.device, dtype)(part, out, p, n)
    return out


@functools.lru_cache(maxsize=256)  # asked per backward; a BoundLaunch is shared, never mutated
def column_sum_launch(p: int, n: int, device: torch.device, dtype: torch.dtype):
    """The bound launch of `_column_sum_kernel` over a [p, n] partial buffer into an [n] tensor
    of `dtype`: call it with (part, out, p, n)."""
    # Narrow column blocks: enough programs to spread the read over the SMs.
    block_n = max(16, min(256, next_pow2(n // (2 * sm_count(device)))))
    return _column_sum_kernel.bound((cdiv(n, block_n),), {"BLOCK_P": 64, "BLOCK_N": block_n})


def fwd_kernel(cfg: dict):
    """The forward kernel a geometry runs: two passes over chunks with LOOP, else whole rows."""
    return _rms_norm_fwd_looped_kernel if cfg.get("LOOP") else _rms_norm_fwd_kernel


def fwd_config(m: int, n: int) -> dict:
    """Launch geometry for the forward: several rows per program when rows are short."""
    return fwd_candidates(m, n)[0]


def fwd_candidates(m: int, n: int) -> list[dict]:
    """Forward geometries worth timing; the first is the default, used untimed while a CUDA graph
    is captured. Where a geometry tiles [m, n] exactly it comes twice: masked, and EVEN."""
    base = _fwd_candidates(next_pow2(m), n)
    if n != next_pow2(n):
        return base
    # Without masks the compiler schedules the loads and stores differently, faster at some
    # shapes and slower at others (on the H200, in CUDA graphs: 1024 x 1024 faster, 4096 x 1024
    # 7 % slower), so the variant is timed, not assumed.
    return base + [dict(c, EVEN=True) for c in base if m % c["BLOCK_M"] == 0 and "LOOP" not in c]


def even_key(m: int) -> int:
    """What decides which EVEN geometries fit m rows (the power of two dividing m), for keys of
    picks shared across row counts."""
    return m & -m


# Keyed by the row count's power of two, all the lists depend on: varying sequence lengths hit.
@functools.lru_cache(maxsize=1024)  # asked on every call; shared, never mutated
def _fwd_candidates(m_pow2: int, n: int) -> list[dict]:
    block_n = next_pow2(n)

    def cfg(tile, warps):
        block_m = max(1, min(tile // block_n, m_pow2))
        return {"BLOCK_M": block_m, "num_warps": max(1, min(warps, block_m * block_n // 256))}

    if block_n > 512:
        # Wide rows: the first (about 90 % of copy bandwidth on large inputs), then one or two
        # rows per program at 16, 32 or 64 elements per thread. With 1024-4096 rows, inside a
        # CUDA graph, the tuner's pick among these beat the first by 2-9 % at four of eight
        # widths x row counts and lost 1 % at one (scripts/probes/probe_norm_fwd_ab_gpu.py).
        wide = [cfg(max(4096, block_n), 8 if block_n <= 4096 else 16)]
        for rows in (1, 2) if block_n <= 4096 else (1,):
            block_m = min(rows, m_pow2)
            for per_thread in (16, 32, 64):
                warps = block_m * block_n // (32 * per_thread)
                option = {"BLOCK_M": block_m, "num_warps": warps}
                if 1 <= warps <= 32 and option not in wide:
                    wide.append(option)
        if block_n >= 8192:  # two passes over chunks (see _rms_norm_fwd_looped_kernel)
            # Forced, in CUDA graphs of 32 calls each writing a new output, on the H200: the
            # best of ours at 1024 x 8192 (8 warps, chunks of 2048: 0.935-0.966x Inductor's in
            # three calls) and at 4096 x 8192 (16 warps, 4096: 0.992-1.008x; every whole-row
            # geometry 1.007x or more in the same calls). Chunks of 1024, 2048 at 16 warps and
            # unmasked versions of these were never the best.
            looped = [{"BLOCK_M": 1, "num_warps": 16, "LOOP": 4096},
                      {"BLOCK_M": 1, "num_warps": 8, "LOOP": 2048}]  # fmt: skip
            if n == 8192:
                # Only these at rows of exactly 8192: the tuner, timing one launch or a burst
                # into two output sets, kept picking a whole-row geometry that ran 1.5-3 %
                # slower than the looped one in those chains (fifteenth and sixteenth sessions;
                # at 16384 columns a whole-row geometry was the best, and other widths were not
                # measured).
                return looped
            wide += looped
        return wide
    # 16 rows x 8 warps at 128 columns (cfg(2048, 8)): 1.70 µs at 4096 x 128 in CUDA graphs on
    # the H200, 6 % under the best of the others (and 1.39 against 1.44 at 1024 x 128), below
    # Inductor's 1.74-2.21 (its own pick varies between processes); sixteenth session.
    small = [cfg(4096, 8), cfg(4096, 4), cfg(8192, 8), cfg(8192, 4), cfg(2048, 4), cfg(2048, 8)]
    return [c for i, c in enumerate(small) if c not in small[:i]]  # a few rows clamp alike


def bwd_candidates(
    m: int, n: int, dw: bool = True, row_bytes: int = 4, spread: bool = False
) -> list[dict]:
    """Persistent-backward geometries worth timing for this width (the first is the default,
    used untimed on the interpreter, under CUDA-graph capture and for in-place calls).

    Each is rows per program-iteration (BLOCK_M), warps, programs per SM, register prefetch of
    the next rows, per-row dW accumulation (ACC_2D), RELOAD and STAGES (see the kernel). With
    `dw` (the weight's gradient is computed) the geometries run one program per SM, so the fp32
    dW partials are one row per SM, as Liger's; with `spread` too (plain RMSNorm, where it was
    measured) one more runs two per SM at widths 513-2048 and more than 8192 rows. Without `dw`
    there are no partials and two programs per SM are timed too (small batches gain from them). `row_bytes`, the bytes per
    column of the row tensors read (dy, x and any ds: 4 for two bf16), drops the STAGES
    geometries whose shared-memory buffers would not fit (see `stage_bytes`).
    """
    return _bwd_candidates(next_pow2(m), n, dw, row_bytes, spread)


# Shared memory the STAGES buffers may take: what an A100 grants one program (164 KiB) less the
# reductions' scratch; an H100/H200 grants 227 KiB.
STAGE_BYTES_MAX = 160 * 1024


def stage_bytes(cfg: dict, n: int, row_bytes: int) -> int:
    """Shared memory of a geometry's pipelined loads: STAGES - 1 blocks of rows in flight, twice
    with RELOAD (the second read is pipelined too), and w (4 bytes at most) per pass with
    RELOAD 2."""
    block_n = next_pow2(n)
    rows = cfg["BLOCK_M"] * block_n * row_bytes * (2 if cfg["RELOAD"] else 1)
    weight = 2 * block_n * 4 if cfg["RELOAD"] == 2 else 0
    return (cfg["STAGES"] - 1) * (rows + weight)


def _geometry(block_n: int, m_pow2: int, tile: int, warps: int, per_sm: int = 1,
              prefetch: bool = False, acc_2d: bool = False, reload: int = 0,
              stages: int = 1) -> dict:  # fmt: skip
    """One backward geometry: rows per program-iteration from a tile of elements."""
    block_m = max(1, min(tile // block_n, m_pow2))
    return {"BLOCK_M": block_m, "num_warps": warps, "per_sm": per_sm, "PREFETCH": prefetch,
            "ACC_2D": acc_2d, "RELOAD": reload, "STAGES": stages}  # fmt: skip


# Keyed by the row count's power of two, all the lists depend on: varying sequence lengths hit.
# The orders follow the H200 probe (scripts/probes/probe_norms_glu_gpu.py --part cand): where a
# width was measured, its best first, then the rest the tuner may prefer at other row counts.
# RELOAD and STAGES await that measurement (they came after it).
@functools.lru_cache(maxsize=1024)  # asked on every call; shared, never mutated
def _bwd_candidates(m_pow2: int, n: int, dw: bool, row_bytes: int, spread: bool) -> list[dict]:
    block_n = next_pow2(n)
    cfg = functools.partial(_geometry, block_n, m_pow2)
    if block_n <= 512:  # q/k norms: many short rows per program
        if dw:  # more warps per program and per-row dW partials reduced once at the end
            return [cfg(8192, 8, acc_2d=True), cfg(4096, 4, acc_2d=True),
                    cfg(16384, 8, acc_2d=True), cfg(8192, 4, acc_2d=True),
                    cfg(4096, 8, acc_2d=True)]  # fmt: skip
        return [cfg(4096, 2, 4), cfg(4096, 4, 2, True), cfg(2048, 2, 8),
                cfg(4096, 4, 2, acc_2d=True), cfg(4096, 2, 4, acc_2d=True),
                cfg(8192, 4, 2, acc_2d=True), cfg(2048, 2, 4, True, True)]  # fmt: skip
    if block_n > 16384:  # registers run out whatever the geometry: the fewest spills
        return [cfg(block_n, 16), cfg(block_n, 16, prefetch=True), cfg(block_n, 32)]
    if block_n == 16384:
        # Register prefetch spills here (0.89 ms against 0.59 at 16384x16384); Liger's geometry
        # (one row, 16 warps) spills less. RELOAD 1 spills nothing, and with STAGES 2 the next
        # row arrives by asynchronous copies into shared memory instead of registers.
        wide = [cfg(block_n, 16), cfg(block_n, 16, reload=1), cfg(block_n, 16, reload=1, stages=2),
                cfg(block_n, 32, reload=1, stages=2), cfg(block_n, 8)]  # fmt: skip
    elif block_n == 8192:
        # 32 warps with register prefetch: the best at every row count measured.
        wide = [cfg(8192, 32, prefetch=True), cfg(8192, 16, prefetch=True),
                cfg(8192, 8, prefetch=True), cfg(8192, 16, stages=2),
                cfg(8192, 16, reload=1, stages=2), cfg(8192, 32, reload=1, stages=2)]  # fmt: skip
    else:
        wide = [cfg(16384, 8), cfg(8192, 16, prefetch=True), cfg(8192, 8, prefetch=True),
                cfg(16384, 16, prefetch=True), cfg(block_n, 16), cfg(8192, 16, stages=2)]  # fmt: skip
    if not dw:  # no partials: two programs per SM cost no memory
        wide += [cfg(4096, 8, 2, True), cfg(4096, 4, 2)]
    elif spread and block_n <= 2048 and m_pow2 >= 16384:
        # Many rows of 1-2k: one program per SM cannot keep enough rows in flight; two small
        # programs per SM with register prefetch took the backward from 0.182 to 0.117 ms at
        # 65536x1024 (0.64x, and 0.43 against 0.64 at 262144x1024; H200 probe), for one more
        # row of fp32 dW partials per SM (0.5 MiB at width 1024).
        wide += [cfg(4 * block_n, 4, 2, True)]
    # A geometry listed twice (tiles that clamp to one row) is timed once; fp32 rows at hidden
    # 16384 leave no room for the RELOAD + STAGES buffers.
    return [c for i, c in enumerate(wide)
            if c not in wide[:i] and stage_bytes(c, n, row_bytes) <= STAGE_BYTES_MAX]  # fmt: skip


def out_dtype(x: torch.Tensor, weight: torch.Tensor | None, gemma) -> torch.dtype:
    """Result dtype: llama mode promotes with the weight (as HF's module); gemma and none modes,
    and no weight, give the input's."""
    if weight is None or numerics(gemma)[1] != LLAMA:
        return x.dtype
    return torch.promote_types(x.dtype, weight.dtype)


def forward(x, weight, eps, gemma, cfg=None, residual=None, stats=True):
    """Triton forward: returns (y shaped like x, rstd [rows] fp32, s).

    `gemma` is the legacy bool or an (offset, mode) pair (see `numerics`); `weight` may be None.
    With `residual` (shaped and typed like x) it normalises s = x + residual and returns s too
    (shaped like x); else s is None. ``stats=False`` (no backward will follow) neither computes
    into nor allocates rstd: it is returned empty. `cfg` fixes the geometry (else it is picked,
    see `pick_config`); a call without one runs the plan its key maps to (see `_ForwardPlan`).
    """
    if cfg is not None:
        return _ForwardPlan(x, weight, eps, gemma, residual, stats)(x, weight, residual, cfg)
    # Everything the plan's constants derive from: x's layout and dtype, the weight's dtype (or
    # its absence), the options, and the residual's layout and dtype (or its absence).
    key = (x.shape, x.stride(), x.dtype, x.device, weight is None or weight.dtype, eps, gemma,
           residual is None or (residual.stride(), residual.dtype), stats)  # fmt: skip
    plan = _FORWARD_PLANS.get(key)
    if plan is None:
        plan = _ForwardPlan(x, weight, eps, gemma, residual, stats)
        out = plan(x, weight, residual)
        if plan.final:
            _FORWARD_PLANS.keep(key, plan)
        return out
    return plan(x, weight, residual)


class _ForwardPlan:
    """What a forward call's key fixes: row count and strides, output dtype and shapes, the
    kernel's scalars; the config and the bound launch once its first call has chosen them."""

    __slots__ = ("m", "n", "shape", "strides", "rstd_shape", "rstd_strides", "device", "y_dtype",
                 "s_dtype", "x_rows", "r_rows", "scalars", "mode", "has_w", "has_r", "stats",
                 "launch", "final")  # fmt: skip

    def __init__(self, x, weight, eps, gemma, residual, stats=True) -> None:
        offset, self.mode = numerics(gemma)
        n = self.n = x.shape[-1]
        self.m = x.numel() // n if n else 0
        self.stats = stats
        self.rstd_shape = x.shape[:-1] if stats else (0,)  # none without stats
        self.shape, self.device = x.shape, x.device
        self.strides, self.rstd_strides = (
            contiguous_strides(x.shape),
            contiguous_strides(self.rstd_shape),
        )
        self.y_dtype = out_dtype(x, weight, (offset, self.mode))
        self.s_dtype = x.dtype
        self.has_w, self.has_r = weight is not None, residual is not None
        self.x_rows = rows_stride(x, n)  # None: the call copies x into rows
        self.r_rows = None if residual is None else rows_stride(residual, n)
        sx = n if self.x_rows is None else self.x_rows  # a copy's rows are n apart
        sr = sx if residual is None else (n if self.r_rows is None else self.r_rows)
        self.scalars = (self.m, n, sx, sr, n, n, eps, offset)
        self.launch = None
        self.final = True

    def __call__(self, x, weight, residual, cfg=None):
        m, n = self.m, self.n
        x2 = x if self.x_rows is not None else as_rows(x, n)
        # Outputs are allocated in x's shape, contiguous (rows n apart): no views to make.
        y = torch.empty_strided(self.shape, self.strides, dtype=self.y_dtype, device=self.device)
        rstd = torch.empty_strided(
            self.rstd_shape, self.rstd_strides, dtype=torch.float32, device=self.device
        )
        if residual is None:
            r2, s = x2, None  # an unused stand-in without a residual
        else:
            r2 = residual if self.r_rows is not None else as_rows(residual, n)
            s = torch.empty_strided(
                self.shape, self.strides, dtype=self.s_dtype, device=self.device
            )
        if m == 0:
            return y, rstd, s
        # Unused stand-ins: x for a missing weight, y for a missing s or rstd.
        args = (x2, r2, x2 if weight is None else weight, y, y if s is None else s,
                rstd if self.stats else y, *self.scalars)  # fmt: skip
        launch = self.launch
        if launch is None or cfg is not None:
            launch = self._choose(args, cfg)
        launch(*args)
        return y, rstd, s

    def _choose(self, args: tuple, cfg: dict | None):
        """The bound launch for `cfg`, or for the config picked for this key (timed into this
        call's outputs on a GPU's first call); kept when the pick is final."""
        m, n = self.m, self.n
        residual = self.has_r
        x_dtype, w_dtype = args[0].dtype, args[2].dtype
        offset = self.scalars[-1]

        stats = self.stats

        def kwargs(c):
            width = {"LOOP": c["LOOP"]} if c.get("LOOP") else {"BLOCK_N": next_pow2(n)}
            return {"BLOCK_M": c["BLOCK_M"], **width, "MODE": self.mode, "RESIDUAL": residual,
                    "HAS_W": self.has_w, "HAS_OFFSET": offset != 0.0, "STATS": stats,
                    "EVEN": c.get("EVEN", False), "num_warps": c["num_warps"]}  # fmt: skip

        outputs = [args]

        def launch(c):
            # Each timed launch writes the other of two output sets (see _spare_outputs).
            outputs.append(outputs.pop(0))
            fwd_kernel(c)[(cdiv(m, c["BLOCK_M"]),)](*outputs[-1], **kwargs(c))

        keep = cfg is None
        if cfg is None:
            key = ("rms_fwd", m.bit_length(), n, x_dtype, w_dtype, self.device, self.mode,
                   residual, not self.has_w, offset != 0.0, stats, even_key(m))  # fmt: skip
            candidates = fwd_candidates(m, n)
            if (self.device.type == "cuda" and cached_config(key) is None and len(candidates) > 1
                    and not torch.cuda.is_current_stream_capturing()
                    and args[3].nbytes * (2 if residual else 1) <= SPARE_BYTES_MAX):  # fmt: skip
                outputs.append(_spare_outputs(args, residual, stats))
            cfg = pick_config(key, candidates, launch)
            self.final = config_is_final(key, candidates)
        bound = fwd_kernel(cfg).bound((cdiv(m, cfg["BLOCK_M"]),), kwargs(cfg))
        if keep:
            self.launch = bound
        return bound


# Larger outputs (y, and s with a residual) are timed in place: a spare would take memory a first
# step may not have, and writing 5x the L2 (50 MB on an H200) leaves little of the previous
# output in it.
SPARE_BYTES_MAX = 256 << 20


def _spare_outputs(args: tuple, residual: bool, stats: bool) -> tuple:
    """`args` of a forward launch with new y (and s, rstd) buffers of the same shapes.

    Timed into a buffer it wrote a moment before, a kernel rewrites lines still dirty in L2; in
    a model (and in a CUDA graph of many calls) each call writes a new buffer, and the previous
    one's lines must be written back first. The two settings order the kernels differently: at
    4096 x 8192 on the H200 every whole-row geometry ran 3-5 % ahead of Inductor's kernel in
    the first and 2.5-4 % behind in the second (twelfth session: probe_norm_fwd_load_order_gpu.py
    and probe_norm_fwd_chain_picks_gpu.py). Alternating two output sets times the kernels in the setting they run in.
    """
    spare = list(args)
    spare[3] = y2 = torch.empty_like(args[3])
    spare[4] = torch.empty_like(args[4]) if residual else y2
    spare[5] = torch.empty_like(args[5]) if stats else y2
    return tuple(spare)


_FORWARD_PLANS = PlanCache()
_BACKWARD_PLANS = PlanCache()


def _launch_bwd(dy2, x2, weight, rstd, dx, gemma, compute_dw, cfg, from_y=False, ds2=None):
    """One backward launch through Triton's binder (the tuner's timing launches); dx and rstd
    are contiguous (dx's rows n apart)."""
    offset, mode = numerics(gemma)
    m, n = x2.shape
    programs, rows_per_program = _bwd_programs(m, cfg, x2.device)
    part = torch.empty(
        (programs, n) if compute_dw else (1, 1), dtype=torch.float32, device=x2.device
    )
    ds_arg = dy2 if ds2 is None else ds2  # an unused stand-in without a residual gradient
    _rms_norm_bwd_kernel[(programs,)](
        dy2, x2, x2 if weight is None else weight, rstd, dx, part, ds_arg, m, n,
        dy2.stride(0), x2.stride(0), n, ds_arg.stride(0), rows_per_program, offset,
        **_bwd_kwargs(cfg, n, mode, compute_dw, from_y, ds2 is not None, weight is not None),
    )  # fmt: skip
    return part


def _bwd_programs(m: int, cfg: dict, device: torch.device) -> tuple[int, int]:
    """(programs, rows per program) of the persistent backward."""
    programs = min(cfg["per_sm"] * sm_count(device), cdiv(m, cfg["BLOCK_M"]))
    rows_per_program = cdiv(m, programs)
    return cdiv(m, rows_per_program), rows_per_program


def _bwd_kwargs(cfg, n, mode, compute_dw, from_y, has_ds, has_w) -> dict:
    return {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": next_pow2(n), "MODE": mode,
            "COMPUTE_DW": compute_dw, "PREFETCH": cfg["PREFETCH"], "ACC_2D": cfg["ACC_2D"],
            "FROM_Y": from_y, "HAS_DS": has_ds, "HAS_W": has_w, "RELOAD": cfg["RELOAD"],
            "STAGES": cfg["STAGES"], "num_warps": cfg["num_warps"]}  # fmt: skip


def _dx_buffer(dy, shape, dtype, in_place):
    """Where dx goes: over dy when `in_place` allows it (same dtype, contiguous), else new."""
    if in_place and dy.dtype == dtype and dy.is_contiguous() and dy.shape == shape:
        return dy
    return torch.empty(shape, dtype=dtype, device=dy.device)


def backward(
    dy, x, weight, rstd, gemma, compute_dw, cfg=None, from_y=False, x_dtype=None, ds=None,
    in_place=False,
):  # fmt: skip
    """Triton backward: returns (dx, dW like weight or an empty tensor); `rstd` as forward
    returned it (contiguous), `dy` shaped like x.

    With ``from_y`` the tensor passed as `x` is the forward's output y, and dx takes `x_dtype`.
    With `ds` (the gradient reaching the residual sum s of the fused add) `x` is s and dx is the
    gradient of s, which is also that of both summands. With `in_place` dx is written over dy
    where dy is contiguous and of dx's dtype (each program reads its rows before writing them).
    A call without `cfg` runs the plan its key maps to (see `_BackwardPlan`).
    """
    if cfg is not None:
        plan = _BackwardPlan(dy, x, weight, gemma, compute_dw, from_y, x_dtype, ds, in_place)
        return plan(dy, x, weight, rstd, ds, cfg)
    key = (x.shape, x.stride(), x.dtype, x.device, dy.shape, dy.stride(), dy.dtype,
           weight is None or weight.dtype, gemma, compute_dw, from_y, x_dtype,
           ds is None or (ds.stride(), ds.dtype), in_place)  # fmt: skip
    plan = _BACKWARD_PLANS.get(key)
    if plan is None:
        plan = _BackwardPlan(dy, x, weight, gemma, compute_dw, from_y, x_dtype, ds, in_place)
        out = plan(dy, x, weight, rstd, ds)
        if plan.final:
            _BACKWARD_PLANS.keep(key, plan)
        return out
    return plan(dy, x, weight, rstd, ds)


class _BackwardPlan:
    """What a backward call's key fixes (see `_ForwardPlan`): dx's buffer and dtype, row strides,
    the dW partials' shape and the column sum's launch; the config once chosen."""

    __slots__ = ("m", "n", "shape", "strides", "device", "dx_dtype", "over_dy", "dy_rows",
                 "x_rows", "ds_rows", "mode", "offset", "compute_dw", "from_y", "has_w", "has_ds",
                 "row_bytes", "launch", "scalars", "part_shape", "colsum", "final")  # fmt: skip

    def __init__(self, dy, x, weight, gemma, compute_dw, from_y, x_dtype, ds, in_place) -> None:
        self.offset, self.mode = numerics(gemma)
        n = self.n = x.shape[-1]
        self.m = x.numel() // n if n else 0
        self.shape, self.strides, self.device = x.shape, contiguous_strides(x.shape), x.device
        self.dx_dtype = x_dtype or x.dtype
        self.over_dy = (
            in_place and dy.dtype == self.dx_dtype and dy.is_contiguous() and dy.shape == x.shape
        )
        self.dy_rows, self.x_rows = rows_stride(dy, n), rows_stride(x, n)
        self.ds_rows = None if ds is None else rows_stride(ds, n)
        self.compute_dw, self.from_y = compute_dw, from_y
        self.has_w, self.has_ds = weight is not None, ds is not None
        # The fused add reads a third row tensor, ds.
        self.row_bytes = (
            dy.element_size() + x.element_size() + (0 if ds is None else ds.element_size())
        )
        self.launch = self.scalars = self.part_shape = self.colsum = None
        self.final = True

    def __call__(self, dy, x, weight, rstd, ds, cfg=None):
        m, n = self.m, self.n
        dy2 = dy if self.dy_rows is not None else as_rows(dy, n)
        x2 = x if self.x_rows is not None else as_rows(x, n)
        dx = (
            dy
            if self.over_dy
            else torch.empty_strided(
                self.shape, self.strides, dtype=self.dx_dtype, device=self.device
            )
        )
        if m == 0:
            dw = torch.zeros_like(weight) if self.compute_dw else x.new_empty(0)
            return dx, dw
        ds2 = None if ds is None else (ds if self.ds_rows is not None else as_rows(ds, n))
        if self.launch is None or cfg is not None:
            launch, scalars, part_shape, colsum = self._choose(dy2, x2, weight, rstd, dx, ds2, cfg)
        else:
            launch, scalars = self.launch, self.scalars
            part_shape, colsum = self.part_shape, self.colsum
        part = torch.empty_strided(
            part_shape, (part_shape[1], 1), dtype=torch.float32, device=self.device
        )
        launch(dy2, x2, x2 if weight is None else weight, rstd, dx, part,
               dy2 if ds2 is None else ds2, *scalars)  # fmt: skip
        if not self.compute_dw:
            return dx, torch.empty_strided((0,), (1,), dtype=x.dtype, device=self.device)
        dw = torch.empty_strided((n,), (1,), dtype=weight.dtype, device=self.device)
        colsum(part, dw, part_shape[0], n)
        return dx, dw

    def _choose(self, dy2, x2, weight, rstd, dx, ds2, cfg):
        """(bound launch, scalars, partials' shape, column-sum launch) for `cfg`, or for the
        config picked for this key (timed on a GPU's first call); kept when the pick is final."""
        m, n = self.m, self.n
        keep = cfg is None
        if cfg is None:
            key = ("rms_bwd", m.bit_length(), n, x2.dtype, dy2.dtype,
                   weight.dtype if self.has_w else None, self.device, self.mode, self.compute_dw,
                   self.from_y, self.has_ds)  # fmt: skip
            cfg = cached_config(key)  # a config an earlier call (or plan) timed
            if cfg is None:
                # Two programs per SM only for plain RMSNorm: measured there, and one row of
                # partials per SM more (LayerNorm's dB and the fused add's ds were not timed).
                spread = not self.has_ds
                candidates = bwd_candidates(m, n, self.compute_dw, self.row_bytes, spread)
                # Timing launches several times, and a launch after the first would read a dx
                # as dy: in place takes the geometry an earlier out-of-place call timed, or
                # the default (not kept: a later out-of-place call may time another).
                if self.over_dy:
                    cfg = candidates[0]
                else:
                    numer = (self.offset, self.mode)
                    rows = [None if t is None else as_rows(t, n) for t in (dy2, x2, ds2)]
                    cfg = pick_config(
                        key,
                        candidates,
                        lambda c: _launch_bwd(rows[0], rows[1], weight, rstd, dx, numer,
                                              self.compute_dw, c, self.from_y, rows[2]),
                    )  # fmt: skip
                # In place before any timing: final only where no timing will ever come.
                self.final = config_is_final(key, candidates)
        programs, rows_per_program = _bwd_programs(m, cfg, self.device)
        kwargs = _bwd_kwargs(
            cfg, n, self.mode, self.compute_dw, self.from_y, self.has_ds, self.has_w
        )
        launch = _rms_norm_bwd_kernel.bound((programs,), kwargs)
        # Row strides: the view's, or n for a copy (contiguous).
        sdy = n if self.dy_rows is None else self.dy_rows
        sx = n if self.x_rows is None else self.x_rows
        sds = sdy if ds2 is None else (n if self.ds_rows is None else self.ds_rows)
        scalars = (m, n, sdy, sx, n, sds, rows_per_program, self.offset)
        part_shape = (programs, n) if self.compute_dw else (1, 1)
        colsum = None
        if self.compute_dw:
            colsum = column_sum_launch(programs, n, self.device, weight.dtype)
        if keep:
            self.launch, self.scalars = launch, scalars
            self.part_shape, self.colsum = part_shape, colsum
        return launch, scalars, part_shape, colsum


def _torch_forward(x, weight, eps, gemma):
    offset, mode = numerics(gemma)
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    if mode == NONE:
        rstd = rstd.to(x.dtype).float()
    xhat = xf * rstd.unsqueeze(-1)
    if mode != GEMMA:
        xhat = xhat.to(x.dtype).float()
    y = xhat if weight is None else xhat * (weight.float() + offset)
    # Contiguous like the Triton path and the fake op: compiled graphs rely on those strides.
    return y.to(out_dtype(x, weight, (offset, mode))).contiguous(), rstd.contiguous()


def _torch_backward(
    dy, x, weight, rstd, gemma, compute_dw, from_y=False, x_dtype=None, ds=None, in_place=False
):  # fmt: skip
    offset, mode = numerics(gemma)
    w = 1.0 if weight is None else weight.float() + offset
    xhat = x.float() / w if from_y else x.float() * rstd.unsqueeze(-1)
    x_dtype = x_dtype or x.dtype
    g = dy.float() * w
    dx = (g - xhat * (g * xhat).mean(-1, keepdim=True)) * rstd.unsqueeze(-1)
    if ds is not None:  # added before the one rounding, as the kernel does
        dx = dx + ds.float()
    dw = x.new_empty(0)
    if compute_dw:
        xw = xhat if mode == GEMMA or from_y else xhat.to(x_dtype).float()
        dw = (dy.float() * xw).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    out = _dx_buffer(dy, x.shape, x_dtype, in_place)
    out.copy_(dx)
    return out, dw


def use_triton_rows(x: torch.Tensor) -> bool:
    """Whether rows of `x` take the Triton kernels (else the torch path)."""
    return use_triton(x) and x.shape[-1] <= MAX_TRITON_N


def _forward_any(x, weight, eps, gemma, stats=True):
    """(y, rstd): the Triton kernel where it applies, else torch ops with the same roundings;
    rstd is empty without `stats` on the Triton path (see `forward`)."""
    if use_triton_rows(x):
        return forward(x, weight, eps, gemma, stats=stats)[:2]
    y, rstd = _torch_forward(x, weight, eps, gemma)
    return y, (rstd if stats else rstd.new_empty(0))


def _backward_any(
    dy, x, weight, rstd, gemma, compute_dw, from_y=False, x_dtype=None, ds=None, in_place=False
):  # fmt: skip
    if use_triton_rows(x):
        return backward(dy, x, weight, rstd, gemma, compute_dw, None, from_y, x_dtype, ds, in_place)
    return _torch_backward(dy, x, weight, rstd, gemma, compute_dw, from_y, x_dtype, ds, in_place)


# The ops take the legacy `gemma` flag plus (offset, mode); gemma=True overrides the pair.
def _op_numerics(gemma: bool, offset: float, mode: int) -> tuple[float, int]:
    return (1.0, GEMMA) if gemma else (offset, mode)


@torch.library.custom_op(op_name("rms_norm_fwd"), mutates_args=())
def rms_norm_fwd(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],  # noqa: UP045 - torch.library parses typing.Optional
    eps: float,
    gemma: bool,
    save_output: bool,
    offset: float = 0.0,
    mode: int = LLAMA,
    stats: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward_any(x, weight, eps, _op_numerics(gemma, offset, mode), stats)


@rms_norm_fwd.register_fake
def _(x, weight, eps, gemma, save_output, offset=0.0, mode=LLAMA, stats=True):
    # Traced for a compile: let Inductor fuse the residual adds around the norms (idempotent;
    # each trace checks, as a config.patch context may have reset the slot since), and keep its
    # note on the ops' first lowerings short (inductor_note.py: a chain of norms made it endless).
    from . import compile_fusion, inductor_note

    compile_fusion.install()
    inductor_note.shorten_fallback_note()
    y = x.new_empty(x.shape, dtype=out_dtype(x, weight, _op_numerics(gemma, offset, mode)))
    return y, x.new_empty(x.shape[:-1] if stats else (0,), dtype=torch.float32)


@torch.library.custom_op(op_name("rms_norm_bwd"), mutates_args=())
def rms_norm_bwd(
    dy: torch.Tensor,
    saved: torch.Tensor,
    weight: Optional[torch.Tensor],  # noqa: UP045 - torch.library parses typing.Optional
    rstd: torch.Tensor,
    gemma: bool,
    compute_dw: bool,
    from_y: bool,
    x_dtype: torch.dtype,
    offset: float = 0.0,
    mode: int = LLAMA,
) -> tuple[torch.Tensor, torch.Tensor]:
    numer = _op_numerics(gemma, offset, mode)
    return _backward_any(dy, saved, weight, rstd, numer, compute_dw, from_y, x_dtype)


@rms_norm_bwd.register_fake
def _(dy, saved, weight, rstd, gemma, compute_dw, from_y, x_dtype, offset=0.0, mode=LLAMA):
    dw = torch.empty_like(weight) if compute_dw else saved.new_empty(0)
    return saved.new_empty(saved.shape, dtype=x_dtype), dw


def _save(ctx, x, weight, y, rstd, numer, save_output, in_place=False):
    """Keep x, or y when `save_output` (x̂ = y / w then), for the backward."""
    ctx.save_for_backward(y if save_output else x, weight, rstd)
    ctx.numer, ctx.from_y, ctx.x_dtype, ctx.in_place = numer, save_output, x.dtype, in_place


def _setup_context(ctx, inputs, output):
    x, weight, _eps, gemma, save_output, offset, mode, stats = inputs
    numer = _op_numerics(gemma, offset, mode)
    _save(ctx, x, weight, output[0], output[1], numer, save_output)
    ctx.stats = stats


def no_stats_backward_error(op: str) -> RuntimeError:
    return RuntimeError(f"{op} ran with stats=False, which keeps nothing for a backward; "
                        "call it with stats=True where a gradient will be taken")  # fmt: skip


def _backward(ctx, dy, _drstd):
    if not ctx.stats:
        raise no_stats_backward_error("rms_norm_fwd")
    saved, weight, rstd = ctx.saved_tensors
    need_dw = weight is not None and ctx.needs_input_grad[1]
    offset, mode = ctx.numer
    dx, dw = rms_norm_bwd(
        dy, saved, weight, rstd, False, need_dw, ctx.from_y, ctx.x_dtype, offset, mode
    )
    return dx, (dw if need_dw else None), None, None, None, None, None, None


rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


class _RMSNormFunction(torch.autograd.Function):
    """The eager path: the same kernels without the custom-op dispatch cost on every call."""

    @staticmethod
    def forward(ctx, x, weight, eps, numer, save_output, in_place):
        y, rstd = _forward_any(x, weight, eps, numer)
        _save(ctx, x, weight, y, rstd, numer, save_output, in_place)
        return y

    @staticmethod
    def backward(ctx, dy):
        saved, weight, rstd = ctx.saved_tensors
        need_dw = weight is not None and ctx.needs_input_grad[1]
        dx, dw = _backward_any(
            dy, saved, weight, rstd, ctx.numer, need_dw, ctx.from_y, ctx.x_dtype,
            in_place=ctx.in_place,
        )  # fmt: skip
        return dx, (dw if need_dw else None), None, None, None, None


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    gemma: bool = False,
    save_output: bool = False,
    *,
    offset: float = 0.0,
    casting_mode: str | None = None,
    in_place: bool = False,
) -> torch.Tensor:
    """RMSNorm of `x` over its last dim: ``x̂ · (offset + weight)``, or ``x̂`` without a weight.

    `casting_mode` is Liger's: "llama" (default; HF Llama numerics), "gemma" (all fp32, HF
    Gemma with ``offset=1.0``) or "none" (the input dtype throughout); see the module docstring.
    ``gemma=True`` is the same as ``offset=1.0, casting_mode="gemma"``.

    ``save_output=True`` keeps the output instead of the input for the backward (see the module
    docstring): no memory of its own when the next layer saves the output anyway; a weight
    entry of exactly zero then makes that column's gradients NaN.

    ``in_place=True`` writes the backward's dx over the incoming gradient dy (no dx buffer).
    Only correct when nothing else reads that gradient tensor afterwards: not when y's gradient
    is shared, e.g. ``y + other`` hands one tensor to both. Ignored under torch.compile.
    """
    numer = resolve_numerics(gemma, offset, casting_mode)
    if is_dtensor(x):  # tensor or sequence parallel: this rank's shard (tensor_parallel.py)
        return dtensor_rms_norm(rms_norm, x, weight, eps, numer, save_output, in_place, out_dtype)
    grad = needs_grad(x, weight)
    if torch.compiler.is_compiling():  # Dynamo guards on the grad mode and requires_grad
        return rms_norm_fwd(x, weight, float(eps), False, save_output, *numer, grad)[0]
    if not grad:  # inference: no rstd, and no autograd node
        return _forward_any(x, weight, float(eps), numer, stats=False)[0]
    return _RMSNormFunction.apply(x, weight, float(eps), numer, save_output, in_place)
