"""The bound loss head speaks TRL 1.16's fused-head contract itself: ``model(..., labels=...,
fused_lm_head=True)`` on a kernelized model (no TRL wrapper) returns what TRL's
``add_fused_lm_head`` returns on the plain model: every per-token field, the loss (with
``num_items_in_batch``, ``shift_labels`` and the MoE load-balancing term) and every gradient,
computed by the training kernels' log-prob head without [tokens, vocab] logits."""

from __future__ import annotations

import copy

import kernels
import pytest
import torch
from kernels.layers.binding import bound_layer

from tests.models.registry import VOCAB, build

trl_utils = pytest.importorskip("trl.trainer.utils")

FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")


def _pair(model_type: str, **overrides):
    plain = build(model_type, overrides=overrides).float().train()
    ours = copy.deepcopy(plain)
    kernels.apply_training_kernels(ours)
    return plain, ours


def _batch(seed: int = 0, ignored: int = 3):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 11), generator=gen)
    labels = ids.clone()
    labels[:, :ignored] = -100
    labels[1, -2] = -100  # a hole inside the completion
    return ids, labels


def _compare(ours, plain, call, options, trl_options, aux=False):
    trl_utils.add_fused_lm_head(plain, **trl_options)
    out = call(ours, dict(options))
    ref = call(plain, {})
    assert type(out).__name__ == "FusedCausalLMOutput"
    for name in FIELDS:
        got, want = getattr(out, name), getattr(ref, name)
        if want is None:
            assert got is None, name
            continue
        assert got.dtype == want.dtype and got.shape == want.shape, name
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    if aux:
        assert out.aux_loss is not None
        torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=1e-5, atol=1e-6)
    grad_out = out.loss + (out.entropy.sum() * 1e-2 if out.entropy is not None else 0)
    grad_ref = ref.loss + (ref.entropy.sum() * 1e-2 if ref.entropy is not None else 0)
    grad_out.backward()
    grad_ref.backward()
    for (name, p), q in zip(ours.named_parameters(), plain.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "model_type, layer",
    [("qwen3", "ForCausalLM"), ("gemma2", "ForCausalLM"), ("gpt2", "CausalLMHead")],
)
def test_fused_call_matches_trls_head(local_kernels, model_type, layer):
    """gemma2: soft-capped logits; gpt2: the generic head (the family's own forward runs)."""
    plain, ours = _pair(model_type)
    assert bound_layer(ours).__name__ == layer
    ids, labels = _batch()
    outputs = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    options = {"temperature": 0.7, "fused_outputs": outputs}

    def call(model, extra):
        return model(input_ids=ids, labels=labels, fused_lm_head=True, **extra)

    _compare(ours, plain, call, options, {"temperature": 0.7, "outputs": outputs})


def test_shift_labels_and_num_items(local_kernels):
    """Pre-shifted labels (context / sequence parallelism) are scored as they are, and the loss
    divides by num_items_in_batch; the default fields are the log-probs only."""
    plain, ours = _pair("qwen3")
    ids, labels = _batch(1)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]

    def call(model, extra):
        return model(
            input_ids=ids, shift_labels=shifted, num_items_in_batch=torch.tensor(7.0),
            fused_lm_head=True, **extra,
        )  # fmt: skip

    _compare(ours, plain, call, {}, {})


def test_all_labels_ignored_gives_a_zero_loss_that_backpropagates(local_kernels):
    plain, ours = _pair("qwen3")
    ids, labels = _batch(2, ignored=11)
    out = ours(input_ids=ids, labels=labels, fused_lm_head=True)
    assert out.loss == 0 and not out.label_mask.any()
    out.loss.backward()  # connected to the graph, as TRL's head is
    assert ours.model.embed_tokens.weight.grad is not None


def test_moe_router_logits_add_the_load_balancing_loss(local_kernels):
    plain, ours = _pair("mixtral", output_router_logits=True, router_aux_loss_coef=0.02)
    assert bound_layer(ours).__name__ == "MoEForCausalLM"
    ids, labels = _batch(3)

    def call(model, extra):
        return model(input_ids=ids, labels=labels, fused_lm_head=True, **extra)

    _compare(ours, plain, call, {}, {}, aux=True)


def test_unknown_fused_outputs_is_an_error(local_kernels):
    _, ours = _pair("qwen3")
    ids, labels = _batch()
    with pytest.raises(ValueError, match="fused_outputs"):
        ours(input_ids=ids, labels=labels, fused_lm_head=True, fused_outputs=("logits",))
