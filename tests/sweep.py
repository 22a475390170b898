"""The opt-in sweep of the CPU suite: ``KERNELS_SWEEP=1`` runs the extra cases.

The default run keeps one representative of each code path (every kernel geometry branch, every
special-cased dtype, every option, every model family's bound layer set) so that it stays near
ten minutes on a 2-core machine. The cases that only add more of the same (more shapes through
one branch, more model types of one family, more setups of one script) are marked with
`sweep_only` or made with `sweep_param`; they run when ``KERNELS_SWEEP`` is set to anything but
empty or 0.

The variable is read at import: the root conftest clears KERNELS_* variables for each test.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")

SWEEP: bool = os.environ.get("KERNELS_SWEEP", "").strip() not in ("", "0")


def sweep_marks(what: str) -> list[pytest.MarkDecorator]:
    """Marks for a test or a parameter that runs only under ``KERNELS_SWEEP=1``: `slow`, and a
    skip whose reason names `what` the sweep adds and how to turn it on."""
    return [pytest.mark.slow, pytest.mark.skipif(not SWEEP, reason=f"{what}: set KERNELS_SWEEP=1")]


def sweep_only(what: str) -> Callable[[T], T]:
    """Decorator: the test runs only under ``KERNELS_SWEEP=1`` (see `sweep_marks`)."""

    def mark(test: T) -> T:
        for m in sweep_marks(what):
            test = m(test)
        return test

    return mark


def sweep_param(*values: object, what: str, id: str | None = None) -> object:
    """``pytest.param(*values)`` that runs only under ``KERNELS_SWEEP=1`` (see `sweep_marks`)."""
    return pytest.param(*values, marks=sweep_marks(what), id=id)
