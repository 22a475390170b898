"""LayerNorm over the last dimension (torch.nn.LayerNorm numerics), forward and backward.

Statistics and the affine transform are computed in fp32 and the output is rounded once to the
input dtype, as torch's layer_norm does for half inputs. The forward keeps an fp32 mean and rstd
per row; the backward is persistent like RMSNorm's, with fp32 dW and dB partials per program
summed by a second small kernel. Weight and bias are optional (``elementwise_affine=False``,
``bias=False``).
"""

from typing import Optional

import torch
import torch.nn.functional as F

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
)
from ._triton import tl, triton
from .rms_norm import _bwd_programs, bwd_candidates, column_sum_launch, fwd_config, use_triton_rows
from .tensor_parallel import dtensor_layer_norm, is_dtensor


@fast_launch
@triton.jit
def _layer_norm_fwd_kernel(
    X, W, B, Y, MEAN, RSTD, M, N, stride_x, stride_y, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    STATS: tl.constexpr,
):  # fmt: skip
    # STATS: store mean and rstd for a backward; a forward no gradient follows skips the stores.
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / N
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
    y = xc * rstd[:, None]
    if HAS_W:
        y = y * tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + r64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    if STATS:
        tl.store(MEAN + rows, mean, mask=rmask)
        tl.store(RSTD + rows, rstd, mask=rmask)


@triton.jit
def _load_rows(
    DY, X, MEAN, RSTD, r0, row_end, cols, cmask, stride_dy, stride_x, BLOCK_M: tl.constexpr,
    POLICY: tl.constexpr,
):  # fmt: skip
    rows = r0 + tl.arange(0, BLOCK_M)
    rmask = rows < row_end
    mask = rmask[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)[:, None]
    dy = tl.load(DY + r64 * stride_dy + cols[None, :], mask=mask, other=0.0, eviction_policy=POLICY)
    x = tl.load(X + r64 * stride_x + cols[None, :], mask=mask, other=0.0, eviction_policy=POLICY)
    mean = tl.load(MEAN + rows, mask=rmask, other=0.0)
    rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
    return dy, x, mean, rstd


@triton.jit
def _weight(W, cols, cmask, BLOCK_N: tl.constexpr, HAS_W: tl.constexpr):
    """w in fp32 (ones without a weight: then it is never read)."""
    if HAS_W:
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    else:
        w = tl.full([BLOCK_N], 1.0, tl.float32)
    return w


@triton.jit
def _row_terms(dy, x, mean, rstd, w, mask, HAS_W: tl.constexpr):
    """(dy, x̂, g = dy·w) in fp32 for one block of rows (x̂ zero outside the mask)."""
    dy = dy.to(tl.float32)
    xhat = tl.where(mask, (x.to(tl.float32) - mean[:, None]) * rstd[:, None], 0.0)
    g = dy
    if HAS_W:
        g = dy * w[None, :]
    return dy, xhat, g


@fast_launch
@triton.jit
def _layer_norm_bwd_kernel(
    DY, X, W, MEAN, RSTD, DX, DW_PART, DB_PART, M, N,
    stride_dy, stride_x, stride_dx, rows_per_program,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_W: tl.constexpr,
    COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr, PREFETCH: tl.constexpr,
    ACC_2D: tl.constexpr, RELOAD: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    # RELOAD and STAGES as in rms_norm's backward: with RELOAD > 0 dy and x are read again
    # after the row sums instead of kept across them; with 2, w is read per pass too.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    if RELOAD < 2:
        w = _weight(W, cols, cmask, BLOCK_N, HAS_W)
    # ACC_2D: per-row partials reduced once at the end (see rms_norm).
    if ACC_2D:
        dw = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        db = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        db = tl.zeros([BLOCK_N], dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    if PREFETCH:
        dy_n, x_n, mean_n, rstd_n = _load_rows(
            DY, X, MEAN, RSTD, row_start, row_end, cols, cmask, stride_dy, stride_x, BLOCK_M, ""
        )
    for r0 in tl.range(row_start, row_end, BLOCK_M, num_stages=STAGES):
        if PREFETCH:
            dy, x, mean, rstd = dy_n, x_n, mean_n, rstd_n
            dy_n, x_n, mean_n, rstd_n = _load_rows(
                DY,
                X,
                MEAN,
                RSTD,
                r0 + BLOCK_M,
                row_end,
                cols,
                cmask,
                stride_dy,
                stride_x,
                BLOCK_M,
                "",
            )
        else:
            dy, x, mean, rstd = _load_rows(
                DY, X, MEAN, RSTD, r0, row_end, cols, cmask, stride_dy, stride_x, BLOCK_M, ""
            )
        rows = r0 + tl.arange(0, BLOCK_M)
        mask = (rows < row_end)[:, None] & cmask[None, :]
        if RELOAD == 2:
            w = _weight(W, cols, cmask, BLOCK_N, HAS_W)
        dy, xhat, g = _row_terms(dy, x, mean, rstd, w, mask, HAS_W)
        c1 = tl.sum(g * xhat, axis=1) / N
        c2 = tl.sum(g, axis=1) / N
        if RELOAD > 0:
            # A second read of the same rows, from the cache (see rms_norm).
            dy, x, _mean, _rstd = _load_rows(
                DY, X, MEAN, RSTD, r0, row_end, cols, cmask, stride_dy, stride_x, BLOCK_M,
                "evict_first",
            )  # fmt: skip
            if RELOAD == 2:
                w = _weight(W, cols, cmask, BLOCK_N, HAS_W)
            dy, xhat, g = _row_terms(dy, x, mean, rstd, w, mask, HAS_W)
        dx = (g - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
        dx_ptr = DX + rows.to(tl.int64)[:, None] * stride_dx + cols[None, :]
        tl.store(dx_ptr, dx.to(DX.dtype.element_ty), mask=mask)
        if ACC_2D:
            if COMPUTE_DW:
                dw += dy * xhat
            if COMPUTE_DB:
                db += dy
        else:
            if COMPUTE_DW:
                dw += tl.sum(dy * xhat, axis=0)
            if COMPUTE_DB:
                db += tl.sum(dy, axis=0)
    if ACC_2D:
        dw_row = tl.sum(dw, axis=0)
        db_row = tl.sum(db, axis=0)
    else:
        dw_row = dw
        db_row = db
    if COMPUTE_DW:
        tl.store(DW_PART + pid * N + cols, dw_row, mask=cmask)
    if COMPUTE_DB:
        tl.store(DB_PART + pid * N + cols, db_row, mask=cmask)


def forward(x, weight, bias, eps, cfg=None, stats=True):
    """Triton forward: (y like x, mean [rows] fp32, rstd [rows] fp32); without `stats` (no
    backward will follow) neither is stored nor allocated, and both are None. A call without
    `cfg` runs the plan its key maps to (row stride, allocation shapes, scalars, the bound
    launch)."""
    if cfg is not None:
        return _ForwardPlan(x, weight, bias, eps, cfg, stats)(x, weight, bias)
    key = (x.shape, x.stride(), x.dtype, x.device, weight is None or weight.dtype,
           bias is None or bias.dtype, eps, stats)  # fmt: skip
    plan = _FORWARD_PLANS.get(key)
    if plan is None:
        plan = _ForwardPlan(x, weight, bias, eps, None, stats)
        _FORWARD_PLANS.keep(key, plan)
    return plan(x, weight, bias)


class _ForwardPlan:
    """What a forward call's key fixes (see rms_norm's plans); the config needs no timing."""

    __slots__ = ("m", "n", "shape", "strides", "stats_shape", "stats_strides", "device", "dtype",
                 "x_rows", "scalars", "launch", "stats")  # fmt: skip

    def __init__(self, x, weight, bias, eps, cfg, stats=True) -> None:
        self.stats = stats
        n = self.n = x.shape[-1]
        m = self.m = x.numel() // n if n else 0
        self.shape, self.strides = x.shape, contiguous_strides(x.shape)
        self.stats_shape, self.stats_strides = x.shape[:-1], contiguous_strides(x.shape[:-1])
        self.device, self.dtype = x.device, x.dtype
        self.x_rows = rows_stride(x, n)  # None: the call copies x into rows
        self.scalars = (m, n, n if self.x_rows is None else self.x_rows, n, eps)
        self.launch = None
        if m > 0:
            cfg = cfg or fwd_config(m, n)
            self.launch = _layer_norm_fwd_kernel.bound(
                (cdiv(m, cfg["BLOCK_M"]),),
                {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": next_pow2(n), "HAS_W": weight is not None,
                 "HAS_B": bias is not None, "STATS": stats, "num_warps": cfg["num_warps"]},
            )  # fmt: skip

    def __call__(self, x, weight, bias):
        dev = self.device
        # Outputs are allocated in x's shape, contiguous (rows n apart): no views to make.
        y = torch.empty_strided(self.shape, self.strides, dtype=self.dtype, device=dev)
        mean = rstd = None
        if self.stats:
            shape, strides = self.stats_shape, self.stats_strides
            mean = torch.empty_strided(shape, strides, dtype=torch.float32, device=dev)
            rstd = torch.empty_strided(shape, strides, dtype=torch.float32, device=dev)
        if self.launch is not None:
            x2 = x if self.x_rows is not None else as_rows(x, self.n)
            # y stands in for the statistics the kernel does not store without STATS
            self.launch(x2, weight, bias, y, y if mean is None else mean,
                        y if rstd is None else rstd, *self.scalars)  # fmt: skip
        return y, mean, rstd


_FORWARD_PLANS = PlanCache()
_BACKWARD_PLANS = PlanCache()


def _launch_bwd(dy2, x2, weight, mean, rstd, dx, compute_dw, compute_db, cfg):
    """One backward launch through Triton's binder (the tuner's timing launches); dx, mean and
    rstd are contiguous (dx's rows n apart)."""
    m, n = x2.shape
    programs, rows_per_program = _bwd_programs(m, cfg, x2.device)
    dw_part = torch.empty(
        (programs, n) if compute_dw else (1, 1), dtype=torch.float32, device=x2.device
    )
    db_part = torch.empty(
        (programs, n) if compute_db else (1, 1), dtype=torch.float32, device=x2.device
    )
    _layer_norm_bwd_kernel[(programs,)](
        dy2, x2, weight, mean, rstd, dx, dw_part, db_part, m, n,
        dy2.stride(0), x2.stride(0), n, rows_per_program,
        **_bwd_kwargs(cfg, n, weight is not None, compute_dw, compute_db),
    )  # fmt: skip
    return dw_part, db_part


def _bwd_kwargs(cfg, n, has_w, compute_dw, compute_db) -> dict:
    return {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": next_pow2(n), "HAS_W": has_w,
            "COMPUTE_DW": compute_dw, "COMPUTE_DB": compute_db, "PREFETCH": cfg["PREFETCH"],
            "ACC_2D": cfg["ACC_2D"], "RELOAD": cfg["RELOAD"], "STAGES": cfg["STAGES"],
            "num_warps": cfg["num_warps"]}  # fmt: skip


def backward(dy, x, weight, mean, rstd, compute_dw, compute_db, cfg=None):
    """Triton backward: (dx, dW or empty, dB or empty); mean and rstd as forward returned them,
    dy shaped like x. A call without `cfg` runs the plan its key maps to."""
    if cfg is not None:
        plan = _BackwardPlan(dy, x, weight, compute_dw, compute_db)
        return plan(dy, x, weight, mean, rstd, cfg)
    key = (x.shape, x.stride(), x.dtype, x.device, dy.shape, dy.stride(), dy.dtype,
           weight is None or weight.dtype, compute_dw, compute_db)  # fmt: skip
    plan = _BACKWARD_PLANS.get(key)
    if plan is None:
        plan = _BackwardPlan(dy, x, weight, compute_dw, compute_db)
        out = plan(dy, x, weight, mean, rstd)
        if plan.final:
            _BACKWARD_PLANS.keep(key, plan)
        return out
    return plan(dy, x, weight, mean, rstd)


class _BackwardPlan:
    """What a backward call's key fixes; the config and launches once its first call chose them."""

    __slots__ = ("m", "n", "shape", "strides", "device", "dtype", "dy_dtype", "dy_rows", "x_rows",
                 "compute_dw", "compute_db", "has_w", "row_bytes", "ready", "final")  # fmt: skip

    def __init__(self, dy, x, weight, compute_dw, compute_db) -> None:
        n = self.n = x.shape[-1]
        self.m = x.numel() // n if n else 0
        self.shape, self.strides = x.shape, contiguous_strides(x.shape)
        self.device, self.dtype, self.dy_dtype = x.device, x.dtype, dy.dtype
        self.dy_rows, self.x_rows = rows_stride(dy, n), rows_stride(x, n)
        self.compute_dw, self.compute_db, self.has_w = compute_dw, compute_db, weight is not None
        self.row_bytes = dy.element_size() + x.element_size()
        self.ready = None  # (launch, scalars, dW and dB partials' shapes, their column sums)
        self.final = True

    def __call__(self, dy, x, weight, mean, rstd, cfg=None):
        m, n, dev = self.m, self.n, self.device
        dx = torch.empty_strided(self.shape, self.strides, dtype=self.dtype, device=dev)
        if m == 0:
            dw = torch.zeros_like(weight) if self.compute_dw else x.new_empty(0)
            return dx, dw, x.new_zeros(n) if self.compute_db else x.new_empty(0)
        dy2 = dy if self.dy_rows is not None else as_rows(dy, n)
        x2 = x if self.x_rows is not None else as_rows(x, n)
        ready = self.ready
        if ready is None or cfg is not None:
            ready = self._choose(dy2, x2, weight, mean, rstd, dx, cfg)
        launch, scalars, dw_shape, db_shape, colsum_w, colsum_b = ready
        dw_part = torch.empty_strided(dw_shape, (dw_shape[1], 1), dtype=torch.float32, device=dev)
        db_part = torch.empty_strided(db_shape, (db_shape[1], 1), dtype=torch.float32, device=dev)
        launch(dy2, x2, weight, mean, rstd, dx, dw_part, db_part, *scalars)
        # Distinct empty tensors: a custom op's outputs may not alias each other.
        if self.compute_dw:
            dw = torch.empty_strided((n,), (1,), dtype=weight.dtype, device=dev)
            colsum_w(dw_part, dw, dw_shape[0], n)
        else:
            dw = torch.empty_strided((0,), (1,), dtype=self.dtype, device=dev)
        if self.compute_db:
            db = torch.empty_strided((n,), (1,), dtype=self.dy_dtype, device=dev)
            colsum_b(db_part, db, db_shape[0], n)
        else:
            db = torch.empty_strided((0,), (1,), dtype=self.dtype, device=dev)
        return dx, dw, db

    def _choose(self, dy2, x2, weight, mean, rstd, dx, cfg):
        m, n = self.m, self.n
        compute_dw, compute_db = self.compute_dw, self.compute_db
        keep = cfg is None
        if cfg is None:
            key = ("ln_bwd", m.bit_length(), n, self.dtype, self.dy_dtype, self.device,
                   self.has_w, compute_dw, compute_db)  # fmt: skip
            cfg = cached_config(key)  # a config an earlier call (or plan) timed
            if cfg is None:
                candidates = bwd_candidates(m, n, compute_dw or compute_db, self.row_bytes)
                dy_r, x_r = as_rows(dy2, n), as_rows(x2, n)
                cfg = pick_config(
                    key,
                    candidates,
                    lambda c: _launch_bwd(dy_r, x_r, weight, mean, rstd, dx, compute_dw,
                                          compute_db, c),
                )  # fmt: skip
                self.final = config_is_final(key, candidates)
        programs, rows_per_program = _bwd_programs(m, cfg, self.device)
        launch = _layer_norm_bwd_kernel.bound(
            (programs,), _bwd_kwargs(cfg, n, self.has_w, compute_dw, compute_db)
        )
        sdy = n if self.dy_rows is None else self.dy_rows
        sx = n if self.x_rows is None else self.x_rows
        ready = (
            launch,
            (m, n, sdy, sx, n, rows_per_program),
            (programs, n) if compute_dw else (1, 1),
            (programs, n) if compute_db else (1, 1),
            # dW takes the weight's dtype, dB the gradient's: a column sum each.
            column_sum_launch(programs, n, self.device, weight.dtype) if compute_dw else None,
            column_sum_launch(programs, n, self.device, self.dy_dtype) if compute_db else None,
        )
        if keep:
            self.ready = ready
        return ready


def _torch_backward(dy, x, weight, mean, rstd, compute_dw, compute_db):
    n = x.shape[-1]
    xhat = (x.float() - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    g = dy.float() * weight.float() if weight is not None else dy.float()
    c1 = (g * xhat).mean(-1, keepdim=True)
    c2 = g.mean(-1, keepdim=True)
    # Contiguous like the Triton path and the fake op: compiled graphs rely on those strides.
    dx = ((g - xhat * c1 - c2) * rstd.unsqueeze(-1)).to(x.dtype).contiguous()
    dw = (
        (dy.float() * xhat).reshape(-1, n).sum(0).to(weight.dtype) if compute_dw else x.new_empty(0)
    )
    db = dy.float().reshape(-1, n).sum(0).to(dy.dtype) if compute_db else x.new_empty(0)
    return dx, dw, db


def _forward_any(x, weight, bias, eps, stats=True):
    """(y, mean, rstd): the Triton kernel where it applies, else torch ops; without `stats`
    the Triton path neither stores nor returns the statistics (None)."""
    if use_triton_rows(x):
        return forward(x, weight, bias, eps, stats=stats)
    y = F.layer_norm(x, (x.shape[-1],), weight, bias, eps).contiguous()
    if not stats:
        return y, None, None
    xf = x.float()
    return y, xf.mean(-1), torch.rsqrt(xf.var(-1, unbiased=False) + eps)


def _backward_any(dy, x, weight, mean, rstd, compute_dw, compute_db):
    if use_triton_rows(x):
        return backward(dy, x, weight, mean, rstd, compute_dw, compute_db)
    return _torch_backward(dy, x, weight, mean, rstd, compute_dw, compute_db)


@torch.library.custom_op(op_name("layer_norm_fwd"), mutates_args=())
def layer_norm_fwd(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],  # noqa: UP045 - torch.library parses Optional[...]
    bias: Optional[torch.Tensor],  # noqa: UP045
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward_any(x, weight, bias, eps)


@layer_norm_fwd.register_fake
def _(x, weight, bias, eps):
    from . import inductor_note  # a chain of norms between opaque ops: see inductor_note.py

    inductor_note.shorten_fallback_note()
    stat = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return x.new_empty(x.shape), stat, torch.empty_like(stat)


@torch.library.custom_op(op_name("layer_norm_bwd"), mutates_args=())
def layer_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: Optional[torch.Tensor],  # noqa: UP045
    mean: torch.Tensor,
    rstd: torch.Tensor,
    compute_dw: bool,
    compute_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_any(dy, x, weight, mean, rstd, compute_dw, compute_db)


@layer_norm_bwd.register_fake
def _(dy, x, weight, mean, rstd, compute_dw, compute_db):
    n = x.shape[-1]
    dw = torch.empty_like(weight) if compute_dw else x.new_empty(0)
    db = dy.new_empty(n) if compute_db else x.new_empty(0)
    return x.new_empty(x.shape), dw, db


def _grad_flags(ctx, weight, has_bias):
    need = ctx.needs_input_grad
    return weight is not None and need[1], has_bias and need[2]


def _setup_context(ctx, inputs, output):
    x, weight, bias, _eps = inputs
    ctx.save_for_backward(x, weight, output[1], output[2])
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    compute_dw, compute_db = _grad_flags(ctx, weight, ctx.bias_dtype is not None)
    dx, dw, db = layer_norm_bwd(dy, x, weight, mean, rstd, compute_dw, compute_db)
    return dx, (dw if compute_dw else None), (db.to(ctx.bias_dtype) if compute_db else None), None


layer_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


class _LayerNormFunction(torch.autograd.Function):
    """The eager path: the same kernels without the custom-op dispatch cost on every call."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = _forward_any(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        compute_dw, compute_db = _grad_flags(ctx, weight, ctx.bias_dtype is not None)
        dx, dw, db = _backward_any(dy, x, weight, mean, rstd, compute_dw, compute_db)
        return (
            dx,
            (dw if compute_dw else None),
            (db.to(ctx.bias_dtype) if compute_db else None),
            None,
        )


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """LayerNorm of `x` over its last dim with optional affine weight and bias."""
    if is_dtensor(x):  # tensor or sequence parallel: whole rows on this rank (tensor_parallel.py)
        return dtensor_layer_norm(layer_norm, x, weight, bias, eps)
    if torch.compiler.is_compiling():
        return layer_norm_fwd(x, weight, bias, float(eps))[0]
    if not needs_grad(x, weight, bias):  # inference: no Function, no mean or rstd kept
        return _forward_any(x, weight, bias, float(eps), stats=False)[0]
    return _LayerNormFunction.apply(x, weight, bias, float(eps))
