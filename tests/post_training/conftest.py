"""Fixtures of the post-training tests: the training kernels from this checkout (LOCAL_KERNELS,
or a `kernels serve` mirror), TRL's module globals put back after each test."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.class_marks import restored

ROOT = Path(__file__).resolve().parents[2]
TRAINING = ROOT / "hub_kernels" / "kernels-lab" / "training"


@pytest.fixture
def local_kernels(monkeypatch):
    """kernels-lab/training served from this checkout's folder (no HTTP)."""
    monkeypatch.setenv("LOCAL_KERNELS", f"kernels-lab/training={TRAINING}")


@pytest.fixture
def mirror(hub):
    """kernels-lab/training from `kernels serve` over real HTTP."""
    hub.build(ROOT / "hub_kernels")
    return hub


@pytest.fixture(autouse=True)
def _trl_globals_restored():
    yield
    from kernels.training import trl_head

    trl_head.release_all()


@pytest.fixture(autouse=True)
def _model_classes_restored():
    with restored(("qwen3", "gemma2", "phi3", "gpt2", "mixtral")):
        yield
