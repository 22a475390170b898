"""Image-text-to-text models from transformers' registry, trained 3 AdamW steps on batches with
images as they are and after ``kernels.apply_training_kernels(model)``: losses and gradient
norms agree (fp32, 1e-4 relative), and the text model, the vision tower and the head bind the
layers for what they hold. The one-line config switch builds VLM configs as VLMs.

The default run covers one model type per vision structure; every type runs under
``KERNELS_SWEEP=1`` (marked slow; scripts/sweep_vlm.py writes the same run to docs/models-vlm.md).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import kernels
import pytest
import torch

from tests.sweep import sweep_only

from .vlm_registry import build_vlm, mapping, run_vlm, tiny_vlm_config

ROOT = Path(__file__).resolve().parents[2]
REPO = "kernels-lab/training"


@pytest.fixture
def mirror(hub):
    hub.build(ROOT / "hub_kernels")
    return hub


# model type -> {place: layers that must bind there}
REPRESENTATIVES = {
    # Qwen2.5-VL: sectioned multimodal RoPE (t, h, w), the vision rotary over [S, H, D], RMSNorm
    # and a gated MLP with biases in the tower, window attention over packed patches;
    # flattened patches with image_grid_thw
    "qwen2_5_vl": {
        "text": {"RMSNorm", "SwiGLUMLP", "rotary_pos_emb", "MultimodalRotaryEmbedding"},
        "vision": {"RMSNorm", "SwiGLUMLP", "vision_rotary_pos_emb", "VisionVarlenAttention"},
        "head": {"CausalLMHead"},
    },
    # Qwen3-VL: interleaved multimodal RoPE; LayerNorm and a GELU MLP in the tower
    "qwen3_vl": {
        "text": {"RMSNorm", "SwiGLUMLP", "rotary_pos_emb", "MultimodalRotaryEmbedding"},
        "vision": {"LayerNorm", "GELUMLP", "vision_rotary_pos_emb", "VisionVarlenAttention"},
        "head": {"CausalLMHead"},
    },
    # Gemma 3: SigLIP's LayerNorm and tanh-GELU MLP, the projector's Gemma norm, pooled images
    "gemma3": {
        "text": {"GemmaRMSNorm", "GeGLUMLP", "rotary_pos_emb"},
        "vision": {"LayerNorm", "GELUMLP", "GemmaRMSNorm"},
        "head": {"CausalLMHead"},
    },
    # LLaVA: CLIP's quick-GELU MLP and the GELU projector, 64 image tokens per image
    "llava": {
        "text": {"RMSNorm", "SwiGLUMLP", "rotary_pos_emb"},
        "vision": {"LayerNorm", "GELUMLP"},
        "head": {"CausalLMHead"},
    },
    # LFM2-VL: a gated MLP under other names (w1/w3/w2) with an inline F.silu
    "lfm2_vl": {
        "text": {"RMSNorm", "SwiGLUMLP", "rotary_pos_emb"},
        "vision": {"LayerNorm", "GELUMLP"},
        "head": {"CausalLMHead"},
    },
    # GIT: image positions before the text; the loss on the text positions only
    "git": {"text": {"LayerNorm", "GELUMLP"}, "head": {"CausalLMHead"}},
    # Nemotron-H Omni: no head of its own, the loss on its language model's logits
    "nemotron_h_omni": {
        "text": {"RMSNormFloatWeight", "ReLUSquaredMLP"},
        "head": {"CausalLMHead"},
    },
    # MuseGlimmer: one RMSNorm class, weighted (the final norm) and scale-free (q/k, the
    # embeddings' and the perception embeddings' norms), next to Gemma-style (1 + w) norms
    "muse_glimmer": {
        "text": {"GemmaRMSNorm", "RMSNormFloatWeight", "SwiGLUMLP", "rotary_pos_emb"},
        "vision": {"LayerNorm", "GELUMLP", "RMSNormFloatWeight", "vision_rotary_pos_emb"},
        "head": {"CausalLMHead"},
    },
    # T5Gemma 2: an encoder-decoder, decoder inputs made from the labels, a masked-LM loss
    "t5gemma2": {
        "text": {"GemmaRMSNorm", "GeGLUMLP", "rotary_pos_emb"},
        "head": {"CausalLMHead"},
    },
}


IMAGE_PREFIXED = {"git"}


@pytest.mark.parametrize("model_type", sorted(REPRESENTATIVES))
def test_representative_vlms_bind_and_match_with_images(mirror, model_type):
    outcome = run_vlm(model_type)
    assert outcome.status == "match", outcome
    details = outcome.details
    assert "pixel_values" in details["inputs"], details
    # GIT puts its image features before the text: no image tokens in the text
    assert details["image_tokens"] > 0 or model_type in IMAGE_PREFIXED, details
    for place, layers in REPRESENTATIVES[model_type].items():
        missing = layers - set(details[f"{place}_bound"])
        assert not missing, (place, missing, details[f"{place}_unbound"])


def test_every_muse_glimmer_norm_binds_weighted_and_scale_free(mirror):
    """Liger patches every MuseGlimmerRMSNorm, with_scale=False ones included: so do we."""
    model = build_vlm("muse_glimmer")
    report = kernels.apply_training_kernels(model)
    norms = [n for n, m in model.named_modules() if type(m).__name__ == "MuseGlimmerRMSNorm"]
    weightless = [n for n in norms if getattr(model.get_submodule(n), "weight", None) is None]
    assert weightless and len(weightless) < len(norms), norms  # both layouts are there
    assert {n: report[n].status for n in norms} == dict.fromkeys(norms, "bound")
    assert {report[n].layer_name for n in norms} == {"RMSNormFloatWeight"}


def test_kernel_config_for_a_vlm_checkpoint_is_accepted_by_transformers(mirror, tmp_path):
    """A VLM's config used to fail: it was built with AutoModelForCausalLM (no Qwen2.5-VL there).
    Now it is built as the image-text-to-text model, its vision layers are in the mapping, and
    transformers' check of the mapping against the loaded model passes."""
    from transformers import AutoModelForImageTextToText

    build_vlm("qwen2_5_vl").save_pretrained(tmp_path / "ckpt")
    config = kernels.training_kernel_config(str(tmp_path / "ckpt"))
    assert {
        "CausalLMHead", "MultimodalRotaryEmbedding", "RMSNorm", "SwiGLUMLP", "rotary_pos_emb",
        "vision_rotary_pos_emb",
    } <= set(config.kernel_mapping)  # fmt: skip
    assert config.kernel_mapping["vision_rotary_pos_emb"] == f"{REPO}:vision_rotary_pos_emb"
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "ckpt")
    config.sanitize_kernel_mapping(model)  # raises "Layer ... is not registered" otherwise


def test_model_class_picks_the_vlm_where_a_type_has_both(mirror):
    """Mllama has a causal LM (text only) and a VLM: the causal one is the default, the VLM
    (vision LayerNorm and GELU MLP, the multimodal head) where model_class says so."""
    from transformers import AutoModelForImageTextToText

    config = tiny_vlm_config("mllama")
    text = kernels.training_kernel_mapping(config)
    vlm = kernels.training_kernel_mapping(config, model_class=AutoModelForImageTextToText)
    assert {"CausalLMHead", "RMSNorm", "SwiGLUMLP"} <= set(text)
    assert not {"GELUMLP", "LayerNorm"} & set(text)  # no vision tower in the causal LM
    assert {"CausalLMHead", "GELUMLP", "LayerNorm", "RMSNorm", "SwiGLUMLP"} <= set(vlm)


@sweep_only("every image-text-to-text type (~30 min on 2 cores)")
@pytest.mark.parametrize("model_type", list(mapping()))
def test_every_registered_vlm(mirror, model_type):
    """Every type: skipped only if its plain model or its inputs cannot be made here; else the
    kernelized copy matches (what binds is in docs/models-vlm.md)."""
    outcome = run_vlm(model_type)
    if outcome.status == "skipped":
        pytest.skip(outcome.reason)
    assert outcome.status == "match", outcome


# type -> (config overrides that make the head's numerics show, {place: layers}, what the head
# does to its logits or its loss)
HEADS = {
    # loss += config.text_config.router_aux_loss_coef * aux_loss, router logits on
    "qwen3_vl_moe": {
        "text_config.output_router_logits": True,
        "text_config.router_aux_loss_coef": 0.5,
    },
    # final_logit_softcapping read from the text config with getattr
    "paligemma": {"text_config.final_logit_softcapping": 3.0},
    # logits * config.text_config.logits_scaling (the tiny config sets 4.0)
    "hyperclovax_vision_v2": {},
}


@pytest.mark.parametrize("model_type", sorted(HEADS))
def test_multimodal_heads_bind_with_what_they_do_to_their_logits(mirror, model_type):
    outcome = run_vlm(model_type, overrides=HEADS[model_type])
    assert outcome.status == "match", (outcome.loss_diff, outcome.grad_diff, outcome.reason)
    assert outcome.details["head_bound"] == ["CausalLMHead"], outcome.details["head_unbound"]


# type -> what the forward does with the labels that the loss head must do the same way
LOSS_RULES = {
    "git": "drops its image positions; takes a caller's shift_labels against the text positions",
    "idefics": "a Linear subclass for a head (probed to compute the Linear), labels shifted",
    "kosmos-2.5": "its text model computes the causal loss; the model returns it",
    "pix2struct": "its decoder computes a plain CE on the labels as they come; the model returns it",
    "udop": "decoder inputs from the labels when none are given; a plain CE on the labels",
    "nemotron_h_omni": "its language model's logits, labels shifted",
    "t5gemma2": "decoder inputs from the labels, the labels unshifted (masked-LM loss)",
}


def _loss_and_grads(model, batch: dict):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


@pytest.mark.parametrize("model_type", sorted(LOSS_RULES))
def test_bound_heads_give_the_models_own_loss_and_gradients(mirror, model_type):
    """The bound head's loss and gradients are the model's own (fp32, 1e-5 relative) with
    ignored label positions, with ``num_items_in_batch`` and, for GIT, with a caller's
    ``shift_labels``, each of which the head must take as the family's forward does."""
    import copy

    from .vlm_registry import vlm_batches

    plain = build_vlm(model_type).train()
    ours = copy.deepcopy(plain)
    report = kernels.apply_training_kernels(ours)
    assert any(e.layer_name == "CausalLMHead" and e.status == "bound" for e in report)
    batch = vlm_batches(plain, "cpu", steps=1)[0]
    labels = batch["labels"].clone()
    labels[0, -3:] = -100  # padding at the end of one sample
    variants = [{"labels": labels}, {"labels": labels, "num_items_in_batch": torch.tensor(5)}]
    if model_type == "git":
        # a caller's targets, one per text position (as a context-parallel collator makes them)
        shifted = labels.roll(-2, dims=1)
        shifted[:, -2:] = -100
        variants.append({"labels": labels, "shift_labels": shifted})
    for extra in variants:
        inputs = {**batch, **extra}
        want, want_grads = _loss_and_grads(plain, inputs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, got_grads = _loss_and_grads(ours, inputs)
        # the head was folded into the fused loss, not run on its own forward
        assert not [w for w in caught if "cannot fold" in str(w.message)], model_type
        # the fused loss ran: in training it makes no logits (the family's forward does)
        assert ours(**inputs).logits is None
        assert torch.allclose(got, want, rtol=1e-5, atol=0), (sorted(extra), got, want)
        assert got_grads.keys() == want_grads.keys()
        for name, g in want_grads.items():
            # 1e-4 of the gradient's size; an absolute floor for gradients that are zero but
            # for rounding (a key projection's bias under softmax)
            limit = 1e-4 * g.abs().max() + 1e-9
            assert (got_grads[name] - g).abs().max() <= limit, (sorted(extra), name)


def test_a_masked_lm_head_under_fused_lm_head_ignores_a_callers_shift_labels(mirror):
    """T5Gemma 2's loss (transformers' masked-LM loss) takes the labels as they are and ignores
    a caller's ``shift_labels``; TRL's ``fused_lm_head=True`` call must give that same loss."""
    import copy

    from .vlm_registry import vlm_batches

    plain = build_vlm("t5gemma2").train()
    ours = copy.deepcopy(plain)
    kernels.apply_training_kernels(ours)
    batch = vlm_batches(plain, "cpu", steps=1)[0]
    labels = batch["labels"]
    other = labels.roll(-1, dims=1)  # a caller's targets the model's own loss never reads
    want = plain(**batch).loss
    got = ours(**batch, shift_labels=other, fused_lm_head=True).loss
    assert torch.allclose(got, want, rtol=1e-5, atol=0), (got, want)


def test_an_encoder_decoder_gets_its_float64_run_in_bf16(mirror):
    """The bf16 verdict's routing check calls the bf16 model with the labels too: T5Gemma 2's
    decoder makes its inputs from them, and without them the check raised, leaving the type
    with no float64 comparison ("no float64 run")."""
    outcome = run_vlm("t5gemma2", dtype=torch.bfloat16)
    assert outcome.verdict is not None, outcome.reason
    assert "no float64 run" not in outcome.reason, outcome.reason
