"""The sweep's workers on a GPU: a type that ends its worker's CUDA context with a device-side
assert (the VLM sweep's layout probe once did, and 87 types after it were charged with it) is
its own row, and a fresh worker takes the types after it."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import sweep_models  # noqa: E402

from tests.models.registry import Outcome  # noqa: E402

POISON = "index-out-of-range"


def run_poison_or_add(model_type: str, *, device: str, dtype) -> Outcome:
    """The sweep runner of this test: POISON indexes past a CUDA tensor (a device-side
    assert); any other type adds on the device and matches."""
    x = torch.zeros(4, device=device, dtype=dtype)
    try:
        if model_type == POISON:
            x[torch.tensor([40], device=device)].sum().item()
        (x + 1).sum().item()
    except Exception as exc:  # noqa: BLE001 - as registry.compare reports a failing type
        return Outcome(model_type, "skipped", reason=str(exc).splitlines()[0])
    return Outcome(model_type, "match")


def test_a_device_side_assert_charges_only_its_own_type():
    types = ["first", POISON, "after-1", "after-2"]
    outcomes = sweep_models.sweep(
        types, "cuda", "fp32", limit_s=60, jobs=1, kind=f"{__name__}:run_poison_or_add"
    )
    status = {o.model_type: o.status for o in outcomes}
    assert status["first"] == "match", outcomes
    assert status[POISON] == "skipped" and "CUDA" in outcomes[1].reason, outcomes[1]
    assert status["after-1"] == status["after-2"] == "match", outcomes
