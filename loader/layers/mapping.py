"""The kernel mapping: which repository serves a layer name on a device type in a mode.

The mapping is a stack of scopes held in a ContextVar. Values are never changed in place: every
registration publishes a new tuple of new scopes (copy-on-write), so a mapping seen by one
context, thread or model never changes under it.

- `register_kernel_mapping` merges into the innermost scope of the current context. Within a
  scope, an entry replaces the earlier entry for the same layer, device and capability range.
- `use_kernel_mapping` pushes an overlay scope for the duration of a `with` block.

Lookup for (layer, device, capability) takes the innermost scope that has an entry for that
layer and device whose capability range holds the GPU; within it the smallest such range wins.
So an overlay (a user's request, e.g. a transformers KernelConfig) wins over the registered
table for that layer and device. Modes are then tried in priority order (`candidates`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ..errors import InvalidSpec
from .device import ANY_CAPABILITY, as_device
from .fallback import KernelizeFallback
from .mode import Mode, check_mapping_mode, mode_name


@dataclass(frozen=True)
class RangeEntry:
    """Repositories by registered mode, for one capability range of one device type."""

    low: int
    high: int
    modes: Mapping[Mode, Any]
    seq: int  # registration order, to break ties between equally wide ranges


@dataclass(frozen=True)
class Scope:
    """One level of the mapping: layer name -> device type -> capability-range entries.

    `overlay` marks scopes pushed by use_kernel_mapping: a request for this scope, in which an
    INFERENCE entry also serves TRAINING when its layer has a backward (see `candidates`).
    """

    layers: Mapping[str, Mapping[str, tuple[RangeEntry, ...]]]
    overlay: bool
    next_seq: int = 0

    def merged(self, mapping: Mapping[str, Any]) -> Scope:
        """A new scope with `mapping` (already validated by `normalize`) registered on top."""
        layers = {name: dict(devices) for name, devices in self.layers.items()}
        seq = self.next_seq
        for layer_name, entries in mapping.items():
            devices = layers.setdefault(layer_name, {})
            for device_type, low, high, modes in entries:
                kept = tuple(
                    e for e in devices.get(device_type, ()) if (e.low, e.high) != (low, high)
                )
                devices[device_type] = (*kept, RangeEntry(low, high, modes, seq))
                seq += 1
        frozen = {
            name: MappingProxyType(dict(devices)) for name, devices in layers.items() if devices
        }
        return Scope(MappingProxyType(frozen), self.overlay, seq)


_EMPTY = MappingProxyType({})
_MAPPING: ContextVar[tuple[Scope, ...]] = ContextVar("kernels_layer_mapping", default=())


def _check_repo(repo: object, where: str) -> object:
    if not callable(getattr(repo, "load", None)):
        raise InvalidSpec(
            f"{where}: {repo!r} is not a repository (it has no .load())",
            hint="use LayerRepository(...), LocalLayerRepository(...) or LockedLayerRepository(...)",
        )
    return repo


def normalize(mapping: object) -> dict[str, list[tuple[str, int, int, Mapping[Mode, Any]]]]:
    """Validate a user mapping {layer: {device: repo | {Mode: repo}}} into flat entries.

    A bare repository is registered for Mode.FALLBACK (any mode).
    """
    if not isinstance(mapping, Mapping):
        raise InvalidSpec(
            f"a kernel mapping must be a dict, got {type(mapping).__name__}",
            hint='use {"RMSNorm": {"cuda": LayerRepository(...)}}',
        )
    out: dict[str, list[tuple[str, int, int, Mapping[Mode, Any]]]] = {}
    for layer_name, devices in mapping.items():
        if not isinstance(layer_name, str) or not layer_name:
            raise InvalidSpec(
                f"mapping keys must be layer names (str), got {layer_name!r}",
                hint='key the mapping by the name given to use_kernel_forward_from_hub, e.g. "RMSNorm"',
            )
        if not isinstance(devices, Mapping):
            raise InvalidSpec(
                f"mapping[{layer_name!r}] must be a dict of device -> repository, got {devices!r}",
                hint=f'use {{"{layer_name}": {{"cuda": LayerRepository(...)}}}}',
            )
        entries = out.setdefault(layer_name, [])
        for key, value in devices.items():
            device = as_device(key)
            where = f"mapping[{layer_name!r}][{device.type!r}]"
            if isinstance(value, Mapping):
                modes = {
                    check_mapping_mode(mode): _check_repo(repo, where)
                    for mode, repo in value.items()
                }
                if not modes:
                    raise InvalidSpec(
                        f"{where} is an empty mode dict", hint="map at least one Mode"
                    )
            else:
                modes = {Mode.FALLBACK: _check_repo(value, where)}
            low, high = device.capability_range
            entries.append((device.type, low, high, MappingProxyType(modes)))
    return out


def current_scopes() -> tuple[Scope, ...]:
    """The scopes of the current context, outermost first."""
    return _MAPPING.get()


def register_kernel_mapping(mapping: Mapping[str, Any], inherit_mapping: bool = True) -> None:
    """Register `mapping` in the current context (its innermost scope).

    With inherit_mapping=False the current context's mapping is replaced by `mapping` alone.
    """
    entries = normalize(mapping)
    scopes = _MAPPING.get()
    overlay = scopes[-1].overlay if scopes else False
    if not inherit_mapping or not scopes:
        scopes = (Scope(_EMPTY, overlay),)
    _MAPPING.set((*scopes[:-1], scopes[-1].merged(entries)))


def use_kernel_mapping(
    mapping: Mapping[str, Any], *, inherit_mapping: bool = True
) -> AbstractContextManager[None]:
    """Within the `with` block, `mapping` is an overlay on the current mapping (or, with
    inherit_mapping=False, the whole mapping); the previous mapping is restored on exit.

    The mapping is validated here, so a bad one fails at the call, before the block."""
    return _overlay(normalize(mapping), inherit_mapping)


@contextmanager
def _overlay(entries: Mapping[str, Any], inherit_mapping: bool) -> Iterator[None]:
    overlay = Scope(_EMPTY, overlay=True).merged(entries)
    scopes = _MAPPING.get() if inherit_mapping else ()
    token = _MAPPING.set((*scopes, overlay))
    try:
        yield
    finally:
        _MAPPING.reset(token)


# -- lookup --------------------------------------------------------------------------------------

_TC = Mode.TORCH_COMPILE
# Registered modes to try, best first, for each requested mode (the reference's priority chain).
_PRIORITY: dict[Mode, tuple[Mode, ...]] = {
    Mode.INFERENCE: (
        Mode.INFERENCE,
        Mode.INFERENCE | _TC,
        Mode.TRAINING,
        Mode.TRAINING | _TC,
        Mode.FALLBACK,
    ),
    Mode.INFERENCE | _TC: (Mode.INFERENCE | _TC, Mode.TRAINING | _TC, Mode.FALLBACK),
    Mode.TRAINING: (Mode.TRAINING, Mode.TRAINING | _TC, Mode.FALLBACK),
    Mode.TRAINING | _TC: (Mode.TRAINING | _TC, Mode.FALLBACK),
}
# In an overlay scope, these INFERENCE entries may serve a TRAINING request (inserted before
# FALLBACK) when the layer they name has a backward.
_PROMOTED: dict[Mode, tuple[Mode, ...]] = {
    Mode.TRAINING: (Mode.INFERENCE, Mode.INFERENCE | _TC),
    Mode.TRAINING | _TC: (Mode.INFERENCE | _TC,),
}


@dataclass(frozen=True)
class Candidate:
    """A repository that may serve the request, with the mode it was registered for.

    `promoted`: an INFERENCE entry offered for TRAINING; it serves only if the layer has a backward.
    """

    repo: Any
    registered: Mode
    promoted: bool = False


@dataclass(frozen=True)
class Lookup:
    """What the mapping offers for one layer: candidates best first, or why there are none."""

    candidates: tuple[Candidate, ...]
    miss: KernelizeFallback | None = None
    reason: str = ""


def candidates(modes: Mapping[Mode, Any], mode: Mode, *, overlay: bool) -> tuple[Candidate, ...]:
    """The entries of one range that may serve `mode`, in priority order."""
    order = list(_PRIORITY[mode])
    promoted = _PROMOTED.get(mode, ()) if overlay else ()
    order[-1:-1] = promoted  # before FALLBACK
    return tuple(Candidate(modes[m], m, promoted=m in promoted) for m in order if m in modes)


def lookup(
    layer_name: str,
    device_type: str,
    capability: int | None,
    mode: Mode,
    scopes: tuple[Scope, ...] | None = None,
) -> Lookup:
    """Select the repositories that may serve `layer_name` on this device in this mode.

    `capability` is the GPU's major*10+minor (None when unknown: only unconstrained entries match).
    """
    scopes = current_scopes() if scopes is None else scopes
    seen_layer = seen_device = False
    for scope in reversed(scopes):
        devices = scope.layers.get(layer_name)
        if devices is None:
            continue
        seen_layer = True
        ranges = devices.get(device_type)
        if not ranges:
            continue
        seen_device = True
        fitting = [e for e in ranges if _contains(e, capability)]
        if not fitting:
            continue
        best = min(fitting, key=lambda e: (e.high - e.low, -e.seq))
        found = candidates(best.modes, mode, overlay=scope.overlay)
        if found:
            return Lookup(found)
        registered = ", ".join(mode_name(m) for m in best.modes)
        return Lookup(
            (),
            KernelizeFallback.NO_COMPATIBLE_MODE,
            f"no entry for mode {mode_name(mode)} (registered: {registered})",
        )
    if not seen_layer:
        return Lookup((), KernelizeFallback.NO_LAYER, f"no mapping for layer {layer_name!r}")
    if not seen_device:
        return Lookup((), KernelizeFallback.NO_DEVICE, f"no mapping for device {device_type!r}")
    shown = "unknown" if capability is None else str(capability)
    return Lookup(
        (),
        KernelizeFallback.NO_COMPATIBLE_PROPERTIES,
        f"no {device_type} entry covers capability {shown}",
    )


def _contains(entry: RangeEntry, capability: int | None) -> bool:
    if capability is None:
        return entry.low == 0 and entry.high == ANY_CAPABILITY
    return entry.low <= capability <= entry.high
