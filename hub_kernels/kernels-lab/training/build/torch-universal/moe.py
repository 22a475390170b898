"""Mixture-of-experts experts with fused 3-D weights (transformers 5.x ``*Experts`` modules).

What the module computes, for each token t and each of its k routed experts e = idx[t, k]:

    out[t] = sum_k w[t, k] * (down_e(gate(gate_up_e(x[t]))) + b_down[e])

with ``gate(v) = act(gate half) * up half`` (or gpt-oss's clamped SwiGLU over alternating
columns) and gate_up_e / down_e the experts' slices of ``gate_up_proj`` / ``down_proj``
(gate_up_e including its bias, where the family has one).

The grouped path sorts the S = T*K (token, expert) pairs by expert once, so that every expert's
rows are one contiguous block, and then runs:

    x_g      = x[token of each sorted pair]                      [S, H]  (freed after use)
    gate_up  = grouped_mm(x_g, W_gate_up)                        [S, 2I] (saved)
    h        = gate(gate_up)     (one elementwise kernel; a bias  [S, I]
                                  is added here, written back into gate_up)
    y        = grouped_mm(h, W_down)                             [S, H]
    out[t]   = sum_k w[t, k] * (y[pair (t, k)] + b_down[e])  (one kernel: the down bias, the
                                                 routing-weight multiply and the scatter-add,
                                                 in fp32, no atomics)

The backward recomputes what it can instead of keeping it: x_g is gathered again, h is
recomputed from the saved gate_up in the same pass that computes d(gate_up), the routing-weight
gradient (a row dot product) and the weighted h that down_proj's weight gradient needs (written
over the buffer it read, as gated_mlp.py does). Only gate_up, the sort and the inputs are kept
from the forward: neither x_g, h nor y. Bias gradients are per-expert row sums, computed as
grouped matmuls with a selector column.

Grouped matmuls run ``torch._grouped_mm`` where the device and dtype have it (CUDA bf16 on sm80+
with recent torch; CPU fp32/bf16 on torch >= 2.9), with shapes whose rows are 16-byte aligned;
everything else loops over the experts with contiguous slices (one host sync per call).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ._common import cdiv, fast_launch, needs_grad, op_name, use_triton
from ._triton import tl, triton
from .swiglu import (
    GELU_ERF,
    GELU_TANH,
    SILU,
    _act,
    _act_grad,
    _glu_forward_any,
    _torch_act,
    _torch_act_grad,
    device_tanh,
)

__all__ = ["CLAMPED_SWIGLU", "MoEExperts", "experts_supported", "moe_experts"]

_SILU_NAMES = {"SiLUActivation", "SiLU"}
_GELU_TANH_NAMES = {"GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "FastGELUActivation"}
_GELU_ERF_NAMES = {"GELUActivation"}


# --------------------------------------------------------------------------- Triton kernels

# The gate as gpt-oss writes it (clamps, alpha, up + 1); its alpha and limit travel as floats.
CLAMPED_SWIGLU = 3


@fast_launch
@triton.jit
def _combine_kernel(
    Y, POS, W, IDS, BIAS, OUT, H, K, E, stride_y,
    HAS_W: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """OUT[t] = sum_k W[t, k] * (Y[POS[t, k]] + BIAS[e]) over the pairs whose expert id e is
    < E, in fp32."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in range(K):
        p = tl.load(POS + t * K + k).to(tl.int64)
        e = tl.load(IDS + t * K + k)
        if e < E:  # an expert-parallel sentinel id has no row of its own
            y = tl.load(Y + p * stride_y + cols, mask=cmask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                y += tl.load(BIAS + e * H + cols, mask=cmask, other=0.0).to(tl.float32)
            if HAS_W:
                y = y * tl.load(W + t * K + k).to(tl.float32)
            acc += y
    tl.store(OUT + t * H + cols, acc.to(OUT.dtype.element_ty), mask=cmask)


@triton.jit
def _gate_columns(cols, N, INTERLEAVED: tl.constexpr):
    """Columns of gate and up in a [rows, 2N] gate/up row: halves, or alternating (gpt-oss)."""
    if INTERLEAVED:
        ca = 2 * cols
        cb = 2 * cols + 1
    else:
        ca = cols
        cb = N + cols
    return ca, cb


@fast_launch
@triton.jit
def _gate_fwd_kernel(
    GU, BIAS, IDS, HOUT, S, N, E, alpha, limit,
    ACT: tl.constexpr, DEV_TANH: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """HOUT[s] = gate(GU[s] + BIAS[e]); with a bias, the biased values are written back to GU
    (the backward's pre-activations). For layouts and gates swiglu.py's kernel does not cover."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < S
    if HAS_BIAS:
        e = tl.load(IDS + rows, mask=rmask, other=0)
        e = tl.where(e < E, e, 0).to(tl.int64)
    for c0 in range(0, N, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        m = rmask[:, None] & (cols < N)[None, :]
        ca, cb = _gate_columns(cols, N, INTERLEAVED)
        a_ptr = GU + rows[:, None] * (2 * N) + ca[None, :]
        b_ptr = GU + rows[:, None] * (2 * N) + cb[None, :]
        a = tl.load(a_ptr, mask=m, other=0.0).to(tl.float32)
        b = tl.load(b_ptr, mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            a += tl.load(BIAS + e[:, None] * (2 * N) + ca[None, :], mask=m, other=0.0).to(
                tl.float32
            )
            b += tl.load(BIAS + e[:, None] * (2 * N) + cb[None, :], mask=m, other=0.0).to(
                tl.float32
            )
            a = a.to(GU.dtype.element_ty)
            b = b.to(GU.dtype.element_ty)
            tl.store(a_ptr, a, mask=m)
            tl.store(b_ptr, b, mask=m)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if ACT == 3:
            g = tl.minimum(a, limit)
            u = tl.minimum(tl.maximum(b, -limit), limit)
            h = (u + 1.0) * (g * tl.sigmoid(alpha * g))
        else:
            h = _act(a, ACT, DEV_TANH).to(GU.dtype.element_ty).to(tl.float32) * b
        tl.store(HOUT + rows[:, None] * N + cols[None, :], h.to(HOUT.dtype.element_ty), mask=m)


@fast_launch
@triton.jit
def _gate_bwd_kernel(
    G, GU, W, IDS, DGU, DW, S, N, E, alpha, limit,
    ACT: tl.constexpr, DEV_TANH: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Per sorted pair s with routing weight w and g = d(out) @ W_down[e] (row s of G):
    d(gate_up)[s] from dh = w * g, DW[s] = <g, h> (d out / d w), and G[s] <- w * h, with h the
    gate of GU's row recomputed and rounded as the forward rounded it."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < S
    w = tl.load(W + rows, mask=rmask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for c0 in range(0, N, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        m = rmask[:, None] & (cols < N)[None, :]
        ca, cb = _gate_columns(cols, N, INTERLEAVED)
        g_ptr = G + rows[:, None] * N + cols[None, :]
        g = tl.load(g_ptr, mask=m, other=0.0).to(tl.float32)
        a = tl.load(GU + rows[:, None] * (2 * N) + ca[None, :], mask=m, other=0.0).to(tl.float32)
        b = tl.load(GU + rows[:, None] * (2 * N) + cb[None, :], mask=m, other=0.0).to(tl.float32)
        if ACT == 3:
            gc = tl.minimum(a, limit)
            u = tl.minimum(tl.maximum(b, -limit), limit)
            sg = tl.sigmoid(alpha * gc)
            glu = gc * sg
            h = ((u + 1.0) * glu).to(GU.dtype.element_ty).to(tl.float32)
            # clamp passes the gradient where its input lies inside the bounds (torch's rule)
            da_factor = tl.where(a <= limit, (u + 1.0) * (sg + alpha * gc * sg * (1.0 - sg)), 0.0)
            db_factor = tl.where((b >= -limit) & (b <= limit), glu, 0.0)
        else:
            act = _act(a, ACT, DEV_TANH).to(GU.dtype.element_ty).to(tl.float32)
            h = (act * b).to(GU.dtype.element_ty).to(tl.float32)
            da_factor = b * _act_grad(a, ACT, DEV_TANH)
            db_factor = act
        acc += tl.sum(g * h, axis=1)
        dh = g * w[:, None]
        dgu = DGU + rows[:, None] * (2 * N)
        tl.store(dgu + ca[None, :], (dh * da_factor).to(DGU.dtype.element_ty), mask=m)
        tl.store(dgu + cb[None, :], (dh * db_factor).to(DGU.dtype.element_ty), mask=m)
        tl.store(g_ptr, (h * w[:, None]).to(G.dtype.element_ty), mask=m)
    valid = tl.load(IDS + rows, mask=rmask, other=E) < E
    tl.store(DW + rows, tl.where(valid, acc, 0.0), mask=rmask)


# --------------------------------------------------------------------------- pieces


def _combine(y, pos, w, ids, num_experts: int, dtype, bias=None) -> torch.Tensor:
    """[T, H]: sum over k of w[t, k] * (y[pos[t, k]] + bias[e]) (w None: weight 1; bias None:
    none), skipping ids >= E."""
    t, k = pos.shape
    h = y.shape[1]
    if use_triton(y):
        out = torch.empty(t, h, dtype=dtype, device=y.device)
        if t and h:
            block = min(1024, triton.next_power_of_2(h))
            _combine_kernel[(t, cdiv(h, block))](
                y, pos, y if w is None else w.contiguous(), ids.contiguous(),
                y if bias is None else bias.contiguous(), out, h, k, num_experts, y.stride(0),
                HAS_W=w is not None, HAS_BIAS=bias is not None, BLOCK_H=block, num_warps=4,
            )  # fmt: skip
        return out
    valid = (ids < num_experts).unsqueeze(-1)
    rows = y[pos.reshape(-1)].view(t, k, h).float()
    if bias is not None:
        rows = rows + bias.float()[ids.clamp(max=num_experts - 1)]
    rows = torch.where(valid, rows, 0.0)
    if w is not None:
        rows = rows * w.float().unsqueeze(-1)
    return rows.sum(1).to(dtype)


def _split(gate_up: torch.Tensor, interleaved: bool):
    """The gate and up column views of a [S, 2I] gate/up output."""
    if interleaved:
        return gate_up[:, 0::2], gate_up[:, 1::2]
    inter = gate_up.shape[1] // 2
    return gate_up[:, :inter], gate_up[:, inter:]


def _torch_gate(a, b, gate):
    """(h in fp32 rounded as the kernels round it, d h / d a, d h / d b) in torch."""
    act, alpha, limit, _ = gate
    af, bf = a.float(), b.float()
    if act == CLAMPED_SWIGLU:
        gc, u = af.clamp(max=limit), bf.clamp(-limit, limit)
        sg = torch.sigmoid(alpha * gc)
        glu = gc * sg
        h = ((u + 1.0) * glu).to(a.dtype).float()
        da = torch.where(af <= limit, (u + 1.0) * (sg + alpha * gc * sg * (1.0 - sg)), 0.0)
        db = torch.where((bf >= -limit) & (bf <= limit), glu, 0.0)
        return h, da, db
    act_a = _torch_act(a, act).float()
    return (act_a * bf).to(a.dtype).float(), bf * _torch_act_grad(a, act), act_a


def _gate_forward(gate_up, bias, ids_sorted, num_experts: int, gate) -> torch.Tensor:
    """h [S, I] from the [S, 2I] gate/up output; a bias is added into gate_up in place."""
    act, alpha, limit, interleaved = gate
    s, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if bias is None and not interleaved and act != CLAMPED_SWIGLU:
        return _glu_forward_any(gate_up[:, :inter], gate_up[:, inter:], act)
    if use_triton(gate_up):
        h = gate_up.new_empty(s, inter)
        if s and inter:
            block_c = min(256, triton.next_power_of_2(inter))
            block_r = max(1, min(16, 2048 // block_c))
            _gate_fwd_kernel[(cdiv(s, block_r),)](
                gate_up, gate_up if bias is None else bias.contiguous(), ids_sorted, h, s, inter,
                num_experts, float(alpha), float(limit), ACT=act, DEV_TANH=device_tanh(),
                INTERLEAVED=interleaved, HAS_BIAS=bias is not None, BLOCK_R=block_r,
                BLOCK_C=block_c, num_warps=4,
            )  # fmt: skip
        return h
    if bias is not None:
        gate_up += bias[ids_sorted.clamp(max=num_experts - 1)].to(gate_up.dtype)
    a, b = _split(gate_up, interleaved)
    return _torch_gate(a, b, gate)[0].to(gate_up.dtype)


def _gate_backward(g, gate_up, w_sorted, ids_sorted, num_experts: int, gate):
    """(d gate_up [S, 2I], d w per sorted pair [S] fp32); g is overwritten with w * h."""
    act, alpha, limit, interleaved = gate
    s, inter = g.shape
    d_gate_up = torch.empty_like(gate_up)
    if use_triton(g):
        dw = torch.empty(s, dtype=torch.float32, device=g.device)
        if s and inter:
            block_c = min(256, triton.next_power_of_2(inter))
            block_r = max(1, min(16, 2048 // block_c))
            _gate_bwd_kernel[(cdiv(s, block_r),)](
                g, gate_up, w_sorted, ids_sorted, d_gate_up, dw, s, inter, num_experts,
                float(alpha), float(limit), ACT=act, DEV_TANH=device_tanh(),
                INTERLEAVED=interleaved, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4,
            )  # fmt: skip
        return d_gate_up, dw
    a, b = _split(gate_up, interleaved)
    h, da, db = _torch_gate(a, b, gate)
    gf, wf = g.float(), w_sorted.float().unsqueeze(-1)
    dw = torch.where(ids_sorted < num_experts, (gf * h).sum(-1), 0.0)
    dh = gf * wf
    d_a, d_b = _split(d_gate_up, interleaved)
    d_a.copy_(dh * da)
    d_b.copy_(dh * db)
    g.copy_(h * wf)
    return d_gate_up, dw


def _aligned(*tensors: torch.Tensor) -> bool:
    """torch._grouped_mm wants 16-byte aligned data and row strides."""
    for t in tensors:
        step = t.element_size()
        if t.data_ptr() % 16 or any(st * step % 16 for st in t.stride() if st != 1):
            return False
    return True


def _grouped_mm_since() -> tuple[int, int] | None:
    """(major, minor) of this torch when it has the private ``torch._grouped_mm``, else None
    (before torch 2.8): then every matmul takes the per-expert loop. Which devices it serves
    depends on the release (see _use_grouped_mm; docs/compatibility.md)."""
    found = re.match(r"(\d+)\.(\d+)", torch.__version__)
    if not hasattr(torch, "_grouped_mm") or found is None:
        return None
    return int(found.group(1)), int(found.group(2))


# Decided once per process: _use_grouped_mm runs on every call.
_GROUPED_MM = _grouped_mm_since()


def _use_grouped_mm(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    if _GROUPED_MM is None:
        return False
    recent = _GROUPED_MM >= (2, 9)
    if x.is_cuda:
        major, minor = torch.cuda.get_device_capability(x.device)
        ok_device = (major, minor) >= (8, 0) if recent else major == 9
        ok = ok_device and x.dtype == torch.bfloat16
    elif x.device.type == "cpu":
        ok = recent and x.dtype in (torch.float32, torch.bfloat16)
    else:
        ok = False
    # Every operand's rows ([S, H], [S, 2I], [S, I] and the weights') 16-byte aligned.
    dims = (*w_gate_up.shape[1:], *w_down.shape[1:])
    return (
        ok and _aligned(x, w_gate_up, w_down) and all(d * x.element_size() % 16 == 0 for d in dims)
    )


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


def _expert_sums(rows, scale, offs, grouped: bool, counts) -> torch.Tensor:
    """[E, N]: per expert, the sum of its rows of `rows` [S, N] (each times `scale` [S] if given),
    as a grouped matmul with a [S, 8] selector whose first column holds the scales (8 columns
    keep the column-major operand 16-byte aligned)."""
    select = rows.new_zeros(rows.shape[0], 8)
    select[:, 0] = 1.0 if scale is None else scale
    return _mm_weight_grad(select.t(), rows, offs, grouped, counts)[:, 0]


def _forward(x, w_gate_up, w_down, b_gate_up, b_down, top_k_index, top_k_weights, gate, transposed):
    """(out [T, H], gate_up [S, 2I] (biased), perm, pos, offs) for x [T, H]."""
    num_experts, k = w_gate_up.shape[0], top_k_index.shape[-1]
    perm, pos, ids_sorted, offs = _route(top_k_index, num_experts)
    grouped = _use_grouped_mm(x, w_gate_up, w_down)
    counts = None if grouped else _counts(offs)
    rhs_gate_up, rhs_down = _weights(w_gate_up, w_down, transposed)
    x_g = x.index_select(0, perm // k)
    gate_up = _mm_groups(x_g, rhs_gate_up, offs, grouped, counts)
    del x_g
    h = _gate_forward(gate_up, b_gate_up, ids_sorted, num_experts, gate)
    y = _mm_groups(h, rhs_down, offs, grouped, counts)
    del h
    out = _combine(y, pos, top_k_weights, top_k_index, num_experts, x.dtype, b_down)
    return out, gate_up, perm, pos, offs


def _backward(
    dout, x, w_gate_up, w_down, b_gate_up, b_down, top_k_index, top_k_weights, gate_up, perm,
    pos, offs, gate, transposed: bool, need=(True,) * 6,
):  # fmt: skip
    """(dx, d w_gate_up, d w_down, d b_gate_up, d b_down, d top_k_weights); entries not in
    `need` (or for an absent bias) are None."""
    num_experts, k = w_gate_up.shape[0], top_k_index.shape[-1]
    grouped = _use_grouped_mm(x, w_gate_up, w_down)
    counts = None if grouped else _counts(offs)
    rhs_gate_up, rhs_down = _weights(w_gate_up, w_down, transposed)
    token = perm // k
    ids_sorted = top_k_index.reshape(-1)[perm]
    dout_g = dout.contiguous().index_select(0, token)
    # g = d(out) @ W_down[e]: the gradient of h before the routing weight.
    g = _mm_groups(dout_g, rhs_down.transpose(1, 2), offs, grouped, counts)
    w_sorted = top_k_weights.reshape(-1)[perm].contiguous()
    d_gate_up, dw_sorted = _gate_backward(g, gate_up, w_sorted, ids_sorted, num_experts, gate)
    wh = g  # now w * h, the input of down_proj scaled by the routing weight
    d_w_down = d_b_down = None
    if need[2]:
        if transposed:  # [E, I, H]
            d_w_down = _mm_weight_grad(wh.t(), dout_g, offs, grouped, counts)
        else:  # [E, H, I]
            d_w_down = _mm_weight_grad(dout_g.t(), wh, offs, grouped, counts)
        d_w_down = d_w_down.to(w_down.dtype)
    if b_down is not None:
        if need[4]:
            d_b_down = _expert_sums(dout_g, w_sorted, offs, grouped, counts).to(b_down.dtype)
        # d out / d w also has <d out, b_down[e]>: one [S, E] matmul, one column picked per row.
        per_expert = (dout_g @ b_down.t().to(dout_g.dtype)).float()
        picked = per_expert.gather(1, ids_sorted.clamp(max=num_experts - 1).unsqueeze(1))
        dw_sorted += torch.where(ids_sorted < num_experts, picked.squeeze(1), 0.0)
    del dout_g, g, wh
    d_w_gate_up = d_b_gate_up = None
    if need[1]:
        x_g = x.index_select(0, token)
        if transposed:  # [E, H, 2I]
            d_w_gate_up = _mm_weight_grad(x_g.t(), d_gate_up, offs, grouped, counts)
        else:  # [E, 2I, H]
            d_w_gate_up = _mm_weight_grad(d_gate_up.t(), x_g, offs, grouped, counts)
        d_w_gate_up = d_w_gate_up.to(w_gate_up.dtype)
        del x_g
    if b_gate_up is not None and need[3]:
        d_b_gate_up = _expert_sums(d_gate_up, None, offs, grouped, counts).to(b_gate_up.dtype)
    dx = None
    if need[0]:
        dx_g = _mm_groups(d_gate_up, rhs_gate_up.transpose(1, 2), offs, grouped, counts)
        dx = _combine(dx_g, pos, None, top_k_index, num_experts, x.dtype)
    dw = None
    if need[5]:
        dw = torch.empty_like(dw_sorted)
        dw[perm] = dw_sorted
        dw = dw.view(top_k_weights.shape).to(top_k_weights.dtype)
    return dx, d_w_gate_up, d_w_down, d_b_gate_up, d_b_down, dw


# --------------------------------------------------------------------------- autograd


class _MoEFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, w_gate_up, w_down, b_gate_up, b_down, top_k_index, top_k_weights, gate, transposed
    ):
        out, gate_up, perm, pos, offs = _forward(
            x, w_gate_up, w_down, b_gate_up, b_down, top_k_index, top_k_weights, gate, transposed
        )
        ctx.save_for_backward(
            x, w_gate_up, w_down, b_gate_up, b_down, top_k_index, top_k_weights, gate_up, perm,
            pos, offs,
        )  # fmt: skip
        ctx.gate, ctx.transposed = gate, transposed
        ctx.mark_non_differentiable(top_k_index)
        return out

    @staticmethod
    def backward(ctx, dout):
        n = ctx.needs_input_grad
        need = (n[0], n[1], n[2], n[3], n[4], n[6])
        dx, dwgu, dwd, dbgu, dbd, dw = _backward(
            dout, *ctx.saved_tensors, ctx.gate, ctx.transposed, need
        )
        return dx, dwgu, dwd, dbgu, dbd, None, dw, None, None


# torch.library ops: what torch.compile sees (opaque; the sort and the per-expert sizes are
# data-dependent, which Inductor could not trace into anyway). An absent bias is an empty
# tensor here (the ops' schema has no optional outputs).


def _opt(t: torch.Tensor) -> torch.Tensor | None:
    return None if t.numel() == 0 else t


@torch.library.custom_op(op_name("moe_experts_fwd"), mutates_args=())
def moe_experts_fwd(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, b_gate_up: torch.Tensor,
    b_down: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, act: int,
    alpha: float, limit: float, interleaved: bool, transposed: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    gate = (act, alpha, limit, interleaved)
    return _forward(
        x, w_gate_up, w_down, _opt(b_gate_up), _opt(b_down), top_k_index, top_k_weights, gate,
        transposed,
    )  # fmt: skip


@moe_experts_fwd.register_fake
def _(x, w_gate_up, w_down, b_gate_up, b_down, top_k_index, top_k_weights, *args):
    transposed = args[-1]
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
    b_gate_up: torch.Tensor, b_down: torch.Tensor, top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor, gate_up: torch.Tensor, perm: torch.Tensor, pos: torch.Tensor,
    offs: torch.Tensor, act: int, alpha: float, limit: float, interleaved: bool, transposed: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    # gate_up is read only: the backward writes into buffers of its own.
    grads = _backward(
        dout, x, w_gate_up, w_down, _opt(b_gate_up), _opt(b_down), top_k_index, top_k_weights,
        gate_up, perm, pos, offs, (act, alpha, limit, interleaved), transposed,
    )  # fmt: skip
    return tuple(x.new_empty(0) if g is None else g for g in grads)


@moe_experts_bwd.register_fake
def _(dout, x, w_gate_up, w_down, b_gate_up, b_down, top_k_index, top_k_weights, *args):
    return (
        x.new_empty(x.shape),
        w_gate_up.new_empty(w_gate_up.shape),
        w_down.new_empty(w_down.shape),
        b_gate_up.new_empty(b_gate_up.shape),
        b_down.new_empty(b_down.shape),
        top_k_weights.new_empty(top_k_weights.shape),
    )


def _op_setup(ctx, inputs, output):
    *tensors, act, alpha, limit, interleaved, transposed = inputs
    _, gate_up, perm, pos, offs = output
    ctx.save_for_backward(*tensors, gate_up, perm, pos, offs)
    ctx.args = (act, alpha, limit, interleaved, transposed)


def _op_backward(ctx, dout, *_unused):
    dx, dwgu, dwd, dbgu, dbd, dw = moe_experts_bwd(dout, *ctx.saved_tensors, *ctx.args)
    return dx, dwgu, dwd, _opt(dbgu), _opt(dbd), None, dw, None, None, None, None, None


moe_experts_fwd.register_autograd(_op_backward, setup_context=_op_setup)


def moe_experts(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    act: int = SILU,
    transposed: bool = False,
    *,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    interleaved: bool = False,
    alpha: float = 0.0,
    limit: float = 0.0,
) -> torch.Tensor:
    """The experts' output [T, H] for x [T, H], routed by top_k_index / top_k_weights [T, K].

    Weights as transformers stores them: ``w_gate_up`` [E, 2I, H] (gate rows first, then up;
    with ``interleaved`` alternating gate/up) and ``w_down`` [E, H, I], or with ``transposed``
    [E, H, 2I] and [E, I, H]; optional biases ``b_gate_up`` [E, 2I] and ``b_down`` [E, H].
    ``act`` is SILU, GELU_TANH, GELU_ERF (``act(gate) * up``) or CLAMPED_SWIGLU (gpt-oss:
    ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with g = min(gate, limit)).
    Pairs whose expert id is >= E contribute nothing. Gradients flow to x, the weights, the
    biases and top_k_weights.
    """
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        # As autocast runs nn.Linear: the matmuls in the autocast dtype, gradients flowing back
        # to the stored weights through the casts; the kernels then run with autocast off.
        dtype = torch.get_autocast_dtype(device_type)
        cast = [
            None if t is None else t.to(dtype) for t in (x, w_gate_up, w_down, b_gate_up, b_down)
        ]
        with torch.autocast(device_type, enabled=False):
            return moe_experts(
                cast[0], cast[1], cast[2], top_k_index, top_k_weights, act, transposed,
                b_gate_up=cast[3], b_down=cast[4], interleaved=interleaved, alpha=alpha,
                limit=limit,
            )  # fmt: skip
    if torch.compiler.is_compiling():
        empty = x.new_empty(0)
        return moe_experts_fwd(
            x, w_gate_up, w_down, empty if b_gate_up is None else b_gate_up,
            empty if b_down is None else b_down, top_k_index, top_k_weights, act, float(alpha),
            float(limit), interleaved, transposed,
        )[0]  # fmt: skip
    gate = (act, float(alpha), float(limit), interleaved)
    if not needs_grad(x, w_gate_up, w_down, b_gate_up, b_down, top_k_weights):  # inference
        return _forward(
            x, w_gate_up, w_down, b_gate_up, b_down, top_k_index, top_k_weights, gate, transposed
        )[0]
    return _MoEFunction.apply(
        x, w_gate_up, w_down, b_gate_up, b_down, top_k_index, top_k_weights, gate, transposed
    )


# --------------------------------------------------------------------------- module binding


def _act_code(act_fn) -> int | None:
    """This package's code for the module's activation, or None if it has no fused kernel."""
    if act_fn is F.silu:
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


_PROBED: dict[tuple, tuple | None] = {}


def _probe_clamped_gate(module: nn.Module, alpha: float, limit: float) -> tuple | None:
    """gpt-oss's clamped gate, recognised by what the module's ``_apply_gate`` computes (not by
    its class name): run it on float64 values spanning the clamps and compare with the formula
    in both column layouts. Cached per (class, alpha, limit)."""
    key = (type(module), alpha, limit)
    if key not in _PROBED:
        if torch.compiler.is_compiling():
            raise ValueError(
                f"MoEExperts has not seen {type(module).__name__}'s gate yet: call "
                "experts_supported(module) or run the model once before torch.compile"
            )
        # values on both sides of -limit and +limit, the two columns of a pair differing
        span = 1.5 * limit + 1.0
        probe = torch.linspace(-span, span, 64, dtype=torch.float64).view(4, 16)
        probe[1::2] = probe[1::2].flip(-1)
        found = None
        try:
            with torch.no_grad():
                got = module._apply_gate(probe)
        except Exception:  # noqa: BLE001 - a gate that cannot run on the probe is not ours
            got = None
        for interleaved in (True, False):
            gate = (CLAMPED_SWIGLU, alpha, limit, interleaved)
            a, b = _split(probe, interleaved)
            g, u = a.clamp(max=limit), b.clamp(-limit, limit)
            want = (u + 1.0) * g * torch.sigmoid(alpha * g)
            if isinstance(got, torch.Tensor) and got.shape == want.shape:
                if torch.allclose(got.double(), want, rtol=1e-9, atol=1e-12):
                    found = gate
                    break
        _PROBED[key] = found
    return _PROBED[key]


def _gate_spec(module: nn.Module) -> tuple | str:
    """(act, alpha, limit, interleaved) for the module's gate, or why it has no fused kernel."""
    interleaved = not getattr(module, "is_concatenated", True)
    apply_gate = getattr(type(module), "_apply_gate", None)
    if apply_gate is None or apply_gate.__name__ == "_default_apply_gate":
        act_fn = getattr(module, "act_fn", None)
        act = None if act_fn is None else _act_code(act_fn)
        if act is None:
            return f"act_fn {type(act_fn).__name__} has no fused kernel"
        return (act, 0.0, 0.0, interleaved)
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    if isinstance(alpha, (int, float)) and isinstance(limit, (int, float)):
        found = _probe_clamped_gate(module, float(alpha), float(limit))
        if found is not None:
            return found
    return f"custom gate {type(module).__name__}._apply_gate has no fused kernel"


def experts_supported(module: nn.Module) -> str | None:
    """None when ``MoEExperts`` serves `module`, else a one-line reason why not.

    Served: a module holding 3-D ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]
    parameters (or both transposed, ``is_transposed``), gate/up columns as halves or alternating
    (``is_concatenated=False``), optional biases ``gate_up_proj_bias`` [E, 2I] and
    ``down_proj_bias`` [E, H], and a gate that is either the default ``act_fn(gate) * up`` with
    a SiLU, tanh-GELU or erf-GELU ``act_fn``, or gpt-oss's clamped SwiGLU (``alpha``, ``limit``),
    as transformers' ``@use_experts_implementation`` classes have.
    """
    gu = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    if not isinstance(gu, torch.Tensor) or not isinstance(down, torch.Tensor):
        return "no 3-D gate_up_proj and down_proj weights"
    if gu.dim() != 3 or down.dim() != 3 or gu.shape[0] != down.shape[0]:
        return "gate_up_proj and down_proj are not [experts, ...] 3-D weights"
    if not getattr(module, "has_gate", True):
        return "experts without a gate (up_proj only) have no fused kernel"
    if getattr(module, "has_post_expert_norm", False):
        return "a norm after each expert is not served by the fused path"
    e = gu.shape[0]
    if _is_transposed(module):
        hidden, two_i, ok = (
            gu.shape[1],
            gu.shape[2],
            down.shape[1:] == (gu.shape[2] // 2, gu.shape[1]),
        )
    else:
        hidden, two_i, ok = (
            gu.shape[2],
            gu.shape[1],
            down.shape[1:] == (gu.shape[2], gu.shape[1] // 2),
        )
    if not ok or two_i % 2:
        return f"gate_up_proj {tuple(gu.shape)} and down_proj {tuple(down.shape)} do not match"
    for name, shape in (("gate_up_proj_bias", (e, two_i)), ("down_proj_bias", (e, hidden))):
        bias = getattr(module, name, None)
        if bias is not None and tuple(bias.shape) != shape:
            return f"{name} {tuple(bias.shape)} is not {shape}"
    if getattr(module, "has_bias", False) and getattr(module, "gate_up_proj_bias", None) is None:
        return "has_bias is set but there is no gate_up_proj_bias"
    spec = _gate_spec(module)
    return spec if isinstance(spec, str) else None


class MoEExperts(nn.Module):
    """transformers' fused-weight experts (Mixtral, Qwen3-MoE, DeepSeek-V3, gpt-oss, ...):
    grouped matmuls over expert-sorted tokens, the gate and the weighted combine fused."""

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
        act, alpha, limit, interleaved = _gate_spec(self)
        w_gate_up = self.gate_up_proj
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        if x.dtype != w_gate_up.dtype and not torch.is_autocast_enabled(x.device.type):
            x = x.to(w_gate_up.dtype)  # the eager module's matmuls would refuse mixed dtypes
        out = moe_experts(
            x,
            w_gate_up,
            self.down_proj,
            top_k_index.reshape(x.shape[0], -1),
            top_k_weights.reshape(x.shape[0], -1),
            act,
            _is_transposed(self),
            b_gate_up=getattr(self, "gate_up_proj_bias", None),
            b_down=getattr(self, "down_proj_bias", None),
            interleaved=interleaved,
            alpha=alpha,
            limit=limit,
        )
        return out.to(hidden_states.dtype).view(shape)
