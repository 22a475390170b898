"""SwiGLU / GeGLU with ``in_place=True`` (Liger's memory behaviour): the backward writes the
gradients over a and b. Interpreter and torch path, against float64 and the out-of-place path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _training_refs import DTYPES, assert_close


def act64(a, act):
    return F.silu(a) if act == "silu" else F.gelu(a, approximate="tanh")


def glu(kt, act, a, b, **kw):
    return kt.silu_mul(a, b, **kw) if act == "silu" else kt.gelu_mul(a, b, "tanh", **kw)


def activations(shape, dtype):
    """a and b as a model makes them: non-leaf outputs of a differentiable op."""
    xa = torch.randn(shape, dtype=dtype, requires_grad=True)
    xb = torch.randn(shape, dtype=dtype, requires_grad=True)
    return xa, xb, xa * 1, xb * 1


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_in_place_gradients_match_float64_and_land_in_a_and_b(kt, monkeypatch, dtype, act, path):
    if path == "torch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    xa, xb, a, b = activations((37, 300), dtype)
    c = glu(kt, act, a, b, in_place=True)
    dc = torch.randn_like(c)
    c.backward(dc)
    a64, b64 = xa.detach().double().requires_grad_(), xb.detach().double().requires_grad_()
    (act64(a64, act) * b64).backward(dc.double())
    assert_close(xa.grad, a64.grad, dtype, "da")
    assert_close(xb.grad, b64.grad, dtype, "db")
    # The gradients were written over a and b: a now holds d(a), b holds d(b).
    assert torch.equal(a.detach(), xa.grad) and torch.equal(b.detach(), xb.grad)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_in_place_equals_out_of_place(kt, act):
    xa, xb, a, b = activations((5, 7, 96), torch.bfloat16)
    dc = torch.randn(5, 7, 96, dtype=torch.bfloat16)
    grads = []
    for in_place in (False, True):
        la, lb = xa.detach().clone().requires_grad_(), xb.detach().clone().requires_grad_()
        glu(kt, act, la * 1, lb * 1, in_place=in_place).backward(dc)
        grads.append((la.grad, lb.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_another_saved_use_of_a_raises_instead_of_reading_a_gradient(kt):
    _, _, a, b = activations((8, 64), torch.float32)
    other = a * a  # saves a for its backward, which runs after the GLU's
    loss = kt.silu_mul(a, b, in_place=True).sum() + other.sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_halves_of_one_buffer_take_new_buffers(kt):
    """a and b as column halves of one gate_up output: not overwritten, gradients still right."""
    x = torch.randn(6, 2 * 80, requires_grad=True)
    gate_up = x * 1
    a, b = gate_up.chunk(2, dim=-1)
    keep = gate_up.detach().clone()
    kt.silu_mul(a, b, in_place=True).backward(torch.ones(6, 80))
    assert torch.equal(gate_up.detach(), keep)
    x64 = x.detach().double().requires_grad_()
    a64, b64 = x64.chunk(2, dim=-1)
    (F.silu(a64) * b64).backward(torch.ones(6, 80, dtype=torch.float64))
    assert_close(x.grad, x64.grad, torch.float32, "dx")


def test_default_leaves_a_and_b_alone(kt):
    _, _, a, b = activations((4, 32), torch.float32)
    keep = a.detach().clone(), b.detach().clone()
    kt.silu_mul(a, b).sum().backward()
    assert torch.equal(a.detach(), keep[0]) and torch.equal(b.detach(), keep[1])


def test_one_tensor_as_both_inputs(kt):
    """silu_mul(a, a): d(a) and d(b) cannot both go over a; the sum of the two must be right."""
    x = torch.randn(5, 64, requires_grad=True)
    a = x * 1
    kt.silu_mul(a, a, in_place=True).backward(torch.ones(5, 64))
    x64 = x.detach().double().requires_grad_()
    (F.silu(x64) * x64).backward(torch.ones(5, 64, dtype=torch.float64))
    assert_close(x.grad, x64.grad, torch.float32, "dx")


def test_transposed_inputs_take_new_buffers(kt):
    """a and b laid out column-major (no [rows, n] view of them exists): new buffers, right."""
    xa, xb = torch.randn(48, 6, requires_grad=True), torch.randn(48, 6, requires_grad=True)
    a, b = xa.t() * 1, xb.t() * 1  # [6, 48] with strides (1, 6)
    kt.silu_mul(a, b, in_place=True).backward(torch.ones(6, 48))
    a64, b64 = xa.detach().double().requires_grad_(), xb.detach().double().requires_grad_()
    (F.silu(a64.t()) * b64.t()).backward(torch.ones(6, 48, dtype=torch.float64))
    assert_close(xa.grad, a64.grad, torch.float32, "da")
    assert_close(xb.grad, b64.grad, torch.float32, "db")
