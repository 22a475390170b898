"""The training-kernel variant under test, loaded from hub_kernels/ by path, and the error
measure the GPU tests compare with. No Triton at import (see conftest.py)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import torch

VARIANT = (
    Path(__file__).resolve().parents[2] / "hub_kernels/kernels-lab/training/build/torch-universal"
)


def load_variant(name: str):
    """hub_kernels' training variant imported as package `name` (one per test module, so each
    module's kernels and tuning caches are its own)."""
    spec = importlib.util.spec_from_file_location(
        name, VARIANT / "__init__.py", submodule_search_locations=[str(VARIANT)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm-wise relative error in float64; inf when `out` is not finite."""
    out, ref = out.detach().double(), ref.detach().double()
    if not torch.isfinite(out).all():
        return math.inf
    return ((out - ref).norm() / ref.norm()).item()
