"""What Liger 0.8.5 patches, by default, for each causal-LM model type it knows that transformers
5.24 ships (``liger_kernel.transformers.monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN``, read from
its source; tests/models/test_liger_parity.py checks this table against an installed Liger).

Per model type and kind (norm, rotary, mlp, experts, loss): the names of the classes or
functions Liger replaces with its defaults: a module class (``LlamaRMSNorm``), a rotary
function (``apply_rotary_pos_emb``), an activation (``ReLUSquaredActivation``), or for the loss
the ``*ForCausalLM`` class whose forward it swaps for its fused linear cross-entropy one.
scripts/sweep_models.py compares these names with the classes the training kernels bind.
"""

from __future__ import annotations

LIGER_VERSION = "0.8.5"
KINDS = ("norm", "rotary", "mlp", "experts", "loss")
ROPE = ("apply_rotary_pos_emb",)


def _patch(norm=(), rotary=ROPE, mlp=(), experts=(), loss=(), note="") -> dict:
    return {
        "norm": tuple(norm),
        "rotary": tuple(rotary),
        "mlp": tuple(mlp),
        "experts": tuple(experts),
        "loss": tuple(loss),
        "note": note,
    }


def _dense(prefix: str, causal: str | None = None, **kw) -> dict:
    """RMSNorm, rotate-half RoPE, SwiGLU/GeGLU MLP and the fused loss of a Llama-like family."""
    kw.setdefault("norm", (f"{prefix}RMSNorm",))
    kw.setdefault("mlp", (f"{prefix}MLP",))
    kw.setdefault("loss", (causal or f"{prefix}ForCausalLM",))
    return _patch(**kw)


LIGER_PATCHES: dict[str, dict] = {
    "deepseek_v2": _dense(
        "DeepseekV2", rotary=(), experts=("DeepseekV2Experts",),
        note="rope off: Liger skips DeepSeek-V2's complex (freqs_cis) rotary",
    ),
    "deepseek_v3": _dense(
        "DeepseekV3", rotary=(), experts=("DeepseekV3Experts",),
        note="rope off: interleaved partial RoPE",
    ),
    "deepseek_v4": _dense(
        "DeepseekV4", rotary=(), mlp=(), note="rope and swiglu off (swiglu_limit clamping)"
    ),
    "exaone4": _dense("Exaone4"),
    "falcon_h1": _dense("FalconH1", note="MLP and loss with muP multipliers"),
    "gemma": _dense("Gemma"),
    "gemma2": _dense("Gemma2"),
    "gemma3": _dense(
        "Gemma3", "Gemma3ForConditionalGeneration", norm=("Gemma3RMSNorm", "LayerNorm"),
        note="LayerNorm: the SigLIP vision tower's",
    ),
    "gemma3_text": _dense("Gemma3"),
    "gemma4": _dense(
        "Gemma4", "Gemma4ForConditionalGeneration", rotary=(), mlp=("Gemma4TextMLP",),
        note="rope off: Gemma 4's rotary takes one tensor",
    ),
    "gemma4_text": _dense(
        "Gemma4", rotary=(), mlp=("Gemma4TextMLP",),
        note="rope off: Gemma 4's rotary takes one tensor",
    ),
    "glm4": _dense("Glm4", rotary=(), note="rope off (partial interleaved)"),
    "gpt_oss": _dense("GptOss", mlp=(), note="swiglu off (clamped experts)"),
    "granite": _dense("Granite", note="loss: cross_entropy on the logits (no fused loss)"),
    "hunyuan_v1_dense": _dense("HunYuanDenseV1"),
    "hunyuan_v1_moe": _dense("HunYuanMoEV1", mlp=(), experts=("HunYuanMoEV1Experts",)),
    "llama": _dense("Llama"),
    "llama4": _dense(
        "Llama4Text", "Llama4ForCausalLM", rotary=("apply_rotary_emb",),
        note="experts not patched (only the shared/dense Llama4TextMLP)",
    ),
    "llama4_text": _dense(
        "Llama4Text", "Llama4ForCausalLM", rotary=("apply_rotary_emb",),
        note="experts not patched (only the shared/dense Llama4TextMLP)",
    ),
    "ministral": _dense("Ministral"),
    "mistral": _dense("Mistral"),
    "mixtral": _dense("Mixtral", mlp=(), experts=("MixtralExperts",)),
    "mllama": _dense(
        "MllamaText", "MllamaForCausalLM", norm=("MllamaTextRMSNorm", "LayerNorm"),
        note="LayerNorm: the vision model's",
    ),
    "nemotron": _patch(
        rotary=(), mlp=("ReLUSquaredActivation",), loss=("NemotronForCausalLM",),
        note="relu_squared: the MLP's activation only; norms not patched",
    ),
    "olmo2": _dense("Olmo2"),
    "olmo3": _dense("Olmo3"),
    "phi3": _dense("Phi3"),
    "qwen2": _dense("Qwen2"),
    "qwen3": _dense("Qwen3"),
    "qwen3_5": _dense("Qwen3_5", rotary=(), note="rope off; the gated norm not patched"),
    "qwen3_5_moe": _dense(
        "Qwen3_5Moe", rotary=(), mlp=(), experts=("Qwen3_5MoeExperts",),
        note="rope off; the gated norm not patched",
    ),
    "qwen3_5_moe_text": _dense(
        "Qwen3_5Moe", rotary=(), mlp=(), experts=("Qwen3_5MoeExperts",),
        note="rope off; the gated norm not patched",
    ),
    "qwen3_5_text": _dense("Qwen3_5", rotary=(), note="rope off; the gated norm not patched"),
    "qwen3_moe": _dense("Qwen3Moe", mlp=(), experts=("Qwen3MoeExperts",)),
    "qwen3_next": _dense(
        "Qwen3Next", rotary=(), mlp=(), experts=("Qwen3NextExperts",),
        note="rope off; the gated norm not patched",
    ),
    "smollm3": _dense("SmolLM3"),
}  # fmt: skip
