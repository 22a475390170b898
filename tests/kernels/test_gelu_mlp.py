"""The vision towers' non-gated GELU (or ReLU) MLP (gelu_mlp.py, layers.GELUMLP) and its activations on the
Triton interpreter, against float64 references; what it keeps for the backward, next to the
composed modules; and transformers' own vision MLPs."""

from __future__ import annotations

import math
import types

import pytest
import torch
from _live_bytes import saved_bytes
from _training_refs import DTYPES, assert_close, leaf64
from torch import nn

ACTS = ["gelu", "gelu_tanh", "quick_gelu", "relu"]


def act64(x: torch.Tensor, act: str) -> torch.Tensor:
    if act == "gelu":
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    if act == "gelu_tanh":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    if act == "relu":
        return torch.relu(x)
    return x * torch.sigmoid(1.702 * x)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
def test_activation_values_and_gradient(kt, act, dtype, in_place):
    x = (torch.randn(37, 300, dtype=dtype) * 3).requires_grad_()
    inner = x * 1.0  # a non-leaf: its buffer may take the gradient when in place
    y = kt.gelu_activation(inner, kt.gelu_mlp.CODES[act], in_place=in_place)
    assert y.dtype == dtype and y.shape == x.shape
    dy = torch.randn_like(y)
    y.backward(dy)
    x64 = leaf64(x)
    act64(x64, act).backward(dy.double())
    assert_close(y, act64(x64.detach(), act), dtype, "y")
    assert_close(x.grad, x64.grad, dtype, "dx")


T, H, INTER = 48, 16, 384  # tokens, hidden, intermediate: the [T, INTER] activations dominate


def vision_mlp(hidden: int, inter: int, act: str, dtype=torch.float32, bias=True) -> nn.Module:
    """A module shaped like CLIP's / SigLIP's MLP, the probe's attributes set on it."""
    m = nn.Module()
    m.fc1 = nn.Linear(hidden, inter, bias=bias, dtype=dtype)
    m.fc2 = nn.Linear(inter, hidden, bias=bias, dtype=dtype)
    m.kernels_mlp_projections = ("fc1", "fc2")
    m.kernels_mlp_activation = act
    return m


def layer(kt, m: nn.Module):
    return types.MethodType(kt.layers.GELUMLP.forward, m)


def reference64(m: nn.Module, x64: torch.Tensor, act: str, p64: dict) -> torch.Tensor:
    u = x64 @ p64["fc1.weight"].t() + p64.get("fc1.bias", 0)
    return act64(u, act) @ p64["fc2.weight"].t() + p64.get("fc2.bias", 0)


def check_against64(out, ref, x, x64, m: nn.Module, p64: dict, dtype) -> None:
    """Backward of ``out`` and of its float64 ``ref`` with one random upstream gradient; the
    output, d x and every parameter's gradient compared at ``dtype``'s tolerance."""
    dy = torch.randn_like(out)
    out.backward(dy)
    ref.backward(dy.double())
    assert out.dtype == dtype
    assert_close(out, ref, dtype, "output")
    assert_close(x.grad, x64.grad, dtype, "d x")
    for name, p in m.named_parameters():
        assert_close(p.grad, p64[name].grad, dtype, f"d {name}")


@pytest.mark.parametrize("path", ["lean", "composed"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("act", ACTS)
def test_mlp_values_and_every_gradient(kt, act, dtype, bias, path):
    m = vision_mlp(32, 80, act, dtype, bias)
    if path == "composed":  # a hook on fc2: the projections run as modules around the kernel
        m.fc2.register_forward_hook(lambda *a: None)
    x = torch.randn(2, 7, 32, dtype=dtype, requires_grad=True)
    out = layer(kt, m)(x)
    x64 = leaf64(x)
    p64 = {n: leaf64(p) for n, p in m.named_parameters()}
    ref = reference64(m, x64, act, p64)
    check_against64(out, ref, x, x64, m, p64, dtype)


def test_mlp_keeps_one_intermediate_tensor_not_two(kt):
    """Composed modules keep fc1(x) (for the activation) and gelu(fc1(x)) (for fc2's weight
    gradient); the layer keeps fc1(x) alone."""
    m = vision_mlp(H, INTER, "gelu_tanh", bias=False)
    x = torch.randn(T, H, requires_grad=True)
    weights = sum(p.numel() * 4 for p in m.parameters())
    act, inp = T * INTER * 4, T * H * 4

    def eager(x):
        return m.fc2(torch.nn.functional.gelu(m.fc1(x), approximate="tanh"))

    assert saved_bytes(eager, x) == weights + inp + 2 * act
    assert saved_bytes(layer(kt, m), x) == weights + inp + act


def test_mlp_gradients_twice_with_retain_graph(kt):
    m = vision_mlp(H, 64, "quick_gelu")
    x = torch.randn(6, H, requires_grad=True)
    out = layer(kt, m)(x)
    dy = torch.randn_like(out)
    first = torch.autograd.grad(out, [x, *m.parameters()], dy, retain_graph=True)
    second = torch.autograd.grad(out, [x, *m.parameters()], dy)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def _transformers_mlps():
    from transformers import CLIPVisionConfig, SiglipVisionConfig
    from transformers.models.clip.modeling_clip import CLIPMLP
    from transformers.models.qwen2_vl.modeling_qwen2_vl import VisionMlp
    from transformers.models.siglip.modeling_siglip import SiglipMLP

    small = {"hidden_size": 32, "intermediate_size": 96, "num_attention_heads": 4}
    return [
        (CLIPMLP(CLIPVisionConfig(**small)), ("fc1", "fc2"), "quick_gelu"),
        (SiglipMLP(SiglipVisionConfig(**small)), ("fc1", "fc2"), "gelu_tanh"),
        (VisionMlp(32, 96, "quick_gelu"), ("fc1", "fc2"), "quick_gelu"),
    ]


@pytest.mark.parametrize("index", range(3), ids=["clip", "siglip", "qwen2_vl"])
def test_layer_matches_transformers_vision_mlps(kt, index):
    module, projections, act = _transformers_mlps()[index]
    module.kernels_mlp_projections, module.kernels_mlp_activation = projections, act
    x = torch.randn(2, 9, 32, requires_grad=True)
    want = module(x)
    got = layer(kt, module)(x)
    assert_close(got, want, torch.float32, "output")


@pytest.mark.parametrize("what", ["activation", "mlp"])
def test_fullgraph_compile_matches_eager(kt, what):
    """Under torch.compile the activation is the act_fwd custom op (no graph break) and the MLP
    composes its Linears around it; values and gradients as eager."""
    torch._dynamo.reset()
    m = vision_mlp(24, 40, "quick_gelu")
    code = kt.gelu_mlp.CODES["quick_gelu"]
    fn = (lambda x: kt.gelu_activation(x, code)) if what == "activation" else layer(kt, m)
    x = torch.randn(5, 24 if what == "mlp" else 40, requires_grad=True)
    leaves = [x, *m.parameters()] if what == "mlp" else [x]
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(x)
    want = fn(x)
    dy = torch.randn_like(want)
    for g, w in zip(
        torch.autograd.grad(got, leaves, dy), torch.autograd.grad(want, leaves, dy), strict=True
    ):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_triton_kernels_run(kt):
    """Value checks cannot tell the activation kernels from the torch formulas: the launches
    can (the lean MLP's forward and backward both)."""
    import sys

    from tests.gpu.launches import TritonLaunches

    m = vision_mlp(16, 32, "quick_gelu")
    x = torch.randn(4, 16, requires_grad=True)
    modules = [mod for name, mod in sys.modules.items() if name.startswith(kt.__name__ + ".")]
    with TritonLaunches(*modules) as launches:
        layer(kt, m)(x).sum().backward()
    assert {"_act_fwd_kernel", "_act_bwd_kernel"} <= set(launches.counts())


def test_layer_class_takes_the_forward_it_replaces(kt):
    import inspect

    from transformers.models.clip.modeling_clip import CLIPMLP
    from transformers.models.qwen2_vl.modeling_qwen2_vl import VisionMlp

    cls = kt.layers.GELUMLP
    assert "__init__" not in vars(cls)
    assert {k for k in vars(cls) if not k.startswith("__")} - {"forward"} <= {
        "has_backward",
        "can_torch_compile",
    }
    ours = [p.kind for p in list(inspect.signature(cls.forward).parameters.values())[1:]]
    for replaced in (CLIPMLP.forward, VisionMlp.forward):
        theirs = [p.kind for p in list(inspect.signature(replaced).parameters.values())[1:]]
        assert ours == theirs, replaced


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_normed_mlp_values_and_every_gradient(kt, act, dtype):
    """GELUNormMLP: out(norm(act(in(x)))) with a LayerNorm between the projections (Kosmos-2.5's
    text FFN), names given by the probe's attributes; every gradient against float64."""
    m = nn.Module()
    m.w_in = nn.Linear(32, 80, dtype=dtype)
    m.mid = nn.LayerNorm(80, dtype=dtype)
    m.w_out = nn.Linear(80, 32, dtype=dtype)
    with torch.no_grad():  # a norm that is not the identity at init
        m.mid.weight.uniform_(0.5, 1.5)
        m.mid.bias.uniform_(-0.5, 0.5)
    m.kernels_mlp_projections = ("w_in", "mid", "w_out")
    m.kernels_mlp_activation = act
    x = torch.randn(2, 7, 32, dtype=dtype, requires_grad=True)
    out = types.MethodType(kt.layers.GELUNormMLP.forward, m)(x)
    x64 = leaf64(x)
    p64 = {n: leaf64(p) for n, p in m.named_parameters()}
    u = act64(x64 @ p64["w_in.weight"].t() + p64["w_in.bias"], act)
    n = torch.nn.functional.layer_norm(u, (80,), p64["mid.weight"], p64["mid.bias"], m.mid.eps)
    ref = n @ p64["w_out.weight"].t() + p64["w_out.bias"]
    check_against64(out, ref, x, x64, m, p64, dtype)
