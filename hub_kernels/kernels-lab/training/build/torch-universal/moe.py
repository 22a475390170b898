"""Mixture-of-experts experts with fused 3-D weights (transformers 5.x ``*Experts`` modules).

What the module computes, for each token t and each of its k routed experts e = idx[t, k]:

    out[t] = sum_k w[t, k] * down_e(act(gate_e(x[t])) * up_e(x[t]))

with gate_e/up_e the two halves of ``gate_up_proj[e]`` and down_e ``down_proj[e]``.

The grouped path sorts the S = T*K (token, expert) pairs by expert once, so that every expert's
rows are one contiguous block, and then runs:

    x_g      = x[token of each sorted pair]                      [S, H]  (freed after use)
    gate_up  = grouped_mm(x_g, W_gate_up)                        [S, 2I] (saved)
    h        = act(gate) * up          (swiglu.py's GLU kernel)  [S, I]
    y        = grouped_mm(h, W_down)                             [S, H]
    out[t]   = sum_k w[t, k] * y[pair (t, k)]   (one kernel: the routing-weight multiply and the
                                                 scatter-add, in fp32, no atomics)

The backward recomputes what it can instead of keeping it: x_g is gathered again, h is
recomputed from the saved gate_up in the same pass that computes d(gate_up), the routing-weight
gradient (a row dot product) and the weighted h that down_proj's weight gradient needs (written
over the buffer it read, as gated_mlp.py does). Only gate_up, the sort and the inputs are kept
from the forward: neither x_g, h nor y.

Grouped matmuls run ``torch._grouped_mm`` where the device and dtype have it (CUDA bf16 on sm80+
with recent torch; CPU fp32/bf16 on torch >= 2.9), with shapes whose rows are 16-byte aligned;
everything else loops over the experts with contiguous slices (one host sync per call).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from ._common import cdiv, op_name, use_triton
from .swiglu import (
    GELU_ERF,
    GELU_TANH,
    SILU,
    _act,
    _act_grad,
    _glu_forward_any,
    _torch_act,
    _torch_act_grad,
)

__all__ = ["MoEExperts", "experts_supported", "moe_experts"]

_SILU_NAMES = {"SiLUActivation", "SiLU"}
_GELU_TANH_NAMES = {"GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "FastGELUActivation"}
_GELU_ERF_NAMES = {"GELUActivation"}


# --------------------------------------------------------------------------- Triton kernels


@triton.jit
def _combine_kernel(
    Y, POS, W, IDS, OUT, H, K, E, stride_y,
    HAS_W: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """OUT[t] = sum_k W[t, k] * Y[POS[t, k]] over the pairs whose expert id is < E, in fp32."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in range(K):
        p = tl.load(POS + t * K + k).to(tl.int64)
        e = tl.load(IDS + t * K + k)
        if e < E:  # an expert-parallel sentinel id has no row of its own
            y = tl.load(Y + p * stride_y + cols, mask=cmask, other=0.0).to(tl.float32)
            if HAS_W:
                y = y * tl.load(W + t * K + k).to(tl.float32)
            acc += y
    tl.store(OUT + t * H + cols, acc.to(OUT.dtype.element_ty), mask=cmask)


@triton.jit
def _glu_bwd_kernel(
    G, GU, W, IDS, DGU, DW, S, N, E,
    ACT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Per sorted pair s with routing weight w and g = d(out) @ W_down[e] (row s of G):
    d(gate_up)[s] from dh = w * g, DW[s] = <g, h> (d out / d w), and G[s] <- w * h, with
    h = act(gate) * up recomputed from GU and rounded as the forward rounded it."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < S
    w = tl.load(W + rows, mask=rmask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for c0 in range(0, N, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        m = rmask[:, None] & (cols < N)[None, :]
        g_ptr = G + rows[:, None] * N + cols[None, :]
        gu_ptr = GU + rows[:, None] * (2 * N) + cols[None, :]
        dgu_ptr = DGU + rows[:, None] * (2 * N) + cols[None, :]
        g = tl.load(g_ptr, mask=m, other=0.0).to(tl.float32)
        a = tl.load(gu_ptr, mask=m, other=0.0).to(tl.float32)
        b = tl.load(gu_ptr + N, mask=m, other=0.0).to(tl.float32)
        act = _act(a, ACT).to(GU.dtype.element_ty).to(tl.float32)
        h = (act * b).to(GU.dtype.element_ty).to(tl.float32)
        acc += tl.sum(g * h, axis=1)
        dh = g * w[:, None]
        tl.store(dgu_ptr, (dh * b * _act_grad(a, ACT)).to(DGU.dtype.element_ty), mask=m)
        tl.store(dgu_ptr + N, (dh * act).to(DGU.dtype.element_ty), mask=m)
        tl.store(g_ptr, (h * w[:, None]).to(G.dtype.element_ty), mask=m)
    valid = tl.load(IDS + rows, mask=rmask, other=E) < E
    tl.store(DW + rows, tl.where(valid, acc, 0.0), mask=rmask)


# --------------------------------------------------------------------------- pieces


def _combine(y, pos, w, ids, num_experts: int, dtype) -> torch.Tensor:
    """[T, H]: sum over k of w[t, k] * y[pos[t, k]] (w None: weight 1), skipping ids >= E."""
    t, k = pos.shape
    h = y.shape[1]
    if use_triton(y):
        out = torch.empty(t, h, dtype=dtype, device=y.device)
        if t and h:
            block = min(1024, triton.next_power_of_2(h))
            _combine_kernel[(t, cdiv(h, block))](
                y, pos, y if w is None else w, ids, out, h, k, num_experts, y.stride(0),
                HAS_W=w is not None, BLOCK_H=block, num_warps=4,
            )  # fmt: skip
        return out
    valid = (ids < num_experts).unsqueeze(-1)
    rows = torch.where(valid, y[pos.reshape(-1)].view(t, k, h).float(), 0.0)
    if w is not None:
        rows = rows * w.float().unsqueeze(-1)
    return rows.sum(1).to(dtype)


def _glu_backward(g, gate_up, w_sorted, ids_sorted, num_experts: int, act: int):
    """(d gate_up [S, 2I], d w per sorted pair [S] fp32); g is overwritten with w * h."""
    s, inter = g.shape
    d_gate_up = torch.empty_like(gate_up)
    if use_triton(g):
        dw = torch.empty(s, dtype=torch.float32, device=g.device)
        if s and inter:
            block_c = min(256, triton.next_power_of_2(inter))
            block_r = max(1, min(16, 2048 // block_c))
            _glu_bwd_kernel[(cdiv(s, block_r),)](
                g, gate_up, w_sorted, ids_sorted, d_gate_up, dw, s, inter, num_experts,
                ACT=act, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4,
            )  # fmt: skip
        return d_gate_up, dw
    a, b = gate_up[:, :inter].float(), gate_up[:, inter:].float()
    act_a = _torch_act(gate_up[:, :inter], act).float()
    h = (act_a * b).to(gate_up.dtype).float()
    gf, wf = g.float(), w_sorted.float().unsqueeze(-1)
    dw = torch.where(ids_sorted < num_experts, (gf * h).sum(-1), 0.0)
    dh = gf * wf
    d_gate_up[:, :inter] = dh * b * _torch_act_grad(a, act)
    d_gate_up[:, inter:] = dh * act_a
    g.copy_(h * wf)
    return d_gate_up, dw


def _aligned(*tensors: torch.Tensor) -> bool:
    """torch._grouped_mm wants 16-byte aligned data and row strides."""
    for t in tensors:
        step = t.element_size()
        if t.data_ptr() % 16 or any(st * step % 16 for st in t.stride() if st != 1):
            return False
    return True


def _use_grouped_mm(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.is_cuda:
        major, minor = torch.cuda.get_device_capability(x.device)
        recent = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 9)
        ok_device = (major, minor) >= (8, 0) if recent else major == 9
        ok = ok_device and x.dtype == torch.bfloat16
    elif x.device.type == "cpu":
        recent = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 9)
        ok = recent and x.dtype in (torch.float32, torch.bfloat16)
    else:
        ok = False
    return ok and _aligned(x, w_gate_up, w_down) and x.shape[1] * x.element_size() % 16 == 0


def _mm_groups(a, b, offs, grouped: bool, counts):
    """[S, N]: rows of a (grouped by expert, boundaries `offs`) times b[e] ([E, K, N] view)."""
    if grouped:
        return torch._grouped_mm(a, b, offs=offs)
    out = a.new_empty(a.shape[0], b.shape[2])
    start = 0
    for e, n in enumerate(counts):
        if n:
            torch.mm(a[start : start + n], b[e], out=out[start : start + n])
        start += n
    return out


def _mm_weight_grad(a_t, b, offs, grouped: bool, counts):
    """[E, M, N]: per expert e, a_t[:, rows of e] @ b[rows of e] (zero for an expert with none)."""
    if grouped:
        return torch._grouped_mm(a_t, b, offs=offs)
    out = a_t.new_zeros(len(counts), a_t.shape[0], b.shape[1])
    start = 0
    for e, n in enumerate(counts):
        if n:
            torch.mm(a_t[:, start : start + n], b[start : start + n], out=out[e])
        start += n
    return out


def _route(top_k_index: torch.Tensor, num_experts: int):
    """Sort the pairs by expert: (perm, pos, ids_sorted, offs). perm[s] is the flat (t, k) index
    of sorted row s, pos its inverse ([T, K]); offs[e] the end of expert e's rows (int32).
    Ids >= num_experts (expert-parallel sentinels) sort last and belong to no group."""
    ids = top_k_index.reshape(-1)
    ids_sorted, perm = torch.sort(ids, stable=True)
    pos = torch.empty_like(perm)
    pos.scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
    bounds = torch.arange(1, num_experts + 1, device=ids.device, dtype=ids_sorted.dtype)
    offs = torch.searchsorted(ids_sorted, bounds, out_int32=True)
    return perm, pos.view(top_k_index.shape), ids_sorted, offs


def _counts(offs: torch.Tensor) -> list[int]:
    ends = offs.tolist()
    return [e - s for s, e in zip([0] + ends[:-1], ends, strict=True)]


def _weights(w_gate_up, w_down, transposed: bool):
    """[E, H, 2I] and [E, I, H] views (the right operands of x @ W) of the stored weights."""
    if transposed:
        return w_gate_up, w_down
    return w_gate_up.transpose(1, 2), w_down.transpose(1, 2)


def _forward(x, w_gate_up, w_down, top_k_index, top_k_weights, act: int, transposed: bool):
    """(out [T, H], gate_up [S, 2I], perm, pos, offs) for x [T, H]."""
    num_experts, k = w_gate_up.shape[0], top_k_index.shape[-1]
    perm, pos, ids_sorted, offs = _route(top_k_index, num_experts)
    grouped = _use_grouped_mm(x, w_gate_up, w_down)
    counts = None if grouped else _counts(offs)
    b_gate_up, b_down = _weights(w_gate_up, w_down, transposed)
    x_g = x.index_select(0, perm // k)
    gate_up = _mm_groups(x_g, b_gate_up, offs, grouped, counts)
    del x_g
    inter = gate_up.shape[1] // 2
    h = _glu_forward_any(gate_up[:, :inter], gate_up[:, inter:], act)
    y = _mm_groups(h, b_down, offs, grouped, counts)
    del h
    out = _combine(y, pos, top_k_weights, top_k_index, num_experts, x.dtype)
    return out, gate_up, perm, pos, offs


def _backward(
    dout, x, w_gate_up, w_down, top_k_index, top_k_weights, gate_up, perm, pos, offs,
    act: int, transposed: bool, need=(True, True, True, True),
):  # fmt: skip
    """(dx, d w_gate_up, d w_down, d top_k_weights); entries not in `need` are None."""
    num_experts, k = w_gate_up.shape[0], top_k_index.shape[-1]
    grouped = _use_grouped_mm(x, w_gate_up, w_down)
    counts = None if grouped else _counts(offs)
    b_gate_up, b_down = _weights(w_gate_up, w_down, transposed)
    token = perm // k
    ids_sorted = top_k_index.reshape(-1)[perm]
    dout = dout.contiguous()
    dout_g = dout.index_select(0, token)
    # g = d(out) @ W_down[e]: the gradient of h before the routing weight.
    g = _mm_groups(dout_g, b_down.transpose(1, 2), offs, grouped, counts)
    w_sorted = top_k_weights.reshape(-1)[perm].contiguous()
    d_gate_up, dw_sorted = _glu_backward(g, gate_up, w_sorted, ids_sorted, num_experts, act)
    wh = g  # now w * h, the input of down_proj scaled by the routing weight
    d_down = None
    if need[2]:
        if transposed:  # [E, I, H]
            d_down = _mm_weight_grad(wh.t(), dout_g, offs, grouped, counts)
        else:  # [E, H, I]
            d_down = _mm_weight_grad(dout_g.t(), wh, offs, grouped, counts)
        d_down = d_down.to(w_down.dtype)
    del dout_g, g, wh
    d_gate_up_w = None
    if need[1]:
        x_g = x.index_select(0, token)
        if transposed:  # [E, H, 2I]
            d_gate_up_w = _mm_weight_grad(x_g.t(), d_gate_up, offs, grouped, counts)
        else:  # [E, 2I, H]
            d_gate_up_w = _mm_weight_grad(d_gate_up.t(), x_g, offs, grouped, counts)
        d_gate_up_w = d_gate_up_w.to(w_gate_up.dtype)
        del x_g
    dx = None
    if need[0]:
        dx_g = _mm_groups(d_gate_up, b_gate_up.transpose(1, 2), offs, grouped, counts)
        dx = _combine(dx_g, pos, None, top_k_index, num_experts, x.dtype)
    dw = None
    if need[3]:
        dw = torch.empty_like(dw_sorted)
        dw[perm] = dw_sorted
        dw = dw.view(top_k_weights.shape).to(top_k_weights.dtype)
    return dx, d_gate_up_w, d_down, dw


# --------------------------------------------------------------------------- autograd


class _MoEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate_up, w_down, top_k_index, top_k_weights, act, transposed):
        out, gate_up, perm, pos, offs = _forward(
            x, w_gate_up, w_down, top_k_index, top_k_weights, act, transposed
        )
        ctx.save_for_backward(
            x, w_gate_up, w_down, top_k_index, top_k_weights, gate_up, perm, pos, offs
        )
        ctx.act, ctx.transposed = act, transposed
        ctx.mark_non_differentiable(top_k_index)
        return out

    @staticmethod
    def backward(ctx, dout):
        need = (
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            ctx.needs_input_grad[2],
            ctx.needs_input_grad[4],
        )
        dx, dgu, dd, dw = _backward(dout, *ctx.saved_tensors, ctx.act, ctx.transposed, need)
        return dx, dgu, dd, None, dw, None, None


# torch.library ops: what torch.compile sees (opaque; the sort and the per-expert sizes are
# data-dependent, which Inductor could not trace into anyway).


@torch.library.custom_op(op_name("moe_experts_fwd"), mutates_args=())
def moe_experts_fwd(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor, act: int, transposed: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return _forward(x, w_gate_up, w_down, top_k_index, top_k_weights, act, transposed)


@moe_experts_fwd.register_fake
def _(x, w_gate_up, w_down, top_k_index, top_k_weights, act, transposed):
    s = top_k_index.numel()
    two_i = w_gate_up.shape[2] if transposed else w_gate_up.shape[1]
    idx = top_k_index.new_empty(s, dtype=torch.int64)
    return (
        x.new_empty(x.shape),
        x.new_empty(s, two_i),
        idx,
        idx.new_empty(top_k_index.shape),
        idx.new_empty(w_gate_up.shape[0], dtype=torch.int32),
    )


@torch.library.custom_op(op_name("moe_experts_bwd"), mutates_args=())
def moe_experts_bwd(
    dout: torch.Tensor, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
    top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up: torch.Tensor,
    perm: torch.Tensor, pos: torch.Tensor, offs: torch.Tensor, act: int, transposed: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    # gate_up is read only: the backward writes into buffers of its own.
    return _backward(
        dout, x, w_gate_up, w_down, top_k_index, top_k_weights, gate_up, perm, pos, offs,
        act, transposed,
    )  # fmt: skip


@moe_experts_bwd.register_fake
def _(
    dout,
    x,
    w_gate_up,
    w_down,
    top_k_index,
    top_k_weights,
    gate_up,
    perm,
    pos,
    offs,
    act,
    transposed,
):
    return (
        x.new_empty(x.shape),
        w_gate_up.new_empty(w_gate_up.shape),
        w_down.new_empty(w_down.shape),
        top_k_weights.new_empty(top_k_weights.shape),
    )


def _op_setup(ctx, inputs, output):
    x, w_gate_up, w_down, top_k_index, top_k_weights, act, transposed = inputs
    _, gate_up, perm, pos, offs = output
    ctx.save_for_backward(
        x, w_gate_up, w_down, top_k_index, top_k_weights, gate_up, perm, pos, offs
    )
    ctx.act, ctx.transposed = act, transposed


def _op_backward(ctx, dout, *_unused):
    dx, dgu, dd, dw = moe_experts_bwd(dout, *ctx.saved_tensors, ctx.act, ctx.transposed)
    return dx, dgu, dd, None, dw, None, None


moe_experts_fwd.register_autograd(_op_backward, setup_context=_op_setup)


def moe_experts(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    act: int = SILU,
    transposed: bool = False,
) -> torch.Tensor:
    """The experts' output [T, H] for x [T, H], routed by top_k_index / top_k_weights [T, K].

    Weights as transformers stores them: ``w_gate_up`` [E, 2I, H] (gate rows first, then up)
    and ``w_down`` [E, H, I], or with ``transposed`` [E, H, 2I] and [E, I, H]. Pairs whose
    expert id is >= E contribute nothing. Gradients flow to x, both weights and top_k_weights.
    """
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        # As autocast runs nn.Linear: the matmuls in the autocast dtype, gradients flowing back
        # to the stored weights through the casts; the kernels then run with autocast off.
        dtype = torch.get_autocast_dtype(device_type)
        x, w_gate_up, w_down = x.to(dtype), w_gate_up.to(dtype), w_down.to(dtype)
        with torch.autocast(device_type, enabled=False):
            return moe_experts(x, w_gate_up, w_down, top_k_index, top_k_weights, act, transposed)
    if torch.compiler.is_compiling():
        return moe_experts_fwd(x, w_gate_up, w_down, top_k_index, top_k_weights, act, transposed)[0]
    return _MoEFunction.apply(x, w_gate_up, w_down, top_k_index, top_k_weights, act, transposed)


# --------------------------------------------------------------------------- module binding


def _act_code(act_fn) -> int | None:
    """This package's code for the module's activation, or None if it has no fused kernel."""
    if act_fn is F.silu or act_fn is torch.nn.functional.silu:
        return SILU
    if isinstance(act_fn, nn.GELU):
        return GELU_TANH if act_fn.approximate == "tanh" else GELU_ERF
    name = type(act_fn).__name__
    if name in _SILU_NAMES:
        return SILU
    if name in _GELU_TANH_NAMES:
        return GELU_TANH
    if name in _GELU_ERF_NAMES:
        return GELU_ERF
    return None


def _is_transposed(module: nn.Module) -> bool:
    flag = getattr(module, "is_transposed", None)
    if flag is not None:
        return bool(flag)
    # Without the flag of transformers' use_experts_implementation: [E, 2I, H] with [E, H, I]
    # is the default layout, [E, H, 2I] with [E, I, H] the transposed one.
    gu, down = module.gate_up_proj.shape, module.down_proj.shape
    return not (gu[2] == down[1] and gu[1] == 2 * down[2])


def experts_supported(module: nn.Module) -> str | None:
    """None when ``MoEExperts`` serves `module`, else a one-line reason why not.

    Served: a module holding 3-D ``gate_up_proj`` [E, 2I, H] (gate rows, then up rows) and
    ``down_proj`` [E, H, I] parameters, or both transposed, without biases, with an ``act_fn``
    that has a fused gated kernel (SiLU, tanh or erf GELU) and the default gate
    ``act_fn(gate) * up``, as transformers' ``@use_experts_implementation`` classes have.
    """
    gu = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    if not isinstance(gu, torch.Tensor) or not isinstance(down, torch.Tensor):
        return "no 3-D gate_up_proj and down_proj weights"
    if gu.dim() != 3 or down.dim() != 3 or gu.shape[0] != down.shape[0]:
        return "gate_up_proj and down_proj are not [experts, ...] 3-D weights"
    if not getattr(module, "has_gate", True):
        return "experts without a gate (up_proj only) have no fused kernel"
    if not getattr(module, "is_concatenated", True):
        return "interleaved gate/up columns (gpt-oss layout) have no fused kernel"
    if getattr(module, "has_bias", False) or any(
        getattr(module, n, None) is not None for n in ("gate_up_proj_bias", "down_proj_bias")
    ):
        return "expert biases are not served by the fused path"
    if getattr(module, "has_post_expert_norm", False):
        return "a norm after each expert is not served by the fused path"
    apply_gate = getattr(type(module), "_apply_gate", None)
    if apply_gate is not None and apply_gate.__name__ != "_default_apply_gate":
        return f"custom gate {type(module).__name__}._apply_gate has no fused kernel"
    act_fn = getattr(module, "act_fn", None)
    if act_fn is None or _act_code(act_fn) is None:
        return f"act_fn {type(act_fn).__name__} has no fused kernel"
    e = gu.shape[0]
    if _is_transposed(module):
        ok = down.shape[2] == gu.shape[1] and gu.shape[2] == 2 * down.shape[1]
    else:
        ok = down.shape[1] == gu.shape[2] and gu.shape[1] == 2 * down.shape[2]
    if not ok:
        return f"gate_up_proj {tuple(gu.shape)} and down_proj {tuple(down.shape)} do not match ({e} experts)"
    return None


class MoEExperts(nn.Module):
    """transformers' fused-weight experts (Mixtral, Qwen3-MoE, DeepSeek-V3, ...): grouped
    matmuls over expert-sorted tokens, the gated activation and the weighted combine fused."""

    has_backward = True
    can_torch_compile = True

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        reason = experts_supported(self)
        if reason is not None:
            raise ValueError(
                f"MoEExperts cannot serve {type(self).__name__}: {reason}; map it to another layer"
            )
        w_gate_up, w_down = self.gate_up_proj, self.down_proj
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        if x.dtype != w_gate_up.dtype and not torch.is_autocast_enabled(x.device.type):
            x = x.to(w_gate_up.dtype)  # the eager module's matmuls would refuse mixed dtypes
        out = moe_experts(
            x,
            w_gate_up,
            w_down,
            top_k_index.reshape(x.shape[0], -1),
            top_k_weights.reshape(x.shape[0], -1),
            _act_code(self.act_fn),
            _is_transposed(self),
        )
        return out.to(hidden_states.dtype).view(shape)
