"""The lean gated MLP (recomputes act(gate) * up in the backward) against float64 references."""

from __future__ import annotations

import types

import pytest
import torch
from _training_refs import assert_close, gelu64, leaf64, silu64
from torch import nn


def mlp(hidden: int, inter: int, dtype, bias: bool = False) -> nn.Module:
    module = nn.Module()
    module.gate_proj = nn.Linear(hidden, inter, bias=bias, dtype=dtype)
    module.up_proj = nn.Linear(hidden, inter, bias=bias, dtype=dtype)
    module.down_proj = nn.Linear(inter, hidden, bias=bias, dtype=dtype)
    return module


def ref_forward(m: nn.Module, x: torch.Tensor, act: str):
    """float64 copies of x and the weights, and the reference output."""
    x64 = leaf64(x)
    ws = {n: leaf64(getattr(m, n).weight) for n in ("gate_proj", "up_proj", "down_proj")}
    g = x64 @ ws["gate_proj"].t()
    u = x64 @ ws["up_proj"].t()
    a = silu64(g) if act == "silu" else gelu64(g, "tanh")
    return x64, ws, (a * u) @ ws["down_proj"].t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("shape", [(5, 48), (2, 7, 32)])
def test_values_and_every_gradient(kt, dtype, act, shape):
    hidden, inter = shape[-1], 80
    m = mlp(hidden, inter, dtype)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    code = kt.gated_mlp.SILU if act == "silu" else kt.gated_mlp.GELU_TANH
    out = kt.gated_mlp.gated_mlp(x, m.gate_proj, m.up_proj, m.down_proj, code)
    assert out is not None  # the lean path applies to plain bias-free Linears
    x64, ws, ref = ref_forward(m, x, act)
    dy = torch.randn_like(out)
    out.backward(dy)
    ref.backward(dy.double())
    factor = 4.0 if dtype == torch.bfloat16 else 1.0  # three chained bf16 matmuls
    assert_close(out, ref, dtype, "output", factor)
    assert_close(x.grad, x64.grad, dtype, "d x", factor)
    for name, w64 in ws.items():
        assert_close(getattr(m, name).weight.grad, w64.grad, dtype, f"d {name}", factor)


def test_the_gated_product_is_not_saved(kt):
    m = mlp(64, 256, torch.float32)
    x = torch.randn(16, 64, requires_grad=True)
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        kt.gated_mlp.gated_mlp(x, m.gate_proj, m.up_proj, m.down_proj, kt.gated_mlp.SILU).sum()
    # gate and up, side by side in one [16, 2 * 256] buffer; the product fed to down_proj is recomputed
    assert [t.shape for t in saved if t.shape[0] == 16] == [(16, 64), (16, 512)]

    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m.down_proj(kt.silu_mul(m.gate_proj(x), m.up_proj(x))).sum()
    assert len([t for t in saved if t.shape == (16, 256)]) == 3  # composed: gate, up and product


def test_falls_back_where_it_does_not_apply(kt):
    x = torch.randn(4, 32)
    with_bias = mlp(32, 64, torch.float32, bias=True)
    assert (
        kt.gated_mlp.gated_mlp(x, with_bias.gate_proj, with_bias.up_proj, with_bias.down_proj, 0)
        is None
    )
    hooked = mlp(32, 64, torch.float32)
    hooked.up_proj.register_forward_hook(lambda *a: None)
    assert kt.gated_mlp.gated_mlp(x, hooked.gate_proj, hooked.up_proj, hooked.down_proj, 0) is None
    plain = mlp(32, 64, torch.float32)
    assert (
        kt.gated_mlp.gated_mlp(x.double(), plain.gate_proj, plain.up_proj, plain.down_proj, 0)
        is None
    )


def test_backward_and_global_hooks_keep_the_linears_own_calls(kt):
    """A full backward hook on one Linear, or a global forward hook, is run by calling the
    module: the fused path, which skips those calls, must not be taken."""
    x = torch.randn(4, 32)
    back = mlp(32, 64, torch.float32)
    back.down_proj.register_full_backward_hook(lambda *a: None)
    assert kt.gated_mlp.gated_mlp(x, back.gate_proj, back.up_proj, back.down_proj, 0) is None
    plain = mlp(32, 64, torch.float32)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert kt.gated_mlp.gated_mlp(x, plain.gate_proj, plain.up_proj, plain.down_proj, 0) is None
    finally:
        handle.remove()
    assert kt.gated_mlp.gated_mlp(x, plain.gate_proj, plain.up_proj, plain.down_proj, 0) is not None


def test_swiglu_layer_matches_qwen3_mlp_and_uses_the_lean_path(kt):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

    config = Qwen3Config(hidden_size=48, intermediate_size=96)
    module = Qwen3MLP(config)
    x = torch.randn(3, 5, 48, requires_grad=True)
    expected = module(x)
    (ex_grad,) = torch.autograd.grad(expected.sum(), x)
    module.forward = types.MethodType(kt.layers.SwiGLUMLP.forward, module)
    calls = []
    original = kt.gated_mlp.GatedMLPFunction.apply
    kt.gated_mlp.GatedMLPFunction.apply = lambda *a: calls.append(1) or original(*a)
    try:
        got = module(x)
    finally:
        kt.gated_mlp.GatedMLPFunction.apply = original
    (grad,) = torch.autograd.grad(got.sum(), x)
    assert calls == [1]
    assert_close(got, expected, torch.float32, "output")
    assert_close(grad, ex_grad, torch.float32, "d x")
