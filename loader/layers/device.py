"""Devices as mapping keys (`Device`, `CUDAProperties`, `ROCMProperties`) and the device a model
is kernelized for (`Target`), including the GPU capability of the device each module lives on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import InvalidSpec

if TYPE_CHECKING:
    import torch
    from torch import nn

DEVICE_TYPES = ("cpu", "cuda", "rocm", "mps", "xpu", "npu", "neuron", "tpu")
# Capabilities are major*10+minor; an unconstrained entry spans [0, ANY_CAPABILITY].
ANY_CAPABILITY = 2**31 - 1


def _check_range(cls_name: str, low: object, high: object) -> None:
    for value in (low, high):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidSpec(
                f"{cls_name} capabilities must be non-negative ints, got {value!r}",
                hint="encode capability major.minor as major*10+minor, e.g. 90 for sm_90",
            )
    if low > high:  # type: ignore[operator]
        raise InvalidSpec(
            f"{cls_name}(min_capability={low}, max_capability={high}): min is above max",
            hint="the range is inclusive; use min_capability <= max_capability",
        )


@dataclass(frozen=True)
class CUDAProperties:
    """An inclusive CUDA compute-capability range, major*10+minor (sm_90 is 90)."""

    min_capability: int
    max_capability: int

    def __post_init__(self) -> None:
        _check_range("CUDAProperties", self.min_capability, self.max_capability)


@dataclass(frozen=True)
class ROCMProperties:
    """An inclusive ROCm capability range, major*10+minor as torch reports it (gfx1151 is 115)."""

    min_capability: int
    max_capability: int

    def __post_init__(self) -> None:
        _check_range("ROCMProperties", self.min_capability, self.max_capability)


_PROPERTIES_FOR = {"cuda": CUDAProperties, "rocm": ROCMProperties}


@dataclass(frozen=True)
class Device:
    """A mapping key: a device type, optionally narrowed to a capability range (cuda, rocm)."""

    type: str
    properties: CUDAProperties | ROCMProperties | None = None

    def __post_init__(self) -> None:
        if self.type not in DEVICE_TYPES:
            raise InvalidSpec(
                f"unknown device type {self.type!r}",
                hint=f"use one of: {', '.join(DEVICE_TYPES)}",
            )
        if self.properties is None:
            return
        expected = _PROPERTIES_FOR.get(self.type)
        if expected is None or not isinstance(self.properties, expected):
            raise InvalidSpec(
                f"Device(type={self.type!r}) cannot take {type(self.properties).__name__}",
                hint="CUDAProperties go with type='cuda', ROCMProperties with type='rocm'",
            )

    @property
    def capability_range(self) -> tuple[int, int]:
        """(min, max) inclusive; (0, ANY_CAPABILITY) when unconstrained."""
        if self.properties is None:
            return (0, ANY_CAPABILITY)
        return (self.properties.min_capability, self.properties.max_capability)


def as_device(key: object) -> Device:
    """A mapping device key (str or Device) as a Device."""
    if isinstance(key, Device):
        return key
    if isinstance(key, str):
        return Device(type=key)
    raise InvalidSpec(
        f"mapping device keys must be a str or a Device, got {key!r}",
        hint='use "cuda", "cpu", ... or Device(type="cuda", properties=CUDAProperties(80, 90))',
    )


@dataclass(frozen=True)
class Target:
    """The device a kernelize call selects kernels for.

    `type` is the mapping device type ('rocm' for an AMD GPU, which torch calls 'cuda');
    `index` is the GPU index named by the caller, if any.
    """

    type: str
    index: int | None = None


def _is_hip() -> bool:
    import torch

    return getattr(torch.version, "hip", None) is not None


def _refine(device_type: str) -> str:
    # torch names AMD GPUs "cuda"; their kernels are registered under "rocm".
    return "rocm" if device_type == "cuda" and _is_hip() else device_type


def first_device(module: nn.Module) -> torch.device | None:
    """The device of the module's first parameter or buffer, if it has any."""
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return None


def resolve_target(model: nn.Module, device: object) -> Target:
    """The kernelize target: `device` (str, torch.device or Device) or else the model's device."""
    import torch

    if device is None:
        found = first_device(model)
        if found is None:
            raise InvalidSpec(
                "cannot tell which device the model is on: it has no parameters or buffers",
                hint='pass device="cpu" or device="cuda" to kernelize',
            )
        return Target(type=_refine(found.type), index=found.index)
    if isinstance(device, Device):
        return Target(type=_refine(device.type))
    if isinstance(device, torch.device):
        return Target(type=_refine(as_device(device.type).type), index=device.index)
    if isinstance(device, str):
        kind, _, index = device.partition(":")
        if index and not index.isdigit():
            raise InvalidSpec(
                f"device {device!r} has a bad index", hint='use e.g. "cuda" or "cuda:1"'
            )
        return Target(type=_refine(as_device(kind).type), index=int(index) if index else None)
    raise InvalidSpec(
        f"device must be a str, a torch.device or a Device, got {device!r}",
        hint='pass device="cpu", "cuda", "cuda:1" or a torch.device',
    )


class CapabilityProbe:
    """GPU capability of the device each module lives on, memoized per GPU index for one call."""

    def __init__(self, target: Target):
        self.target = target
        self._by_index: dict[int, int | None] = {}

    def for_module(self, module: nn.Module) -> int | None:
        """major*10+minor of the GPU holding `module`; None off-GPU or without a usable GPU."""
        if self.target.type not in _PROPERTIES_FOR:
            return None
        import torch

        if not torch.cuda.is_available():
            return None
        where = first_device(module)
        if where is not None and where.type == "cuda" and where.index is not None:
            index = where.index
        elif self.target.index is not None:
            index = self.target.index
        else:
            index = torch.cuda.current_device()
        if index not in self._by_index:
            major, minor = torch.cuda.get_device_capability(index)
            self._by_index[index] = major * 10 + minor
        return self._by_index[index]
