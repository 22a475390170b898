"""The cache the fused loss head hands its decoder in a training step (``step_cache``): the
attention of a bound model gets SDPA's implicit causal mask, compiled or not, exactly where the
plain model's would; packed positions, a padding mask and gradient checkpointing keep what
transformers does without a cache; the step returns no cache and computes the same loss.
"""

from __future__ import annotations

import copy
import logging

import kernels
import pytest
import torch
import torch.nn.functional as F

from tests.class_marks import restored
from tests.models.registry import causal_lm_class, tiny_config


@pytest.fixture(autouse=True)
def _model_classes_restored():
    with restored(("llama", "qwen3", "qwen3_moe", "gemma3", "jamba")):
        yield


def pair(model_type: str):
    """(plain, bound) copies of one tiny sdpa model with the same weights."""
    torch.manual_seed(0)
    plain = (
        causal_lm_class(model_type)
        ._from_config(tiny_config(model_type), attn_implementation="sdpa")
        .train()
    )
    bound = copy.deepcopy(plain)
    kernels.apply_training_kernels(bound)
    return plain, bound


class SdpaCalls:
    """Records the (has a mask, is_causal) of every eager SDPA call while active."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple[bool, bool]] = []
        original = F.scaled_dot_product_attention

        def spy(*args, **kwargs):
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            self.calls.append((mask is not None, bool(kwargs.get("is_causal", False))))
            return original(*args, **kwargs)

        monkeypatch.setattr(F, "scaled_dot_product_attention", spy)


def traced_sdpa(model, **inputs) -> list[dict]:
    """The keyword arguments of the SDPA calls in the graph Dynamo traces for one step."""
    found: list[dict] = []

    def backend(gm, example):
        for node in gm.graph.nodes:
            if "scaled_dot_product" in str(node.target):
                found.append(dict(node.kwargs))
        return gm.forward

    torch.compile(model, backend=backend, fullgraph=True)(**inputs).loss.backward()
    return found


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen3_moe"])
def test_compiled_step_keeps_the_causal_mask_implicit(local_kernels, model_type):
    _, bound = pair(model_type)
    ids = torch.randint(0, 256, (2, 16))
    calls = traced_sdpa(bound, input_ids=ids, labels=ids)
    assert calls, "no SDPA call traced"
    for kwargs in calls:
        assert kwargs.get("attn_mask") is None, kwargs
        assert kwargs.get("is_causal") is True, kwargs


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])  # gemma3: sliding windows
def test_eager_step_matches_plain_and_returns_no_cache(local_kernels, monkeypatch, model_type):
    plain, bound = pair(model_type)
    ids = torch.randint(0, 256, (2, 16))
    spy = SdpaCalls(monkeypatch)
    out = bound(input_ids=ids, labels=ids)
    window = getattr(bound.config, "sliding_window", None)
    if window is None or window >= ids.shape[1]:
        assert spy.calls and all(c == (False, True) for c in spy.calls), spy.calls
    assert out.past_key_values is None
    ref = plain(input_ids=ids, labels=ids, use_cache=False)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    ref.loss.backward()
    for (name, p), q in zip(bound.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_packed_positions_keep_the_packed_mask(local_kernels):
    """Two sequences packed in one row (positions restart): no cache, so transformers finds
    them and masks across the boundary, as the plain model does."""
    plain, bound = pair("llama")
    ids = torch.randint(0, 256, (1, 16))
    positions = torch.cat([torch.arange(7), torch.arange(9)])[None]
    out = bound(input_ids=ids, labels=ids, position_ids=positions)
    ref = plain(input_ids=ids, labels=ids, position_ids=positions, use_cache=False)
    unpacked = plain(input_ids=ids, labels=ids, use_cache=False)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(ref.loss, unpacked.loss)  # the packing changed the loss


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_gradient_checkpointing_gets_no_cache(local_kernels):
    """Its layers would drop a cache with a warning each step: none is handed to them."""
    plain, bound = pair("llama")
    for model in (plain, bound):
        model.gradient_checkpointing_enable()
    ids = torch.randint(0, 256, (2, 16))
    collect, logger = Collect(), logging.getLogger("transformers")  # it does not propagate
    logger.addHandler(collect)
    try:
        out = bound(input_ids=ids, labels=ids)
    finally:
        logger.removeHandler(collect)
    assert not any("gradient checkpointing" in m for m in collect.messages), collect.messages
    ref = plain(input_ids=ids, labels=ids, use_cache=False)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)


def test_a_caller_asking_for_a_cache_gets_a_full_one(local_kernels):
    _, bound = pair("llama")
    ids = torch.randint(0, 256, (2, 16))
    out = bound(input_ids=ids, labels=ids, use_cache=True)
    cache = out.past_key_values
    assert type(cache).__name__ == "DynamicCache" and cache.get_seq_length() == 16


def test_masking_reads_the_export_flag_after_binding(local_kernels, monkeypatch):
    """Older Dynamo answers torch.compiler.is_exporting() with True in any trace, so
    transformers would build the mask in every compiled step (tests/gpu/test_compile_gpu.py
    traces it on such a torch): after binding, its masking module reads the flag export sets."""
    import transformers.masking_utils as masking

    pair("qwen3")
    monkeypatch.setattr(torch.compiler, "_is_exporting_flag", True)
    assert masking.is_torchdynamo_exporting() is True
    monkeypatch.setattr(torch.compiler, "_is_exporting_flag", False)
    assert masking.is_torchdynamo_exporting() is False
    # such a Dynamo, simulated: is_exporting() is True whenever Dynamo traces it
    monkeypatch.setattr(
        torch.compiler, "is_exporting", lambda: torch.compiler.is_compiling() or False
    )
    traced = torch.compile(lambda x: x + int(masking.is_torchdynamo_exporting()), fullgraph=True)
    assert traced(torch.zeros(())).item() == 0  # read in a trace as the flag's value


def test_a_hybrid_decoder_gets_no_step_cache(local_kernels):
    """Jamba's DynamicCache holds recurrent (mamba) layers, which a step cache would hand
    attention's calls (ValueError from get_seq_length): the step runs as without a cache."""
    plain, bound = pair("jamba")
    assert not getattr(type(bound), "kernels_step_cache", False)
    ids = torch.randint(0, 256, (2, 16))
    out = bound(input_ids=ids, labels=ids)
    ref = plain(input_ids=ids, labels=ids, use_cache=False)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
