"""A forward that no gradient will follow runs the kernel without the autograd Function.

Generation (TRL's rollouts, evaluation) calls the bound layers under no_grad, one token at a
time, where the host's work per op is the step's cost. Under no_grad, or on inputs that need no
gradient, the eager paths of GLU, the activations, the gated, GELU and ReLU² MLPs, the MoE
experts, LayerNorm, RoPE and the fused-qkv split + RoPE launch their forward directly: the same kernel and values as the training forward, no Function.apply
(the RMSNorm paths are tested in test_rms_norm.py). Inputs here need a gradient, so grad mode is
what decides.
"""

from __future__ import annotations

import sys

import pytest
import torch


def _leaf(*shape):
    return torch.randn(*shape).requires_grad_()


def _cases(kt):
    """name -> (the module holding the Function, its class name, a call of the public entry)."""
    swiglu = sys.modules[kt.__name__ + ".swiglu"]
    gated = sys.modules[kt.__name__ + ".gated_mlp"]
    a, b, x = _leaf(6, 40), _leaf(6, 40), _leaf(6, 80)
    h, w, bias = _leaf(5, 48), _leaf(48), _leaf(48)
    q, k = _leaf(2, 7, 4, 16).transpose(1, 2), _leaf(2, 7, 2, 16).transpose(1, 2)
    emb = torch.randn(2, 7, 8).repeat(1, 1, 2)
    cos, sin = emb.cos(), emb.sin()
    lin = [torch.nn.Linear(48, 32, bias=False), torch.nn.Linear(48, 32, bias=False)]
    down = torch.nn.Linear(32, 48, bias=False)
    fc = [torch.nn.Linear(48, 32), torch.nn.Linear(32, 48)]  # with biases
    qkv_mod = sys.modules[kt.__name__ + ".qkv_attention"]
    qkv = _leaf(2, 7, (4 + 2 * 2) * 16)
    gelu = sys.modules[kt.__name__ + ".gelu_mlp"]
    relu2 = sys.modules[kt.__name__ + ".relu_squared_mlp"]
    moe = sys.modules[kt.__name__ + ".moe"]
    w_gate_up, w_down = _leaf(3, 2 * 24, 48) / 7, _leaf(3, 48, 24) / 5  # 3 experts, I = 24
    top_idx = torch.randint(0, 3, (5, 2))
    top_w = torch.rand(5, 2).requires_grad_()
    return {
        "silu_mul": (swiglu, "_GLUFunction", lambda: kt.silu_mul(a, b)),
        "gelu_mul": (swiglu, "_GLUFunction", lambda: kt.gelu_mul(a, b)),
        "glu_halves": (swiglu, "_GLUHalvesFunction", lambda: swiglu.glu_halves(x, swiglu.SILU)),
        "silu": (swiglu, "_ActFunction", lambda: kt.silu(a)),
        "relu_squared": (swiglu, "_ActFunction", lambda: kt.relu_squared(a)),
        "gated_mlp": (
            gated,
            "GatedMLPFunction",
            lambda: gated.gated_mlp(h, lin[0], lin[1], down, swiglu.SILU),
        ),
        "layer_norm": (
            sys.modules[kt.__name__ + ".layer_norm"],
            "_LayerNormFunction",
            lambda: kt.layer_norm(h, w, bias, 1e-5),
        ),
        "rope": (
            sys.modules[kt.__name__ + ".rope"],
            "_RopeFunction",
            # clones: the rotation may be written over its inputs
            lambda: kt.apply_rotary_pos_emb(q.clone(), k.clone(), cos, sin),
        ),
        "split_qkv_rope": (
            qkv_mod,
            "SplitQKVRope",
            lambda: qkv_mod.split_qkv_rope(qkv, cos, sin, 4, 2, 16),
        ),
        "gelu_mlp": (
            gelu,
            "GELUMLPFunction",
            lambda: gelu.gelu_mlp(h, fc[0], fc[1], swiglu.GELU_TANH),
        ),
        "gelu_activation": (
            swiglu,
            "_ActFunction",
            lambda: gelu.gelu_activation(a, swiglu.GELU_ERF),
        ),
        "relu_squared_mlp": (
            relu2,
            "ReLUSquaredMLPFunction",
            lambda: relu2.relu_squared_mlp(h, lin[0], down),
        ),
        "moe_experts": (
            moe,
            "_MoEFunction",
            lambda: moe.moe_experts(h, w_gate_up, w_down, top_idx, top_w, moe.SILU),
        ),
    }


class _Refused:
    """Stands in for a Function's apply: any call is the test's failure."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args, **kwargs):
        raise AssertionError(f"{self.name}.apply ran under no_grad")


NAMES = ["silu_mul", "gelu_mul", "glu_halves", "silu", "relu_squared", "gated_mlp",
         "layer_norm", "rope", "split_qkv_rope", "gelu_mlp", "gelu_activation",
         "relu_squared_mlp", "moe_experts"]  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_a_forward_no_gradient_follows_skips_the_autograd_function(kt, name, monkeypatch):
    module, cls, call = _cases(kt)[name]
    train = call()
    train = train if isinstance(train, tuple) else (train,)
    assert all(t.grad_fn is not None for t in train), "the training path records its node"
    monkeypatch.setattr(getattr(module, cls), "apply", _Refused(cls))
    with torch.no_grad():
        out = call()
    out = out if isinstance(out, tuple) else (out,)
    assert len(out) == len(train)
    for got, want in zip(out, train, strict=True):
        assert got.grad_fn is None and not got.requires_grad
        assert torch.equal(got, want.detach())  # the same kernel: bit for bit
