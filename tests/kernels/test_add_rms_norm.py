"""Residual add fused with RMSNorm on the Triton interpreter, against float64 references."""

from __future__ import annotations

import types

import pytest
import torch
from _training_refs import DTYPES, assert_close, leaf64, rms_norm64
from test_rms_norm import CASES, make_x


def assert_same_sum(s, expected):
    """s equals the separate add's result. Exactly, except bfloat16 on the interpreter, which
    rounds bfloat16 toward zero (the GPU rounds to nearest, and tests/gpu checks it exactly)."""
    if s.dtype == torch.bfloat16:
        eps = torch.finfo(s.dtype).eps
        torch.testing.assert_close(s, expected, rtol=eps, atol=0)
    else:
        assert torch.equal(s, expected)


def reference(x, r, w, eps, gemma, dy, ds):
    """float64 (y, s) of the same inputs, and their gradients for upstream dy and ds."""
    x64, r64, w64 = leaf64(x), leaf64(r), leaf64(w)
    s64 = x64 + r64
    y64 = rms_norm64(s64, w64, eps, gemma)
    outs = [(o, g.double()) for o, g in ((y64, dy), (s64, ds)) if g is not None]
    torch.autograd.backward([o for o, _ in outs], [g for _, g in outs])
    return y64, s64, x64.grad, r64.grad, w64.grad


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,layout", CASES, ids=[f"{s}-{lay}" for s, lay in CASES])
def test_forward_and_grads(kt, shape, layout, dtype, gemma):
    x, r = make_x(shape, layout, dtype), make_x(shape, "contiguous", dtype)
    w = (torch.randn(shape[-1], dtype=dtype) * 0.5 + (0.0 if gemma else 1.0)).requires_grad_()
    y, s = kt.fused_add_rms_norm(x, r, w, 1e-6, gemma=gemma)
    assert y.dtype == s.dtype == dtype and y.shape == s.shape == x.shape
    assert_same_sum(s.detach(), (r + x).detach())
    if dtype != torch.bfloat16:  # the norm of the rounded sum, bit for bit (see assert_same_sum)
        with torch.no_grad():
            assert torch.equal(y, kt.rms_norm(r + x, w, 1e-6, gemma=gemma))
    dy, ds = torch.randn_like(y), torch.randn_like(s)
    torch.autograd.backward((y, s), (dy, ds))
    y64, s64, dx64, dr64, dw64 = reference(x, r, w, 1e-6, gemma, dy, ds)
    assert_close(y, y64, dtype, "y")
    assert_close(s, s64, dtype, "s")
    assert_close(x.grad, dx64, dtype, "dx")
    assert_close(r.grad, dr64, dtype, "dresidual")
    assert_close(w.grad, dw64, dtype, "dw")


@pytest.mark.parametrize("used", ["y only", "s only"])
def test_one_output_unused(kt, used):
    """Only the norm (or only the sum) feeds the loss: the other gradient is absent, not zeros."""
    x, r = torch.randn(5, 72, requires_grad=True), torch.randn(5, 72, requires_grad=True)
    w = torch.randn(72, requires_grad=True)
    y, s = kt.fused_add_rms_norm(x, r, w, 1e-6)
    out, grad = (y, torch.randn_like(y)) if used == "y only" else (s, torch.randn_like(s))
    out.backward(grad)
    dy, ds = (grad, None) if used == "y only" else (None, grad)
    _, _, dx64, dr64, dw64 = reference(x, r, w, 1e-6, False, dy, ds)
    assert_close(x.grad, dx64, torch.float32, "dx")
    assert_close(r.grad, dr64, torch.float32, "dresidual")
    if used == "y only":
        assert_close(w.grad, dw64, torch.float32, "dw")
    else:
        assert w.grad is None or not w.grad.any()


def test_frozen_weight_and_inputs_without_grad(kt):
    x = torch.randn(4, 48, requires_grad=True)
    r = torch.randn(4, 48)  # e.g. the embeddings of a frozen table
    w = torch.randn(48)
    y, s = kt.fused_add_rms_norm(x, r, w, 1e-6)
    (y.sum() + s.sum()).backward()
    _, _, dx64, _, _ = reference(x, r, w, 1e-6, False, torch.ones_like(y), torch.ones_like(s))
    assert_close(x.grad, dx64, torch.float32, "dx")


def test_mismatched_inputs_run_the_add_and_norm_separately(kt):
    """A broadcast or promoting add keeps torch's semantics (no fused kernel for it)."""
    x = torch.randn(3, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(3, 8, 64, dtype=torch.float32, requires_grad=True)
    w = torch.randn(64, dtype=torch.float32, requires_grad=True)
    y, s = kt.fused_add_rms_norm(x, r, w, 1e-6)
    assert s.dtype == torch.float32 and torch.equal(s, r + x)
    y64 = rms_norm64(s.detach().double(), w.detach().double(), 1e-6)
    assert_close(y, y64, torch.float32, "y")
    b = torch.randn(64, requires_grad=True)  # broadcast residual
    y, s = kt.fused_add_rms_norm(x.float(), b, w, 1e-6)
    assert s.shape == x.shape
    (y.sum() + s.sum()).backward()
    assert b.grad.shape == (64,)


def test_torch_path_without_interpreter(kt, monkeypatch):
    """CPU tensors take plain torch ops when the interpreter is off; same results."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, r = torch.randn(4, 3, 40, requires_grad=True), torch.randn(4, 3, 40, requires_grad=True)
    w = torch.randn(40, requires_grad=True)
    y, s = kt.fused_add_rms_norm(x, r, w, 1e-6)
    dy, ds = torch.randn_like(y), torch.randn_like(s)
    torch.autograd.backward((y, s), (dy, ds))
    y64, s64, dx64, dr64, dw64 = reference(x, r, w, 1e-6, False, dy, ds)
    for name, out, ref in (("y", y, y64), ("s", s, s64), ("dx", x.grad, dx64),
                           ("dresidual", r.grad, dr64), ("dw", w.grad, dw64)):  # fmt: skip
        assert_close(out, ref, torch.float32, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_matches_add_then_hf_norm(kt, dtype):
    """FusedAddRMSNorm bound on a Qwen3RMSNorm equals `residual + x` followed by the module."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    ref = Qwen3RMSNorm(96, eps=1e-6).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(96) * 0.3 + 1.0)
    mod = Qwen3RMSNorm(96, eps=1e-6).to(dtype)
    mod.load_state_dict(ref.state_dict())
    mod.forward = types.MethodType(kt.layers.FusedAddRMSNorm.forward, mod)
    x, r = torch.randn(2, 9, 96, dtype=dtype), torch.randn(2, 9, 96, dtype=dtype)
    s_ref = r + x
    y_ref = ref(s_ref)
    y, s = mod(x, r)
    assert_same_sum(s.detach(), s_ref)
    eps = torch.finfo(dtype).eps  # same numerics in the module's dtype: one rounding apart
    torch.testing.assert_close(y, y_ref, rtol=eps, atol=eps * y_ref.abs().max().item())
