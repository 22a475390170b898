"""Nemotron's MLP, down(relu(x @ Wu^T)^2), as one autograd function that keeps one
[tokens, intermediate] tensor for the backward instead of two.

Composed from modules, autograd keeps the activation's input side (relu's output, which square
reads) and h = relu(u)^2, which down_proj needs for its weight gradient: two [tokens,
intermediate] tensors per layer (Liger's activation keeps u and h, two as well). Here only u =
up_proj(x) is kept; the backward recomputes h from u in the same elementwise pass that computes
d(u), writing h over d(h) as it goes, and d(u) over u itself (the buffer is this function's own:
nothing else holds it). A backward that keeps its graph (``retain_graph=True``) takes a new
buffer instead, and the bumped version counter makes any other reuse of the overwritten buffer
autograd's error rather than a wrong gradient.
"""

from __future__ import annotations

import torch

from ._common import has_hooks, needs_grad
from .swiglu import RELU_SQUARED, _act_backward_any, _act_forward_any, graph_is_freed

__all__ = ["ReLUSquaredMLPFunction", "relu_squared_mlp"]


def _forward(x, w_up, w_down):
    """(down(relu(up(x))^2), up's output u, the one tensor the backward needs besides x)."""
    u = x.reshape(-1, x.shape[-1]) @ w_up.t()
    h = _act_forward_any(u, RELU_SQUARED)
    # a fresh tensor, not a view: callers may add to the MLP's output in place
    return torch.matmul(h.view(*x.shape[:-1], u.shape[-1]), w_down.t()), u


class ReLUSquaredMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_up, w_down):
        y, u = _forward(x, w_up, w_down)
        ctx.save_for_backward(x, u, w_up, w_down)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, u, w_up, w_down = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dh = dy2 @ w_down
        overwrite = graph_is_freed()
        need_h = ctx.needs_input_grad[2]
        # One pass: d(u) (over u when the graph is freed) and h = relu(u)^2 recomputed into
        # dh's own buffer (each element of dh and u is read before it is written).
        du = _act_backward_any(
            dh, u, RELU_SQUARED, out=u if overwrite else None, product=dh if need_h else None
        )
        if overwrite:
            torch.autograd.graph.increment_version(u)
        d_down = (dy2.t() @ dh).to(w_down.dtype) if need_h else None
        del dh
        dx = (du @ w_up).view(x.shape) if ctx.needs_input_grad[0] else None
        d_up = None
        if ctx.needs_input_grad[1]:
            d_up = (du.t() @ x.reshape(-1, x.shape[-1])).to(w_up.dtype)
        return dx, d_up, d_down


def relu_squared_mlp(x, up_proj, down_proj) -> torch.Tensor | None:
    """down_proj(relu(up_proj(x))^2) for bias-free, hook-free nn.Linear modules of x's dtype,
    or None when the lean path does not apply (biases, hooks, compiling, autocast) and the
    caller should compose."""
    linears = (up_proj, down_proj)
    # Plain Linears only: a LoRA wrapper, a quantized layer or a module with hooks (FSDP
    # applied per Linear, for example) must run its own forward.
    if (
        torch.compiler.is_compiling()
        or torch.is_autocast_enabled(x.device.type)
        or any(type(m) is not torch.nn.Linear or m.bias is not None for m in linears)
        or any(has_hooks(m) for m in linears)
        or any(m.weight.dtype != x.dtype for m in linears)
        or any(type(m.weight).__name__ == "DTensor" for m in linears)  # compose: their TP forwards
    ):
        return None
    if not needs_grad(x, up_proj.weight, down_proj.weight):  # inference: no Function's host cost
        return _forward(x, up_proj.weight, down_proj.weight)[0]
    return ReLUSquaredMLPFunction.apply(x, up_proj.weight, down_proj.weight)
