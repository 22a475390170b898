"""`fast_launch` (the training kernels' launcher that skips Triton's per-call binding) on a GPU.

A launch that reuses a compiled kernel must only ever reuse one Triton itself would have picked:
these tests change each thing Triton specialises on (pointer alignment, an int equal to 1 or a
multiple of 16, an int past int32, a dtype, a constexpr) and check the results, and they prove
the direct path is taken by making Triton's own launch path raise once a specialisation is known.
Run in its own pytest process (see conftest.py).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VARIANT = (
    Path(__file__).resolve().parents[2] / "hub_kernels/kernels-lab/training/build/torch-universal"
)


@pytest.fixture(scope="module")
def common():
    """The variant's `_common` module, imported as part of its package (it imports siblings)."""
    name = "_fast_launch_gpu_variant"
    spec = importlib.util.spec_from_file_location(
        name, VARIANT / "__init__.py", submodule_search_locations=[str(VARIANT)]
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    return importlib.import_module(f"{name}._common")


@pytest.fixture(scope="module")
def scaled_copy(common):
    import triton
    import triton.language as tl

    @common.fast_launch
    @triton.jit
    def kernel(X, Y, n, step, scale, BLOCK: tl.constexpr, NEGATE: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(X + offs * step, mask=mask).to(tl.float32) * scale
        if NEGATE:
            x = -x
        tl.store(Y + offs, x.to(Y.dtype.element_ty), mask=mask)

    return kernel


def run(kernel, x, n, step, scale=2.0, negate=False, block=128):
    import triton  # not at module level: collecting this file must not import triton (conftest.py)

    y = torch.zeros(n, dtype=x.dtype, device=x.device)
    kernel[(triton.cdiv(n, block),)](x, y, n, step, scale, BLOCK=block, NEGATE=negate)
    ref = x[: n * step : step].float() * scale
    return y, (-ref if negate else ref).to(x.dtype)


def forbid_triton_path(kernel):
    """Make Triton's own launch path raise: only the direct launcher can succeed now."""

    def refuse(*args, **kwargs):
        raise AssertionError("Triton's launch path was taken for a known specialisation")

    kernel.fn.run = refuse
    return lambda: vars(kernel.fn).pop("run", None)


def test_known_specialisation_launches_directly(scaled_copy):
    x = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    y, ref = run(scaled_copy, x, 1000, 3)  # compiles and records the specialisation
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    restore = forbid_triton_path(scaled_copy)
    try:
        x2 = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
        for n in (1000, 999, 5):  # other values of the same specialisation (none is 1 or 16k)
            y, ref = run(scaled_copy, x2, n, 3, scale=0.5)
            torch.testing.assert_close(y, ref, rtol=0, atol=0)
    finally:
        restore()


@pytest.mark.parametrize(
    "change",
    ["misaligned pointer", "int == 1", "int % 16 == 0", "dtype", "constexpr", "int past int32"],
)
def test_each_specialisation_change_compiles_anew(scaled_copy, change):
    base = torch.randn(8192, device="cuda", dtype=torch.bfloat16)
    run(scaled_copy, base, 1000, 3)
    known = len(scaled_copy.compiled)
    x, n, step, negate = base, 1000, 3, False
    if change == "misaligned pointer":
        x = base[1:]  # 2 bytes past a 16-byte boundary
    elif change == "int == 1":
        step = 1
    elif change == "int % 16 == 0":
        n = 1024
    elif change == "dtype":
        x = base.half()
    elif change == "constexpr":
        negate = True
    elif change == "int past int32":
        # A step past int32 needs i64 arithmetic; only offset 0 is read (n = 1).
        n, step = 1, 2**31 + 7
    y, ref = run(scaled_copy, x, n, step, negate=negate)
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    assert len(scaled_copy.compiled) == known + 1, "a new specialisation must get its own entry"


def test_launch_hooks_take_tritons_path(scaled_copy):
    """A profiler's launch hook must see every launch: with one set, Triton's path is taken."""
    from tests.gpu.launches import _add_launch_hook

    x = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    run(scaled_copy, x, 1000, 3)
    seen = []
    remove = _add_launch_hook(seen.append)
    try:
        run(scaled_copy, x, 1000, 3)
    finally:
        remove()
    assert len(seen) == 1


def test_a_launcher_that_refuses_the_arguments_falls_back_for_good(common):
    """A Triton whose compiled launcher takes other arguments: the launch still happens (through
    Triton's path) and the wrapper stops trying the direct one."""
    import triton
    import triton.language as tl

    @common.fast_launch
    @triton.jit
    def double(X, Y, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Y + offs, tl.load(X + offs, mask=offs < n) * 2, mask=offs < n)

    x = torch.randn(300, device="cuda")
    y = torch.zeros_like(x)
    double[(3,)](x, y, 300, BLOCK=128)  # compiles; the plan holds the compiled kernel
    ((key, (kernel, tail)),) = double.compiled.items()
    # One argument too many for the compiled launcher, as a Triton with another launch signature
    # would see it: the launcher refuses before launching.
    double.compiled[key] = (kernel, (*tail, 0))
    y.zero_()
    double[(3,)](x, y, 300, BLOCK=128)
    torch.testing.assert_close(y, 2 * x)
    assert not double.enabled


def test_a_constexpr_passed_by_position_is_never_replayed(common):
    """The key does not hold constexpr values given by position: such a launch takes Triton's
    path each time, so a second value compiles its own kernel instead of reusing the first."""
    import triton
    import triton.language as tl

    @common.fast_launch
    @triton.jit
    def fill(Y, n, VALUE: tl.constexpr):
        offs = tl.arange(0, 128)
        tl.store(Y + offs, tl.full([128], VALUE, tl.float32), mask=offs < n)

    y = torch.zeros(128, device="cuda")
    for value in (1, 2, 3):
        fill[(1,)](y, 100, value)
        assert torch.all(y[:100] == value)


def test_bound_launch_replays_directly_and_falls_back_off_its_specialisation(scaled_copy):
    """A plan's BoundLaunch: after its first aligned call it launches through the compiled
    kernel's launcher alone; a misaligned pointer takes FastLaunch's path (its own kernel)."""
    bound = scaled_copy.bound((8,), {"BLOCK": 128, "NEGATE": False})
    x = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    y = torch.zeros(1000, dtype=x.dtype, device="cuda")
    bound(x, y, 1000, 3, 2.0)  # compiles through Triton, then keeps the kernel
    assert bound.ready is not None
    ref = (x[:3000:3].float() * 2.0).to(x.dtype)
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    restore = forbid_triton_path(scaled_copy)
    try:
        x2 = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
        y.zero_()
        bound(x2, y, 1000, 3, 2.0)
        torch.testing.assert_close(y, (x2[:3000:3].float() * 2.0).to(x.dtype), rtol=0, atol=0)
    finally:
        restore()
    # Off the kept specialisation each call gets its own compiled kernel, not the kept one (the
    # module's earlier tests may have compiled these already: the fixture is shared, so the
    # kernel returned is compared, not a count of FastLaunch's entries).
    kept = bound.ready[1]
    y.zero_()
    other = bound(x[1:], y, 1000, 3, 2.0)  # 2 bytes off: another specialisation
    torch.testing.assert_close(y, (x[1:3001:3].float() * 2.0).to(x.dtype), rtol=0, atol=0)
    assert other is not kept and bound.ready[1] is kept
    xh, yh = x.half(), torch.zeros(1000, dtype=torch.half, device="cuda")
    other = bound(xh, yh, 1000, 3, 2.0)  # aligned, another dtype: not the kept bf16 kernel
    torch.testing.assert_close(yh, (xh[:3000:3].float() * 2.0).half(), rtol=0, atol=0)
    assert other is not kept and bound.ready[1] is kept


def _kept_bound_launch(scaled_copy):
    bound = scaled_copy.bound((8,), {"BLOCK": 128, "NEGATE": False})
    x = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    y = torch.zeros(1000, dtype=x.dtype, device="cuda")
    bound(x, y, 1000, 3, 2.0)
    assert bound.ready is not None
    return bound, x, y


def test_bound_launch_passes_no_host_pointer(scaled_copy):
    """The direct path hands the launcher addresses as ints, which it no longer checks: a tensor
    in host memory must still take Triton's path (and its error), not reach the GPU."""
    bound, _, y = _kept_bound_launch(scaled_copy)
    host = torch.randn(4096, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cpu tensor"):
        bound(host, y, 1000, 3, 2.0)
    torch.cuda.synchronize()  # a host address launched on the GPU would fault here


def test_bound_launch_honours_hooks_and_resumes_without_them(scaled_copy):
    """A launch hook set after the kernel was kept (assigned, or added to Triton's chain; enter
    or exit) is called: Triton's path. Once removed, the direct path is taken again."""
    import triton

    from tests.gpu.launches import _add_launch_hook

    bound, x, y = _kept_bound_launch(scaled_copy)
    runtime = triton.knobs.runtime
    seen = []
    remove = _add_launch_hook(seen.append)
    try:
        bound(x, y, 1000, 3, 2.0)
    finally:
        remove()
    assert len(seen) == 1
    exits = []
    hook, before = exits.append, runtime.launch_exit_hook
    if hasattr(before, "add"):  # triton >= 3.5: a chain of hooks
        before.add(hook)
        undo = lambda: before.remove(hook)  # noqa: E731
    else:
        runtime.launch_exit_hook = hook
        undo = lambda: setattr(runtime, "launch_exit_hook", before)  # noqa: E731
    try:
        bound(x, y, 1000, 3, 2.0)
    finally:
        undo()
    assert len(exits) == 1
    restore = forbid_triton_path(scaled_copy)
    try:
        y.zero_()
        bound(x, y, 1000, 3, 2.0)  # no hook left: the direct path, or this raises
    finally:
        restore()
    torch.testing.assert_close(y, (x[:3000:3].float() * 2.0).to(x.dtype), rtol=0, atol=0)


def test_rms_norm_plans_launch_directly_after_the_first_call():
    """RMSNorm fwd+bwd through the public function: once its plans are made, a second call
    with new tensors of the same key launches all three kernels without Triton's binder, and
    its results are the float64 reference's to bf16 precision."""
    from tests.gpu.variant import load_variant, rel_err

    kt = load_variant("_fast_launch_gpu_plans")
    rms = sys.modules["_fast_launch_gpu_plans.rms_norm"]
    kernels = (rms._rms_norm_fwd_kernel, rms._rms_norm_bwd_kernel, rms._column_sum_kernel)

    def step():
        x = torch.randn(4, 512, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        y = kt.rms_norm(x, w, 1e-6)
        dx, dw = torch.autograd.grad(y, (x, w), dy)
        x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64
        dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.double())
        for out, ref in ((y, y64), (dx, dx64), (dw, dw64)):
            assert rel_err(out, ref) <= 1e-2

    step()  # compiles, tunes, makes the plans
    restores = [forbid_triton_path(k) for k in kernels]
    try:
        step()
    finally:
        for restore in restores:
            restore()
