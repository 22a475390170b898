"""The whole gated MLP, down(act(x @ Wg^T) * (x @ Wu^T)), as one autograd function that saves
less: x, the gate and the up projections, but not their gated product h.

h is what down_proj needs for its weight gradient. Autograd through nn.Linear keeps it alive from
the forward to the backward (one [tokens, intermediate] tensor per layer: 96 MiB per layer for
Qwen3-0.6B at 16k tokens); here the backward recomputes it from the saved gate and up in the
same elementwise pass that computes d(gate) and d(up), writing it over d(h) as it goes: one
extra [tokens, intermediate] store, no extra buffer, and ~2.6 GiB freed over 28 layers.

Gate and up are written side by side into one [tokens, 2I] buffer (two matmuls into its column
halves, no copy of the weights), so that the backward works on one buffer too: d(W) of both
weights is a single [2I, H] matmul whose row halves become the two gradients. d(x) is the sum of
two matmuls, each rounded to the input dtype before they are added, as eager's two Linears
leave it: an addmm accumulating the second into the first rounds once and is closer to exact,
but differs from eager in about a quarter of the elements, which Liger's GeGLU test (N(0, 1)
weights, 1e-2) reports as a failure; one [tokens, H] product more per layer is the price.

d(gate) and d(up) are written over gate and up themselves (the buffer is this function's own:
nothing else holds it), so the backward allocates no [tokens, 2I] gradient buffer; Liger's
SwiGLU writes its gradients over its inputs the same way. A backward that keeps its graph
(``retain_graph=True``) takes a new buffer instead, and the bumped version counter makes any
other reuse of the overwritten buffer autograd's error rather than a wrong gradient.
"""

from __future__ import annotations

import torch

from . import tensor_parallel
from ._common import has_hooks, needs_grad, op_name
from .swiglu import GELU_ERF, GELU_TANH, SILU, _glu_backward_any, _glu_forward_any, graph_is_freed

__all__ = ["GELU_ERF", "GELU_TANH", "SILU", "GatedMLPFunction", "gated_mlp"]


def _forward(x, w_gate, w_up, w_down, act):
    """(the MLP's output, the [tokens, 2I] gate | up buffer the backward reads)."""
    inter = w_gate.shape[0]
    x2 = x.reshape(-1, x.shape[-1])
    gate_up = x2.new_empty(x2.shape[0], 2 * inter)
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    torch.mm(x2, w_gate.t(), out=gate)
    torch.mm(x2, w_up.t(), out=up)
    h = _glu_forward_any(gate, up, act)
    # matmul of the [.., inter] view makes a fresh tensor, not a view: callers may add to
    # the MLP's output in place (Llama 4's shared expert does)
    return torch.matmul(h.view(*x.shape[:-1], inter), w_down.t()), gate_up


def _backward(dy, x, gate_up, w_gate, w_up, w_down, act, need, overwrite: bool):
    """(dx, d[W_gate; W_up] as one [2I, H] tensor, d(W_down)), None where `need` (x, the two
    weights, down) says no. With `overwrite`, the gradients of gate and up go over gate_up."""
    need_x, need_w, need_h = need
    inter = w_gate.shape[0]
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    dy2 = dy.reshape(-1, dy.shape[-1])
    dh = dy2 @ w_down
    d_gate_up = gate_up if overwrite else torch.empty_like(gate_up)
    d_gate, d_up = d_gate_up[:, :inter], d_gate_up[:, inter:]
    # One pass: d(gate), d(up), and h = act(gate) * up recomputed into dh's own buffer
    # (each element of dh is read before h overwrites it), for down_proj's weight gradient.
    # Each element of gate and up is read before its gradient overwrites it, by one program.
    _glu_backward_any(dh, gate, up, act, out=(d_gate, d_up), product=dh if need_h else None)
    if overwrite:
        torch.autograd.graph.increment_version(gate_up)
    d_down = (dy2.t() @ dh).to(w_down.dtype) if need_h else None
    del dh
    dx = None
    if need_x:
        dx = d_gate @ w_gate
        dx += d_up @ w_up  # each product rounded, then the sum: eager's numbers (see above)
        dx = dx.view(x.shape)
    dw = (d_gate_up.t() @ x.reshape(-1, x.shape[-1])).to(w_gate.dtype) if need_w else None
    return dx, dw, d_down


class GatedMLPFunction(torch.autograd.Function):
    """The eager path: saves x and gate_up; the backward writes over gate_up (see above)."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, act):
        y, gate_up = _forward(x, w_gate, w_up, w_down, act)
        ctx.save_for_backward(x, gate_up, w_gate, w_up, w_down)
        ctx.act = act
        return y

    @staticmethod
    def backward(ctx, dy):
        x, gate_up, w_gate, w_up, w_down = ctx.saved_tensors
        g = ctx.needs_input_grad
        need = (g[0], g[1] or g[2], g[3])
        dx, dw, d_down = _backward(
            dy, x, gate_up, w_gate, w_up, w_down, ctx.act, need, graph_is_freed()
        )
        inter = w_gate.shape[0]
        dw_gate, dw_up = (None, None) if dw is None else (dw[:inter], dw[inter:])
        return dx, dw_gate, dw_up, d_down, None


# --- torch.library ops: what torch.compile sees ------------------------------------------------
#
# The same saved tensors as the eager path (x and the gate | up buffer; the weights are the
# graph's own inputs), so a compiled model keeps no [tokens, I] product per layer either: the
# composed Linears would have Inductor save gate, up and their product. The matmuls are inside
# the op (cuBLAS, as in eager). The backward writes its gradients into a new buffer (an op may
# not write over its inputs), one [tokens, 2I] buffer per layer, freed when the layer's
# backward ends.


@torch.library.custom_op(op_name("gated_mlp_fwd"), mutates_args=())
def gated_mlp_fwd(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, act: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(x, w_gate, w_up, w_down, act)


@gated_mlp_fwd.register_fake
def _(x, w_gate, w_up, w_down, act):
    rows = x.numel() // x.shape[-1]
    return x.new_empty(*x.shape[:-1], w_down.shape[0]), x.new_empty(rows, 2 * w_gate.shape[0])


@torch.library.custom_op(op_name("gated_mlp_bwd"), mutates_args=())
def gated_mlp_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    gate_up: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    act: int,
    need_x: bool,
    need_w: bool,
    need_down: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    need = (need_x, need_w, need_down)
    grads = _backward(dy, x, gate_up, w_gate, w_up, w_down, act, need, overwrite=False)
    return tuple(x.new_empty(0) if g is None else g for g in grads)


@gated_mlp_bwd.register_fake
def _(dy, x, gate_up, w_gate, w_up, w_down, act, need_x, need_w, need_down):
    inter, hidden = w_gate.shape
    return (
        x.new_empty(x.shape) if need_x else x.new_empty(0),
        w_gate.new_empty(2 * inter, hidden) if need_w else x.new_empty(0),
        w_down.new_empty(w_down.shape) if need_down else x.new_empty(0),
    )


def _op_setup(ctx, inputs, output):
    x, w_gate, w_up, w_down, act = inputs
    ctx.save_for_backward(x, output[1], w_gate, w_up, w_down)
    ctx.act = act


def _op_backward(ctx, dy, _d_gate_up):
    x, gate_up, w_gate, w_up, w_down = ctx.saved_tensors
    g = ctx.needs_input_grad
    need_w = g[1] or g[2]
    dx, dw, d_down = gated_mlp_bwd(
        dy, x, gate_up, w_gate, w_up, w_down, ctx.act, g[0], need_w, g[3]
    )
    inter = w_gate.shape[0]
    return (
        dx if g[0] else None,
        dw[:inter] if g[1] else None,
        dw[inter:] if g[2] else None,
        d_down if g[3] else None,
        None,
    )


gated_mlp_fwd.register_autograd(_op_backward, setup_context=_op_setup)


def gated_mlp(x, gate_proj, up_proj, down_proj, act: int) -> torch.Tensor | None:
    """down_proj(act(gate_proj(x)) * up_proj(x)) for bias-free nn.Linear modules, or None when
    the lean path does not apply (biases, hooks, autocast) and the caller should compose.
    Under torch.compile it is the custom op `gated_mlp_fwd`, which saves what eager saves."""
    linears = (gate_proj, up_proj, down_proj)
    # Plain, hook-free Linears only: a LoRA wrapper, a quantized layer or a module with hooks
    # (FSDP applied per Linear, for example) must run its own forward.
    if (
        torch.is_autocast_enabled(x.device.type)
        or any(type(m) is not torch.nn.Linear or m.bias is not None for m in linears)
        or any(has_hooks(m) for m in linears)
        or any(m.weight.dtype != x.dtype for m in linears)
    ):
        return None
    if any(tensor_parallel.is_dtensor(m.weight) for m in linears):  # this rank's columns
        return tensor_parallel.megatron_gated_mlp(
            GatedMLPFunction.apply, x, gate_proj, up_proj, down_proj, act
        )
    weights = (gate_proj.weight, up_proj.weight, down_proj.weight)
    if torch.compiler.is_compiling():
        return gated_mlp_fwd(x, *weights, act)[0]
    if not needs_grad(x, *weights):  # inference: no autograd Function's host cost
        return _forward(x, *weights, act)[0]
    return GatedMLPFunction.apply(x, *weights, act)
