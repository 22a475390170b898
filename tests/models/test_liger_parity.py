"""Parity with Liger 0.8.5: every causal-LM model type Liger patches binds, on the same classes,
at least what Liger patches by default (norms, rotary, MLP/experts, loss), and matches the plain
model (fp32, 1e-4 relative over 3 AdamW steps).

The table of what Liger patches (liger_patches.py) is checked against Liger's own source when
liger-kernel is installed. The families whose binding closed a gap with Liger run by default at
settings that make their numerics show (muP multipliers off one, a logit soft-cap on); every
Liger type runs under ``KERNELS_SWEEP=1``.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from tests.sweep import sweep_only

from .liger_patches import KINDS, LIGER_PATCHES
from .registry import run_one

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def mirror(hub):
    hub.build(ROOT / "hub_kernels")
    return hub


def _unbound_liger_classes(outcome) -> dict[str, str]:
    """Liger-patched names of the model that no training-kernel layer serves, with the reason."""
    names = {n for kind in KINDS for n in LIGER_PATCHES[outcome.model_type][kind]}
    return {n: r for n, r in outcome.unbound_classes.items() if n in names}


# type -> (config overrides that make the family's numerics show, {Liger name: our layer})
CLOSED_GAPS = {
    # lm_head(hidden) * model.lm_head_multiplier; down(silu(gate(x) * g) * up(x)) * d
    "falcon_h1": (
        {"lm_head_multiplier": 0.37, "mlp_multipliers": [0.6, 1.7]},
        {"FalconH1ForCausalLM": "ForCausalLM", "FalconH1MLP": "ScaledSwiGLUMLP"},
    ),
    # apply_rotary_emb(xq [B, T, H, D], xk, freqs_cis): complex product, attention scaling on
    "llama4_text": (
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 32}},
        {"apply_rotary_emb": "complex_rotary_emb", "Llama4TextRMSNorm": "RMSNorm"},
    ),
    # the same with q/k [B, H, T, D] (beyond Liger, which leaves DeepSeek-V2's rotary alone)
    "deepseek_v2": ({}, {"apply_rotary_emb": "complex_rotary_emb_bhtd"}),
    # the multimodal head soft-caps with its text config's final_logit_softcapping
    "gemma4": (
        {"text_config.final_logit_softcapping": 10.0},
        {"Gemma4ForConditionalGeneration": "CausalLMHead", "Gemma4TextMLP": "GeGLUMLP"},
    ),
}  # fmt: skip


@pytest.mark.parametrize("model_type", sorted(CLOSED_GAPS))
def test_closed_gaps_bind_and_match(mirror, model_type):
    overrides, layers = CLOSED_GAPS[model_type]
    outcome = run_one(model_type, overrides=overrides)
    assert outcome.status == "match", (outcome.loss_diff, outcome.grad_diff, outcome.reason)
    for name, layer in layers.items():
        assert outcome.classes.get(name) == layer, (name, outcome.classes, outcome.unbound)
    if model_type in LIGER_PATCHES:
        assert not _unbound_liger_classes(outcome), outcome.unbound_classes


def test_nemotron_builds_and_binds_its_relu_squared(mirror):
    """Nemotron's config leaves num_key_value_heads None (the sweep used to skip it); Liger
    patches its ReLU² activation: ReLUSquared serves that, ReLUSquaredMLP the MLP around it."""
    outcome = run_one("nemotron")
    assert outcome.status == "match", outcome
    assert outcome.classes.get("NemotronForCausalLM") == "ForCausalLM"
    assert outcome.classes.get("ReLUSquaredActivation") == "ReLUSquared"
    assert outcome.classes.get("NemotronMLP") == "ReLUSquaredMLP"
    assert not _unbound_liger_classes(outcome), outcome.unbound_classes


@sweep_only("every Liger type (~1 min)")
@pytest.mark.parametrize("model_type", sorted(LIGER_PATCHES))
def test_every_liger_type_binds_what_liger_patches(mirror, model_type):
    outcome = run_one(model_type)
    assert outcome.status == "match", outcome
    missing = _unbound_liger_classes(outcome)
    assert not missing, missing


# -- the table against Liger's source ---------------------------------------------------------

# Where the names Liger's apply functions assign differ from the table's, and why:
# (names only Liger's source has, names only the table has).
_RECONCILED = {
    # the text apply is called with fused_linear_cross_entropy=False; `if layer_norm and ...`
    "gemma3": ({"Gemma3ForCausalLM"}, {"LayerNorm"}),
    "gemma4": ({"Gemma4ForCausalLM"}, set()),
    "mllama": (set(), {"LayerNorm"}),
    # the rotary function is assigned inside apply_liger_llama4_rope_full
    "llama4": (set(), {"apply_rotary_emb"}),
    "llama4_text": (set(), {"apply_rotary_emb"}),
    # Liger swaps the functional cross-entropy the loss calls; the table names the loss's class
    "granite": ({"cross_entropy"}, {"GraniteForCausalLM"}),
    # transformers < 5 branches
    "mixtral": ({"MixtralBlockSparseTop2MLP"}, set()),
    "qwen3_moe": ({"Qwen3MoeMLP"}, set()),
    "qwen3_next": ({"Qwen3NextMLP"}, set()),
    "hunyuan_v1_moe": ({"HunYuanMoEV1MLP"}, set()),
    # the multimodal heads of the same module (another model type's causal class)
    "qwen3_5": ({"Qwen3_5ForConditionalGeneration"}, set()),
    "qwen3_5_text": ({"Qwen3_5ForConditionalGeneration"}, set()),
    "qwen3_5_moe": ({"Qwen3_5MoeForConditionalGeneration"}, set()),
    "qwen3_5_moe_text": ({"Qwen3_5MoeForConditionalGeneration"}, set()),
    # ACT2FN["relu2"] builds transformers' ReLUSquaredActivation
    "nemotron": ({"modeling_nemotron.ACT2FN['relu2']"}, {"ReLUSquaredActivation"}),
    # an attribute of Liger's own RMSNorm subclass, not a patch
    "exaone4": ({"in_place"}, set()),
}


def _default_targets(fn, monkey_patch) -> set[str]:
    """Names an ``apply_liger_kernel_to_*`` function assigns under the switches that default
    to True (and under the apply functions it calls)."""
    func = ast.parse(inspect.getsource(fn)).body[0]
    args = [a.arg for a in func.args.args]
    defaults = dict(
        zip(args[len(args) - len(func.args.defaults) :], func.args.defaults, strict=True)
    )
    on = {name for name, node in defaults.items() if getattr(node, "value", None) is True}
    names: set[str] = set()
    for stmt in func.body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "").startswith(
                "apply_liger_kernel_to_"
            ):
                names |= _default_targets(getattr(monkey_patch, node.func.id), monkey_patch)
        if not (isinstance(stmt, ast.If) and getattr(stmt.test, "id", None) in on):
            continue
        for node in ast.walk(stmt):
            for target in getattr(node, "targets", []) if isinstance(node, ast.Assign) else []:
                if isinstance(target, ast.Subscript):
                    names.add(ast.unparse(target))
                elif isinstance(target, ast.Attribute) and target.attr != "forward":
                    names.add(target.attr)
                elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Attribute):
                    names.add(target.value.attr)  # modeling_x.XForCausalLM.forward = ...
    return names


def test_liger_table_matches_liger_source():
    monkey_patch = pytest.importorskip("liger_kernel.transformers.monkey_patch")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    applies = {
        t: fn
        for t, fn in monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN.items()
        if t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    }
    assert set(applies) == set(LIGER_PATCHES)
    for model_type, fn in applies.items():
        table = {n for kind in KINDS for n in LIGER_PATCHES[model_type][kind]}
        liger = _default_targets(fn, monkey_patch)
        only_liger, only_table = _RECONCILED.get(model_type, (set(), set()))
        assert (liger - table, table - liger) == (only_liger, only_table), model_type
