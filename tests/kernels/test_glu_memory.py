"""The gated MLP layers' memory: a fwd+bwd peaks no higher than Liger's design, in which the
backward writes d(gate), d(up) over the gate and up activations and allocates no gradient
buffers for them; gradients still match float64, also where in place must not be taken."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from _live_bytes import extra_peak
from _training_refs import assert_close, leaf64
from torch import nn

T, H, INTER = 48, 16, 384  # tokens, hidden, intermediate: the [T, INTER] activations dominate


def act_fn(act: str):
    return F.silu if act == "silu" else (lambda a: F.gelu(a, approximate="tanh"))


class LigerDesignProduct(torch.autograd.Function):
    """act(a) * b with Liger's memory: the backward overwrites a and b with their gradients, a
    row at a time (so its own temporaries stay one row small), and returns them."""

    @staticmethod
    def forward(ctx, a, b, act):
        ctx.save_for_backward(a, b)
        ctx.act = act
        return act_fn(act)(a) * b

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        for i in range(a.shape[0]):
            with torch.enable_grad():
                ar, br = a[i].detach().requires_grad_(), b[i].detach().requires_grad_()
                da, db = torch.autograd.grad(act_fn(ctx.act)(ar) * br, (ar, br), dc[i])
            a[i], b[i] = da, db
        return a, b, None


def mlp(act: str, fused: bool, bias: bool = False) -> nn.Module:
    m = nn.Module()
    if fused:
        m.gate_up_proj = nn.Linear(H, 2 * INTER, bias=bias)
    else:
        m.gate_proj, m.up_proj = nn.Linear(H, INTER, bias=bias), nn.Linear(H, INTER, bias=bias)
    m.down_proj = nn.Linear(INTER, H, bias=bias)
    m.act_fn = nn.SiLU() if act == "silu" else nn.GELU(approximate="tanh")
    return m


def layer_forward(kt, m: nn.Module, act: str, fused: bool):
    name = ("FusedSwiGLUMLP" if fused else "SwiGLUMLP") if act == "silu" else "GeGLUMLP"
    if fused and act != "silu":
        name = "FusedGeGLUMLP"
    return types.MethodType(getattr(kt.layers, name).forward, m)


def liger_design_forward(m: nn.Module, act: str, fused: bool):
    def forward(x):
        if fused:  # Liger makes the two halves contiguous copies before its kernel
            gate, up = (t.contiguous() for t in m.gate_up_proj(x).chunk(2, dim=-1))
        else:
            gate, up = m.gate_proj(x), m.up_proj(x)
        return m.down_proj(LigerDesignProduct.apply(gate, up, act))

    return forward


def fwd_bwd_peak(m: nn.Module, forward) -> int:
    x = torch.randn(T, H, requires_grad=True)
    dy = torch.randn(T, H)
    leaves = [x, *m.parameters()]
    peak, _grads = extra_peak(lambda: torch.autograd.grad(forward(x), leaves, dy))
    return peak


# lean: plain bias-free Linears, the whole-MLP autograd function (gated_mlp.py); composed: biased
# Linears, the layer composes the projections with the fused product; fused: one gate_up_proj.
PATHS = {"lean": (False, False), "composed": (False, True), "fused": (True, False)}


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("path", PATHS)
def test_layer_peak_memory_is_at_most_liger_design(kt, act, path):
    fused, bias = PATHS[path]
    m = mlp(act, fused, bias)
    ours = fwd_bwd_peak(m, layer_forward(kt, m, act, fused))
    liger = fwd_bwd_peak(m, liger_design_forward(m, act, fused))
    activation = T * INTER * 4  # one fp32 [T, INTER] tensor
    # Liger's design peaks at three activations above the gradients it returns; a gradient
    # buffer for gate or up (or a concatenation of both) would add one activation or more.
    assert liger >= 3 * activation
    assert ours <= liger, (
        f"ours {ours / activation:.2f} vs Liger {liger / activation:.2f} [T, INTER]"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("path", PATHS)
def test_layer_gradients_match_float64_twice_with_retain_graph(kt, dtype, act, path):
    """In place where it saves memory; a graph kept for a second backward reads the same
    activations again, so both backward passes give the float64 gradients."""
    fused, bias = PATHS[path]
    m = mlp(act, fused, bias).to(dtype)
    m64 = mlp(act, fused, bias).double()
    m64.load_state_dict(m.state_dict())
    x = torch.randn(2, T // 2, H, dtype=dtype, requires_grad=True)
    x64 = leaf64(x)
    dy = torch.randn(2, T // 2, H, dtype=dtype)
    ref = liger_design_forward(m64, act, fused)(x64)
    grads64 = torch.autograd.grad(ref, [x64, *m64.parameters()], dy.double())
    y = layer_forward(kt, m, act, fused)(x)
    leaves = [x, *m.parameters()]
    first = torch.autograd.grad(y, leaves, dy, retain_graph=True)
    second = torch.autograd.grad(y, leaves, dy)
    for g1, g2, g64 in zip(first, second, grads64, strict=True):
        assert_close(g1, g64, dtype, "first backward")
        assert torch.equal(g1, g2)


@pytest.mark.parametrize("fused", [False, True], ids=["composed", "fused"])
def test_a_hooked_projection_keeps_its_output(kt, fused):
    """A forward hook may hand the projection's output to someone else: no gradient over it."""
    m = mlp("silu", fused, bias=True)
    proj = m.gate_up_proj if fused else m.up_proj
    seen = []
    proj.register_forward_hook(lambda _mod, _args, out: seen.append((out, out.detach().clone())))
    x = torch.randn(T, H, requires_grad=True)
    layer_forward(kt, m, "silu", fused)(x).sum().backward()
    out, copy = seen[0]
    assert torch.equal(out.detach(), copy)


def test_glu_halves_gradient_lands_in_its_input(kt):
    x = torch.randn(6, 2 * 40, requires_grad=True)
    gate_up = x * 1
    c = kt.layers.glu_halves(gate_up, kt.layers.SILU, in_place=True)
    c.backward(torch.ones_like(c))
    x64 = leaf64(x)
    gate, up = x64.chunk(2, dim=-1)
    (F.silu(gate) * up).sum().backward()
    assert_close(x.grad, x64.grad, torch.float32, "d gate_up")
    assert torch.equal(gate_up.detach(), x.grad)  # written over gate_up, handed on as its grad
    with pytest.raises(ValueError, match="even"):
        kt.layers.glu_halves(torch.randn(3, 7), kt.layers.SILU)
