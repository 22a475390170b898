"""ReLU² and Nemotron's MLP (hub_kernels/kernels-lab/training) on a CUDA GPU at real shapes:
values and gradients against float64, bit-for-bit bf16 rounding against transformers, the
Triton launches that ran, and the MLP's peak memory next to the composed modules'. Run in its
own pytest process (see conftest.py): ``python -m pytest tests/gpu/test_relu2_gpu.py``.
"""

from __future__ import annotations

import types

import pytest
import torch

from tests.gpu.launches import TritonLaunches
from tests.gpu.variant import load_variant, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


@pytest.fixture(scope="module")
def kt():
    return load_variant("_kernels_training_relu2_gpu_test")


def check(out, ref, dtype, what, factor=1.0):
    err = rel_err(out, ref)
    assert err <= TOL[dtype] * factor, f"{what}: {err:.3e} > {TOL[dtype] * factor:.1e}"


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_relu_squared_values_gradient_and_launches(kt, dtype, in_place):
    torch.manual_seed(0)
    x = torch.randn(4096, 14336, device="cuda", dtype=dtype, requires_grad=True)
    inner = x * 1.0
    with TritonLaunches(kt.swiglu, device=True) as launches:
        y = kt.relu_squared(inner, in_place=in_place)
        dy = torch.randn_like(y)
        (dx,) = torch.autograd.grad(y, x, dy)
    launches.assert_launched("_act_fwd_kernel")
    launches.assert_launched("_act_bwd_kernel")
    launches.assert_device_matches()
    x64 = x.detach().double()
    check(y, x64.clamp_min(0) ** 2, dtype, "y")
    check(dx, 2 * x64.clamp_min(0) * dy.double(), dtype, "dx")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_relu_squared_rounds_as_transformers_does(kt, dtype):
    from transformers.activations import ReLUSquaredActivation

    x = torch.randn(2048, 4096, device="cuda", dtype=dtype)
    assert torch.equal(kt.relu_squared(x), ReLUSquaredActivation()(x))


def _nemotron_mlp(dtype, hidden=3072, inter=9216):
    from transformers import NemotronConfig
    from transformers.models.nemotron.modeling_nemotron import NemotronMLP

    config = NemotronConfig(hidden_size=hidden, intermediate_size=inter, mlp_bias=False)
    return NemotronMLP(config).to(device="cuda", dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mlp_values_and_every_gradient(kt, dtype):
    torch.manual_seed(0)
    mlp = _nemotron_mlp(dtype, 1024, 3072)
    with torch.no_grad():  # unit-scale activations, so relu² neither vanishes nor overflows
        mlp.up_proj.weight.mul_(1024**-0.5 / mlp.up_proj.weight.std())
        mlp.down_proj.weight.mul_(3072**-0.5 / mlp.down_proj.weight.std())
    x = torch.randn(2, 1024, 1024, device="cuda", dtype=dtype, requires_grad=True)
    leaves = [x, mlp.up_proj.weight, mlp.down_proj.weight]
    forward = types.MethodType(kt.layers.ReLUSquaredMLP.forward, mlp)
    with TritonLaunches(kt.swiglu, device=True) as launches:
        out = forward(x)
        dy = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves, dy)
    launches.assert_launched("_act_fwd_kernel")
    launches.assert_launched("_act_bwd_kernel")
    launches.assert_device_matches()
    l64 = [t.detach().double().requires_grad_() for t in leaves]
    ref = (l64[0] @ l64[1].t()).clamp_min(0) ** 2 @ l64[2].t()
    refs = torch.autograd.grad(ref, l64, dy.double())
    check(out, ref, dtype, "out")
    for name, g, r in zip(("dx", "d up", "d down"), grads, refs, strict=True):
        check(g, r, dtype, name)


def _peak_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del result
    return peak / 2**20


def test_mlp_peak_memory_is_lower_than_the_composed_modules(kt):
    """16384 tokens of Nemotron-Mini-4B's MLP in bf16: one [T, I] tensor is 288 MiB; the layer's
    fwd+bwd peaks at least that much below NemotronMLP's own forward (it keeps u alone)."""
    torch.manual_seed(0)
    mlp = _nemotron_mlp(torch.bfloat16)
    x = torch.randn(16384, 3072, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    leaves = [x, mlp.up_proj.weight, mlp.down_proj.weight]
    dy = torch.randn_like(x)
    composed = _peak_mib(lambda: torch.autograd.grad(mlp(x), leaves, dy))
    forward = types.MethodType(kt.layers.ReLUSquaredMLP.forward, mlp)
    ours = _peak_mib(lambda: torch.autograd.grad(forward(x), leaves, dy))
    act_mib = 16384 * 9216 * 2 / 2**20
    print(f"fwd+bwd peak: composed {composed:.0f} MiB, ours {ours:.0f} MiB, [T, I] {act_mib:.0f}")
    assert ours <= composed - act_mib, (ours, composed)
