"""`Mode`: what a model is being kernelized for, and what a mapping entry is registered for.

A kernelize call asks for exactly one of INFERENCE and TRAINING, optionally with TORCH_COMPILE.
A mapping entry may also be registered for FALLBACK, which stands alone and serves any mode.
"""

from __future__ import annotations

from enum import Flag, auto

from ..errors import InvalidSpec


class Mode(Flag):
    """The mode a model is kernelized for; entries of a kernel mapping are keyed by it.

    INFERENCE and TRAINING exclude each other; FALLBACK cannot be combined with anything.
    """

    FALLBACK = auto()
    TRAINING = auto()
    INFERENCE = auto()
    TORCH_COMPILE = auto()

    def __or__(self, other: Mode) -> Mode:
        union = super().__or__(other)
        _check_combination(union)
        return union


def _check_combination(mode: Mode) -> None:
    if Mode.INFERENCE in mode and Mode.TRAINING in mode:
        raise InvalidSpec(
            "Mode.INFERENCE and Mode.TRAINING are mutually exclusive",
            hint="register one entry per mode, e.g. {Mode.INFERENCE: repo_a, Mode.TRAINING: repo_b}",
        )
    if Mode.FALLBACK in mode and mode != Mode.FALLBACK:
        raise InvalidSpec(
            "Mode.FALLBACK cannot be combined with other modes",
            hint="use Mode.FALLBACK alone; it already serves every mode",
        )


def check_mapping_mode(mode: object) -> Mode:
    """Return `mode` if it may key a mapping entry (any valid non-empty Mode), else raise."""
    if not isinstance(mode, Mode) or not mode:
        raise InvalidSpec(
            f"mapping modes must be Mode members, got {mode!r}",
            hint="key a per-mode mapping with Mode.INFERENCE, Mode.TRAINING, Mode.FALLBACK, ...",
        )
    _check_combination(mode)
    if mode == Mode.TORCH_COMPILE:
        raise InvalidSpec(
            "Mode.TORCH_COMPILE alone names no mode",
            hint="combine it: Mode.INFERENCE | Mode.TORCH_COMPILE or Mode.TRAINING | Mode.TORCH_COMPILE",
        )
    return mode


def check_requested_mode(mode: object) -> Mode:
    """Return `mode` if kernelize may be asked for it (INFERENCE or TRAINING, maybe | TORCH_COMPILE)."""
    if not isinstance(mode, Mode):
        raise InvalidSpec(
            f"mode must be a Mode, got {mode!r}",
            hint="pass mode=Mode.INFERENCE or mode=Mode.TRAINING (optionally | Mode.TORCH_COMPILE)",
        )
    if mode == Mode.FALLBACK:
        raise InvalidSpec(
            "Mode.FALLBACK can only be used to register kernel mappings",
            hint="kernelize with mode=Mode.INFERENCE or mode=Mode.TRAINING",
        )
    _check_combination(mode)
    if Mode.INFERENCE not in mode and Mode.TRAINING not in mode:
        raise InvalidSpec(
            f"kernelize mode must contain Mode.INFERENCE or Mode.TRAINING, got {mode}",
            hint="pass mode=Mode.INFERENCE or mode=Mode.TRAINING (optionally | Mode.TORCH_COMPILE)",
        )
    return mode


def mode_name(mode: Mode) -> str:
    """'INFERENCE|TORCH_COMPILE' style name, stable across Python versions."""
    return "|".join(str(m.name) for m in Mode if m in mode) or "NONE"
