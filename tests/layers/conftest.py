"""Fixtures for the layer-binding tests: a local kernel repo with the test layers, per test."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from kernels.layers import mapping

from .helpers import kernel_files, write_repo


@pytest.fixture
def repo_path(tmp_path: Path) -> Path:
    """A local kernel repo (build/torch-universal) with the test layers; unique to the test."""
    return write_repo(tmp_path / "testlayers", kernel_files(salt=uuid.uuid4().hex))


@pytest.fixture(autouse=True)
def _fresh_mapping():
    """Each test starts from an empty mapping; what it registers is gone afterwards."""
    token = mapping._MAPPING.set(())
    yield
    mapping._MAPPING.reset(token)
