"""Whole tiny Llama and Qwen3 with transformers' apply_rotary_pos_emb replaced by the kernel
(in place: q/k are the projections' views, Qwen3's through its q_norm/k_norm), also under
gradient checkpointing (the layer's forward runs again inside the backward): the loss and
every parameter's gradient match the plain model in fp32, and the in-place path did run."""

from __future__ import annotations

import copy
import importlib
import sys
import types

import pytest
import torch
from _training_refs import assert_close

from tests.models.registry import VOCAB, build


@pytest.mark.parametrize(
    "model_type, variant",
    [
        ("llama", None),
        ("qwen3", None),
        ("llama", "non-reentrant"),
        ("qwen3", "reentrant"),
        ("qwen3", "MemoryEfficientRMSNorm"),
    ],
)
def test_tiny_model_matches_the_plain_one(kt, model_type, variant, monkeypatch):
    """variant: activation checkpointing, or every RMSNorm (q_norm/k_norm included) on the
    layer that keeps its output for its backward (the training benchmark's mapping): q and k
    are then that output, so the rotation must take new buffers, not raise in the backward."""
    rope = sys.modules[kt.__name__ + ".rope"]
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    plain = build(model_type)
    ours = copy.deepcopy(plain)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    plain.train(), ours.train()
    if variant in ("reentrant", "non-reentrant"):
        kwargs = {"use_reentrant": variant == "reentrant"}
        for model in (plain, ours):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    if variant == "MemoryEfficientRMSNorm":
        for module in ours.modules():
            if type(module).__name__ == "Qwen3RMSNorm":
                module.forward = types.MethodType(kt.layers.MemoryEfficientRMSNorm.forward, module)
    ref = plain(input_ids=ids, labels=ids).loss
    ref.backward()

    decisions = []
    own_memory = rope._own_memory

    def spy(x):  # records what the real check answers; changes nothing
        decisions.append(own_memory(x))
        return decisions[-1]

    monkeypatch.setattr(rope, "_own_memory", spy)
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", kt.apply_rotary_pos_emb)
    got = ours(input_ids=ids, labels=ids).loss
    got.backward()
    # every q and k rotated in place; over a norm's saved output, none
    in_place = variant != "MemoryEfficientRMSNorm"
    assert decisions and all(d is in_place for d in decisions), decisions
    assert_close(got, ref, torch.float32, "loss")
    for (name, p), q in zip(ours.named_parameters(), plain.parameters(), strict=True):
        if q.grad is not None:
            assert_close(p.grad, q.grad, torch.float32, name)
