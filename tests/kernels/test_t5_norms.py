"""T5-style norms bound to the RMSNorm layer. T5LayerNorm casts x̂ to its weight's dtype when
that is 16-bit; Llama's norm keeps the input's. The two agree when x and the weight share a
dtype, and differ when they do not: an fp16 T5 keeps ``wo`` in fp32, so from the first
feed-forward block on its norms see fp32 inputs with fp16 weights. Bound, such a norm must still
return what T5's own does, and the model must run (it used to fail in cross-attention with
"Half != float")."""

from __future__ import annotations

import copy

import kernels
import pytest
import torch
from kernels.training.probes import casts_to_weight_dtype
from transformers import T5Config, T5ForConditionalGeneration
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.t5.modeling_t5 import T5LayerNorm

from tests.class_marks import restored


@pytest.fixture(autouse=True)
def _model_classes_restored():
    with restored(("t5",)):
        yield


def test_the_probe_tells_t5_style_norms_from_llama_ones():
    assert casts_to_weight_dtype(T5LayerNorm(16))
    assert not casts_to_weight_dtype(LlamaRMSNorm(16))


def _fp16_t5_with_wo_in_fp32(feed_forward: str) -> T5ForConditionalGeneration:
    """A tiny T5 as an fp16 load leaves it: everything fp16 but the feed-forward ``wo``."""
    config = T5Config(
        vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
        num_heads=2, feed_forward_proj=feed_forward, dropout_rate=0.0, decoder_start_token_id=0,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config).half()
    for name, module in model.named_modules():
        if name.endswith(".wo"):
            module.float()
    return model


# Flan-T5's gated feed-forward, and the original T5's (and UDOP's) wi -> relu -> wo, which the
# loader binds to GELUMLP: neither MLP layer may serve projections of two dtypes.
@pytest.mark.parametrize("feed_forward", ["gated-gelu", "relu"])
def test_an_fp16_t5_keeping_wo_in_fp32_runs_bound_and_matches_its_own_forward(
    local_kernels, feed_forward
):
    plain = _fp16_t5_with_wo_in_fp32(feed_forward)
    bound = copy.deepcopy(plain)
    report = kernels.apply_training_kernels(bound)
    norms = [m for m in bound.modules() if isinstance(m, T5LayerNorm)]
    assert norms and all("forward" in vars(m) for m in norms), report  # every norm is bound
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 7), generator=gen)
    labels = torch.randint(0, 64, (2, 5), generator=gen)
    outs = {}
    for name, model in (("plain", plain), ("bound", bound)):
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        outs[name] = out
    assert outs["bound"].encoder_last_hidden_state.dtype == torch.float16
    torch.testing.assert_close(
        outs["bound"].encoder_last_hidden_state, outs["plain"].encoder_last_hidden_state
    )
    torch.testing.assert_close(outs["bound"].loss, outs["plain"].loss, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    "x_dtype, w_dtype",
    [
        (torch.float32, torch.float16),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
    ],
    ids=str,
)
def test_a_bound_t5_norm_returns_t5s_dtype_and_values(local_kernels, x_dtype, w_dtype):
    """Bound through the binder, one norm at each pairing of input and weight dtype: where they
    differ, T5's dtype and values exactly; where they agree, the kernel's."""
    plain = T5LayerNorm(32, eps=1e-6)
    with torch.no_grad():
        plain.weight.normal_(1.0, 0.1)
    plain = plain.to(w_dtype)
    bound = copy.deepcopy(plain)
    kernels.apply_training_kernels(torch.nn.Sequential(bound))
    assert "forward" in vars(bound)
    x = torch.randn(3, 5, 32, dtype=x_dtype)
    want, got = plain(x), bound(x)
    assert got.dtype == want.dtype
    if x_dtype != w_dtype:  # T5's own formula, in the layer: the same operations
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    else:  # the kernel (here the Triton interpreter): bf16 rounding apart
        torch.testing.assert_close(got, want)
