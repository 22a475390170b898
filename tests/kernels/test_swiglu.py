"""SwiGLU / GeGLU gated products and SiLU on the Triton interpreter against float64 references."""

from __future__ import annotations

import types

import pytest
import torch
from _training_refs import DTYPES, assert_close, gelu64, leaf64, silu64

from tests.gpu.variant import load_variant as load_by_path

SHAPES = [(7, 77), (37, 1000), (1, 64), (3, 5000), (2, 3, 96)]
ACTS = ["silu", "gelu_tanh", "gelu"]


def ref_act(x, act):
    if act == "silu":
        return silu64(x)
    return gelu64(x, "tanh" if act == "gelu_tanh" else "none")


def ours(kt, act, a, b):
    if act == "silu":
        return kt.silu_mul(a, b)
    return kt.gelu_mul(a, b, approximate="tanh" if act == "gelu_tanh" else "none")


def gated_pair(shape, dtype, layout):
    if layout == "slices":  # gate and up as column slices of one fused gate_up tensor
        gu = torch.randn(*shape[:-1], 2 * shape[-1], dtype=dtype)
        return gu[..., : shape[-1]].requires_grad_(), gu[..., shape[-1] :].requires_grad_()
    return torch.randn(shape, dtype=dtype, requires_grad=True), torch.randn(
        shape, dtype=dtype, requires_grad=True
    )


# Column slices (the strided path) on the smaller shapes: the interpreter is slow per element.
LAYOUTS = [(s, "contiguous") for s in SHAPES] + [
    (s, "slices") for s in SHAPES if s[0] * s[-1] <= 1000
]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,layout", LAYOUTS, ids=[f"{s}-{lay}" for s, lay in LAYOUTS])
def test_gated_forward_and_grads(kt, shape, dtype, act, layout):
    a, b = gated_pair(shape, dtype, layout)
    if layout == "slices":  # leaves made from a fused tensor: keep them leaves of their own
        a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
        assert a.numel() == a.shape[-1] or not a.is_contiguous()
    c = ours(kt, act, a, b)
    assert c.shape == a.shape and c.dtype == dtype
    dc = torch.randn_like(c)
    c.backward(dc)
    a64, b64 = leaf64(a), leaf64(b)
    c64 = ref_act(a64, act) * b64
    c64.backward(dc.double())
    assert_close(c, c64, dtype, "c")
    assert_close(a.grad, a64.grad, dtype, "da")
    assert_close(b.grad, b64.grad, dtype, "db")


def test_a_package_imported_with_the_interpreter_off_runs_under_it(kt, monkeypatch):
    """The device-tanh choice is made per launch, not at import. Tests outside tests/kernels
    import kernels with TRITON_INTERPRET=0 and Triton's own switch on (tests/conftest.py), and
    the loader keeps a tree's module for the process: a GELU (tanh) kernel then run here, under
    the interpreter, must not call the device's tanh (the interpreter's returns None: CI failed
    so once). `kt` first: Triton itself is imported with the interpreter on, as in the suite."""
    import triton

    triton.knobs.runtime.interpret = True  # as tests/conftest.py leaves it, process-wide
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    late = load_by_path("_kernels_training_imported_off")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    a, b = gated_pair((5, 96), torch.float32, "contiguous")
    c = ours(late, "gelu_tanh", a, b)
    c.backward(dc := torch.randn_like(c))
    a64, b64 = leaf64(a), leaf64(b)
    c64 = ref_act(a64, "gelu_tanh") * b64
    c64.backward(dc.double())
    assert_close(c, c64, torch.float32, "c")
    assert_close(a.grad, a64.grad, torch.float32, "da")
    x = a.detach().requires_grad_()
    (dx,) = torch.autograd.grad(late.gelu_activation(x, late.swiglu.GELU_TANH), (x,), dc)
    x64 = leaf64(x)
    (dx64,) = torch.autograd.grad(ref_act(x64, "gelu_tanh"), (x64,), dc.double())
    assert_close(dx, dx64, torch.float32, "dx")


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_torch_path_rounds_where_eager_rounds(kt, torch_path, dtype, act):
    """On the torch path (CPU tensors without the interpreter) the product and both gradients
    are eager's `act(a) * b` in the input dtype, bit for bit: d(act) = dc * b is rounded before
    the activation's backward, as eager's multiply leaves it. (The Triton path makes the same
    choice; tests/gpu checks it against eager on the GPU: the interpreter rounds to bf16 by
    truncation, so it cannot.)"""
    a = (2 * torch.randn(64, 1000)).to(dtype).requires_grad_()
    b = torch.randn(64, 1000, dtype=dtype, requires_grad=True)
    dc = torch.randn(64, 1000, dtype=dtype)
    c = ours(kt, act, a, b)
    da, db = torch.autograd.grad(c, (a, b), dc)
    a2, b2 = a.detach().requires_grad_(), b.detach().requires_grad_()
    f = torch.nn.functional
    h = (
        f.silu(a2)
        if act == "silu"
        else f.gelu(a2, approximate="tanh" if act == "gelu_tanh" else "none")
    )
    c2 = h * b2
    da2, db2 = torch.autograd.grad(c2, (a2, b2), dc)
    assert torch.equal(c, c2)
    assert torch.equal(db, db2)
    assert torch.equal(da, da2), f"{(da != da2).float().mean():.1%} of d(a) differ from eager's"
    if act == "silu":  # the plain activation's backward too
        x = a.detach().requires_grad_()
        (dx,) = torch.autograd.grad(kt.silu(x), (x,), dc)
        x2 = a.detach().requires_grad_()
        (dx2,) = torch.autograd.grad(f.silu(x2), (x2,), dc)
        assert torch.equal(dx, dx2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7, 77), (3, 5000)], ids=str)
def test_silu_forward_and_grad(kt, shape, dtype):
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    y = kt.silu(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    x64 = leaf64(x)
    silu64(x64).backward(dy.double())
    assert_close(y, silu64(x.detach().double()), dtype, "y")
    assert_close(x.grad, x64.grad, dtype, "dx")


def test_silu_non_contiguous_input(kt):
    x = torch.randn(40, 30).t().requires_grad_()
    y = kt.silu(x)
    y.backward(torch.ones_like(y))
    x64 = leaf64(x)
    silu64(x64).sum().backward()
    assert_close(y, silu64(x.detach().double()), torch.float32, "y")
    assert_close(x.grad, x64.grad, torch.float32, "dx")


def test_shape_mismatch_is_a_clear_error(kt):
    with pytest.raises(ValueError, match="one shape"):
        kt.silu_mul(torch.randn(3, 4), torch.randn(3, 5))
    with pytest.raises(ValueError, match="approximate"):
        kt.gelu_mul(torch.randn(3, 4), torch.randn(3, 4), approximate="erf")


def _mlp(kind, dtype):
    if kind == "qwen3":
        from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

        cfg = Qwen3Config(hidden_size=48, intermediate_size=136, hidden_act="silu")
        return Qwen3MLP(cfg).to(dtype), "SwiGLUMLP"
    if kind == "llama":
        from transformers.models.llama.configuration_llama import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaMLP

        cfg = LlamaConfig(
            hidden_size=48, intermediate_size=136, hidden_act="silu", num_attention_heads=4
        )
        return LlamaMLP(cfg).to(dtype), "SwiGLUMLP"
    from transformers.models.gemma.configuration_gemma import GemmaConfig
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    cfg = GemmaConfig(hidden_size=48, intermediate_size=136, hidden_act="gelu_pytorch_tanh")
    return GemmaMLP(cfg).to(dtype), "GeGLUMLP"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["qwen3", "llama", "gemma"])
def test_mlp_layer_bound_on_hf_module(kt, kind, dtype):
    ref, layer = _mlp(kind, dtype)
    mod, _ = _mlp(kind, dtype)
    mod.load_state_dict(ref.state_dict())
    mod.forward = types.MethodType(getattr(kt.layers, layer).forward, mod)
    x = torch.randn(2, 5, 48, dtype=dtype)
    y_ref, y = ref(x), mod(x)
    # Same numerics as HF in its dtype (the GEMMs are shared): a rounding step apart at most.
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(y, y_ref, rtol=4 * eps, atol=4 * eps * y_ref.abs().max().item())

    dy = torch.randn_like(y)
    y.backward(dy)
    m64 = _mlp(kind, torch.float64)[0]
    m64.load_state_dict(ref.state_dict())
    m64(x.double()).backward(dy.double())
    for name, p in mod.named_parameters():
        assert_close(p.grad, dict(m64.named_parameters())[name].grad, dtype, f"d{name}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["qwen3", "gemma"])
def test_bound_mlp_is_eager_bit_for_bit_on_the_torch_path(kt, torch_path, kind, dtype):
    """The bound MLP (one autograd function: gate and up in one buffer, one weight-gradient
    matmul) returns eager's output and gradients exactly when its kernels take the torch path:
    every rounding eager makes, it makes (d(x) too: two rounded products, then their sum)."""
    ref, layer = _mlp(kind, dtype)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_()  # N(0, 1), as Liger's test: large, cancelling gradients
    mod, _ = _mlp(kind, dtype)
    mod.load_state_dict(ref.state_dict())
    mod.forward = types.MethodType(getattr(kt.layers, layer).forward, mod)
    x = torch.randn(3, 7, 48, dtype=dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y = ref(x1), mod(x2)
    dy = torch.randn_like(y)
    y_ref.backward(dy)
    y.backward(dy)
    assert torch.equal(y, y_ref)
    assert torch.equal(x2.grad, x1.grad), f"{(x2.grad != x1.grad).float().mean():.1%} of dx"
    for name, p in mod.named_parameters():
        assert torch.equal(p.grad, dict(ref.named_parameters())[name].grad), name


def test_swiglu_mlp_rejects_other_activations(kt):
    from transformers.models.llama.configuration_llama import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    mod = LlamaMLP(
        LlamaConfig(hidden_size=16, intermediate_size=32, hidden_act="relu", num_attention_heads=4)
    )
    mod.forward = types.MethodType(kt.layers.SwiGLUMLP.forward, mod)
    with pytest.raises(ValueError, match="SiLU"):
        mod(torch.randn(2, 16))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_layer_bound_on_siluactivation(kt, dtype):
    from transformers.activations import SiLUActivation

    ref, mod = SiLUActivation(), SiLUActivation()
    mod.forward = types.MethodType(kt.layers.SiLU.forward, mod)
    x = torch.randn(4, 333, dtype=dtype)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(mod(x), ref(x), rtol=eps, atol=eps)
