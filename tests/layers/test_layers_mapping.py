"""The kernel mapping: registration, scopes, copy-on-write, capability and mode selection."""

from __future__ import annotations

import contextvars
import threading

import pytest
from kernels import InvalidSpec
from kernels.layers import (
    CUDAProperties,
    Device,
    KernelizeFallback,
    LayerRepository,
    Mode,
    ROCMProperties,
    register_kernel_mapping,
    use_kernel_mapping,
)
from kernels.layers.mapping import current_scopes, lookup

TC = Mode.TORCH_COMPILE


def repo(name: str) -> LayerRepository:
    return LayerRepository(f"org/{name}", layer_name="L", version=1)


A, B, C, D = repo("a"), repo("b"), repo("c"), repo("d")


def chosen(layer="RMSNorm", device="cuda", capability=None, mode=Mode.INFERENCE):
    found = lookup(layer, device, capability, mode)
    return [c.repo for c in found.candidates], found


def test_a_bare_repository_serves_every_mode():
    register_kernel_mapping({"RMSNorm": {"cuda": A}})
    for mode in (Mode.INFERENCE, Mode.TRAINING, Mode.INFERENCE | TC, Mode.TRAINING | TC):
        repos, found = chosen(mode=mode)
        assert repos == [A]
        assert found.candidates[0].registered == Mode.FALLBACK


def test_registration_is_copy_on_write():
    register_kernel_mapping({"RMSNorm": {"cuda": A}})
    before = current_scopes()
    snapshot = {name: dict(devices) for name, devices in before[-1].layers.items()}
    register_kernel_mapping({"RMSNorm": {"cuda": B}, "SiLU": {"cpu": C}})
    assert current_scopes() is not before
    # What was published before is untouched: readers holding it see a stable mapping.
    assert {name: dict(devices) for name, devices in before[-1].layers.items()} == snapshot
    assert "SiLU" not in before[-1].layers
    with pytest.raises(TypeError):
        before[-1].layers["x"] = {}  # type: ignore[index]


def test_same_layer_device_and_range_is_replaced_other_devices_stay():
    register_kernel_mapping({"RMSNorm": {"cuda": A, "cpu": C}})
    register_kernel_mapping({"RMSNorm": {"cuda": {Mode.INFERENCE: B}}})
    assert chosen()[0] == [B]
    assert chosen(mode=Mode.TRAINING)[1].miss == KernelizeFallback.NO_COMPATIBLE_MODE
    assert chosen(device="cpu")[0] == [C]


def test_inherit_mapping_false_replaces_the_mapping():
    register_kernel_mapping({"RMSNorm": {"cuda": A}})
    register_kernel_mapping({"SiLU": {"cuda": B}}, inherit_mapping=False)
    assert chosen()[1].miss == KernelizeFallback.NO_LAYER
    assert chosen("SiLU")[0] == [B]


def test_use_kernel_mapping_overlays_and_restores_even_on_error():
    register_kernel_mapping({"RMSNorm": {"cuda": A}, "SiLU": {"cuda": C}})
    with use_kernel_mapping({"RMSNorm": {"cuda": B}}):
        assert chosen()[0] == [B]
        assert chosen("SiLU")[0] == [C]  # inherited
        with use_kernel_mapping({"RMSNorm": {"cuda": D}}, inherit_mapping=False):
            assert chosen()[0] == [D]
            assert chosen("SiLU")[1].miss == KernelizeFallback.NO_LAYER
        assert chosen()[0] == [B]
        register_kernel_mapping({"GeLU": {"cuda": D}})  # lands in the overlay
        assert chosen("GeLU")[0] == [D]
    assert chosen()[0] == [A]
    assert chosen("GeLU")[1].miss == KernelizeFallback.NO_LAYER
    with pytest.raises(RuntimeError), use_kernel_mapping({"RMSNorm": {"cuda": B}}):
        raise RuntimeError("boom")
    assert chosen()[0] == [A]


def test_a_bad_overlay_is_rejected_before_entering():
    before = current_scopes()
    with pytest.raises(InvalidSpec):
        use_kernel_mapping({"RMSNorm": {"gpu": A}})
    assert current_scopes() is before


def test_innermost_scope_wins_for_its_layer_and_device_even_against_a_tighter_range():
    register_kernel_mapping({"RMSNorm": {Device("cuda", CUDAProperties(90, 90)): A}})
    with use_kernel_mapping({"RMSNorm": {"cuda": B}}):
        assert chosen(capability=90)[0] == [B]
    assert chosen(capability=90)[0] == [A]


def test_an_overlay_without_a_fitting_range_defers_to_outer_scopes():
    register_kernel_mapping({"RMSNorm": {"cuda": A}})
    with use_kernel_mapping({"RMSNorm": {Device("cuda", CUDAProperties(100, 120)): B}}):
        assert chosen(capability=90)[0] == [A]
        assert chosen(capability=100)[0] == [B]


def test_smallest_containing_capability_range_wins():
    register_kernel_mapping(
        {
            "RMSNorm": {
                "cuda": A,
                Device("cuda", CUDAProperties(80, 100)): B,
                Device("cuda", CUDAProperties(89, 90)): C,
            }
        }
    )
    assert chosen(capability=75)[0] == [A]
    assert chosen(capability=86)[0] == [B]
    assert chosen(capability=89)[0] == [C]
    assert chosen(capability=90)[0] == [C]
    assert chosen(capability=100)[0] == [B]
    assert chosen(capability=120)[0] == [A]
    # Bounds are inclusive; equal-width ranges: the later registration wins.
    register_kernel_mapping({"RMSNorm": {Device("cuda", CUDAProperties(90, 91)): D}})
    assert chosen(capability=90)[0] == [D]
    assert chosen(capability=89)[0] == [C]


def test_no_fitting_capability_and_unknown_capability():
    register_kernel_mapping({"RMSNorm": {Device("cuda", CUDAProperties(90, 90)): A}})
    repos, found = chosen(capability=80)
    assert repos == [] and found.miss == KernelizeFallback.NO_COMPATIBLE_PROPERTIES
    assert "80" in found.reason
    # Unknown capability (no usable GPU): only unconstrained entries fit.
    assert chosen(capability=None)[1].miss == KernelizeFallback.NO_COMPATIBLE_PROPERTIES
    register_kernel_mapping({"RMSNorm": {"cuda": B}})
    assert chosen(capability=None)[0] == [B]


def test_rocm_entries_are_their_own_device():
    register_kernel_mapping({"RMSNorm": {Device("rocm", ROCMProperties(115, 115)): A, "cuda": B}})
    assert chosen(device="rocm", capability=115)[0] == [A]
    assert (
        chosen(device="rocm", capability=94)[1].miss == KernelizeFallback.NO_COMPATIBLE_PROPERTIES
    )
    assert chosen(device="cpu")[1].miss == KernelizeFallback.NO_DEVICE


ALL_MODES = {
    Mode.INFERENCE: A,
    Mode.INFERENCE | TC: B,
    Mode.TRAINING: C,
    Mode.TRAINING | TC: D,
}


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (Mode.INFERENCE, [A, B, C, D]),
        (Mode.INFERENCE | TC, [B, D]),
        (Mode.TRAINING, [C, D]),
        (Mode.TRAINING | TC, [D]),
    ],
)
def test_mode_priority_in_the_registered_mapping(mode, expected):
    register_kernel_mapping({"RMSNorm": {"cuda": ALL_MODES}})
    assert chosen(mode=mode)[0] == expected


def test_fallback_entry_comes_last():
    register_kernel_mapping({"RMSNorm": {"cuda": {Mode.FALLBACK: A, Mode.TRAINING: B}}})
    assert chosen(mode=Mode.TRAINING)[0] == [B, A]
    assert chosen(mode=Mode.INFERENCE)[0] == [B, A]


def test_registered_inference_entry_does_not_serve_training():
    # The registered table is taken literally (transformers marks some kernels inference-only).
    register_kernel_mapping({"RMSNorm": {"cuda": {Mode.INFERENCE: A}}})
    repos, found = chosen(mode=Mode.TRAINING)
    assert repos == [] and found.miss == KernelizeFallback.NO_COMPATIBLE_MODE
    assert "INFERENCE" in found.reason


def test_overlay_inference_entry_is_offered_for_training_before_fallback():
    register_kernel_mapping({"RMSNorm": {"cuda": {Mode.TRAINING: D}}})  # the built-in table
    with use_kernel_mapping({"RMSNorm": {"cuda": {Mode.INFERENCE: A, Mode.FALLBACK: B}}}):
        repos, found = chosen(mode=Mode.TRAINING)
        assert repos == [A, B]  # the user's overlay wins over the table's TRAINING entry
        assert [c.promoted for c in found.candidates] == [True, False]
        assert chosen(mode=Mode.TRAINING | TC)[0] == [B]
    with use_kernel_mapping({"RMSNorm": {"cuda": {Mode.INFERENCE | TC: C}}}):
        assert chosen(mode=Mode.TRAINING | TC)[0] == [C]


@pytest.mark.parametrize(
    "mapping",
    [
        ["RMSNorm"],
        {"": {"cuda": A}},
        {1: {"cuda": A}},
        {"RMSNorm": A},
        {"RMSNorm": {"gpu": A}},
        {"RMSNorm": {3: A}},
        {"RMSNorm": {"cuda": "org/a:L"}},
        {"RMSNorm": {"cuda": {}}},
        {"RMSNorm": {"cuda": {"inference": A}}},
        {"RMSNorm": {"cuda": {Mode.TORCH_COMPILE: A}}},
        {"RMSNorm": {"cuda": {Mode.INFERENCE: object()}}},
    ],
)
def test_malformed_mappings_raise_invalid_spec(mapping):
    before = current_scopes()
    with pytest.raises(InvalidSpec) as err:
        register_kernel_mapping(mapping)
    assert "hint:" in str(err.value)
    assert current_scopes() is before


def test_the_transformers_builtin_shape_is_accepted():
    mapping = {
        "Qwen3_5GatedDeltaNet": {
            Device("cuda", CUDAProperties(min_capability=121, max_capability=121)): A,
            Device("rocm", ROCMProperties(min_capability=115, max_capability=115)): B,
        },
        "SiLU": {"cuda": {Mode.INFERENCE | TC: C}, "xpu": {Mode.INFERENCE | TC: C}},
    }
    register_kernel_mapping(mapping)
    register_kernel_mapping(mapping)  # transformers registers it again on every train()/eval()
    assert chosen("Qwen3_5GatedDeltaNet", capability=121)[0] == [A]
    assert chosen("Qwen3_5GatedDeltaNet", "rocm", 115)[0] == [B]
    assert chosen("SiLU", "xpu")[0] == [C]


def test_mappings_are_per_context_not_global():
    register_kernel_mapping({"RMSNorm": {"cuda": A}})
    seen = {}

    def in_thread():
        seen["fresh"] = chosen()[1].miss
        register_kernel_mapping({"RMSNorm": {"cuda": B}})
        seen["own"] = chosen()[0]

    worker = threading.Thread(target=in_thread)
    worker.start()
    worker.join()
    # A new thread starts with an empty mapping and its registrations stay in it.
    assert seen == {"fresh": KernelizeFallback.NO_LAYER, "own": [B]}
    assert chosen()[0] == [A]
    # A copied context sees the mapping and keeps its own changes to itself.
    context = contextvars.copy_context()
    assert context.run(lambda: chosen()[0]) == [A]
    context.run(register_kernel_mapping, {"RMSNorm": {"cuda": C}})
    assert context.run(lambda: chosen()[0]) == [C]
    assert chosen()[0] == [A]
