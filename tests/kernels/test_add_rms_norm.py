"""Residual add fused with RMSNorm on the Triton interpreter, against float64 references."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from _training_refs import DTYPES, assert_close, leaf64, rms_norm64
from test_rms_norm import BWD_SHAPES, CASES, make_x


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
def test_one_output_unused(kt, used, monkeypatch):
    """Only the norm (or only the sum) feeds the loss: the other gradient is absent, not zeros."""
    mod = sys.modules[kt.__name__ + ".add_rms_norm"]
    seen = []
    real = mod._backward_any
    monkeypatch.setattr(
        mod, "_backward_any", lambda dy, ds, *a: seen.append((dy, ds)) or real(dy, ds, *a)
    )
    x, r = torch.randn(5, 72, requires_grad=True), torch.randn(5, 72, requires_grad=True)
    w = torch.randn(72, requires_grad=True)
    y, s = kt.fused_add_rms_norm(x, r, w, 1e-6)
    out, grad = (y, torch.randn_like(y)) if used == "y only" else (s, torch.randn_like(s))
    out.backward(grad)
    dy, ds = (grad, None) if used == "y only" else (None, grad)
    assert [(a is None, b is None) for a, b in seen] == [(dy is None, ds is None)]
    _, _, dx64, dr64, dw64 = reference(x, r, w, 1e-6, False, dy, ds)
    assert_close(x.grad, dx64, torch.float32, "dx")
    assert_close(r.grad, dr64, torch.float32, "dresidual")
    if used == "y only":
        assert_close(w.grad, dw64, torch.float32, "dw")
    else:
        assert torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("trainable", ["x", "residual", "weight", "x,weight", "residual,weight"])
def test_gradients_of_whichever_inputs_require_them(kt, trainable, compiled):
    """Each input that requires grad gets its own gradient (the weight's is not the residual's),
    the others get none; the sum requires grad only where torch's add would."""
    names = trainable.split(",")
    x, r, w = torch.randn(4, 48), torch.randn(4, 48), torch.randn(48) * 0.3 + 1
    for name, t in zip(("x", "residual", "weight"), (x, r, w), strict=True):
        t.requires_grad_(name in names)
    fn = lambda x, r, w: kt.fused_add_rms_norm(x, r, w, 1e-6)  # noqa: E731
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
    y, s = fn(x, r, w)
    assert s.requires_grad == (x.requires_grad or r.requires_grad)
    dy, ds = torch.randn_like(y), torch.randn_like(s)
    outs = [(y, dy)] + ([(s, ds)] if s.requires_grad else [])
    torch.autograd.backward([o for o, _ in outs], [g for _, g in outs])
    _, _, dx64, dr64, dw64 = reference(x, r, w, 1e-6, False, dy, ds if s.requires_grad else None)
    for t, ref, what in ((x, dx64, "dx"), (r, dr64, "dresidual"), (w, dw64, "dw")):
        if t.requires_grad:
            assert_close(t.grad, ref, torch.float32, what)
        else:
            assert t.grad is None, what


def test_strided_residual_and_sum_gradient(kt):
    """A residual whose rows are apart by more than their width (an unaligned slice), and a
    gradient of the sum that arrives row-strided (the sum feeds a cat)."""
    x = torch.randn(9, 96, requires_grad=True)
    base = torch.randn(9, 200)
    r = base[:, 3:99].requires_grad_()
    w = (torch.randn(96) * 0.3 + 1).requires_grad_()
    y, s = kt.fused_add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(s, r + x)
    cat = torch.cat([s, torch.randn(9, 40)], dim=-1)
    dy, dcat = torch.randn_like(y), torch.randn_like(cat)
    torch.autograd.backward((y, cat), (dy, dcat))
    _, _, dx64, dr64, dw64 = reference(x, r, w, 1e-6, False, dy, dcat[:, :96])
    for name, out, ref in (("dx", x.grad, dx64), ("dresidual", r.grad, dr64), ("dw", w.grad, dw64)):
        assert_close(out, ref, torch.float32, name)


def test_sum_gradient_is_added_before_the_one_rounding(kt):
    """fp16: the kernel's dx equals the fp32 norm gradient plus ds, rounded once."""
    mod = sys.modules[kt.__name__ + ".rms_norm"]
    x = torch.randn(6, 200, dtype=torch.float16)
    w = torch.rand(200, dtype=torch.float16) + 0.5
    dy, ds = torch.randn_like(x), torch.randn_like(x)
    _, rstd, _ = mod.forward(x, w, 1e-6, False)
    cfg = mod.bwd_candidates(6, 200)[0]
    dx, _ = mod.backward(dy, x, w, rstd, False, False, cfg, ds=ds)
    dx32, _ = mod.backward(dy, x, w, rstd, False, False, cfg, x_dtype=torch.float32)
    assert torch.equal(dx, (dx32 + ds.float()).to(torch.float16))


# The shapes of test_rms_norm.py's BWD_SHAPES (why each: there).
@pytest.mark.parametrize("shape", BWD_SHAPES, ids=str)
def test_every_backward_candidate_with_a_sum_gradient(kt, shape):
    """The GPU picks the backward geometry by timing (prefetching ds too); each must be right."""
    mod = sys.modules[kt.__name__ + ".rms_norm"]
    x, r = torch.randn(shape, dtype=torch.bfloat16), torch.randn(shape, dtype=torch.bfloat16)
    w = torch.randn(shape[-1], dtype=torch.bfloat16) * 0.3 + 1
    y, rstd, s = mod.forward(x, w, 1e-6, False, residual=r)
    dy, ds = torch.randn_like(y), torch.randn_like(s)
    leaves = [t.clone().requires_grad_() for t in (x, r, w)]
    _, _, dx64, _, dw64 = reference(*leaves, 1e-6, False, dy, ds)
    for cfg in mod.bwd_candidates(*shape):
        dsum, dw = mod.backward(dy, s, w, rstd, False, True, cfg, ds=ds)
        assert_close(dsum, dx64, torch.bfloat16, f"dsum {cfg}")
        assert_close(dw, dw64, torch.bfloat16, f"dw {cfg}")


def test_ops_pass_opcheck(kt):
    """torch.library.opcheck: schema, fake tensors against real ones, autograd registration."""
    mod = sys.modules[kt.__name__ + ".add_rms_norm"]
    x = torch.randn(5, 3, 40, dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(5, 3, 40, dtype=torch.bfloat16, requires_grad=True)
    w32 = torch.randn(40, requires_grad=True)
    for gemma in (False, True):  # bf16 inputs with an fp32 weight: y promotes unless gemma
        torch.library.opcheck(mod.add_rms_norm_fwd, (x, r, w32, 1e-6, gemma))
    torch.library.opcheck(mod.add_rms_norm_fwd, (x[:0], r[:0], w32, 1e-6, False))  # no rows
    _, s, rstd = mod.add_rms_norm_fwd(x.detach(), r.detach(), w32.detach(), 1e-6, False)
    dy = torch.randn(5, 3, 40)
    for ds in (torch.randn_like(s), None):
        for compute_dw in (True, False):
            args = (dy, ds, s, w32.detach(), rstd, False, compute_dw)
            torch.library.opcheck(mod.add_rms_norm_bwd, args)


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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_path_without_interpreter(kt, monkeypatch, dtype):
    """CPU tensors take plain torch ops when the interpreter is off; same results."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(4, 3, 40, dtype=dtype, requires_grad=True)
    r = torch.randn(4, 3, 40, dtype=dtype, requires_grad=True)
    w = (torch.randn(40, dtype=dtype) * 0.3 + 1).requires_grad_()
    y, s = kt.fused_add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(s, r + x)  # torch's own add: exact in every dtype
    with torch.no_grad():  # the norm of the rounded sum
        assert torch.equal(y, kt.rms_norm(r + x, w, 1e-6))
    dy, ds = torch.randn_like(y), torch.randn_like(s)
    torch.autograd.backward((y, s), (dy, ds))
    y64, s64, dx64, dr64, dw64 = reference(x, r, w, 1e-6, False, dy, ds)
    for name, out, ref in (("y", y, y64), ("s", s, s64), ("dx", x.grad, dx64),
                           ("dresidual", r.grad, dr64), ("dw", w.grad, dw64)):  # fmt: skip
        assert_close(out, ref, dtype, name)


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
