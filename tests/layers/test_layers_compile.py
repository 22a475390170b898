"""torch.compile over a model whose layers and functions are bound by kernelize.

Binding a function (transformers' apply_rotary_pos_emb) per calling module uses a stack of
active owners; under Dynamo that stack must be traceable, or every attention layer breaks the
graph. The training kernels' ops must also give real outputs with the strides their fake
registrations promise, or the compiled backward fails at the first view.
"""

from __future__ import annotations

from pathlib import Path

import kernels
import torch
from kernels.layers.binding import bound_layer
from torch._dynamo.utils import counters

from .helpers import tiny_qwen3

TRAINING = (
    Path(__file__).resolve().parents[2] / "hub_kernels/kernels-lab/training/build/torch-universal"
)


def _mapping() -> dict[str, str]:
    return {
        "RMSNorm": f"{TRAINING}:MemoryEfficientRMSNorm",
        "rotary_pos_emb": f"{TRAINING}:rotary_pos_emb",
    }


def test_compiled_kernelized_model_has_no_graph_break_and_matches(monkeypatch):
    model, reference = tiny_qwen3(seed=3).train(), tiny_qwen3(seed=3).train()
    report = kernels.apply_kernels(model, _mapping())
    bound = [e for e in report if e.status == "bound"]
    assert {e.layer_name for e in bound} == {"RMSNorm", "rotary_pos_emb"}, str(report)
    calls: list[str] = []
    layers_module = __import__(bound_layer(model.model.norm).__module__, fromlist=["rms_norm"])
    for name in ("rms_norm", "apply_rotary_pos_emb"):
        original = getattr(layers_module, name)

        def counting(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(layers_module, name, counting)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    ids = torch.randint(0, 1000, (2, 24))
    out = compiled(input_ids=ids, labels=ids)
    out.loss.backward()
    ref = reference(input_ids=ids, labels=ids)
    ref.loss.backward()

    assert dict(counters["graph_break"]) == {}
    # Traced into the graph (each layer once), not skipped: norms and the per-owner rotary.
    assert calls.count("apply_rotary_pos_emb") == 2 and calls.count("rms_norm") == 9
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
