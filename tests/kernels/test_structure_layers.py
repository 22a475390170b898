"""The layer classes the structure classifier (kernels.training) binds beyond Llama's: OLMo2's
fp32-weight RMSNorm, the weight-less RMSNorm, fused gate_up MLPs, a bias-free LayerNorm read
from module attributes; forward and backward on the Triton interpreter vs float64."""

from __future__ import annotations

import pytest
import torch
from _training_refs import DTYPES, assert_close, gelu64, layer_norm64, leaf64, rms_norm64, silu64
from torch import nn


class Holder(nn.Module):
    """A module holding what the layer reads (as the transformers module would)."""


def _bind(layer, module):
    return lambda *args: layer.forward(module, *args)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_float_weight(kt, dtype):
    m = Holder()
    m.weight = nn.Parameter(torch.rand(48, dtype=dtype) + 0.5)
    m.variance_epsilon = 1e-6
    x = torch.randn(3, 5, 48, dtype=dtype, requires_grad=True)
    y = _bind(kt.layers.RMSNormFloatWeight, m)(x)
    assert y.dtype == dtype
    dy = torch.randn_like(y)
    y.backward(dy)
    x64, w64 = leaf64(x), leaf64(m.weight)
    ref = rms_norm64(x64, w64, 1e-6)
    ref.backward(dy.double())
    assert_close(y, ref, dtype, "y")
    assert_close(x.grad, x64.grad, dtype, "dx")
    assert_close(m.weight.grad, w64.grad, dtype, "dw", factor=4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_weightless_rms_norm(kt, dtype):
    m = Holder()
    m.eps = 1e-5
    _check_weightless(kt.layers.WeightlessRMSNorm, m, (4, 32), dtype)


def _check_weightless(layer, m, shape, dtype):
    """The layer bound to `m` (no weight) gives x_hat in `dtype` and its gradient, against
    float64."""
    x = torch.randn(*shape, dtype=dtype, requires_grad=True)
    y = _bind(layer, m)(x)
    assert y.dtype == dtype and not hasattr(m, "weight")
    dy = torch.randn_like(y)
    y.backward(dy)
    x64 = leaf64(x)
    ref = rms_norm64(x64, torch.ones(shape[-1], dtype=torch.float64), m.eps)
    ref.backward(dy.double())
    assert_close(y, ref, dtype, "y")
    assert_close(x.grad, x64.grad, dtype, "dx")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_float_weight_on_an_instance_without_a_weight(kt, dtype):
    """MuseGlimmer's with_scale=False RMSNorm (no weight attribute at all, ``eps``) over a q/k
    norm's [B, T, H, D]: the weight-less norm, x_hat cast, gradients against float64."""
    m = Holder()
    m.eps, m.with_scale = 1e-6, False
    _check_weightless(kt.layers.RMSNormFloatWeight, m, (2, 5, 3, 16), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_without_bias_from_attributes(kt, dtype):
    """Cohere's LayerNorm: weight, no bias, variance_epsilon, no normalized_shape."""
    m = Holder()
    m.weight = nn.Parameter(torch.rand(40, dtype=dtype) + 0.5)
    m.variance_epsilon = 1e-5
    x = (torch.randn(6, 40) * 2 + 1).to(dtype).requires_grad_()
    y = _bind(kt.layers.LayerNorm, m)(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    x64, w64 = leaf64(x), leaf64(m.weight)
    ref = layer_norm64(x64, w64, None, 1e-5)
    ref.backward(dy.double())
    assert_close(y, ref, dtype, "y")
    assert_close(x.grad, x64.grad, dtype, "dx")
    assert_close(m.weight.grad, w64.grad, dtype, "dw", factor=4)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_gate_up_mlp(kt, dtype, act):
    """Phi3/GLM: gate, up = gate_up_proj(x).chunk(2) (gate first); down(act(gate) * up)."""
    torch.manual_seed(0)
    m = Holder()
    m.gate_up_proj = nn.Linear(16, 48, bias=False).to(dtype)
    m.down_proj = nn.Linear(24, 16, bias=False).to(dtype)
    if act == "silu":
        m.activation_fn, layer = nn.SiLU(), kt.layers.FusedSwiGLUMLP
    else:
        m.act_fn, layer = nn.GELU(approximate="tanh"), kt.layers.FusedGeGLUMLP
    x = torch.randn(3, 4, 16, dtype=dtype, requires_grad=True)
    y = _bind(layer, m)(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    x64 = leaf64(x)
    wgu, wd = leaf64(m.gate_up_proj.weight), leaf64(m.down_proj.weight)
    gate, up = (x64 @ wgu.T).chunk(2, dim=-1)
    a = silu64(gate) if act == "silu" else gelu64(gate, "tanh")
    ref = (a * up) @ wd.T
    ref.backward(dy.double())
    assert_close(y, ref, dtype, "y", factor=2)
    assert_close(x.grad, x64.grad, dtype, "dx", factor=2)
    assert_close(m.gate_up_proj.weight.grad, wgu.grad, dtype, "d gate_up", factor=4)
