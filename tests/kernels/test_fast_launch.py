"""The keys `fast_launch` reuses compiled kernels under (CPU): every property Triton specialises
on must change the key. The launches themselves are tested on the GPU
(tests/gpu/test_fast_launch_gpu.py); under the interpreter the wrapper defers to Triton."""

from __future__ import annotations

import sys

import pytest
import torch


@pytest.fixture
def common(kt):
    return sys.modules[kt.__name__ + "._common"]


def test_int_keys_separate_what_triton_specialises(common):
    spec = common._arg_spec
    assert spec(1) != spec(3)  # == 1
    assert spec(32) != spec(33)  # multiple of 16
    assert spec(3) == spec(5)  # nothing Triton tells apart
    assert spec(2**31 + 1) != spec(3)  # int64
    assert spec(2**63 + 1) != spec(2**31 + 1)  # uint64
    assert spec(True) != spec(1)  # bool is its own type
    assert spec(1.0) != spec(1)


def test_tensor_keys_separate_dtype_and_alignment(common):
    x = torch.zeros(64, dtype=torch.bfloat16)
    spec = common._arg_spec
    assert spec(x) != spec(x[1:])  # 2 bytes off a 16-byte boundary
    assert spec(x) == spec(x[8:])  # 16 bytes on
    assert spec(x) != spec(x.float())
    assert spec(torch.nn.Parameter(x)) == spec(x)


def test_unknown_argument_kinds_are_refused(common):
    with pytest.raises(TypeError):
        common._arg_spec((1, 2))


def test_interpreter_defers_to_triton(kt, common):
    rms = sys.modules[kt.__name__ + ".rms_norm"]
    assert isinstance(rms._rms_norm_fwd_kernel, common.FastLaunch)
    assert not rms._rms_norm_fwd_kernel.enabled  # interpreting: Triton's own path
    x, w = torch.randn(4, 32), torch.randn(32)
    y = kt.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (32,), w, 1e-6))
    assert not rms._rms_norm_fwd_kernel.compiled
