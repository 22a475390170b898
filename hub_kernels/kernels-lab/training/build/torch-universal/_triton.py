"""Triton, or a stand-in for it when it is not installed.

CPU tensors run the torch formulas, which need no Triton, but every op module defines its
``@triton.jit`` kernels when it is imported. Without Triton, ``triton`` and ``tl`` here are
stand-ins: ``jit`` keeps the function and refuses to launch it, ``tl.constexpr`` is a plain
holder, and anything else raises ``missing()``. ``_common.use_triton`` raises the same error
before a CUDA tensor (or Triton's interpreter) would need a kernel. Op modules import Triton
from here, never directly (tests/kernels/test_no_triton.py checks both).
"""

from __future__ import annotations

import types

HINT = "pip install 'kernels[training]' (or pip install triton)"

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
    try:  # the device math library (CUDA's libdevice / ROCm's); Triton >= 3.0
        from triton.language.extra import libdevice
    except ImportError:
        libdevice = None
except ModuleNotFoundError as exc:
    if exc.name not in ("triton", "triton.language"):
        raise  # a Triton that is there but broken: its own error says more
    AVAILABLE = False


class TritonMissing(ModuleNotFoundError):
    """Triton is needed for this call and is not installed; `hint` says what to install. (Not the
    loader's MissingDependency: this folder imports nothing of any loader, so it runs under the
    reference `kernels` too.)"""

    def __init__(self, message: str, hint: str = HINT) -> None:
        super().__init__(f"{message}\nhint: {hint}", name="triton")
        self.message = message
        self.hint = hint


def missing(needed_for: str) -> TritonMissing:
    """The error for a call that needs Triton here."""
    return TritonMissing(f"triton is not installed (needed for {needed_for})")


class _Unlaunchable:
    """A ``@triton.jit`` function without Triton: defined, never launched."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")

    def __getitem__(self, grid):
        raise missing(f"the Triton kernel {self.__name__}")

    def run(self, *args, **kwargs):
        raise missing(f"the Triton kernel {self.__name__}")

    __call__ = run


class _Constexpr:
    """``tl.constexpr`` without Triton: annotations and module constants only."""

    def __init__(self, value=None) -> None:
        self.value = value


def _jit(fn=None, **_options):
    if fn is None:  # @triton.jit(...) with options
        return _Unlaunchable
    return _Unlaunchable(fn)


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise missing(f"triton.{name}")


if not AVAILABLE:
    triton = _StandIn("triton")
    triton.__version__ = "0"  # FastLaunch reads it at import: "no known launch signature"
    triton.jit = _jit
    tl = _StandIn("triton.language")
    tl.constexpr = _Constexpr
    libdevice = None

__all__ = ["AVAILABLE", "HINT", "TritonMissing", "libdevice", "missing", "tl", "triton"]
