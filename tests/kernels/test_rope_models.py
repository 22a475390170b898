"""Whole tiny Llama and Qwen3 with transformers' apply_rotary_pos_emb replaced by the kernel
(in place: q/k are the projections' views, Qwen3's through its q_norm/k_norm), also under
gradient checkpointing (the layer's forward runs again inside the backward): the loss and
every parameter's gradient match the plain model in fp32, and the in-place path did run."""

from __future__ import annotations

import copy
import importlib
import sys

import pytest
import torch
from _training_refs import assert_close

from tests.models.registry import VOCAB, build


@pytest.mark.parametrize(
    "model_type, checkpointing",
    [("llama", None), ("qwen3", None), ("llama", "non-reentrant"), ("qwen3", "reentrant")],
)
def test_tiny_model_matches_the_plain_one(kt, model_type, checkpointing, monkeypatch):
    rope = sys.modules[kt.__name__ + ".rope"]
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    plain = build(model_type)
    ours = copy.deepcopy(plain)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    plain.train(), ours.train()
    if checkpointing:
        kwargs = {"use_reentrant": checkpointing == "reentrant"}
        for model in (plain, ours):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
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
    assert decisions and all(decisions), decisions  # every q and k was rotated in place
    assert_close(got, ref, torch.float32, "loss")
    for (name, p), q in zip(ours.named_parameters(), plain.parameters(), strict=True):
        if q.grad is not None:
            assert_close(p.grad, q.grad, torch.float32, name)
