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
except ModuleNotFoundError as exc:
    if exc.name not in ("triton", "triton.language"):
        raise  # a Triton that is there but broken: its own error says more
    AVAILABLE = False


def missing(needed_for: str) -> ImportError:
    """The error for a call that needs Triton here: the loader's MissingDependency when this
    kernel was loaded by this project's `kernels`, else a ModuleNotFoundError."""
    message = f"triton is not installed (needed for {needed_for})"
    try:
        from kernels.errors import KernelsError, MissingDependency
    except ImportError:  # another loader (the reference `kernels`): the builtin type
        return ModuleNotFoundError(f"{message}; {HINT}", name="triton")
    if not issubclass(MissingDependency, KernelsError):
        return ModuleNotFoundError(f"{message}; {HINT}", name="triton")
    return MissingDependency(message, hint=HINT)


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

__all__ = ["AVAILABLE", "HINT", "missing", "tl", "triton"]
