"""Gated activations act(a) * b (SwiGLU, GeGLU) and plain SiLU / ReLU², forward and backward.

Numerics follow the HF MLP ``act_fn(gate) * up`` run in the input dtype, rounding where eager
rounds: the activation is computed in fp32 and rounded to the input dtype, then multiplied by
``b`` in fp32 and rounded once. The backward rounds d(act) = dc * b to the input dtype before the
activation's derivative multiplies it, as eager's multiply backward does, and GELU (tanh) uses
torch's formula and the device's tanh, so a GeGLU MLP's gradients are eager's rather than merely
as close to exact (Liger's GeGLU test compares them at 1e-2 on N(0, 1) weights, where 1e5-sized
weight gradients cancel). The backward recomputes the activation from the saved ``a`` and
``b``; no activation is stored. The kernels walk the tensors as flat ranges (rows with a stride
when a or b is a column slice, e.g. of a fused gate_up projection), so odd widths like 14336
waste no lanes.

With ``in_place=True`` the backward writes d(a) over a and d(b) over b (as Liger's SwiGLU does),
so it allocates no gradient buffers: a and b hold their gradients afterwards. Their version
counters are bumped, so an op that saved a or b for its own later backward raises autograd's
"modified by an inplace operation" error instead of reading gradients as activations. A backward
that keeps its graph (``retain_graph=True``) takes new buffers, so a second backward still reads
the activations.

`glu_halves` is the gated product of the two halves of one tensor (a fused gate_up projection):
its backward writes d(gate_up) over gate_up itself, one tensor, so nothing downstream has to
concatenate two half gradients into a new buffer either.
"""

import functools
import struct

import torch
import torch.nn.functional as F

from . import tensor_parallel
from ._common import (
    PlanCache,
    as_rows,
    cdiv,
    contiguous_strides,
    fast_launch,
    flat,
    graph_is_freed,
    interpreting,
    needs_grad,
    op_name,
    rows_stride,
    use_triton,
)
from ._triton import libdevice, tl, triton

SILU, GELU_TANH, GELU_ERF, RELU_SQUARED = 0, 1, 2, 3
QUICK_GELU = 4  # x * sigmoid(1.702 x) (CLIP's and Qwen2-VL's vision towers)
RELU = 5  # max(x, 0) (T5's and UDOP's non-gated MLPs)

_SQRT_2_OVER_PI = 0.7978845608028654
_GELU_C = 0.044715
_INV_SQRT2 = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327
# Triton kernels may only read globals that are constexpr.
_K = tl.constexpr(_SQRT_2_OVER_PI)
_C = tl.constexpr(_GELU_C)
_R2 = tl.constexpr(_INV_SQRT2)
_R2PI = tl.constexpr(_INV_SQRT_2PI)


def _fp32(x: float) -> float:
    """x rounded to the nearest fp32 (plain Python: the import may run under a meta device)."""
    return struct.unpack("f", struct.pack("f", x))[0]


# 3 * kappa as torch's kernel forms it: a product of two fp32 constants, rounded to fp32 (the
# double product of two fp32 values is exact, so one rounding gives the fp32 product).
_GELU_3C = _fp32(3.0 * _fp32(_GELU_C))
_C3 = tl.constexpr(_GELU_3C)


def device_tanh() -> bool:
    """The kernels' DEV_TANH, asked per launch: torch's CUDA GELU calls the device's tanhf, and
    Triton's interpreter has no libdevice (its tanh returns None), so there tanh comes from exp
    (as accurate in fp32; only the CPU checks run it). Asked at launch, not at import: a module
    imported with the interpreter off may run with it on."""
    return libdevice is not None and not interpreting()


@triton.jit
def _tanh(x, DEV_TANH: tl.constexpr):
    if DEV_TANH:
        t = libdevice.tanh(x)
    else:
        t = 1.0 - 2.0 / (tl.exp(x * 2.0) + 1.0)
    return t


@triton.jit
def _act(a, ACT: tl.constexpr, DEV_TANH: tl.constexpr):
    """act(a) for fp32 a."""
    if ACT == 0:
        y = a * tl.sigmoid(a)
    elif ACT == 1:
        # torch's CUDA kernel, operation for operation, so the rounded activation is eager's.
        # (A tensor leads each product: the interpreter keeps constexpr * tensor a constexpr.)
        y = a * 0.5 * (1.0 + _tanh((a + (a * a * a) * _C) * _K, DEV_TANH))
    elif ACT == 2:
        y = 0.5 * a * (1.0 + tl.erf(a * _R2))
    elif ACT == 4:
        y = a * tl.sigmoid(1.702 * a)
    elif ACT == 5:
        y = tl.maximum(a, 0.0)
    else:
        # relu(a)^2: exact in fp32 for a bf16/fp16 a, so one rounding, as torch's square
        r = tl.maximum(a, 0.0)
        y = r * r
    return y


@triton.jit
def _act_grad(a, ACT: tl.constexpr, DEV_TANH: tl.constexpr):
    """d act(a) / da for fp32 a."""
    if ACT == 0:
        s = tl.sigmoid(a)
        g = s * (1.0 + a * (1.0 - s))
    elif ACT == 1:
        # torch's CUDA kernel, operation for operation (see _act)
        a_sq = a * a
        t = _tanh((a + (a_sq * a) * _C) * _K, DEV_TANH)
        g = (t + 1.0) * 0.5 + (a * 0.5) * (1.0 - t * t) * ((a_sq * _C3 + 1.0) * _K)
    elif ACT == 2:
        g = 0.5 * (1.0 + tl.erf(a * _R2)) + a * _R2PI * tl.exp(-0.5 * a * a)
    elif ACT == 4:
        s = tl.sigmoid(1.702 * a)
        g = s + 1.702 * a * s * (1.0 - s)
    elif ACT == 5:
        g = tl.where(a > 0.0, 1.0, 0.0)  # 0 at 0, as torch's relu backward
    else:
        g = 2.0 * tl.maximum(a, 0.0)
    return g


@triton.jit
def _offsets(offs, N, stride, CONTIG: tl.constexpr):
    if CONTIG:
        o = offs
    else:
        o = (offs // N) * stride + offs % N
    return o


@fast_launch
@triton.jit
def _glu_fwd_kernel(
    A, B, C, numel, N, stride_a, stride_b,
    ACT: tl.constexpr, DEV_TANH: tl.constexpr, CONTIG: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    a = tl.load(A + _offsets(offs, N, stride_a, CONTIG), mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + _offsets(offs, N, stride_b, CONTIG), mask=mask, other=0.0).to(tl.float32)
    h = _act(a, ACT, DEV_TANH).to(A.dtype.element_ty).to(tl.float32)
    tl.store(C + offs, (h * b).to(C.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _glu_bwd_kernel(
    DC, A, B, DA, DB, C, numel, N, stride_a, stride_b, stride_da, stride_db,
    ACT: tl.constexpr, DEV_TANH: tl.constexpr, CONTIG: tl.constexpr, OUT_CONTIG: tl.constexpr,
    WRITE_C: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    dc = tl.load(DC + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A + _offsets(offs, N, stride_a, CONTIG), mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + _offsets(offs, N, stride_b, CONTIG), mask=mask, other=0.0).to(tl.float32)
    h = _act(a, ACT, DEV_TANH).to(A.dtype.element_ty).to(tl.float32)
    db = (dc * h).to(DB.dtype.element_ty)
    # d(act) rounded to the input dtype first, as eager's multiply backward leaves it
    d_act = (dc * b).to(A.dtype.element_ty).to(tl.float32)
    da = (d_act * _act_grad(a, ACT, DEV_TANH)).to(DA.dtype.element_ty)
    tl.store(DB + _offsets(offs, N, stride_db, OUT_CONTIG), db, mask=mask)
    tl.store(DA + _offsets(offs, N, stride_da, OUT_CONTIG), da, mask=mask)
    if WRITE_C:
        # The forward's product again, element for element after dc was read (C may be DC).
        tl.store(C + offs, (h * b).to(C.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _act_fwd_kernel(X, Y, numel, ACT: tl.constexpr, DEV_TANH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, _act(x, ACT, DEV_TANH).to(Y.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _act_bwd_kernel(
    DY, X, DX, Y, numel,
    ACT: tl.constexpr, DEV_TANH: tl.constexpr, WRITE_Y: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(DX + offs, (dy * _act_grad(x, ACT, DEV_TANH)).to(DX.dtype.element_ty), mask=mask)
    if WRITE_Y:
        # The forward's act(x) again, element for element after dy and x were read (Y may be
        # DY, DX may be X).
        tl.store(Y + offs, _act(x, ACT, DEV_TANH).to(Y.dtype.element_ty), mask=mask)


def elementwise_config(numel: int) -> dict:
    """Elements per program and warps for the flat kernels (within 1 % of the best on an H200)."""
    return {"BLOCK": 2048, "num_warps": 8} if numel >= 1 << 22 else {"BLOCK": 1024, "num_warps": 4}


def _glu_rows(a: torch.Tensor, b: torch.Tensor):
    n = a.shape[-1]
    a2, b2 = as_rows(a, n), as_rows(b, n)
    contig = (a2.stride(0) == n and b2.stride(0) == n) or a2.shape[0] <= 1
    return a2, b2, n, contig


def glu_forward(a, b, act, cfg=None):
    """Triton act(a) * b for a, b of one shape. A call without `cfg` runs the plan its key maps
    to (row strides, the output's dtype and strides, scalars, the bound launch)."""
    key = (a.shape, a.stride(), b.shape, b.stride(), a.dtype, b.dtype, a.device, act, cfg is None)
    plan = _GLU_FORWARD_PLANS.get(key) if cfg is None else None
    if plan is None:
        plan = _GLUForwardPlan(a, b, act, cfg)
        if cfg is None:
            _GLU_FORWARD_PLANS.keep(key, plan)
    return plan(a, b)


class _GLUForwardPlan:
    __slots__ = ("n", "shape", "strides", "dtype", "device", "a_rows", "b_rows", "args", "launch")

    def __init__(self, a, b, act, cfg) -> None:
        a2, b2, n, contig = _glu_rows(a, b)
        self.n, self.shape, self.device = n, a.shape, a.device
        self.strides = contiguous_strides(a.shape)
        self.dtype = torch.promote_types(a.dtype, b.dtype)
        self.a_rows, self.b_rows = rows_stride(a, n) is not None, rows_stride(b, n) is not None
        numel = a.numel()
        self.args = (numel, n, a2.stride(0), b2.stride(0))
        self.launch = None
        if numel:
            cfg = cfg or elementwise_config(numel)
            self.launch = _glu_fwd_kernel.bound(
                (cdiv(numel, cfg["BLOCK"]),),
                {
                    "ACT": act,
                    "DEV_TANH": device_tanh(),
                    "CONTIG": contig,
                    "BLOCK": cfg["BLOCK"],
                    "num_warps": cfg["num_warps"],
                },
            )

    def __call__(self, a, b):
        c = torch.empty_strided(self.shape, self.strides, dtype=self.dtype, device=self.device)
        if self.launch is not None:
            # a and b themselves stand for their row views (one base pointer), else copies.
            a2 = a if self.a_rows else as_rows(a, self.n)
            b2 = b if self.b_rows else as_rows(b, self.n)
            self.launch(a2, b2, c, *self.args)
        return c


def glu_backward(dc, a, b, act, cfg=None, out=None, product=None):
    """Triton gradients (da, db) of act(a) * b, recomputing act(a).

    `out`: optional (da, db) to write into, each [..., N] with unit stride along N (for example
    the two halves of one [rows, 2N] buffer). `product`: optional contiguous tensor shaped like
    dc (it may be dc itself) that receives the forward's act(a) * b in the same pass. A call
    without `cfg` runs the plan its key maps to.
    """
    key = (dc.shape, dc.stride(), dc.dtype, a.shape, a.stride(), b.shape, b.stride(), a.dtype,
           b.dtype, a.device, act, cfg is None,
           out is None or (out[0].stride(), out[0].dtype, out[1].stride(), out[1].dtype),
           product is None or (product.stride(), product.dtype))  # fmt: skip
    plan = _GLU_BACKWARD_PLANS.get(key) if cfg is None else None
    if plan is None:
        plan = _GLUBackwardPlan(dc, a, b, act, cfg, out, product)
        if cfg is None:
            _GLU_BACKWARD_PLANS.keep(key, plan)
    return plan(dc, a, b, out, product)


class _GLUBackwardPlan:
    __slots__ = ("n", "a_shape", "b_shape", "a_strides", "b_strides", "a_dtype", "b_dtype",
                 "device", "a_rows", "b_rows", "dc_flat", "bad_product", "args",
                 "launch")  # fmt: skip

    def __init__(self, dc, a, b, act, cfg, out, product) -> None:
        a2, b2, n, contig = _glu_rows(a, b)
        self.n, self.device = n, a.device
        self.a_shape, self.b_shape = a.shape, b.shape
        self.a_strides, self.b_strides = contiguous_strides(a.shape), contiguous_strides(b.shape)
        self.a_dtype, self.b_dtype = a.dtype, b.dtype
        self.a_rows, self.b_rows = rows_stride(a, n) is not None, rows_stride(b, n) is not None
        self.dc_flat = dc.is_contiguous()  # dc itself is its flat view, else a copy per call
        self.bad_product = product is not None and not (
            product.is_contiguous() and dc.is_contiguous()
        )
        if out is None:
            da = torch.empty_strided(a.shape, self.a_strides, dtype=a.dtype, device="meta")
            db = torch.empty_strided(b.shape, self.b_strides, dtype=b.dtype, device="meta")
        else:
            da, db = out
        da2, db2 = da.view(-1, n), db.view(-1, n)
        out_contig = (da2.stride(0) == n and db2.stride(0) == n) or da2.shape[0] <= 1
        numel = da.numel()
        self.args = (numel, n, a2.stride(0), b2.stride(0), da2.stride(0), db2.stride(0))
        self.launch = None
        if numel:
            cfg = cfg or elementwise_config(numel)
            self.launch = _glu_bwd_kernel.bound(
                (cdiv(numel, cfg["BLOCK"]),),
                {"ACT": act, "DEV_TANH": device_tanh(), "CONTIG": contig, "OUT_CONTIG": out_contig,
                 "WRITE_C": product is not None, "BLOCK": cfg["BLOCK"],
                 "num_warps": cfg["num_warps"]},
            )  # fmt: skip

    def __call__(self, dc, a, b, out, product):
        dev = self.device
        if out is None:
            da = torch.empty_strided(self.a_shape, self.a_strides, dtype=self.a_dtype, device=dev)
            db = torch.empty_strided(self.b_shape, self.b_strides, dtype=self.b_dtype, device=dev)
        else:
            da, db = out
        if self.bad_product:
            raise ValueError("glu_backward writes `product` at dc's flat offsets: both contiguous")
        if self.launch is not None:
            n = self.n
            dc1 = dc if self.dc_flat else flat(dc)
            a2 = a if self.a_rows else as_rows(a, n)
            b2 = b if self.b_rows else as_rows(b, n)
            # da and db stand for their [rows, n] views (one base pointer each).
            self.launch(dc1, a2, b2, da, db, dc1 if product is None else product, *self.args)
        return da, db


_GLU_FORWARD_PLANS = PlanCache()
_GLU_BACKWARD_PLANS = PlanCache()


def _torch_act(x: torch.Tensor, act: int) -> torch.Tensor:
    if act == SILU:
        return F.silu(x)
    if act == RELU_SQUARED:
        return torch.square(F.relu(x))
    if act == RELU:
        return F.relu(x)
    if act == QUICK_GELU:
        return (x.float() * torch.sigmoid(1.702 * x.float())).to(x.dtype)
    return F.gelu(x, approximate="tanh" if act == GELU_TANH else "none")


def _torch_act_grad(x: torch.Tensor, act: int) -> torch.Tensor:
    """d act / dx in fp32."""
    x = x.float()
    if act == SILU:
        s = torch.sigmoid(x)
        return s * (1.0 + x * (1.0 - s))
    if act == RELU_SQUARED:
        return 2.0 * F.relu(x)
    if act == RELU:
        return (x > 0).float()
    if act == QUICK_GELU:
        s = torch.sigmoid(1.702 * x)
        return s + 1.702 * x * s * (1.0 - s)
    if act == GELU_TANH:
        x_sq = x * x
        t = torch.tanh(_SQRT_2_OVER_PI * (x + _GELU_C * (x_sq * x)))
        return 0.5 * (1.0 + t) + (0.5 * x) * (1.0 - t * t) * (
            _SQRT_2_OVER_PI * (1.0 + _GELU_3C * x_sq)
        )
    return 0.5 * (1.0 + torch.erf(x * _INV_SQRT2)) + x * _INV_SQRT_2PI * torch.exp(-0.5 * x * x)


def _torch_act_backward(dy: torch.Tensor, x: torch.Tensor, act: int) -> torch.Tensor:
    """d(x) of act(x) for dy, in x's dtype: torch's own backward ops where eager has one (so
    the CPU path is eager's bit for bit), else the fp32 derivative rounded once."""
    if dy.dtype == x.dtype:
        if act == SILU:
            return torch.ops.aten.silu_backward(dy, x)
        if act in (GELU_TANH, GELU_ERF):
            approximate = "tanh" if act == GELU_TANH else "none"
            return torch.ops.aten.gelu_backward(dy, x, approximate=approximate)
        if act == RELU:
            return torch.ops.aten.threshold_backward(dy, x, 0)
    return (dy.float() * _torch_act_grad(x, act)).to(x.dtype)


def _glu_forward_any(a, b, act):
    if use_triton(a):
        return glu_forward(a, b, act)
    return (_torch_act(a, act) * b).contiguous()


def _glu_backward_any(dc, a, b, act, out=None, product=None):
    if use_triton(a):
        return glu_backward(dc, a, b, act, out=out, product=product)
    act_a = _torch_act(a, act)
    # d(act) rounded to the input dtype first, as eager's multiply backward leaves it
    da = _torch_act_backward((dc.float() * b.float()).to(a.dtype), a, act)
    db = (dc.float() * act_a.float()).to(b.dtype)
    if product is not None:
        product.copy_(act_a * b)
    if out is None:
        return da.contiguous(), db.contiguous()
    out[0].copy_(da)
    out[1].copy_(db)
    return out


def _act_forward_any(x, act):
    if not use_triton(x):
        return _torch_act(x, act).contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    numel = y.numel()
    if numel:
        _act_launch(numel, act, None, device_tanh())(flat(x), y, numel)
    return y


@functools.lru_cache(maxsize=256)  # asked per call; a BoundLaunch is shared, never mutated
def _act_launch(numel: int, act: int, write_y: bool | None, dev_tanh: bool):
    """The bound launch of the activation's forward (`write_y` None) or backward kernel over
    `numel` elements: everything but the tensors and numel is fixed by these four."""
    cfg = elementwise_config(numel)
    grid = (cdiv(numel, cfg["BLOCK"]),)
    kwargs = {"ACT": act, "DEV_TANH": dev_tanh, "BLOCK": cfg["BLOCK"]}
    if write_y is None:
        return _act_fwd_kernel.bound(grid, {**kwargs, "num_warps": cfg["num_warps"]})
    return _act_bwd_kernel.bound(
        grid, {**kwargs, "WRITE_Y": write_y, "num_warps": cfg["num_warps"]}
    )


def _act_backward_any(dy, x, act, out=None, product=None):
    """d(x) of act(x) for the incoming dy, into `out` when given (it may be x itself: each
    element is read before it is written). `product`: optional tensor shaped like dy (it may be
    dy itself) that receives the forward's act(x) in the same pass. All contiguous."""
    if not use_triton(x):
        dx = _torch_act_backward(dy, x, act)
        if product is not None:
            product.copy_(_torch_act(x, act))
        if out is None:
            return dx.contiguous()
        return out.copy_(dx)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    numel = dx.numel()
    if numel:
        dy1 = flat(dy)
        _act_launch(numel, act, product is not None, device_tanh())(
            dy1, flat(x), dx, dy1 if product is None else product, numel
        )
    return dx


# torch.library ops: what torch.compile sees (opaque, with fake and autograd registrations).


@torch.library.custom_op(op_name("glu_fwd"), mutates_args=())
def glu_fwd(a: torch.Tensor, b: torch.Tensor, act: int) -> torch.Tensor:
    return _glu_forward_any(a, b, act)


@glu_fwd.register_fake
def _(a, b, act):
    return a.new_empty(a.shape, dtype=torch.promote_types(a.dtype, b.dtype))


@torch.library.custom_op(op_name("glu_bwd"), mutates_args=())
def glu_bwd(
    dc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, act: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return _glu_backward_any(dc, a, b, act)


@glu_bwd.register_fake
def _(dc, a, b, act):
    return a.new_empty(a.shape), b.new_empty(b.shape)


def _glu_setup(ctx, inputs, output):
    a, b, act = inputs
    ctx.save_for_backward(a, b)
    ctx.act = act


def _glu_backward(ctx, dc):
    a, b = ctx.saved_tensors
    da, db = glu_bwd(dc, a, b, ctx.act)
    return da, db, None


glu_fwd.register_autograd(_glu_backward, setup_context=_glu_setup)


@torch.library.custom_op(op_name("act_fwd"), mutates_args=())
def act_fwd(x: torch.Tensor, act: int) -> torch.Tensor:
    return _act_forward_any(x, act)


@act_fwd.register_fake
def _(x, act):
    return x.new_empty(x.shape)


@torch.library.custom_op(op_name("act_bwd"), mutates_args=())
def act_bwd(dy: torch.Tensor, x: torch.Tensor, act: int) -> torch.Tensor:
    return _act_backward_any(dy, x, act)


@act_bwd.register_fake
def _(dy, x, act):
    return x.new_empty(x.shape)


def _act_setup(ctx, inputs, output):
    x, act = inputs
    ctx.save_for_backward(x)
    ctx.act = act


def _act_backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return act_bwd(dy, x, ctx.act), None


act_fwd.register_autograd(_act_backward, setup_context=_act_setup)


# autograd.Functions: the eager path, without the custom-op dispatch cost on every call.


def _can_overwrite(a: torch.Tensor, b: torch.Tensor, dc: torch.Tensor) -> bool:
    """Whether d(a), d(b) may go over a and b: both contiguous, of one dtype with dc (the
    gradients' dtype), and in separate storages (two halves of one buffer take new ones)."""
    return (
        a.is_contiguous()
        and b.is_contiguous()
        and a.dtype == b.dtype == dc.dtype
        and a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    )


class _GLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, act, in_place=False):
        ctx.save_for_backward(a, b)
        ctx.act, ctx.in_place = act, in_place
        return _glu_forward_any(a, b, act)

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        if ctx.in_place and _can_overwrite(a, b, dc) and graph_is_freed():
            # Each element is read before it is written, by the same program: safe in place.
            da, db = _glu_backward_any(dc, a, b, ctx.act, out=(a, b))
            torch.autograd.graph.increment_version(a)
            torch.autograd.graph.increment_version(b)
        else:
            da, db = _glu_backward_any(dc, a, b, ctx.act)
        return da, db, None, None


class _GLUHalvesFunction(torch.autograd.Function):
    """act(x[..., :I]) * x[..., I:]; the gradient is one tensor shaped like x (over x itself
    when in place), its halves written by one backward pass."""

    @staticmethod
    def forward(ctx, x, act, in_place):
        a, b = x.chunk(2, dim=-1)
        ctx.save_for_backward(x)
        ctx.act, ctx.in_place = act, in_place
        return _glu_forward_any(a, b, act)

    @staticmethod
    def backward(ctx, dc):
        (x,) = ctx.saved_tensors
        overwrite = ctx.in_place and x.is_contiguous() and x.dtype == dc.dtype and graph_is_freed()
        dx = x if overwrite else torch.empty(x.shape, dtype=x.dtype, device=x.device)
        a, b = x.chunk(2, dim=-1)
        # Each element is read before it is written, by the same program: safe over x.
        _glu_backward_any(dc, a, b, ctx.act, out=dx.chunk(2, dim=-1))
        if overwrite:
            torch.autograd.graph.increment_version(x)
        return dx, None, None


class _ActFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, act, in_place=False):
        ctx.save_for_backward(x)
        ctx.act, ctx.in_place = act, in_place
        return _act_forward_any(x, act)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        if ctx.in_place and x.is_contiguous() and x.dtype == dy.dtype and graph_is_freed():
            # Each element is read before it is written, by the same program: safe over x.
            dx = _act_backward_any(dy, x, ctx.act, out=x)
            torch.autograd.graph.increment_version(x)
        else:
            dx = _act_backward_any(dy, x, ctx.act)
        return dx, None, None


def _glu(a, b, act, in_place=False):
    if tensor_parallel.is_dtensor(a) or tensor_parallel.is_dtensor(b):  # local, elementwise
        return tensor_parallel.elementwise(_glu, a, b, act=act, in_place=in_place)
    if torch.compiler.is_compiling():
        return glu_fwd(a, b, act)  # the compiled graph owns its buffers: in_place is ignored
    if not needs_grad(a, b):  # inference: the kernel alone, no autograd Function's host cost
        return _glu_forward_any(a, b, act)
    return _GLUFunction.apply(a, b, act, in_place)


def _check_pair(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(
            f"gate and up must have one shape, got {tuple(a.shape)} and {tuple(b.shape)}"
        )


def silu_mul(a: torch.Tensor, b: torch.Tensor, *, in_place: bool = False) -> torch.Tensor:
    """silu(a) * b (SwiGLU), a and b of one shape.

    ``in_place=True``: the backward writes the gradients over a and b (no gradient buffers; see
    the module docstring); where that cannot be done (a or b strided, dtypes differing, one
    storage) it takes new buffers. Do not read a or b after the backward.
    """
    _check_pair(a, b)
    return _glu(a, b, SILU, in_place)


def gelu_mul(
    a: torch.Tensor, b: torch.Tensor, approximate: str = "tanh", *, in_place: bool = False
) -> torch.Tensor:
    """gelu(a) * b (GeGLU); ``approximate`` is "tanh" or "none" as in torch's gelu;
    ``in_place`` as in `silu_mul`."""
    _check_pair(a, b)
    if approximate not in ("tanh", "none"):
        raise ValueError(f'approximate must be "tanh" or "none", got {approximate!r}')
    return _glu(a, b, GELU_TANH if approximate == "tanh" else GELU_ERF, in_place)


def glu_halves(x: torch.Tensor, act: int, *, in_place: bool = False) -> torch.Tensor:
    """act(gate) * up for ``gate, up = x.chunk(2, dim=-1)`` (a fused gate_up projection's
    output), `act` one of SILU, GELU_TANH, GELU_ERF.

    The gradient of x comes back as one tensor; ``in_place=True`` writes it over x (contiguous,
    of the gradient's dtype; else a new buffer), so do not read x after the backward.
    """
    if x.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim must be even (two halves), got {x.shape[-1]}")
    if tensor_parallel.is_dtensor(x):  # halves of a split dim: DTensor's own ops lay them out
        gate, up = x.chunk(2, dim=-1)
        return _torch_act(gate, act) * up
    if torch.compiler.is_compiling():
        return glu_fwd(*x.chunk(2, dim=-1), act)  # the compiled graph owns its buffers
    if not needs_grad(x):
        return _glu_forward_any(*x.chunk(2, dim=-1), act)
    return _GLUHalvesFunction.apply(x, act, in_place)


def silu(x: torch.Tensor) -> torch.Tensor:
    """silu(x) with a Triton backward."""
    if tensor_parallel.is_dtensor(x):
        return tensor_parallel.elementwise(silu, x)
    if torch.compiler.is_compiling():
        return act_fwd(x, SILU)
    if not needs_grad(x):
        return _act_forward_any(x, SILU)
    return _ActFunction.apply(x, SILU)


def relu_squared(x: torch.Tensor, *, in_place: bool = False) -> torch.Tensor:
    """relu(x)^2 (transformers' ReLUSquaredActivation, Nemotron's "relu2") with a Triton
    backward that keeps x only.

    ``in_place=True``: the backward writes d(x) over x (contiguous, of the gradient's dtype;
    else a new buffer), as silu_mul's in_place does; do not read x after the backward.
    """
    if tensor_parallel.is_dtensor(x):
        return tensor_parallel.elementwise(relu_squared, x, in_place=in_place)
    if torch.compiler.is_compiling():
        return act_fwd(x, RELU_SQUARED)  # the compiled graph owns its buffers
    if not needs_grad(x):
        return _act_forward_any(x, RELU_SQUARED)
    return _ActFunction.apply(x, RELU_SQUARED, in_place)
