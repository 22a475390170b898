"""Fixtures of the reliability suite (see tests/reliability/helpers.py for the helpers)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kernels import notices


@pytest.fixture
def hub(hub) -> Iterator:
    """The root `hub` fixture, with any fault plan a test set switched off again afterwards."""
    hub.server.faults = None
    try:
        yield hub
    finally:
        hub.server.faults = None


@pytest.fixture(autouse=True)
def _fresh_notices() -> Iterator[None]:
    """Notices are once per process; each test counts its own."""
    notices.reset()
    yield
    notices.reset()
