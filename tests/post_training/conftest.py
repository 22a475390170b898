"""Fixtures of the post-training tests: the training kernels from this checkout (LOCAL_KERNELS,
or a `kernels serve` mirror), TRL's module globals put back after each test."""

from __future__ import annotations

from pathlib import Path

import pytest

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


# What kernels.training's Plan.mark changes process-wide on the model classes it classifies
# (layer names, conditions, the reasons and attributes the layers read, the rotary functions
# it routes): put back after each test, so tests elsewhere see transformers' classes as they are.
_FAMILIES = ("qwen3", "gemma2", "phi3", "gpt2", "mixtral")
_MARKS = (
    "kernel_layer_name", "kernel_condition", "__init__", "_kernels_unserved",
    "_kernels_attached_funcs", "kernels_logit_ops", "kernels_output_head",
    "kernels_shift_labels", "kernels_aux_loss", "kernels_mlp_projections",
    "kernels_qkv_projections",
)  # fmt: skip


def _marked_objects():
    import importlib

    for family in _FAMILIES:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        rotary = {k: v for k, v in vars(module).items() if k.startswith("apply_rotary")}
        yield module, rotary
        classes = [c for c in vars(module).values() if isinstance(c, type)]
        classes += [type(f) for f in rotary.values()]
        for cls in classes:
            yield cls, {a: cls.__dict__[a] for a in _MARKS if a in cls.__dict__}


@pytest.fixture(autouse=True)
def _model_classes_restored():
    saved = list(_marked_objects())
    yield
    for obj, attrs in saved:
        if isinstance(obj, type):
            for name in _MARKS:
                if name in attrs:
                    setattr(obj, name, attrs[name])
                elif name in obj.__dict__:
                    delattr(obj, name)
        else:
            vars(obj).update(attrs)
