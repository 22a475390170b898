"""The vision towers' MLP, fc2(gelu(fc1(x))) with biases (CLIP, SigLIP, Qwen2-VL's and
InternVL's towers, ...), as one autograd function that keeps one [tokens, intermediate] tensor
for the backward instead of two; GELU as erf, tanh or "quick" (x * sigmoid(1.702 x)), or ReLU
(T5's and UDOP's wi -> relu -> wo).

Composed from modules, autograd keeps u = fc1(x) for the activation's backward and h = gelu(u)
for fc2's weight gradient: two [tokens, intermediate] tensors per layer, the largest activations
of a vision tower. Here u alone is kept; the backward recomputes h from u in the same
elementwise pass (swiglu.py's activation kernels) that computes d(u), writing h over d(h) as it
goes and d(u) over u (the buffer is this function's own). A backward that keeps its graph
(``retain_graph=True``) takes a new buffer instead. The activation is computed in fp32 and
rounded once to the input dtype; the biases are added by the matmuls (addmm), as nn.Linear does.
"""

from __future__ import annotations

import torch

from ._common import has_hooks, needs_grad
from .swiglu import (
    GELU_ERF,
    GELU_TANH,
    QUICK_GELU,
    RELU,
    _act_backward_any,
    _act_forward_any,
    _ActFunction,
    act_fwd,
    graph_is_freed,
)

__all__ = [
    "GELU_ERF", "GELU_TANH", "GELUMLPFunction", "QUICK_GELU", "RELU", "gelu_activation", "gelu_mlp",
]  # fmt: skip

CODES = {"gelu": GELU_ERF, "gelu_tanh": GELU_TANH, "quick_gelu": QUICK_GELU, "relu": RELU}


def _linear(x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return x2 @ w.t() if b is None else torch.addmm(b, x2, w.t())


def _forward(x, w1, b1, w2, b2, act):
    """(fc2(act(fc1(x))), fc1's output u, the one tensor the backward needs besides x)."""
    u = _linear(x.reshape(-1, x.shape[-1]), w1, b1)
    h = _act_forward_any(u, act)
    return _linear(h, w2, b2).view(*x.shape[:-1], w2.shape[0]), u


class GELUMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, act):
        y, u = _forward(x, w1, b1, w2, b2, act)
        ctx.save_for_backward(x, u, w1, w2)
        ctx.act, ctx.biases = act, (b1 is not None, b2 is not None)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, u, w1, w2 = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dh = dy2 @ w2
        overwrite = graph_is_freed()
        need_h = ctx.needs_input_grad[3]
        # One pass: d(u) (over u when the graph is freed) and h = act(u) recomputed into dh's
        # own buffer (each element of dh and u is read before it is written).
        du = _act_backward_any(
            dh, u, ctx.act, out=u if overwrite else None, product=dh if need_h else None
        )
        if overwrite:
            torch.autograd.graph.increment_version(u)
        d_w2 = (dy2.t() @ dh).to(w2.dtype) if need_h else None
        del dh
        has_b1, has_b2 = ctx.biases
        d_b2 = dy2.sum(0).to(w2.dtype) if has_b2 and ctx.needs_input_grad[4] else None
        dx = (du @ w1).view(x.shape) if ctx.needs_input_grad[0] else None
        d_w1 = None
        if ctx.needs_input_grad[1]:
            d_w1 = (du.t() @ x.reshape(-1, x.shape[-1])).to(w1.dtype)
        d_b1 = du.sum(0).to(w1.dtype) if has_b1 and ctx.needs_input_grad[2] else None
        return dx, d_w1, d_b1, d_w2, d_b2, None


def gelu_mlp(x: torch.Tensor, fc1, fc2, act: int) -> torch.Tensor | None:
    """fc2(act(fc1(x))) for hook-free nn.Linear modules of x's dtype (biases or not), or None
    when the lean path does not apply (compiling, autocast, other modules) and the caller
    should compose."""
    linears = (fc1, fc2)
    # Plain Linears only: a LoRA wrapper, a quantized layer or a module with hooks (FSDP
    # applied per Linear, for example) must run its own forward.
    if (
        torch.compiler.is_compiling()
        or torch.is_autocast_enabled(x.device.type)
        or any(type(m) is not torch.nn.Linear for m in linears)
        or any(has_hooks(m) for m in linears)
        or any(m.weight.dtype != x.dtype for m in linears)
    ):
        return None
    params = (fc1.weight, fc1.bias, fc2.weight, fc2.bias)
    if not needs_grad(x, *params):  # inference: no autograd Function's host cost
        return _forward(x, *params, act)[0]
    return GELUMLPFunction.apply(x, *params, act)


def gelu_activation(x: torch.Tensor, act: int, *, in_place: bool = False) -> torch.Tensor:
    """act(x) for one of GELU_ERF, GELU_TANH, QUICK_GELU, RELU, with a Triton backward that keeps x
    only; ``in_place`` writes d(x) over x (as swiglu.relu_squared does)."""
    if torch.compiler.is_compiling():
        return act_fwd(x, act)  # the compiled graph owns its buffers
    if not needs_grad(x):
        return _act_forward_any(x, act)
    return _ActFunction.apply(x, act, in_place)
