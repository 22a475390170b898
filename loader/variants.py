"""Stage "select": which build variant of a kernel fits this machine, and why the others do not.

A kernel repo ships one folder per build under `build/`, named by the Hub's variant grammar
(docs/variants.md). `parse_variant` reads a name, `detect_system` describes this machine,
`select_variants` returns every name as accepted (best first) or rejected with a reason, and
`check_archs` compares a chosen build's declared GPU architectures with the visible GPUs.

Everything here is pure except `detect_system`, which imports torch when it is called.
"""

from __future__ import annotations

import platform
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .errors import InvalidMetadata, InvalidSpec
from .native_abi import normalize_machine

__all__ = [
    "BACKENDS",
    "SystemInfo",
    "Variant",
    "VariantAccepted",
    "VariantRejected",
    "VariantName",
    "check_archs",
    "detect_system",
    "format_trace",
    "parse_variant",
    "select_variants",
]

# Backend kinds a system can have. NPU systems run CANN builds.
BACKENDS = ("cuda", "rocm", "xpu", "metal", "npu", "neuron", "tpu", "cpu")
# Names after `torch-` in a noarch variant; "universal" is the legacy any-backend build.
_NOARCH = ("cpu", "cuda", "rocm", "xpu", "metal", "npu", "neuron", "tpu", "universal")
# Arch backends without a version, and the versioned ones with their tag prefixes.
_PLAIN_BACKENDS = ("cpu", "metal", "neuron", "tpu")
_TAG_PREFIX = {"cuda": "cu", "rocm": "rocm", "xpu": "xpu", "cann": "cann"}
_LABEL = {
    "cuda": "CUDA",
    "rocm": "ROCm",
    "xpu": "XPU",
    "cann": "CANN",
    "npu": "CANN",
    "cpu": "CPU",
    "metal": "Metal",
    "neuron": "Neuron",
    "tpu": "TPU",
}
_METAL_MIN_MACOS = (26, 0)  # Metal arch builds use Metal 4, which needs macOS 26

_WORD = re.compile(r"[a-z0-9_]+")
_TORCH = re.compile(r"torch([0-9]+)")
_STABLE = re.compile(r"torch-stable-abi([0-9]+)")
_TVM = re.compile(r"tvm-ffi([0-9]+)")
_BACKEND_TAG = re.compile(r"(cu|rocm|xpu|cann)([0-9]+)")


Version = tuple[int, int]


def _split(digits: str, major_len: int, max_minor_len: int) -> Version | None:
    """Split run-together version digits at `major_len`; None unless the split is canonical.

    Canonical means each part has no leading zero (except "0" itself) and the minor has 1 to
    `max_minor_len` digits, so that formatting the result gives back the same digits.
    """
    major, minor = digits[:major_len], digits[major_len:]
    if not major or not minor or len(minor) > max_minor_len:
        return None
    if any(len(p) > 1 and p[0] == "0" for p in (major, minor)):
        return None
    return int(major), int(minor)


def _cuda_version(digits: str) -> Version | None:
    # CUDA majors have had 2 digits since CUDA 10, so "cu128" is 12.8 and "cu130" is 13.0; a
    # 4-digit number is 2 + 2 ("cu1210" is 12.10); a 2-digit one is 1 + 1 (old "cu92" is 9.2).
    if len(digits) == 2:
        return _split(digits, 1, 1)
    return _split(digits, 2, 2) if len(digits) in (3, 4) else None


# How each versioned part splits its digits. Torch, the stable ABI, tvm-ffi, ROCm and CANN have
# one-digit majors ("torch210" is 2.10, "tvm-ffi01" is 0.1); XPU versions are year + release.
_SPLITTERS = {
    "torch": lambda d: _split(d, 1, 2),
    "cuda": _cuda_version,
    "rocm": lambda d: _split(d, 1, 2),
    "cann": lambda d: _split(d, 1, 2),
    "xpu": lambda d: _split(d, 4, 2),
}


@dataclass(frozen=True)
class Variant:
    """A parsed build-variant name. `kind` is one of "torch", "stable-abi", "tvm-ffi",
    "noarch" (`torch-<backend>`) and "universal" (`torch-universal`)."""

    name: str
    kind: str
    framework_version: Version | None = None  # torch / stable-ABI / tvm-ffi (major, minor)
    cxx11: bool | None = None  # the legacy cxx11/cxx98 tag of torch arch builds; None: no tag
    backend: str = "universal"  # arch: cuda rocm xpu cann cpu metal neuron tpu; noarch: as named
    backend_version: Version | None = None
    cpu: str | None = None
    os: str | None = None

    @property
    def is_arch(self) -> bool:
        """True for builds with native code for one CPU, OS and backend version."""
        return self.cpu is not None


def _format(v: Variant) -> str:
    if not v.is_arch:
        return f"torch-{v.backend}"
    major, minor = v.framework_version or (0, 0)
    framework = {
        "torch": f"torch{major}{minor}",
        "stable-abi": f"torch-stable-abi{major}{minor}",
        "tvm-ffi": f"tvm-ffi{major}{minor}",
    }[v.kind]
    tag = {None: "", True: "-cxx11", False: "-cxx98"}[v.cxx11]
    backend = v.backend
    if v.backend_version is not None:
        backend = f"{_TAG_PREFIX[v.backend]}{v.backend_version[0]}{v.backend_version[1]}"
    return f"{framework}{tag}-{backend}-{v.cpu}-{v.os}"


def _parse_backend(tag: str) -> tuple[str, Version | None] | None:
    if tag in _PLAIN_BACKENDS:
        return tag, None
    m = _BACKEND_TAG.fullmatch(tag)
    if m is None:
        return None
    kind = {"cu": "cuda", "rocm": "rocm", "xpu": "xpu", "cann": "cann"}[m.group(1)]
    version = _SPLITTERS[kind](m.group(2))
    return (kind, version) if version is not None else None


def parse_variant(name: str) -> Variant | None:
    """Parse a `build/` folder name; None when it is not a variant name.

    A returned Variant always formats back to `name` exactly (docs/variants.md has the grammar).
    """
    if not isinstance(name, str):
        return None
    if name.startswith("torch-") and name[6:] in _NOARCH:
        kind = "universal" if name == "torch-universal" else "noarch"
        return Variant(name=name, kind=kind, backend=name[6:])
    # Arch variants: <framework>[-cxx11|-cxx98]-<backend>-<cpu>-<os>; the last three never
    # contain '-', so split them off the right and read what is left as the framework.
    parts = name.rsplit("-", 3)
    if len(parts) != 4 or not all(_WORD.fullmatch(p) for p in parts[1:]):
        return None
    framework, backend_tag, cpu, os_name = parts
    cxx11 = None
    for tag, value in (("-cxx11", True), ("-cxx98", False)):
        if framework.endswith(tag):
            framework, cxx11 = framework[: -len(tag)], value
    if m := _TORCH.fullmatch(framework):
        kind = "torch"
    elif m := _STABLE.fullmatch(framework):
        kind = "stable-abi"
    elif m := _TVM.fullmatch(framework):
        kind = "tvm-ffi"
    else:
        return None
    if cxx11 is not None and kind != "torch":
        return None  # only torch arch builds ever carried the ABI tag
    version = _SPLITTERS["torch"](m.group(1))
    backend = _parse_backend(backend_tag)
    if version is None or backend is None:
        return None
    variant = Variant(name, kind, version, cxx11, backend[0], backend[1], cpu, os_name)
    return variant if _format(variant) == name else None


@dataclass(frozen=True, kw_only=True)
class SystemInfo:
    """What a build variant must match on this machine. Construct by hand in tests;
    `detect_system()` fills it from torch and the platform."""

    torch: Version | None  # (major, minor) of the installed torch; None: no torch
    backend: str  # one of BACKENDS
    cpu: str  # normalised like platform.machine() on Linux: x86_64, aarch64, ...
    os: str  # "linux", "darwin" or "windows"
    backend_version: Version | None = None  # CUDA / ROCm / XPU / CANN version torch was built for
    cxx11_abi: bool | None = None  # torch.compiled_with_cxx11_abi() on Linux, else None
    macos: Version | None = None  # macOS version when os == "darwin"
    free_threaded: bool = False  # a free-threaded (no-GIL) CPython build
    gpu_archs: tuple[str, ...] = ()  # every visible device: CUDA "X.Y", ROCm gcnArchName
    tvm_ffi: Version | None = None  # installed tvm-ffi (major, minor), for tvm-ffi builds

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise InvalidSpec(
                f"unknown backend {self.backend!r}",
                hint=f"use one of: {', '.join(BACKENDS)}",
            )
        object.__setattr__(self, "cpu", normalize_machine(self.cpu))
        object.__setattr__(self, "os", self.os.lower())
        object.__setattr__(self, "gpu_archs", tuple(self.gpu_archs))

    def describe(self) -> str:
        """One line for messages and `kernels env`, e.g.
        'torch 2.13 (cxx11 ABI), CUDA 12.8, GPUs [9.0, 9.0], x86_64-linux'."""
        parts = []
        if self.torch is None:
            parts.append("no torch")
        else:
            abi = {True: " (cxx11 ABI)", False: " (pre-cxx11 ABI)", None: ""}[self.cxx11_abi]
            parts.append(f"torch {_dot(self.torch)}{abi}")
        parts.append(_backend_label(self.backend, self.backend_version))
        if self.gpu_archs:
            noun = "GPU" if len(self.gpu_archs) == 1 else "GPUs"
            parts.append(f"{noun} [{', '.join(self.gpu_archs)}]")
        if self.tvm_ffi is not None:
            parts.append(f"tvm-ffi {_dot(self.tvm_ffi)}")
        parts.append(f"{self.cpu}-{self.os}")
        if self.macos is not None:
            parts.append(f"macOS {_dot(self.macos)}")
        if self.free_threaded:
            parts.append("free-threaded Python")
        return ", ".join(parts)


def _dot(version: Sequence[int]) -> str:
    return ".".join(map(str, version))


def _backend_label(kind: str, version: Version | None) -> str:
    label = _LABEL.get(kind, kind)
    return f"{label} {_dot(version)}" if version is not None else label


class VariantName(str):
    """A build-variant name: a plain `str` that also answers the reference's `variant_str`
    (its trace entries hold variant objects, and user code reads `decision.variant.variant_str`)."""

    @property
    def variant_str(self) -> str:
        return str(self)


@dataclass(frozen=True)
class VariantAccepted:
    """A variant that fits this machine; `preferred` marks the one that will be loaded."""

    variant: str
    preferred: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "variant", VariantName(self.variant))

    def __str__(self) -> str:
        return f"{self.variant}: compatible{', preferred' if self.preferred else ''}"


@dataclass(frozen=True)
class VariantRejected:
    """A variant that does not fit this machine, and why (both sides named)."""

    variant: str
    reason: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "variant", VariantName(self.variant))

    def __str__(self) -> str:
        return f"{self.variant}: {self.reason}"


TraceEntry = VariantAccepted | VariantRejected


def _reasons(v: Variant, system: SystemInfo) -> list[str]:
    """The rules the variant breaks on `system`, empty when it fits. A build for another OS or
    CPU gets only those reasons."""
    if not v.is_arch:
        if v.kind == "universal" or v.backend == system.backend:
            return []
        return [f"backend {v.backend} does not match this backend {system.backend}"]
    platform_reasons = []
    if v.os != system.os:
        platform_reasons.append(f"OS {v.os} does not match this OS {system.os}")
    if v.cpu != system.cpu:
        platform_reasons.append(f"CPU {v.cpu} does not match this CPU {system.cpu}")
    if platform_reasons:
        return platform_reasons  # a build for another platform: its other details are moot
    reasons = []
    if system.free_threaded:
        reasons.append("free-threaded Python cannot load native builds (a noarch build can)")
    reasons.extend(_framework_reasons(v, system))
    reasons.extend(_backend_reasons(v, system))
    return reasons


def _framework_reasons(v: Variant, system: SystemInfo) -> list[str]:
    have = system.torch
    want = v.framework_version or (0, 0)  # arch variants always carry one
    if v.kind == "tvm-ffi":
        if system.tvm_ffi is None:
            return [f"needs tvm-ffi {_dot(want)}, which is not installed"]
        if want != system.tvm_ffi:
            return [f"tvm-ffi {_dot(want)} does not match this tvm-ffi {_dot(system.tvm_ffi)}"]
        return []
    if have is None:
        return [f"needs torch {_dot(want)}, which is not installed"]
    if v.kind == "stable-abi":
        # The stable ABI promises that a build for 2.N loads in every later torch.
        if want > have:
            return [f"stable ABI {_dot(want)} is newer than this torch {_dot(have)}"]
        return []
    if want != have:
        return [f"torch {_dot(want)} does not match this torch {_dot(have)}"]
    if v.cxx11 is not None and system.os == "linux" and system.cxx11_abi is not None:
        if v.cxx11 != system.cxx11_abi:
            abi = {True: "cxx11 ABI", False: "pre-cxx11 ABI"}
            return [f"{abi[v.cxx11]} does not match this torch's {abi[system.cxx11_abi]}"]
    return []


def _backend_reasons(v: Variant, system: SystemInfo) -> list[str]:
    built = _backend_label(v.backend, v.backend_version)
    runs_on = "npu" if v.backend == "cann" else v.backend  # CANN builds run on NPU systems
    if runs_on != system.backend:
        mine = _backend_label(system.backend, system.backend_version)
        return [f"backend {built} does not match this backend {mine}"]
    have, want = system.backend_version, v.backend_version
    if want is not None:
        if have is None:
            return [f"{built} needs a known {_LABEL[v.backend]} version; this one is unknown"]
        if v.backend == "cuda":
            # CUDA keeps minor-version compatibility: a 12.6 build runs on a 12.8 toolkit.
            if want[0] != have[0]:
                return [f"{built} does not match this CUDA {_dot(have)} (major versions differ)"]
            if want[1] > have[1]:
                return [f"{built} is newer than this CUDA {_dot(have)}"]
        elif want != have:
            return [f"{built} does not match this {_backend_label(system.backend, have)}"]
    if v.backend == "metal":
        if system.macos is None:
            return ["Metal builds need macOS 26 or newer; the macOS version is unknown"]
        if system.macos < _METAL_MIN_MACOS:
            return [f"Metal builds need macOS 26 or newer, this is macOS {_dot(system.macos)}"]
    return []


def _preference(v: Variant) -> tuple:
    """Sort key, smaller is better: stable ABI (newest first), torch (tagless before tagged),
    tvm-ffi; inside each the newest backend; then `torch-<backend>`, then `torch-universal`."""
    backend = tuple(-x for x in v.backend_version or (0, 0))
    fw = tuple(-x for x in v.framework_version or (0, 0))
    if v.kind == "stable-abi":
        return (0, fw, backend)
    if v.kind == "torch":
        return (1, (0 if v.cxx11 is None else 1,), backend)
    if v.kind == "tvm-ffi":
        return (2, (), backend)
    return (3 if v.kind == "noarch" else 4, (), ())


def select_variants(names: Iterable[str], system: SystemInfo) -> list[TraceEntry]:
    """Judge every name: accepted ones first, best first (the first is `preferred`), then the
    rejected ones by name, each with its reason. Names that do not parse are rejected too."""
    accepted: list[tuple[tuple, str]] = []
    rejected: list[VariantRejected] = []
    for name in dict.fromkeys(names):  # de-duplicated, order kept
        variant = parse_variant(name)
        if variant is None:
            rejected.append(VariantRejected(name, "not a variant name"))
            continue
        reasons = _reasons(variant, system)
        if reasons:
            rejected.append(VariantRejected(name, "; ".join(reasons)))
        else:
            accepted.append((_preference(variant), name))
    accepted.sort()
    trace: list[TraceEntry] = [
        VariantAccepted(name, preferred=(i == 0)) for i, (_, name) in enumerate(accepted)
    ]
    trace.extend(sorted(rejected, key=lambda r: r.variant))
    return trace


def format_trace(trace: Iterable[TraceEntry]) -> str:
    """The trace as text, one entry per line."""
    return "\n".join(str(entry) for entry in trace)


# --- GPU architecture check (metadata.json `backend.archs`) ---------------------------------


def _parse_cuda_arch(arch: str) -> tuple[int, int, str, bool] | None:
    """'9.0' -> (9, 0, '', False); '9.0a' -> suffix 'a'; '10.0f' -> 'f'; '+PTX' sets the flag."""
    ptx = arch.upper().endswith("+PTX")
    if ptx:
        arch = arch[:-4]
    m = re.fullmatch(r"([0-9]+)\.([0-9]+)([af]?)", arch)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), m.group(3), ptx


def _cuda_arch_runs_on(arch: tuple[int, int, str, bool], capability: Version) -> bool:
    major, minor, suffix, ptx = arch
    if suffix == "a":  # arch-specific features: only that exact capability
        return capability == (major, minor)
    if ptx and not suffix:  # PTX is compiled by the driver for any newer GPU
        return capability >= (major, minor)
    # Plain and family ('f') cubins run on the same major with an equal or newer minor.
    return capability[0] == major and capability[1] >= minor


def _parse_capability(text: str) -> Version | None:
    m = re.fullmatch(r"([0-9]+)\.([0-9]+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_archs(backend_meta: dict, system: SystemInfo) -> str | None:
    """Why the GPUs of `system` cannot run a build whose metadata.json `backend` is
    `backend_meta`; None when they can, or when there is nothing to check.

    CUDA archs 'X.Y' and 'X.Yf' run on capability X.Z with Z >= Y, 'X.Ya' only on X.Y, and
    '+PTX' on any capability >= X.Y; ROCm archs must equal the device's gcnArchName. Every
    visible device is checked; archs in formats not known here do not reject a build.
    """
    if not isinstance(backend_meta, dict):
        raise InvalidMetadata(f"metadata.json 'backend' must be an object, got {backend_meta!r}")
    archs = backend_meta.get("archs")
    if not archs:
        return None
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise InvalidMetadata(f"metadata.json 'backend.archs' must be a list of strings: {archs!r}")
    kind = backend_meta.get("type")
    if kind != system.backend or kind not in ("cuda", "rocm") or not system.gpu_archs:
        return None
    declared = ", ".join(archs)
    if kind == "cuda":
        parsed = [p for p in map(_parse_cuda_arch, archs) if p is not None]
        if not parsed:
            return None
        bad = []
        for index, text in enumerate(system.gpu_archs):
            capability = _parse_capability(text)
            if capability is not None and not any(
                _cuda_arch_runs_on(a, capability) for a in parsed
            ):
                bad.append(f"GPU {index} has capability {text}")
        what = "CUDA archs"
    else:
        bad = [
            f"GPU {index} is {name.split(':')[0]}"
            for index, name in enumerate(system.gpu_archs)
            if name.split(":")[0] not in archs  # drop feature flags: gfx90a:sramecc+:xnack-
        ]
        what = "ROCm archs"
    if not bad:
        return None
    return f"the build supports {what} {declared}, but {', '.join(bad)}"


# --- detecting this machine -----------------------------------------------------------------


def _version_prefix(text: str | None) -> Version | None:
    m = re.match(r"([0-9]+)\.([0-9]+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _xpu_version(text: str) -> Version | None:
    # torch.version.xpu is a oneAPI build date like "20250100" (or "2025.1"): year + release.
    m = re.match(r"([0-9]{4})\.([0-9]+)", text) or re.match(r"([0-9]{4})([0-9]{2})", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _torch_backend(torch) -> tuple[str, Version | None]:
    """The backend kind torch was built for, with the toolkit version of that build."""
    if hasattr(torch, "neuron"):  # the Neuron plugin loads into builds of any other kind
        return "neuron", None
    tpu = getattr(torch.backends, "tpu", None)
    if tpu is not None and getattr(tpu, "is_available", lambda: True)():
        return "tpu", None
    if torch.version.cuda:
        return "cuda", _version_prefix(torch.version.cuda)
    if torch.version.hip:
        return "rocm", _version_prefix(torch.version.hip)
    if torch.backends.mps.is_available():
        return "metal", None
    xpu = getattr(torch.version, "xpu", None)  # absent before torch 2.7
    if xpu:
        return "xpu", _xpu_version(str(xpu))
    private = getattr(torch._C, "_get_privateuse1_backend_name", lambda: None)()
    if private == "npu":
        from torch_npu.utils.collect_env import get_cann_version  # type: ignore

        return "npu", _version_prefix(str(get_cann_version()))
    return "cpu", None


def _gpu_archs(torch, backend: str) -> tuple[str, ...]:
    if backend not in ("cuda", "rocm") or not torch.cuda.is_available():
        return ()
    if backend == "cuda":
        return tuple(
            "{}.{}".format(*torch.cuda.get_device_capability(i))
            for i in range(torch.cuda.device_count())
        )
    return tuple(
        torch.cuda.get_device_properties(i).gcnArchName.split(":")[0]
        for i in range(torch.cuda.device_count())
    )


def _tvm_ffi_version() -> Version | None:
    from importlib import metadata

    try:
        return _version_prefix(metadata.version("apache-tvm-ffi"))
    except metadata.PackageNotFoundError:
        return None


def _free_threaded() -> bool:
    """True on a free-threaded (no-GIL) build of Python."""
    # The build's "t" ABI flag is set exactly when Py_GIL_DISABLED is; reading it spares a warm
    # load the import of sysconfig and its config-data module (~1 ms). Windows before 3.14 has
    # no sys.abiflags: ask sysconfig there.
    flags = getattr(sys, "abiflags", None)
    if flags is not None:
        return "t" in flags
    import sysconfig

    return bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


def detect_system(backend: str | None = None) -> SystemInfo:
    """Describe this machine (imports torch if installed; needs no GPU).

    `backend` may be None (use the detected one), "cpu", or the detected backend's name;
    anything else raises InvalidSpec naming the supported ones.
    """
    os_name = platform.system().lower()
    macos = _version_prefix(platform.mac_ver()[0]) if os_name == "darwin" else None
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        torch_version = _version_prefix(torch.__version__)
        cxx11 = bool(torch.compiled_with_cxx11_abi()) if os_name == "linux" else None
        kind, kind_version = _torch_backend(torch)
    else:
        torch_version, cxx11, kind, kind_version = None, None, "cpu", None
    if backend is not None and backend not in ("cpu", kind):
        supported = ", ".join(sorted({"cpu", kind}))
        # The reference's wording first: callers match "Invalid backend '<name>'".
        raise InvalidSpec(
            f"Invalid backend '{backend}', system supported backends: {supported}",
            hint=f"pass backend=None to use the detected backend, or one of: {supported}",
        )
    if backend == "cpu":
        kind, kind_version = "cpu", None
    return SystemInfo(
        torch=torch_version,
        cxx11_abi=cxx11,
        backend=kind,
        backend_version=kind_version,
        cpu=platform.machine(),
        os=os_name,
        macos=macos,
        free_threaded=_free_threaded(),
        gpu_archs=_gpu_archs(torch, kind) if torch is not None else (),
        tvm_ffi=_tvm_ffi_version(),
    )
