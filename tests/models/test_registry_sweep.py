"""Causal LMs from transformers' registry, trained 3 AdamW steps as they are and after
``kernels.apply_training_kernels(model)``: losses and gradient norms agree (fp32, 1e-4
relative), and the modules of each structural kind bind the layer for that kind.

The default run covers one model type per structure; the whole registry runs under
``KERNELS_SWEEP=1`` (marked slow; scripts/sweep_models.py writes the same run to docs/models.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sweep import sweep_only

from .registry import run_one

ROOT = Path(__file__).resolve().parents[2]

# model type -> layers that must bind (one type per structural kind the classifier knows)
REPRESENTATIVES = {
    # Llama: RMSNorm, separate gate/up SwiGLU, decorated rotate-half rotary, Llama-style head
    "llama": {"RMSNorm", "SwiGLUMLP", "rotary_pos_emb", "ForCausalLM"},
    # Gemma 2: (1 + weight) fp32 norm, GeGLU, final logit soft-capping
    "gemma2": {"GemmaRMSNorm", "GeGLUMLP", "rotary_pos_emb", "ForCausalLM"},
    # GLM-4: fused gate_up_proj, an undecorated partial interleaved rotary function
    "glm4": {"RMSNorm", "FusedSwiGLUMLP", "half_interleaved_rotary_pos_emb", "ForCausalLM"},
    # OLMo 2: the weight multiplies in fp32; q/k norms over the whole projection
    "olmo2": {"RMSNormFloatWeight", "SwiGLUMLP", "rotary_pos_emb", "ForCausalLM"},
    # Cohere: LayerNorm without bias, interleaved rotary (cos repeated per pair), logit_scale
    "cohere": {"LayerNorm", "SwiGLUMLP", "interleaved_rotary_pos_emb", "ForCausalLM"},
    # Granite: logits_scaling
    "granite": {"RMSNorm", "SwiGLUMLP", "rotary_pos_emb", "ForCausalLM"},
    # GPT-OSS: its decorated rotary takes one cos/sin value per pair (served as half_rotary_pos_emb)
    "gpt_oss": {"RMSNormFloatWeight", "half_rotary_pos_emb", "MoEForCausalLM"},
    # HyperCLOVA X: multiplies by logits_scaling (Granite divides): read from its forward
    "hyperclovax": {"RMSNorm", "SwiGLUMLP", "ForCausalLM"},
    # StableLM: LayerNorm with bias; partial rotary split off by the attention module
    "stablelm": {"LayerNorm", "SwiGLUMLP", "rotary_pos_emb", "ForCausalLM"},
    # Mixtral: the MoE head (output_router_logits)
    "mixtral": {"RMSNorm", "rotary_pos_emb", "MoEForCausalLM"},
    # GPT-2: decoder `transformer`, its own arguments: the generic head
    "gpt2": {"LayerNorm", "CausalLMHead"},
    # BERT as a decoder: the logits' Linear is cls.predictions.decoder (get_output_embeddings)
    "bert": {"LayerNorm", "CausalLMHead"},
    # BART's decoder: nn.CrossEntropyLoss over labels it does not shift
    "bart": {"LayerNorm", "CausalLMHead"},
    # LongCat-Flash: q's width is the config's qk_head_dim, derived when the config is made
    # (the tiny config derives it again from the shrunk head dims)
    "longcat_flash": {"RMSNorm", "SwiGLUMLP", "ForCausalLM"},
}


@pytest.fixture
def mirror(hub):
    hub.build(ROOT / "hub_kernels")
    return hub


@pytest.mark.parametrize("model_type", sorted(REPRESENTATIVES))
def test_representative_model_types_bind_and_match(mirror, model_type):
    outcome = run_one(model_type)
    assert outcome.status == "match", outcome
    missing = REPRESENTATIVES[model_type] - set(outcome.bound)
    assert not missing, f"{model_type}: {sorted(missing)} not bound: {outcome.unbound}"


def test_partial_rotary_inside_the_rotary_function(mirror):
    """Phi-3 with partial_rotary_factor 0.5: its apply_rotary_pos_emb rotates the first half of
    each head and passes the rest; the bound layer must do the same."""
    outcome = run_one("phi3", overrides={"rope_parameters": {"partial_rotary_factor": 0.5}})
    assert outcome.status == "match", outcome
    assert {"rotary_pos_emb", "FusedSwiGLUMLP"} <= set(outcome.bound), outcome


def test_unserved_modules_are_named_with_their_reason(mirror):
    """GPT-J's rotary function has its own signature, Apertus's MLP is not gated and its
    activation no GELU, and BitNet's gated MLP squares a ReLU, which no fused gated kernel
    computes: each keeps its forward and the report says why (the rest of the model still binds;
    GPT-J's non-gated GELU MLP binds GELUMLP)."""
    gptj, apertus, bitnet = run_one("gptj"), run_one("apertus"), run_one("bitnet")
    assert any(u.startswith("rotary: takes (tensor, sin, cos)") for u in gptj.unbound)
    assert "GELUMLP" in gptj.bound and gptj.status == "match", gptj
    assert any(u.startswith("mlp: not gated") for u in apertus.unbound)
    assert "mlp: activation ReLUSquaredActivation has no fused gated kernel (SiLU, GELU)" in (
        bitnet.unbound
    )
    assert bitnet.status == "match", bitnet


def _all_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@sweep_only("the whole registry (~30 min on 2 cores)")
@pytest.mark.parametrize("model_type", _all_types())
def test_every_registered_causal_lm(mirror, model_type):
    """Every model type: skipped only if its plain model does not build or train here; else
    the kernelized copy matches (unbound modules are listed in docs/models.md)."""
    outcome = run_one(model_type)
    if outcome.status == "skipped":
        pytest.skip(outcome.reason)
    assert outcome.status == "match", outcome
