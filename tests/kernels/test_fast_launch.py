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


def key(common, *args):
    return common.spec_key(args, {})


def test_int_keys_separate_what_triton_specialises(common):
    assert key(common, 1) != key(common, 3)  # == 1
    assert key(common, 32) != key(common, 33)  # multiple of 16
    assert key(common, 3) == key(common, 5)  # nothing Triton tells apart
    assert key(common, 7, 2**31 + 1) != key(common, 7, 3)  # int64
    assert key(common, 2**63 + 1) != key(common, 2**31 + 1)  # uint64
    assert key(common, True) != key(common, 1)  # bool is its own type
    assert key(common, 1.0) != key(common, 1)
    assert key(common, 3, 1) != key(common, 1, 3)  # positions count


def test_tensor_keys_separate_dtype_and_alignment(common):
    x = torch.zeros(64, dtype=torch.bfloat16)
    assert key(common, x, 3) != key(common, x[1:], 3)  # 2 bytes off a 16-byte boundary
    assert key(common, x, 3) == key(common, x[8:], 3)  # 16 bytes on
    assert key(common, x, 3) != key(common, x.float(), 3)
    assert key(common, x, x[1:]) != key(common, x[1:], x)


def test_unknown_argument_kinds_are_refused(common):
    with pytest.raises(TypeError):
        key(common, (1, 2))


def test_interpreter_defers_to_triton(kt, common):
    rms = sys.modules[kt.__name__ + ".rms_norm"]
    assert isinstance(rms._rms_norm_fwd_kernel, common.FastLaunch)
    assert not rms._rms_norm_fwd_kernel.enabled  # interpreting: Triton's own path
    x, w = torch.randn(4, 32), torch.randn(32)
    y = kt.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (32,), w, 1e-6))
    assert not rms._rms_norm_fwd_kernel.compiled
