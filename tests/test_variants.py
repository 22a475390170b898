"""Variant grammar, acceptance rules, preference order, trace text and the GPU arch check."""

from __future__ import annotations

import os
import platform
import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernels.errors import InvalidMetadata, InvalidSpec
from kernels.variants import (
    BACKENDS,
    SystemInfo,
    Variant,
    VariantAccepted,
    VariantRejected,
    check_archs,
    detect_system,
    format_trace,
    parse_variant,
    select_variants,
)

# --- the grammar ------------------------------------------------------------------------------

# name -> (kind, framework_version, cxx11, backend, backend_version, cpu, os)
PARSED = {
    "torch28-cxx11-cu128-x86_64-linux": ("torch", (2, 8), True, "cuda", (12, 8), "x86_64", "linux"),
    "torch25-cxx98-cu124-x86_64-linux": (
        "torch",
        (2, 5),
        False,
        "cuda",
        (12, 4),
        "x86_64",
        "linux",
    ),
    "torch213-cxx11-cpu-x86_64-linux": ("torch", (2, 13), True, "cpu", None, "x86_64", "linux"),
    "torch213-cu130-x86_64-linux": ("torch", (2, 13), None, "cuda", (13, 0), "x86_64", "linux"),
    "torch210-cu128-x86_64-windows": ("torch", (2, 10), None, "cuda", (12, 8), "x86_64", "windows"),
    "torch29-metal-aarch64-darwin": ("torch", (2, 9), None, "metal", None, "aarch64", "darwin"),
    "torch212-cu126-aarch64-linux": ("torch", (2, 12), None, "cuda", (12, 6), "aarch64", "linux"),
    "torch212-cu118-x86_64-linux": ("torch", (2, 12), None, "cuda", (11, 8), "x86_64", "linux"),
    "torch24-cu100-x86_64-linux": ("torch", (2, 4), None, "cuda", (10, 0), "x86_64", "linux"),
    "torch113-cu92-x86_64-linux": ("torch", (1, 13), None, "cuda", (9, 2), "x86_64", "linux"),
    "torch213-cu1210-x86_64-linux": ("torch", (2, 13), None, "cuda", (12, 10), "x86_64", "linux"),
    "torch213-cxx11-rocm71-x86_64-linux": (
        "torch",
        (2, 13),
        True,
        "rocm",
        (7, 1),
        "x86_64",
        "linux",
    ),
    "torch213-rocm610-x86_64-linux": ("torch", (2, 13), None, "rocm", (6, 10), "x86_64", "linux"),
    "torch213-xpu20251-x86_64-linux": ("torch", (2, 13), None, "xpu", (2025, 1), "x86_64", "linux"),
    "torch213-xpu202510-x86_64-linux": (
        "torch",
        (2, 13),
        None,
        "xpu",
        (2025, 10),
        "x86_64",
        "linux",
    ),
    "torch213-cann80-aarch64-linux": ("torch", (2, 13), None, "cann", (8, 0), "aarch64", "linux"),
    "torch213-neuron-x86_64-linux": ("torch", (2, 13), None, "neuron", None, "x86_64", "linux"),
    "torch213-tpu-x86_64-linux": ("torch", (2, 13), None, "tpu", None, "x86_64", "linux"),
    "torch213-cpu-ppc64le-linux": ("torch", (2, 13), None, "cpu", None, "ppc64le", "linux"),
    "torch213-cpu-s390x-linux": ("torch", (2, 13), None, "cpu", None, "s390x", "linux"),
    "torch20-cpu-x86_64-linux": ("torch", (2, 0), None, "cpu", None, "x86_64", "linux"),
    "torch-stable-abi210-cu130-x86_64-linux": (
        "stable-abi",
        (2, 10),
        None,
        "cuda",
        (13, 0),
        "x86_64",
        "linux",
    ),
    "torch-stable-abi29-cpu-aarch64-linux": (
        "stable-abi",
        (2, 9),
        None,
        "cpu",
        None,
        "aarch64",
        "linux",
    ),
    "tvm-ffi01-cu128-x86_64-linux": ("tvm-ffi", (0, 1), None, "cuda", (12, 8), "x86_64", "linux"),
    "tvm-ffi10-rocm72-x86_64-linux": ("tvm-ffi", (1, 0), None, "rocm", (7, 2), "x86_64", "linux"),
}
NOARCH = ["cpu", "cuda", "rocm", "xpu", "metal", "npu", "neuron", "tpu"]

NOT_VARIANTS = [
    "",
    "torch",
    "torch-",
    "torch-foo",
    "torch-cann",  # noarch NPU builds are torch-npu
    "torch-universal2",
    "torch-CPU",
    "torch213",
    "torch213-cu130",
    "torch213-cu130-x86_64",
    "torch213-cu130-x86_64-linux-extra",
    "torch2-cpu-x86_64-linux",  # no minor digit
    "torch2100-cpu-x86_64-linux",  # a 3-digit minor
    "torch201-cpu-x86_64-linux",  # a leading zero: would not format back
    "torch213-cu1-x86_64-linux",
    "torch213-cu12345-x86_64-linux",
    "torch213-cu0128-x86_64-linux",
    "torch213-cu121-0-x86_64-linux",
    "torch213-cuda-x86_64-linux",  # arch builds name the CUDA version
    "torch213-rocm-x86_64-linux",
    "torch213-rocm7-x86_64-linux",
    "torch213-xpu2025-x86_64-linux",
    "torch213-xpu202-x86_64-linux",
    "torch213-cann8-aarch64-linux",
    "torch213-gpu-x86_64-linux",
    "torch213-cxx11-cxx11-cpu-x86_64-linux",
    "torch213-cxx98-cxx11-cpu-x86_64-linux",
    "torch213-cxx14-cpu-x86_64-linux",
    "tvm-ffi01-cxx11-cu128-x86_64-linux",  # only torch builds carried the ABI tag
    "torch-stable-abi210-cxx11-cu130-x86_64-linux",
    "torch-stable-abi-cu130-x86_64-linux",
    "tvm-ffi-cu128-x86_64-linux",
    "tvm01-cu128-x86_64-linux",
    "Torch213-cpu-x86_64-linux",
    "torch213-CPU-x86_64-linux",
    "torch213-cpu-x86-64-linux",
    "torch213-cpu-x86_64-linux ",
    " torch-cpu",
    "torch213-cpu-x86_64-",
    "torch213--x86_64-linux",
    "torch２１３-cpu-x86_64-linux",  # full-width digits are not ASCII digits
    "build",
    "README.md",
    "__pycache__",
]


@pytest.mark.parametrize("name", sorted(PARSED))
def test_parse_arch_variant(name):
    kind, fw, cxx11, backend, backend_version, cpu, os_name = PARSED[name]
    assert parse_variant(name) == Variant(
        name, kind, fw, cxx11, backend, backend_version, cpu, os_name
    )
    assert parse_variant(name).is_arch


@pytest.mark.parametrize("backend", NOARCH)
def test_parse_noarch_variant(backend):
    variant = parse_variant(f"torch-{backend}")
    assert variant == Variant(f"torch-{backend}", "noarch", backend=backend)
    assert not variant.is_arch


def test_parse_universal():
    variant = parse_variant("torch-universal")
    assert variant == Variant("torch-universal", "universal", backend="universal")
    assert not variant.is_arch


@pytest.mark.parametrize("name", NOT_VARIANTS)
def test_not_variant_names_parse_to_none(name):
    assert parse_variant(name) is None


@pytest.mark.parametrize("value", [None, 213, b"torch-cpu", ["torch-cpu"]])
def test_non_strings_parse_to_none(value):
    assert parse_variant(value) is None


# Fragments that, joined by '-', often form real names, so the fuzzer reaches deep branches.
_FRAGMENTS = st.sampled_from(
    [
        "torch",
        "torch213",
        "torch29",
        "torch2100",
        "torch0",
        "stable",
        "abi210",
        "abi09",
        "tvm",
        "ffi01",
        "ffi",
        "cxx11",
        "cxx98",
        "cu128",
        "cu1210",
        "cu92",
        "cu0",
        "rocm71",
        "rocm610",
        "xpu20251",
        "cann80",
        "cpu",
        "metal",
        "neuron",
        "tpu",
        "npu",
        "universal",
        "x86_64",
        "aarch64",
        "linux",
        "darwin",
        "windows",
        "",
        "7",
    ]
)


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.text(max_size=60), st.lists(_FRAGMENTS, max_size=7).map("-".join)))
def test_parse_variant_never_raises_and_round_trips(text):
    variant = parse_variant(text)
    if variant is not None:
        assert variant.name == text
        rebuilt = parse_variant(variant.name)
        assert rebuilt == variant
        # every field the name encodes is present in the parsed form
        if variant.is_arch:
            assert text.endswith(f"-{variant.cpu}-{variant.os}")
            assert variant.framework_version is not None


# --- systems used by the rule tests -----------------------------------------------------------

CPU = SystemInfo(torch=(2, 13), cxx11_abi=True, backend="cpu", cpu="x86_64", os="linux")
CUDA128 = SystemInfo(
    torch=(2, 13),
    cxx11_abi=True,
    backend="cuda",
    backend_version=(12, 8),
    cpu="x86_64",
    os="linux",
    gpu_archs=("9.0",),
)
CUDA130 = SystemInfo(
    torch=(2, 13), cxx11_abi=True, backend="cuda", backend_version=(13, 0), cpu="x86_64", os="linux"
)
CUDA_ARM = SystemInfo(
    torch=(2, 12), cxx11_abi=True, backend="cuda", backend_version=(12, 6), cpu="arm64", os="linux"
)
PRE_CXX11 = SystemInfo(
    torch=(2, 13),
    cxx11_abi=False,
    backend="cuda",
    backend_version=(12, 8),
    cpu="x86_64",
    os="linux",
)
ROCM71 = SystemInfo(
    torch=(2, 13), cxx11_abi=True, backend="rocm", backend_version=(7, 1), cpu="x86_64", os="linux"
)
XPU = SystemInfo(
    torch=(2, 13),
    cxx11_abi=True,
    backend="xpu",
    backend_version=(2025, 1),
    cpu="x86_64",
    os="linux",
)
NPU = SystemInfo(
    torch=(2, 13), cxx11_abi=True, backend="npu", backend_version=(8, 0), cpu="aarch64", os="linux"
)
NEURON = SystemInfo(torch=(2, 13), cxx11_abi=True, backend="neuron", cpu="x86_64", os="linux")
TPU = SystemInfo(torch=(2, 13), cxx11_abi=True, backend="tpu", cpu="x86_64", os="linux")
MAC26 = SystemInfo(torch=(2, 13), backend="metal", cpu="arm64", os="darwin", macos=(26, 1))
MAC15 = SystemInfo(torch=(2, 13), backend="metal", cpu="arm64", os="darwin", macos=(15, 3))
MAC_CPU = SystemInfo(torch=(2, 13), backend="cpu", cpu="arm64", os="darwin", macos=(15, 3))
WINDOWS = SystemInfo(
    torch=(2, 13), backend="cuda", backend_version=(12, 8), cpu="AMD64", os="windows"
)
FREE_THREADED = SystemInfo(
    torch=(2, 13), cxx11_abi=True, backend="cpu", cpu="x86_64", os="linux", free_threaded=True
)
NO_TORCH = SystemInfo(torch=None, backend="cpu", cpu="x86_64", os="linux")
TVM = SystemInfo(
    torch=(2, 13),
    cxx11_abi=True,
    backend="cuda",
    backend_version=(12, 8),
    cpu="x86_64",
    os="linux",
    tvm_ffi=(0, 1),
)
CUDA_UNKNOWN_VERSION = SystemInfo(torch=(2, 13), backend="cuda", cpu="x86_64", os="linux")
MAC_UNKNOWN = SystemInfo(torch=(2, 13), backend="metal", cpu="arm64", os="darwin")

OK = None  # the variant is accepted

# (system, variant, expected reason or OK). Reasons are compared exactly: they are the trace.
RULES = [
    # CPU systems accept their own arch builds, torch-cpu and torch-universal
    (CPU, "torch213-cxx11-cpu-x86_64-linux", OK),
    (CPU, "torch213-cpu-x86_64-linux", OK),
    (CPU, "torch-cpu", OK),
    (CPU, "torch-universal", OK),
    (CPU, "torch-cuda", "backend cuda does not match this backend cpu"),
    (CPU, "torch-metal", "backend metal does not match this backend cpu"),
    (CPU, "torch213-cu130-x86_64-linux", "backend CUDA 13.0 does not match this backend CPU"),
    (CPU, "torch213-metal-x86_64-linux", "backend Metal does not match this backend CPU"),
    # torch major.minor must be equal
    (CPU, "torch212-cxx11-cpu-x86_64-linux", "torch 2.12 does not match this torch 2.13"),
    (CPU, "torch214-cpu-x86_64-linux", "torch 2.14 does not match this torch 2.13"),
    (CPU, "torch23-cpu-x86_64-linux", "torch 2.3 does not match this torch 2.13"),
    (CPU, "torch313-cpu-x86_64-linux", "torch 3.13 does not match this torch 2.13"),
    # CPU arch and OS exact; a foreign platform gets only that reason
    (CPU, "torch213-cpu-aarch64-linux", "CPU aarch64 does not match this CPU x86_64"),
    (CPU, "torch213-cpu-x86_64-windows", "OS windows does not match this OS linux"),
    (
        CPU,
        "torch29-metal-aarch64-darwin",
        "OS darwin does not match this OS linux; CPU aarch64 does not match this CPU x86_64",
    ),
    (CPU, "torch213-cpu-x86_64-freebsd", "OS freebsd does not match this OS linux"),
    # cxx11 tag: equal when tagged, on Linux; tagless builds do not care
    (CPU, "torch213-cxx98-cpu-x86_64-linux", "pre-cxx11 ABI does not match this torch's cxx11 ABI"),
    (
        PRE_CXX11,
        "torch213-cxx11-cu128-x86_64-linux",
        "cxx11 ABI does not match this torch's pre-cxx11 ABI",
    ),
    (PRE_CXX11, "torch213-cxx98-cu128-x86_64-linux", OK),
    (PRE_CXX11, "torch213-cu128-x86_64-linux", OK),
    # several rules broken at once: every reason is listed
    (
        CPU,
        "torch212-cxx98-cu128-x86_64-linux",
        "torch 2.12 does not match this torch 2.13; backend CUDA 12.8 does not match this backend CPU",
    ),
    # CUDA: same major, variant minor <= system minor
    (CUDA128, "torch213-cxx11-cu128-x86_64-linux", OK),
    (CUDA128, "torch213-cu126-x86_64-linux", OK),
    (CUDA128, "torch213-cu120-x86_64-linux", OK),
    (CUDA128, "torch213-cu129-x86_64-linux", "CUDA 12.9 is newer than this CUDA 12.8"),
    (CUDA128, "torch213-cu1210-x86_64-linux", "CUDA 12.10 is newer than this CUDA 12.8"),
    (
        CUDA128,
        "torch213-cu130-x86_64-linux",
        "CUDA 13.0 does not match this CUDA 12.8 (major versions differ)",
    ),
    (
        CUDA128,
        "torch213-cu118-x86_64-linux",
        "CUDA 11.8 does not match this CUDA 12.8 (major versions differ)",
    ),
    (CUDA130, "torch213-cu130-x86_64-linux", OK),
    (CUDA130, "torch213-cu132-x86_64-linux", "CUDA 13.2 is newer than this CUDA 13.0"),
    (CUDA128, "torch213-cpu-x86_64-linux", "backend CPU does not match this backend CUDA 12.8"),
    (
        CUDA128,
        "torch213-rocm71-x86_64-linux",
        "backend ROCm 7.1 does not match this backend CUDA 12.8",
    ),
    (CUDA128, "torch-cuda", OK),
    (CUDA128, "torch-universal", OK),
    (CUDA128, "torch-cpu", "backend cpu does not match this backend cuda"),
    (CUDA128, "torch-rocm", "backend rocm does not match this backend cuda"),
    (
        CUDA_UNKNOWN_VERSION,
        "torch213-cu128-x86_64-linux",
        "CUDA 12.8 needs a known CUDA version; this one is unknown",
    ),
    # cpu names are normalised: arm64 is aarch64
    (CUDA_ARM, "torch212-cu126-aarch64-linux", OK),
    (CUDA_ARM, "torch212-cxx11-cu124-aarch64-linux", OK),
    (CUDA_ARM, "torch212-cu126-x86_64-linux", "CPU x86_64 does not match this CPU aarch64"),
    # ROCm, XPU and CANN versions must be equal
    (ROCM71, "torch213-rocm71-x86_64-linux", OK),
    (ROCM71, "torch213-cxx11-rocm71-x86_64-linux", OK),
    (ROCM71, "torch213-rocm72-x86_64-linux", "ROCm 7.2 does not match this ROCm 7.1"),
    (ROCM71, "torch213-rocm70-x86_64-linux", "ROCm 7.0 does not match this ROCm 7.1"),
    (ROCM71, "torch-rocm", OK),
    (ROCM71, "torch-cuda", "backend cuda does not match this backend rocm"),
    (
        ROCM71,
        "torch213-cu128-x86_64-linux",
        "backend CUDA 12.8 does not match this backend ROCm 7.1",
    ),
    (XPU, "torch213-xpu20251-x86_64-linux", OK),
    (XPU, "torch213-xpu20252-x86_64-linux", "XPU 2025.2 does not match this XPU 2025.1"),
    (XPU, "torch213-xpu20250-x86_64-linux", "XPU 2025.0 does not match this XPU 2025.1"),
    (XPU, "torch-xpu", OK),
    (NPU, "torch213-cann80-aarch64-linux", OK),
    (NPU, "torch213-cann81-aarch64-linux", "CANN 8.1 does not match this CANN 8.0"),
    (NPU, "torch-npu", OK),
    (NPU, "torch-universal", OK),
    (NPU, "torch-cuda", "backend cuda does not match this backend npu"),
    (NEURON, "torch213-neuron-x86_64-linux", OK),
    (NEURON, "torch-neuron", OK),
    (NEURON, "torch213-cpu-x86_64-linux", "backend CPU does not match this backend Neuron"),
    (TPU, "torch213-tpu-x86_64-linux", OK),
    (TPU, "torch-tpu", OK),
    (TPU, "torch213-neuron-x86_64-linux", "backend Neuron does not match this backend TPU"),
    # Metal arch builds need macOS 26; noarch Metal builds do not
    (MAC26, "torch213-metal-aarch64-darwin", OK),
    (
        MAC15,
        "torch213-metal-aarch64-darwin",
        "Metal builds need macOS 26 or newer, this is macOS 15.3",
    ),
    (
        MAC_UNKNOWN,
        "torch213-metal-aarch64-darwin",
        "Metal builds need macOS 26 or newer; the macOS version is unknown",
    ),
    (MAC15, "torch-metal", OK),
    (MAC26, "torch213-metal-x86_64-darwin", "CPU x86_64 does not match this CPU aarch64"),
    (MAC26, "torch212-metal-aarch64-darwin", "torch 2.12 does not match this torch 2.13"),
    (MAC26, "torch213-cxx11-metal-aarch64-darwin", OK),  # the ABI tag is a Linux matter
    (MAC_CPU, "torch213-cpu-aarch64-darwin", OK),
    (MAC_CPU, "torch-cpu", OK),
    # Windows: AMD64 is x86_64
    (WINDOWS, "torch213-cu128-x86_64-windows", OK),
    (WINDOWS, "torch213-cu128-x86_64-linux", "OS linux does not match this OS windows"),
    # free-threaded Python rejects every arch build, not noarch ones
    (
        FREE_THREADED,
        "torch213-cpu-x86_64-linux",
        "free-threaded Python cannot load native builds (a noarch build can)",
    ),
    (
        FREE_THREADED,
        "torch-stable-abi210-cpu-x86_64-linux",
        "free-threaded Python cannot load native builds (a noarch build can)",
    ),
    (FREE_THREADED, "torch-cpu", OK),
    (FREE_THREADED, "torch-universal", OK),
    # stable ABI: ABI version <= torch version
    (CPU, "torch-stable-abi210-cpu-x86_64-linux", OK),
    (CPU, "torch-stable-abi213-cpu-x86_64-linux", OK),
    (CPU, "torch-stable-abi214-cpu-x86_64-linux", "stable ABI 2.14 is newer than this torch 2.13"),
    (CPU, "torch-stable-abi30-cpu-x86_64-linux", "stable ABI 3.0 is newer than this torch 2.13"),
    (CUDA128, "torch-stable-abi210-cu126-x86_64-linux", OK),
    (
        CUDA128,
        "torch-stable-abi210-cu130-x86_64-linux",
        "CUDA 13.0 does not match this CUDA 12.8 (major versions differ)",
    ),
    # tvm-ffi: version equal to the installed tvm-ffi
    (TVM, "tvm-ffi01-cu128-x86_64-linux", OK),
    (TVM, "tvm-ffi01-cu126-x86_64-linux", OK),
    (TVM, "tvm-ffi02-cu128-x86_64-linux", "tvm-ffi 0.2 does not match this tvm-ffi 0.1"),
    (CUDA128, "tvm-ffi01-cu128-x86_64-linux", "needs tvm-ffi 0.1, which is not installed"),
    # no torch: torch arch builds are rejected, noarch ones are not
    (NO_TORCH, "torch213-cpu-x86_64-linux", "needs torch 2.13, which is not installed"),
    (NO_TORCH, "torch-stable-abi210-cpu-x86_64-linux", "needs torch 2.10, which is not installed"),
    (NO_TORCH, "torch-cpu", OK),
    (NO_TORCH, "torch-universal", OK),
    # names that are not variants are rejected, never dropped
    (CPU, "README.md", "not a variant name"),
    (CPU, "torch213-cuda-x86_64-linux", "not a variant name"),
]


def _rule_id(case):
    system, name, _ = case
    return f"{system.backend}-{system.os}-{name}"


@pytest.mark.parametrize("system,name,reason", RULES, ids=[_rule_id(c) for c in RULES])
def test_acceptance_rule(system, name, reason):
    (entry,) = select_variants([name], system)
    if reason is OK:
        assert entry == VariantAccepted(name, preferred=True)
    else:
        assert entry == VariantRejected(name, reason)


def test_no_torch_system_rejects_every_torch_arch_name():
    names = [n for n in PARSED if PARSED[n][0] == "torch"]
    assert all(isinstance(e, VariantRejected) for e in select_variants(names, NO_TORCH))


# --- preference order -------------------------------------------------------------------------

CUDA_REPO = [
    "torch-universal",
    "torch-cuda",
    "torch-cpu",
    "tvm-ffi01-cu126-x86_64-linux",
    "tvm-ffi01-cu128-x86_64-linux",
    "torch213-cxx11-cu126-x86_64-linux",
    "torch213-cxx11-cu128-x86_64-linux",
    "torch213-cu126-x86_64-linux",
    "torch213-cu128-x86_64-linux",
    "torch213-cu129-x86_64-linux",
    "torch213-cu130-x86_64-linux",
    "torch212-cu128-x86_64-linux",
    "torch-stable-abi210-cu128-x86_64-linux",
    "torch-stable-abi212-cu126-x86_64-linux",
    "torch-stable-abi212-cu128-x86_64-linux",
    "torch-stable-abi214-cu128-x86_64-linux",
    "torch213-cu128-aarch64-linux",
    "notes.txt",
]
CUDA_ORDER = [
    "torch-stable-abi212-cu128-x86_64-linux",  # newest stable ABI first, then newest CUDA
    "torch-stable-abi212-cu126-x86_64-linux",
    "torch-stable-abi210-cu128-x86_64-linux",
    "torch213-cu128-x86_64-linux",  # torch arch builds: tagless before cxx11
    "torch213-cu126-x86_64-linux",
    "torch213-cxx11-cu128-x86_64-linux",
    "torch213-cxx11-cu126-x86_64-linux",
    "tvm-ffi01-cu128-x86_64-linux",
    "tvm-ffi01-cu126-x86_64-linux",
    "torch-cuda",  # noarch for this backend
    "torch-universal",  # universal last
]


def test_preference_order_on_cuda():
    trace = select_variants(CUDA_REPO, TVM)
    accepted = [e.variant for e in trace if isinstance(e, VariantAccepted)]
    assert accepted == CUDA_ORDER
    assert [e.preferred for e in trace if isinstance(e, VariantAccepted)] == [True] + [False] * (
        len(CUDA_ORDER) - 1
    )
    rejected = [e.variant for e in trace if isinstance(e, VariantRejected)]
    assert rejected == sorted(set(CUDA_REPO) - set(CUDA_ORDER))
    # accepted entries come first, then the rejected ones
    assert trace[: len(CUDA_ORDER)] == [
        VariantAccepted(n, preferred=(i == 0)) for i, n in enumerate(CUDA_ORDER)
    ]


@settings(max_examples=50, deadline=None)
@given(st.randoms(use_true_random=False))
def test_order_does_not_depend_on_listing_order(rng):
    names = list(CUDA_REPO)
    rng.shuffle(names)
    assert select_variants(names, TVM) == select_variants(CUDA_REPO, TVM)


@pytest.mark.parametrize(
    "system,names,best",
    [
        (CPU, ["torch-universal", "torch-cpu"], "torch-cpu"),
        (
            CPU,
            ["torch-universal", "torch213-cxx11-cpu-x86_64-linux", "torch-cpu"],
            "torch213-cxx11-cpu-x86_64-linux",
        ),
        (
            CPU,
            ["torch213-cxx11-cpu-x86_64-linux", "torch213-cpu-x86_64-linux"],
            "torch213-cpu-x86_64-linux",
        ),
        (
            CPU,
            ["torch213-cpu-x86_64-linux", "torch-stable-abi29-cpu-x86_64-linux"],
            "torch-stable-abi29-cpu-x86_64-linux",
        ),
        (CPU, ["tvm-ffi01-cpu-x86_64-linux", "torch-universal"], "torch-universal"),
        (
            CUDA128,
            [
                "torch213-cu120-x86_64-linux",
                "torch213-cu128-x86_64-linux",
                "torch213-cu124-x86_64-linux",
            ],
            "torch213-cu128-x86_64-linux",
        ),
        (
            CUDA128,
            ["torch213-cu129-x86_64-linux", "torch213-cu126-x86_64-linux"],
            "torch213-cu126-x86_64-linux",
        ),
        (TVM, ["tvm-ffi01-cu128-x86_64-linux", "torch-cuda"], "tvm-ffi01-cu128-x86_64-linux"),
        (
            TVM,
            ["tvm-ffi01-cu128-x86_64-linux", "torch213-cu120-x86_64-linux"],
            "torch213-cu120-x86_64-linux",
        ),
        (MAC26, ["torch-metal", "torch213-metal-aarch64-darwin"], "torch213-metal-aarch64-darwin"),
        (MAC15, ["torch-metal", "torch213-metal-aarch64-darwin"], "torch-metal"),
        (
            NPU,
            ["torch-universal", "torch-npu", "torch213-cann80-aarch64-linux"],
            "torch213-cann80-aarch64-linux",
        ),
        (FREE_THREADED, ["torch213-cpu-x86_64-linux", "torch-cpu"], "torch-cpu"),
    ],
)
def test_best_variant(system, names, best):
    trace = select_variants(names, system)
    assert trace[0] == VariantAccepted(best, preferred=True)


def test_duplicates_are_judged_once():
    trace = select_variants(["torch-cpu", "torch-cpu", "bogus", "bogus"], CPU)
    assert trace == [
        VariantAccepted("torch-cpu", preferred=True),
        VariantRejected("bogus", "not a variant name"),
    ]


def test_empty_listing():
    assert select_variants([], CPU) == []


# --- trace text -------------------------------------------------------------------------------


def test_trace_text():
    names = [
        "torch212-cxx11-cpu-x86_64-linux",
        "torch-universal",
        "torch213-cu130-x86_64-linux",
        "torch213-cxx11-cpu-x86_64-linux",
        "torch-cpu",
    ]
    assert format_trace(select_variants(names, CPU)) == "\n".join(
        [
            "torch213-cxx11-cpu-x86_64-linux: compatible, preferred",
            "torch-cpu: compatible",
            "torch-universal: compatible",
            "torch212-cxx11-cpu-x86_64-linux: torch 2.12 does not match this torch 2.13",
            "torch213-cu130-x86_64-linux: backend CUDA 13.0 does not match this backend CPU",
        ]
    )


def test_trace_entries_are_the_public_names():
    import kernels

    assert kernels.VariantAccepted is VariantAccepted
    assert kernels.VariantRejected is VariantRejected
    assert str(VariantAccepted("torch-cpu")) == "torch-cpu: compatible"
    assert VariantRejected("x", "why").reason == "why"
    with pytest.raises(AttributeError):
        VariantAccepted("torch-cpu").variant = "other"  # frozen


# --- SystemInfo -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "given_cpu,normal",
    [
        ("arm64", "aarch64"),
        ("AMD64", "x86_64"),
        ("x86_64", "x86_64"),
        ("aarch64", "aarch64"),
        ("i686", "x86"),
    ],
)
def test_system_cpu_is_normalised(given_cpu, normal):
    assert SystemInfo(torch=(2, 13), backend="cpu", cpu=given_cpu, os="Linux").cpu == normal


def test_system_rejects_unknown_backend():
    with pytest.raises(InvalidSpec, match="unknown backend 'cann'") as info:
        SystemInfo(torch=(2, 13), backend="cann", cpu="x86_64", os="linux")
    assert "cuda, rocm, xpu, metal, npu, neuron, tpu, cpu" in str(info.value)


@pytest.mark.parametrize(
    "system,line",
    [
        (CPU, "torch 2.13 (cxx11 ABI), CPU, x86_64-linux"),
        (CUDA128, "torch 2.13 (cxx11 ABI), CUDA 12.8, GPU [9.0], x86_64-linux"),
        (
            SystemInfo(
                torch=(2, 13),
                cxx11_abi=False,
                backend="rocm",
                backend_version=(7, 1),
                cpu="x86_64",
                os="linux",
                gpu_archs=("gfx942", "gfx90a"),
            ),
            "torch 2.13 (pre-cxx11 ABI), ROCm 7.1, GPUs [gfx942, gfx90a], x86_64-linux",
        ),
        (MAC26, "torch 2.13, Metal, aarch64-darwin, macOS 26.1"),
        (NO_TORCH, "no torch, CPU, x86_64-linux"),
        (FREE_THREADED, "torch 2.13 (cxx11 ABI), CPU, x86_64-linux, free-threaded Python"),
        (TVM, "torch 2.13 (cxx11 ABI), CUDA 12.8, tvm-ffi 0.1, x86_64-linux"),
        (NPU, "torch 2.13 (cxx11 ABI), CANN 8.0, aarch64-linux"),
    ],
)
def test_describe(system, line):
    assert system.describe() == line


# --- detect_system and backend= ---------------------------------------------------------------


def test_detect_system_matches_this_machine():
    torch = pytest.importorskip("torch")
    system = detect_system()
    assert system.torch == tuple(int(p) for p in torch.__version__.split(".")[:2])
    assert system.os == platform.system().lower()
    assert system.cpu in (platform.machine().lower(), "x86_64", "aarch64")
    assert system.backend in BACKENDS
    if system.os == "linux":
        assert system.cxx11_abi == torch.compiled_with_cxx11_abi()
    if torch.version.cuda:
        assert system.backend == "cuda"
        assert system.backend_version == tuple(int(p) for p in torch.version.cuda.split(".")[:2])
        if torch.cuda.is_available():
            assert len(system.gpu_archs) == torch.cuda.device_count()
    elif not torch.version.hip and not torch.backends.mps.is_available():
        assert system.gpu_archs == ()
    assert system.free_threaded == (not getattr(sys, "_is_gil_enabled", lambda: True)())
    # the detected system accepts a build named for itself
    assert select_variants(["torch-universal"], system)[0] == VariantAccepted(
        "torch-universal", True
    )


def test_detect_system_backend_override():
    detected = detect_system()
    cpu = detect_system("cpu")
    assert cpu.backend == "cpu" and cpu.backend_version is None and cpu.gpu_archs == ()
    assert cpu.torch == detected.torch
    assert detect_system(detected.backend) == detected
    assert select_variants(["torch-cpu"], cpu)[0] == VariantAccepted("torch-cpu", True)


def test_detect_system_refuses_a_backend_this_machine_lacks():
    detected = detect_system()
    missing = next(b for b in BACKENDS if b not in ("cpu", detected.backend))
    supported = ", ".join(sorted({"cpu", detected.backend}))
    with pytest.raises(InvalidSpec) as info:
        detect_system(missing)
    assert str(info.value).splitlines() == [
        f"Invalid backend '{missing}', system supported backends: {supported}",
        f"hint: pass backend=None to use the detected backend, or one of: {supported}",
    ]


def test_modules_do_not_import_torch():
    code = (
        "import sys, kernels.variants, kernels.native_abi\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert 'huggingface_hub' not in sys.modules\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# --- GPU architecture check -------------------------------------------------------------------


def _cuda(*capabilities: str) -> SystemInfo:
    return SystemInfo(
        torch=(2, 13),
        backend="cuda",
        backend_version=(12, 8),
        cpu="x86_64",
        os="linux",
        gpu_archs=capabilities,
    )


def _rocm(*archs: str) -> SystemInfo:
    return SystemInfo(
        torch=(2, 13),
        backend="rocm",
        backend_version=(7, 1),
        cpu="x86_64",
        os="linux",
        gpu_archs=archs,
    )


# (declared archs, device capability, runs?)
CUDA_ARCH_CASES = [
    (["8.0"], "8.0", True),
    (["8.0"], "8.6", True),  # cubins run on newer minors of the same major
    (["8.6"], "8.0", False),
    (["8.0"], "7.5", False),
    (["8.0"], "9.0", False),
    (["8.0", "9.0"], "9.0", True),
    (["7.5", "8.0", "8.6", "8.9", "9.0"], "8.9", True),
    (["9.0a"], "9.0", True),
    (["9.0a"], "9.1", False),  # arch-specific: exact
    (["8.0", "9.0a"], "10.0", False),  # issue 707: FA3 on a B200
    (["10.0f"], "10.0", True),
    (["10.0f"], "10.3", True),  # family: same major
    (["10.3f"], "10.0", False),
    (["10.0f"], "12.0", False),
    (["9.0+PTX"], "9.0", True),
    (["9.0+PTX"], "10.0", True),  # PTX: forward compatible
    (["9.0+PTX"], "12.1", True),
    (["9.0+PTX"], "8.6", False),
    (["9.0+ptx"], "10.0", True),
    (["9.0a+PTX"], "9.0", True),
    (["9.0a+PTX"], "10.0", False),  # the suffix keeps its meaning
    (["10.0f+PTX"], "10.3", True),
    (["10.0f+PTX"], "12.0", False),
    (["garbage", "8.0"], "9.0", False),  # unknown formats do not count as a match
    (["garbage"], "9.0", True),  # nothing known: nothing to check
    (["sm_90"], "8.0", True),
    (["12.0"], "12.0", True),
    (["12.0"], "12.1", True),
]


@pytest.mark.parametrize("archs,capability,runs", CUDA_ARCH_CASES)
def test_check_archs_cuda(archs, capability, runs):
    reason = check_archs({"type": "cuda", "archs": archs}, _cuda(capability))
    if runs:
        assert reason is None
    else:
        assert reason == (
            f"the build supports CUDA archs {', '.join(archs)}, "
            f"but GPU 0 has capability {capability}"
        )


def test_check_archs_every_device():
    meta = {"type": "cuda", "archs": ["8.0", "9.0a"]}
    assert check_archs(meta, _cuda("9.0", "8.6", "9.0")) is None
    assert check_archs(meta, _cuda("9.0", "10.0", "12.0")) == (
        "the build supports CUDA archs 8.0, 9.0a, "
        "but GPU 1 has capability 10.0, GPU 2 has capability 12.0"
    )


@pytest.mark.parametrize(
    "archs,devices,reason",
    [
        (["gfx90a", "gfx942"], ("gfx90a",), None),
        (["gfx90a", "gfx942"], ("gfx90a:sramecc+:xnack-",), None),
        (["gfx90a", "gfx942"], ("gfx942", "gfx90a"), None),
        (["gfx942"], ("gfx90a",), "the build supports ROCm archs gfx942, but GPU 0 is gfx90a"),
        (
            ["gfx942"],
            ("gfx942", "gfx1100"),
            "the build supports ROCm archs gfx942, but GPU 1 is gfx1100",
        ),
        (["gfx94"], ("gfx942",), "the build supports ROCm archs gfx94, but GPU 0 is gfx942"),
    ],
)
def test_check_archs_rocm(archs, devices, reason):
    assert check_archs({"type": "rocm", "archs": archs}, _rocm(*devices)) == reason


@pytest.mark.parametrize(
    "meta,system",
    [
        ({"type": "cuda"}, _cuda("9.0")),  # no archs declared (e.g. a Triton build)
        ({"type": "cuda", "archs": []}, _cuda("9.0")),
        ({"type": "cuda", "archs": None}, _cuda("9.0")),
        ({"type": "cuda", "archs": ["8.0"]}, _cuda()),  # no visible GPU
        ({"type": "cuda", "archs": ["8.0"]}, CPU),  # backend="cpu" chosen
        ({"type": "rocm", "archs": ["gfx942"]}, _cuda("9.0")),  # not this backend
        ({"type": "metal", "archs": ["applegpu_g13"]}, MAC26),
        ({"type": "universal"}, _cuda("9.0")),
        ({"type": "cpu", "archs": ["x86_64"]}, CPU),
    ],
)
def test_check_archs_nothing_to_check(meta, system):
    assert check_archs(meta, system) is None


@pytest.mark.parametrize(
    "meta", [["cuda"], "cuda", {"type": "cuda", "archs": "8.0"}, {"type": "cuda", "archs": [8.0]}]
)
def test_check_archs_rejects_malformed_metadata(meta):
    with pytest.raises(InvalidMetadata):
        check_archs(meta, _cuda("9.0"))


def test_check_archs_on_this_machine():
    torch = pytest.importorskip("torch")
    system = detect_system()
    if system.backend != "cuda" or not torch.cuda.is_available():
        # Without a CUDA GPU there is nothing to compare: the check must pass any build.
        assert check_archs({"type": "cuda", "archs": ["1.0"]}, system) is None
        return
    major, minor = torch.cuda.get_device_capability(0)
    assert check_archs({"type": "cuda", "archs": [f"{major}.{minor}"]}, system) is None
    assert check_archs({"type": "cuda", "archs": [f"{major + 1}.0"]}, system) is not None


def test_random_systems_never_crash_select():
    # every parsed name against every system above: a trace entry per name, no exception
    systems = [CPU, CUDA128, CUDA130, CUDA_ARM, PRE_CXX11, ROCM71, XPU, NPU, NEURON, TPU, MAC26]
    systems += [MAC15, MAC_CPU, WINDOWS, FREE_THREADED, NO_TORCH, TVM, CUDA_UNKNOWN_VERSION]
    names = list(PARSED) + [f"torch-{b}" for b in NOARCH] + ["torch-universal"] + NOT_VARIANTS
    random.Random(0).shuffle(names)
    for system in systems:
        trace = select_variants(names, system)
        assert sorted(e.variant for e in trace) == sorted(set(names))
        assert sum(e.preferred for e in trace if isinstance(e, VariantAccepted)) <= 1
