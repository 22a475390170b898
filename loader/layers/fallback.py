"""`KernelizeFallback`: the cases in which kernelize keeps a module's original forward."""

from __future__ import annotations

from enum import Flag, auto


class KernelizeFallback(Flag):
    """When kernelize may keep the original forward instead of raising.

    NO_LAYER: the mapping has no entry for the layer name. NO_DEVICE: none for the device type.
    NO_COMPATIBLE_PROPERTIES: none whose capability range holds the GPU. NO_COMPATIBLE_MODE: none
    for the mode, or the kernel lacks the backward / torch.compile support the mode needs.
    CANNOT_LOAD: the kernel cannot be fetched, has no variant for this machine, lacks the layer,
    or the layer breaks the layer contract. Trust and integrity errors always raise.
    """

    NONE = 0
    NO_LAYER = auto()
    NO_DEVICE = auto()
    NO_COMPATIBLE_PROPERTIES = auto()
    NO_COMPATIBLE_MODE = auto()
    CANNOT_LOAD = auto()

    DEFAULT = NO_LAYER | NO_DEVICE | NO_COMPATIBLE_PROPERTIES | NO_COMPATIBLE_MODE
    ALL = DEFAULT | CANNOT_LOAD


def as_fallback(use_fallback: object) -> KernelizeFallback:
    """True -> DEFAULT, False -> NONE, a KernelizeFallback as is."""
    if isinstance(use_fallback, KernelizeFallback):
        return use_fallback
    if isinstance(use_fallback, bool):
        return KernelizeFallback.DEFAULT if use_fallback else KernelizeFallback.NONE
    from ..errors import InvalidSpec

    raise InvalidSpec(
        f"use_fallback must be a bool or a KernelizeFallback, got {use_fallback!r}",
        hint="pass use_fallback=True, False or e.g. KernelizeFallback.ALL",
    )
