"""Mode, Device, capability properties, KernelizeFallback and repository objects as values."""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path

import pytest
import torch
from kernels import InvalidSpec, KernelNotFound, LayerError, LockfileError
from kernels.layers import (
    CUDAProperties,
    Device,
    FuncRepository,
    KernelizeFallback,
    LayerRepository,
    LocalFuncRepository,
    LocalLayerRepository,
    LockedFuncRepository,
    LockedLayerRepository,
    Mode,
    ROCMProperties,
)

from .helpers import kernel_files, write_repo

# -- Mode -------------------------------------------------------------------------------------------


def test_mode_is_a_flag_with_the_reference_members():
    assert issubclass(Mode, enum.Flag)
    assert {m.name for m in Mode} == {"FALLBACK", "TRAINING", "INFERENCE", "TORCH_COMPILE"}
    both = Mode.TRAINING | Mode.TORCH_COMPILE
    assert Mode.TRAINING in both and Mode.INFERENCE not in both


@pytest.mark.parametrize(
    "combine",
    [
        lambda: Mode.INFERENCE | Mode.TRAINING,
        lambda: Mode.FALLBACK | Mode.INFERENCE,
        lambda: Mode.TORCH_COMPILE | Mode.FALLBACK,
    ],
)
def test_invalid_mode_combinations_raise_a_typed_value_error(combine):
    with pytest.raises(InvalidSpec) as err:
        combine()
    assert isinstance(err.value, ValueError)
    assert "hint:" in str(err.value)


# -- Device and properties --------------------------------------------------------------------------


def test_device_is_frozen_hashable_and_compares_by_value():
    a = Device(type="cuda", properties=CUDAProperties(min_capability=80, max_capability=90))
    b = Device("cuda", CUDAProperties(80, 90))
    assert a == b and hash(a) == hash(b)
    assert {a: 1}[b] == 1
    assert Device("cuda") != a
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.type = "cpu"  # type: ignore[misc]
    assert Device("cpu").properties is None
    assert Device("rocm", ROCMProperties(115, 115)).capability_range == (115, 115)


def test_cuda_and_rocm_properties_differ_even_with_equal_bounds():
    assert CUDAProperties(80, 90) != ROCMProperties(80, 90)
    assert hash(CUDAProperties(80, 90)) == hash(CUDAProperties(80, 90))


@pytest.mark.parametrize(
    "make",
    [
        lambda: Device("gpu"),
        lambda: Device("cpu", CUDAProperties(80, 90)),
        lambda: Device("rocm", CUDAProperties(80, 90)),
        lambda: Device("cuda", ROCMProperties(80, 90)),
        lambda: CUDAProperties(90, 80),
        lambda: CUDAProperties(-1, 80),
        lambda: ROCMProperties(8.0, 90),
        lambda: CUDAProperties(True, 90),
    ],
)
def test_bad_devices_and_ranges_raise_invalid_spec(make):
    with pytest.raises(InvalidSpec):
        make()


def test_kernelize_fallback_flags():
    assert not KernelizeFallback.NONE
    assert KernelizeFallback.DEFAULT == (
        KernelizeFallback.NO_LAYER
        | KernelizeFallback.NO_DEVICE
        | KernelizeFallback.NO_COMPATIBLE_PROPERTIES
        | KernelizeFallback.NO_COMPATIBLE_MODE
    )
    assert KernelizeFallback.CANNOT_LOAD not in KernelizeFallback.DEFAULT
    assert KernelizeFallback.ALL == KernelizeFallback.DEFAULT | KernelizeFallback.CANNOT_LOAD


# -- repositories -----------------------------------------------------------------------------------


def test_layer_repository_makes_no_request_and_does_not_load(hub):
    repos = [LayerRepository(f"org/repo{i}", layer_name="RMSNorm", version=1) for i in range(50)]
    assert hub.requests == []
    assert repos[0].repo_id == "org/repo0" and repos[0].version == 1 and repos[0].revision is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {},  # neither version nor revision
        {"version": 1, "revision": "main"},
        {"version": -1},
        {"revision": "a..b"},
    ],
)
def test_layer_repository_needs_exactly_one_valid_ref(kwargs):
    with pytest.raises(InvalidSpec) as err:
        LayerRepository("org/repo", layer_name="RMSNorm", **kwargs)
    assert isinstance(err.value, ValueError)  # what transformers' KernelConfig catches


@pytest.mark.parametrize("repo_id", ["repo", "org/", "a/b/c", "org/re po"])
def test_layer_repository_rejects_bad_repo_ids(repo_id):
    with pytest.raises(InvalidSpec):
        LayerRepository(repo_id, layer_name="RMSNorm", version=1)


@pytest.mark.parametrize("layer_name", ["", "has-dash", "1abc", None])
def test_repositories_reject_bad_layer_names(layer_name, tmp_path):
    with pytest.raises(InvalidSpec):
        LayerRepository("org/repo", layer_name=layer_name, version=1)
    with pytest.raises(InvalidSpec):
        LocalLayerRepository(tmp_path, layer_name=layer_name)


def test_repositories_are_values():
    a = LayerRepository("org/repo", layer_name="RMSNorm", version=1)
    b = LayerRepository(repo_id="org/repo", layer_name="RMSNorm", version=1, user_agent={"x": 1})
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != LayerRepository("org/repo", layer_name="RMSNorm", version=2)
    assert a != LayerRepository("org/repo", layer_name="RMSNorm", revision="v1")
    assert a != LayerRepository("org/repo", layer_name="RMSNorm", version=1, trust_remote_code=True)
    trusted = LayerRepository("org/repo", layer_name="X", version=1, trust_remote_code=["org"])
    assert hash(trusted) == hash(
        LayerRepository("org/repo", layer_name="X", version=1, trust_remote_code=["org"])
    )
    assert str(a) == "org/repo@v1:RMSNorm"
    assert repr(a) == "LayerRepository('org/repo', layer_name='RMSNorm', version=1)"
    local = LocalLayerRepository(Path("/k/norm"), layer_name="RMSNorm")
    assert local == LocalLayerRepository("/k/norm", layer_name="RMSNorm")
    assert local != LocalLayerRepository("/k/norm", layer_name="Other")
    assert str(local) == "/k/norm:RMSNorm"
    locked = LockedLayerRepository("org/repo", layer_name="RMSNorm")
    assert locked == LockedLayerRepository("org/repo", layer_name="RMSNorm")
    assert str(locked) == "org/repo@locked:RMSNorm"


def test_local_layer_repository_loads_the_layer_class(repo_path):
    layer = LocalLayerRepository(repo_path, layer_name="RMSNorm").load()
    assert isinstance(layer, type) and issubclass(layer, torch.nn.Module)
    assert layer.__name__ == "RMSNorm"
    import sys

    # transformers looks for a companion "<Layer>Layout" in the layer's module.
    assert layer.__module__ in sys.modules
    assert getattr(sys.modules[layer.__module__], "RMSNormLayout", None) is None


def test_missing_layer_is_a_layer_error_listing_what_the_kernel_offers(repo_path):
    with pytest.raises(LayerError) as err:
        LocalLayerRepository(repo_path, layer_name="RmsNorm").load()
    message = str(err.value)
    assert "'RmsNorm'" in message and "RMSNorm" in message and "Rotary" in message


def test_a_function_is_not_a_layer(repo_path):
    with pytest.raises(LayerError, match="not an nn.Module subclass"):
        LocalLayerRepository(repo_path, layer_name="not_a_layer").load()


def test_a_kernel_without_layers_has_no_layers(tmp_path):
    path = write_repo(tmp_path / "bare", kernel_files("bare", salt="bare", init="VALUE = 1\n"))
    with pytest.raises(LayerError, match="no `layers`"):
        LocalLayerRepository(path, layer_name="RMSNorm").load()


def test_missing_local_folder_is_kernel_not_found(tmp_path):
    with pytest.raises(KernelNotFound):
        LocalLayerRepository(tmp_path / "nowhere", layer_name="RMSNorm").load()


def test_locked_layer_repository_reads_the_lockfile_only_on_load(tmp_path):
    repo = LockedLayerRepository(
        "org/repo", lockfile=tmp_path / "missing.lock", layer_name="RMSNorm"
    )
    with pytest.raises(LockfileError):
        repo.load()


def test_function_repositories_are_deprecated_aliases(tmp_path):
    files = kernel_files(
        "funcs",
        salt="funcs",
        extra={"ops.py": "def double(x):\n    return 2 * x\n"},
        init="from . import layers\nfrom .ops import double\n",
    )
    path = write_repo(tmp_path / "funcs", files)
    with pytest.warns(DeprecationWarning, match="LocalLayerRepository"):
        repo = LocalFuncRepository(path, func_name="double")
    assert repo.func_name == "double"
    layer = repo.load()
    assert issubclass(layer, torch.nn.Module)
    assert layer().forward(torch.ones(2)).tolist() == [2.0, 2.0]
    with pytest.warns(DeprecationWarning):
        hub_repo = FuncRepository("org/repo", func_name="double", version=1)
    with pytest.warns(DeprecationWarning):
        assert hub_repo == FuncRepository("org/repo", func_name="double", version=1)
    assert hub_repo != LayerRepository("org/repo", layer_name="double", version=1)
    with pytest.warns(DeprecationWarning):
        LockedFuncRepository("org/repo", func_name="double")
    with pytest.warns(DeprecationWarning), pytest.raises(LayerError, match="no function"):
        LocalFuncRepository(path, func_name="triple").load()
