"""The norms' backward memory: whichever geometry the autotuner picks, the fp32 dW (and dB)
partials take no more than Liger's, one row per SM, so the extra peak above dx and the weight
gradients is never more than Liger's; the one exception (plain RMSNorm at widths 513-2048 with
more than 8192 rows, where a geometry of two programs per SM is timed too) takes two rows per SM. Measured by a
tensor-registry probe of live storages."""

from __future__ import annotations

import sys

import pytest
import torch
from _live_bytes import extra_peak
from _training_refs import assert_close, layer_norm64, rms_norm64

from tests.sweep import sweep_param

# Wide rows (several rows per program-iteration), head-dim rows (many rows per program) and
# the hidden-8192 and -16384 lists (32 warps, RELOAD, STAGES).
SHAPES = [(64, 1000), (1024, 128), (10, 5000), (8, 9000)]


def module(kt, name: str):
    return sys.modules[f"{kt.__name__}.{name}"]


def liger_partials(mod, x: torch.Tensor, buffers: int = 1) -> int:
    """Liger's fp32 partials: `buffers` x [SMs, n] (the interpreter reports a few SMs)."""
    return buffers * mod.sm_count(x.device) * x.shape[-1] * 4


# The fused add's sum gradient (ds) reaches the same backward and allocates nothing of its own:
# the default run holds it to the budget at the widest shape, the sweep at every shape (its
# values at every geometry list are checked in test_add_rms_norm.py).
RMS_CASES = [
    *(pytest.param(shape, False, id=f"{shape}-rms_norm") for shape in SHAPES),
    pytest.param(SHAPES[-1], True, id=f"{SHAPES[-1]}-add_rms_norm"),
    *(
        sweep_param(shape, True, what="the fused add at every shape", id=f"{shape}-add_rms_norm")
        for shape in SHAPES[:-1]
    ),
]


@pytest.mark.parametrize("shape, residual", RMS_CASES)
def test_rms_norm_backward_partials_are_at_most_liger(kt, shape, residual):
    mod = module(kt, "rms_norm")
    x = torch.randn(shape, dtype=torch.bfloat16)
    w = 1 + 0.1 * torch.randn(shape[-1], dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    ds = torch.randn_like(x) if residual else None
    _y, rstd, _s = mod.forward(x, w, 1e-6, False)
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    rms_norm64(x64, w64, 1e-6).backward(dy.double())
    candidates = mod.bwd_candidates(*shape)
    assert candidates  # the list the GPU times; each one is held to the budget
    for cfg in candidates:
        extra, (dx, dw) = extra_peak(
            lambda c=cfg: mod.backward(dy, x, w, rstd, False, True, c, ds=ds)
        )
        assert extra <= liger_partials(mod, x), f"{cfg}: {extra} bytes of partials"
        ref_dx = x64.grad if ds is None else x64.grad + ds.double()
        assert_close(dx, ref_dx, torch.bfloat16, f"dx {cfg}")
        assert_close(dw, w64.grad, torch.bfloat16, f"dw {cfg}")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_layer_norm_backward_partials_are_at_most_liger(kt, shape):
    mod = module(kt, "layer_norm")
    x = torch.randn(shape, dtype=torch.bfloat16)
    w = 1 + 0.1 * torch.randn(shape[-1], dtype=torch.bfloat16)
    b = 0.1 * torch.randn(shape[-1], dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    _y, mean, rstd = mod.forward(x, w, b, 1e-5)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    layer_norm64(x64, w64, b64, 1e-5).backward(dy.double())
    rms = module(kt, "rms_norm")
    for cfg in rms.bwd_candidates(*shape):
        extra, (dx, dw, db) = extra_peak(
            lambda c=cfg: mod.backward(dy, x, w, mean, rstd, True, True, c)
        )
        assert extra <= liger_partials(rms, x, buffers=2), f"{cfg}: {extra} bytes of partials"
        assert_close(dx, x64.grad, torch.bfloat16, f"dx {cfg}")
        assert_close(dw, w64.grad, torch.bfloat16, f"dw {cfg}")
        assert_close(db, b64.grad, torch.bfloat16, f"db {cfg}")


def test_two_programs_per_sm_geometry_is_right_with_two_partial_rows_per_sm(kt):
    """The geometry of two programs per SM, listed with dW only for plain RMSNorm's many rows of
    513-2048, run on a small input: float64-correct, with two rows of fp32 partials per SM."""
    mod = module(kt, "rms_norm")
    (cfg,) = [c for c in mod.bwd_candidates(65536, 1000, spread=True) if c["per_sm"] == 2]
    x = torch.randn(45, 1000, dtype=torch.bfloat16)
    w = 1 + 0.1 * torch.randn(1000, dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    _y, rstd, _s = mod.forward(x, w, 1e-6, False)
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    rms_norm64(x64, w64, 1e-6).backward(dy.double())
    extra, (dx, dw) = extra_peak(lambda: mod.backward(dy, x, w, rstd, False, True, cfg))
    assert extra == liger_partials(mod, x, buffers=2)
    assert_close(dx, x64.grad, torch.bfloat16, "dx")
    assert_close(dw, w64.grad, torch.bfloat16, "dw")


def test_without_dw_several_programs_per_sm_stay_candidates(kt):
    """No weight gradient, no partials: the geometries that run two programs per SM (small
    batches gain from them) are still timed."""
    mod = module(kt, "rms_norm")
    assert any(c["per_sm"] > 1 for c in mod.bwd_candidates(1024, 8192, dw=False))
    # With dW, one program per SM at every width (each list, not only those run above), but
    # for plain RMSNorm's (spread) one geometry of two per SM (two rows of partials per SM) at
    # widths of 513 to 2048 with more than 8192 rows, where one per SM was 1.5x slower.
    for n in (128, 1000, 2048, 4096, 5000, 8192, 9000, 16384, 40000):
        for m in (1024, 8192, 8193, 262144):
            assert {c["per_sm"] for c in mod.bwd_candidates(m, n)} == {1}, (m, n)
            per_sm = [c["per_sm"] for c in mod.bwd_candidates(m, n, spread=True)]
            if 512 < n <= 2048 and m > 8192:
                assert sorted(per_sm)[-2:] == [1, 2] and per_sm[0] == 1, (m, n)
            else:
                assert set(per_sm) == {1}, (m, n)


def test_stages_geometries_fit_in_shared_memory(kt):
    """The STAGES buffers of every listed geometry fit in STAGE_BYTES_MAX for the row tensors
    given (bf16 rows keep them at hidden 16384; fp32 rows there drop them)."""
    mod = module(kt, "rms_norm")
    for row_bytes in (4, 6, 8, 12):  # bf16 dy and x; + a bf16 ds; fp32 dy and x; + an fp32 ds
        for n in (1000, 4096, 5000, 8192, 9000, 16384):
            for cfg in mod.bwd_candidates(4096, n, row_bytes=row_bytes):
                assert mod.stage_bytes(cfg, n, row_bytes) <= mod.STAGE_BYTES_MAX, (row_bytes, cfg)
    assert any(c["STAGES"] > 1 for c in mod.bwd_candidates(4096, 16384, row_bytes=4))
    assert all(c["STAGES"] == 1 for c in mod.bwd_candidates(4096, 16384, row_bytes=8))
