"""LayerNorm (torch.nn.LayerNorm contract) on the Triton interpreter against float64 references."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from _training_refs import DTYPES, assert_close, layer_norm64, leaf64

from tests.gpu.launches import TritonLaunches
from tests.sweep import sweep_param

SHAPES = [(7, 77), (37, 1000), (1, 64), (3, 5000), (2, 3, 128)]


@pytest.mark.parametrize("affine", ["weight+bias", "weight", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_and_grads(kt, shape, dtype, affine):
    n = shape[-1]
    x = (torch.randn(shape, dtype=dtype) * 2 + 0.5).requires_grad_()
    w = (torch.randn(n, dtype=dtype) * 0.5 + 1).requires_grad_() if affine != "none" else None
    b = torch.randn(n, dtype=dtype).requires_grad_() if affine == "weight+bias" else None
    y = kt.layer_norm(x, w, b, 1e-5)
    dy = torch.randn_like(y)
    y.backward(dy)
    x64 = leaf64(x)
    w64 = leaf64(w) if w is not None else None
    b64 = leaf64(b) if b is not None else None
    layer_norm64(x64, w64, b64, 1e-5).backward(dy.double())
    assert_close(y, layer_norm64(x64.detach(), w64, b64, 1e-5), dtype, "y")
    assert_close(x.grad, x64.grad, dtype, "dx")
    if w is not None:
        assert_close(w.grad, w64.grad, dtype, "dw")
    if b is not None:
        assert_close(b.grad, b64.grad, dtype, "db")


def test_non_contiguous_input(kt):
    x = torch.randn(30, 2, 50)[:, 1, :].requires_grad_()
    w, b = torch.randn(50, requires_grad=True), torch.randn(50, requires_grad=True)
    y = kt.layer_norm(x, w, b, 1e-5)
    y.backward(torch.ones_like(y))
    x64, w64, b64 = leaf64(x), leaf64(w), leaf64(b)
    layer_norm64(x64, w64, b64, 1e-5).sum().backward()
    assert_close(x.grad, x64.grad, torch.float32, "dx")
    assert_close(w.grad, w64.grad, torch.float32, "dw")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_bound_on_nn_layernorm(kt, dtype):
    ref = torch.nn.LayerNorm(200).to(dtype)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    mod = torch.nn.LayerNorm(200).to(dtype)
    mod.load_state_dict(ref.state_dict())
    mod.forward = types.MethodType(kt.layers.LayerNorm.forward, mod)
    x = torch.randn(3, 7, 200, dtype=dtype)
    y_ref, y = ref(x), mod(x)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(y, y_ref, rtol=2 * eps, atol=2 * eps * y_ref.abs().max().item())


# As test_rms_norm.py's BWD_SHAPES (LayerNorm takes RMSNorm's geometry lists): 5 x 9000 and
# 5 x 5000 split 2/2/1 over three programs; KERNELS_SWEEP=1 adds 13 x 9000 and 10 x 5000.
@pytest.mark.parametrize(
    "m,n",
    [(45, 1000), (5, 9000), (5, 5000), (45, 128),
     sweep_param(13, 9000, what="more rows of the hidden-16384 list"),
     sweep_param(10, 5000, what="more rows of the hidden-8192 list")],
    ids=str,
)  # fmt: skip
def test_every_backward_candidate(kt, m, n):
    """The GPU picks among these geometries by timing; each one must be correct (prefetch,
    RELOAD and STAGES too; rows split unevenly over the programs, hidden not a power of 2)."""
    mod = sys.modules[kt.__name__ + ".layer_norm"]
    x = torch.randn(m, n, dtype=torch.bfloat16)
    w, b = torch.randn(n, dtype=torch.bfloat16), torch.randn(n, dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    _, mean, rstd = mod.forward(x, w, b, 1e-5)
    x64, w64, b64 = (leaf64(t.requires_grad_()) for t in (x, w, b))
    layer_norm64(x64, w64, b64, 1e-5).backward(dy.double())
    for cfg in mod.bwd_candidates(m, n):
        dx, dw, db = mod.backward(dy, x.detach(), w.detach(), mean, rstd, True, True, cfg)
        assert_close(dx, x64.grad, torch.bfloat16, f"dx {cfg}")
        assert_close(dw, w64.grad, torch.bfloat16, f"dw {cfg}")
        assert_close(db, b64.grad, torch.bfloat16, f"db {cfg}")


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_reload_and_stages_give_the_same_gradients(kt, affine):
    """As for RMSNorm: RELOAD and STAGES change no operation of the arithmetic, so the gradients
    are bit for bit those of RELOAD 0 (the arithmetic checked against float64 above), with and
    without w and b."""
    mod = sys.modules[kt.__name__ + ".layer_norm"]
    rms = sys.modules[kt.__name__ + ".rms_norm"]
    x = torch.randn(11, 300, dtype=torch.bfloat16)
    w = torch.randn(300, dtype=torch.bfloat16) if affine else None
    b = torch.randn(300, dtype=torch.bfloat16) if affine else None
    dy = torch.randn_like(x)
    _, mean, rstd = mod.forward(x, w, b, 1e-5)

    def grads(**options):
        cfg = rms._geometry(512, 16, 4096, 4, **options)
        return mod.backward(dy, x, w, mean, rstd, affine, affine, cfg)

    base = grads()
    for reload in (0, 1, 2):
        for stages in (1, 2):
            got = grads(reload=reload, stages=stages)
            assert all(torch.equal(g, e) for g, e in zip(got, base, strict=True)), (reload, stages)


def test_a_forward_no_gradient_follows_stores_no_statistics(kt):
    """Under no_grad, or on inputs that need no gradient, the forward launches without STATS
    (no mean or rstd stored or allocated) and records no autograd node; its values are the
    training forward's, bit for bit. With a gradient to come, STATS is on."""
    mod = sys.modules[kt.__name__ + ".layer_norm"]
    x, w, b = torch.randn(6, 96), torch.randn(96).requires_grad_(), torch.randn(96)

    def stats_flags():
        with TritonLaunches(mod) as launches:
            y = kt.layer_norm(x, w, b, 1e-5)
        return y, {launch.options["STATS"] for launch in launches.of("_layer_norm_fwd_kernel")}

    y_train, flags = stats_flags()
    assert flags == {True} and y_train.grad_fn is not None
    with torch.no_grad():
        y, flags = stats_flags()
    assert flags == {False} and y.grad_fn is None
    assert torch.equal(y, y_train.detach())
    w.requires_grad_(False)  # grad mode on, nothing needs a gradient
    y, flags = stats_flags()
    assert flags == {False} and y.grad_fn is None and torch.equal(y, y_train.detach())
    assert mod.forward(x, w, b, 1e-5, stats=False)[1:] == (None, None)
