"""The per-call plans of the training kernels' host paths (CPU, interpreter).

RMSNorm, LayerNorm and RoPE work out everything a call's launch needs (row strides, allocation
shapes, scalars, config) on the first call with a key and keep it. A call that differs from an
earlier one in anything its launch derives from (shape, dtype, strides, options) must get a plan
of its own, and the right result: each case below runs after the others in one process (one
plan cache), forward and backward, against float64, and checks that a new plan was made.
"""

from __future__ import annotations

import sys

import pytest
import torch
from _training_refs import assert_close, layer_norm64, leaf64, rms_norm64, rope64
from conftest import load_variant


@pytest.fixture(scope="module")
def kv():
    """A variant of its own: its plan caches start empty and see only this module's calls."""
    return load_variant()


def _module(kv, name):
    return sys.modules[f"{kv.__name__}.{name}"]


def _grads(out, leaves, grads):
    return torch.autograd.grad(out, [t for t in leaves if t.requires_grad], grads)


def _check(name, fn, ref, leaves, grad, dtype):
    """fn(*leaves) against ref(*float64 leaves): the output and every leaf's gradient."""
    out = fn(*leaves)
    ref_leaves = [leaf64(t) if t is not None else None for t in leaves]
    want = ref(*ref_leaves)
    assert_close(out, want, dtype, f"{name}: y")
    got = _grads(out, [t for t in leaves if t is not None], grad)
    exp = _grads(want, [t for t in ref_leaves if t is not None], grad.double())
    for g, e in zip(got, exp, strict=True):
        assert_close(g, e, dtype, f"{name}: grad")


def _strided(shape, width, dtype=torch.float32):
    """A tensor of `shape` whose rows sit `width` elements apart (a column slice)."""
    base = torch.randn(*shape[:-1], width, dtype=dtype)
    return base[..., : shape[-1]].requires_grad_()


def _permuted(shape):
    """A tensor of `shape` whose leading dims are swapped in memory (rows not one view)."""
    s = list(shape)
    s[0], s[1] = s[1], s[0]
    return torch.randn(*s).transpose(0, 1).requires_grad_()


def _leaf(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype).requires_grad_()


RMS_CASES = {
    # name: (x, weight, kwargs, reference options)
    "base": lambda: (_leaf(3, 5, 32), _leaf(32), {}),
    "rows": lambda: (_leaf(7, 32), _leaf(32), {}),
    "width": lambda: (_leaf(3, 5, 48), _leaf(48), {}),
    "dtype": lambda: (_leaf(3, 5, 32, dtype=torch.float16), _leaf(32), {}),
    "row stride": lambda: (_strided((3, 5, 32), 40), _leaf(32), {}),
    "not one view": lambda: (_permuted((3, 5, 32)), _leaf(32), {}),
    "eps": lambda: (_leaf(3, 5, 32), _leaf(32), {"eps": 1e-1}),
    "gemma": lambda: (_leaf(3, 5, 32), _leaf(32), {"offset": 1.0, "casting_mode": "gemma"}),
    "no weight": lambda: (_leaf(3, 5, 32), None, {}),
    "save_output": lambda: (_leaf(3, 5, 32), _leaf(32), {"save_output": True}),
}


def test_rms_norm_plans_are_keyed_by_what_the_launch_derives_from(kv):
    fwd_plans, bwd_plans = (
        _module(kv, "rms_norm")._FORWARD_PLANS,
        _module(kv, "rms_norm")._BACKWARD_PLANS,
    )
    for name, make in RMS_CASES.items():
        x, w, opts = make()
        eps = opts.pop("eps", 1e-6)
        gemma = opts.get("casting_mode") == "gemma"
        before = len(fwd_plans), len(bwd_plans)

        def ours(x, w, eps=eps, opts=opts):
            return kv.rms_norm(x, w, eps, **opts)

        def ref(x, w, eps=eps, gemma=gemma):
            ones = torch.ones(x.shape[-1], dtype=torch.float64)
            return rms_norm64(x, ones if w is None else w, eps, gemma=gemma)

        _check(name, ours, ref, [x, w], torch.randn(x.shape, dtype=x.dtype), x.dtype)
        # eps is read by the forward alone, save_output changes only what the backward reads.
        if name != "save_output":
            assert len(fwd_plans) == before[0] + 1, f"{name}: no forward plan of its own"
        if name != "eps":
            assert len(bwd_plans) == before[1] + 1, f"{name}: no backward plan of its own"


def test_rms_norm_backward_plan_is_keyed_by_the_gradients_layout(kv):
    """One forward, two backwards: a contiguous dy, then a dy whose rows are 40 apart."""
    bwd_plans = _module(kv, "rms_norm")._BACKWARD_PLANS
    for dy_width in (32, 40):
        x, w = _leaf(4, 6, 32), _leaf(32)
        dy = torch.randn(4, 6, dy_width)[..., :32]
        before = len(bwd_plans)
        x64, w64 = leaf64(x), leaf64(w)
        got = torch.autograd.grad(kv.rms_norm(x, w, 1e-6), (x, w), dy)
        exp = torch.autograd.grad(rms_norm64(x64, w64, 1e-6), (x64, w64), dy.double())
        for g, e in zip(got, exp, strict=True):
            assert_close(g, e, torch.float32, f"dy width {dy_width}")
        if dy_width != 32:
            assert len(bwd_plans) == before + 1


def test_fused_add_rms_norm_plans_are_keyed_by_the_residuals_layout(kv):
    fwd_plans = _module(kv, "rms_norm")._FORWARD_PLANS
    for name, r_make in {
        "contiguous": lambda: _leaf(3, 5, 32),
        "rows 40 apart": lambda: _strided((3, 5, 32), 40),
    }.items():
        x, r, w = _leaf(3, 5, 32), r_make(), _leaf(32)
        before = len(fwd_plans)
        y, s = kv.fused_add_rms_norm(x, r, w, 1e-6)
        x64, r64, w64 = leaf64(x), leaf64(r), leaf64(w)
        s64 = x64 + r64
        y64 = rms_norm64(s64, w64, 1e-6)
        assert_close(s, s64, torch.float32, f"{name}: s")
        assert_close(y, y64, torch.float32, f"{name}: y")
        gy, gs = torch.randn_like(y), torch.randn_like(s)
        got = torch.autograd.grad((y, s), (x, r, w), (gy, gs))
        exp = torch.autograd.grad((y64, s64), (x64, r64, w64), (gy.double(), gs.double()))
        for g, e in zip(got, exp, strict=True):
            assert_close(g, e, torch.float32, f"{name}: grad")
        assert len(fwd_plans) == before + 1, f"{name}: no forward plan of its own"


LN_CASES = {
    "base": lambda: (_leaf(3, 5, 32), _leaf(32), _leaf(32), 1e-5),
    "rows": lambda: (_leaf(9, 32), _leaf(32), _leaf(32), 1e-5),
    "dtype": lambda: (_leaf(3, 5, 32, dtype=torch.float16), _leaf(32), _leaf(32), 1e-5),
    "row stride": lambda: (_strided((3, 5, 32), 40), _leaf(32), _leaf(32), 1e-5),
    "not one view": lambda: (_permuted((3, 5, 32)), _leaf(32), _leaf(32), 1e-5),
    "eps": lambda: (_leaf(3, 5, 32), _leaf(32), _leaf(32), 1e-1),
    "no bias": lambda: (_leaf(3, 5, 32), _leaf(32), None, 1e-5),
}


def test_layer_norm_plans_are_keyed_by_what_the_launch_derives_from(kv):
    fwd_plans = _module(kv, "layer_norm")._FORWARD_PLANS
    for name, make in LN_CASES.items():
        x, w, b, eps = make()
        before = len(fwd_plans)
        _check(
            name,
            lambda x, w, b, eps=eps: kv.layer_norm(x, w, b, eps),
            lambda x, w, b, eps=eps: layer_norm64(x, w, b, eps),
            [x, w, b],
            torch.randn(x.shape, dtype=x.dtype),
            x.dtype,
        )
        assert len(fwd_plans) == before + 1, f"{name}: no forward plan of its own"


def _qk(b, t, hq, hk, d, layout, dtype=torch.float32):
    """q, k as [B, H, T, D] transposed views of [B, T, H, D] ("bthd"), contiguous [B, H, T, D]
    ("bhtd"), or [B, T, H, D] themselves ("unsqueeze 2")."""
    if layout == "bhtd":
        return _leaf(b, hq, t, d, dtype=dtype), _leaf(b, hk, t, d, dtype=dtype)
    q = torch.randn(b, t, hq, d, dtype=dtype)
    k = torch.randn(b, t, hk, d, dtype=dtype)
    if layout == "unsqueeze 2":
        return q.requires_grad_(), k.requires_grad_()
    return q.transpose(1, 2).requires_grad_(), k.transpose(1, 2).requires_grad_()


ROPE_CASES = {
    # name: (b, t, hq, hk, d, layout, dtype, cos batch)
    "base": (2, 5, 4, 2, 16, "bthd", torch.float32, 2),
    "tokens": (2, 7, 4, 2, 16, "bthd", torch.float32, 2),
    "heads": (2, 5, 3, 1, 16, "bthd", torch.float32, 2),
    "head_dim": (2, 5, 4, 2, 32, "bthd", torch.float32, 2),
    "dtype": (2, 5, 4, 2, 16, "bthd", torch.float16, 2),
    "layout": (2, 5, 4, 2, 16, "bhtd", torch.float32, 2),
    "unsqueeze_dim": (2, 5, 4, 2, 16, "unsqueeze 2", torch.float32, 2),
    "cos batch 1": (2, 5, 4, 2, 16, "bthd", torch.float32, 1),
    # Heads == tokens: the same shape and strides read as [B, H, T, D], then as [B, T, H, D].
    "square": (2, 4, 4, 4, 16, "bhtd", torch.float32, 2),
    "square, unsqueeze_dim 2": (2, 4, 4, 4, 16, "unsqueeze 2", torch.float32, 2),
}


def test_rope_plans_are_keyed_by_what_the_launch_derives_from(kv):
    plans = _module(kv, "rope")._ROTATE_PLANS
    for name, (b, t, hq, hk, d, layout, dtype, cb) in ROPE_CASES.items():
        q, k = _qk(b, t, hq, hk, d, layout, dtype)
        emb = torch.randn(cb, t, d // 2, dtype=torch.float64).repeat(1, 1, 2)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        ud = 2 if layout == "unsqueeze 2" else 1
        before = len(plans)
        qo, ko = kv.apply_rotary_pos_emb(q, k, cos, sin, ud)
        q64, k64 = leaf64(q), leaf64(k)
        qr, kr = rope64(q64, k64, cos.double(), sin.double(), ud)
        assert_close(qo, qr, dtype, f"{name}: q")
        assert_close(ko, kr, dtype, f"{name}: k")
        gq, gk = torch.randn_like(qo), torch.randn_like(ko)
        got = torch.autograd.grad((qo, ko), (q, k), (gq, gk))
        exp = torch.autograd.grad((qr, kr), (q64, k64), (gq.double(), gk.double()))
        for g, e in zip(got, exp, strict=True):
            assert_close(g, e, dtype, f"{name}: grad")
        # The forward and the backward (the inverse rotation) each have a plan.
        assert len(plans) >= before + 2, f"{name}: no plans of its own"


GLU_CASES = {
    # name: (a, b)
    "base": lambda: (_leaf(6, 32), _leaf(6, 32)),
    "rows": lambda: (_leaf(9, 32), _leaf(9, 32)),
    "dtype": lambda: (_leaf(6, 32, dtype=torch.float16), _leaf(6, 32, dtype=torch.float16)),
    "row stride": lambda: (_strided((6, 32), 40), _leaf(6, 32)),
    "not one view": lambda: (_permuted((6, 2, 32)), _leaf(6, 2, 32)),
}


def test_glu_plans_are_keyed_by_what_the_launch_derives_from(kv):
    swiglu = _module(kv, "swiglu")
    fwd_plans, bwd_plans = swiglu._GLU_FORWARD_PLANS, swiglu._GLU_BACKWARD_PLANS
    for name, make in GLU_CASES.items():
        a, b = make()
        before = len(fwd_plans), len(bwd_plans)
        _check(
            name,
            kv.silu_mul,
            lambda a, b: a / (1.0 + torch.exp(-a)) * b,
            [a, b],
            torch.randn(a.shape, dtype=a.dtype),
            a.dtype,
        )
        assert len(fwd_plans) == before[0] + 1, f"{name}: no forward plan of its own"
        assert len(bwd_plans) == before[1] + 1, f"{name}: no backward plan of its own"


def test_glu_halves_backward_plan_is_keyed_by_its_outputs_layout(kv):
    """The gated product of a fused gate_up's halves writes its gradient into the halves of one
    buffer: other output strides than the plain product's, for the same a and b layouts."""
    bwd_plans = _module(kv, "swiglu")._GLU_BACKWARD_PLANS
    x = _leaf(6, 64)
    a, b = (h.detach().requires_grad_() for h in x.chunk(2, -1))  # the same layouts as x's halves
    torch.autograd.grad(kv.silu_mul(a, b), (a, b), torch.randn(6, 32))
    before = len(bwd_plans)
    y = _module(kv, "swiglu").glu_halves(x, 0)
    x64 = leaf64(x)
    a64, b64 = x64.chunk(2, -1)
    y64 = a64 / (1.0 + torch.exp(-a64)) * b64
    assert_close(y, y64, torch.float32, "y")
    g = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, g)
    (dx64,) = torch.autograd.grad(y64, x64, g.double())
    assert_close(dx, dx64, torch.float32, "dx")
    assert len(bwd_plans) == before + 1
