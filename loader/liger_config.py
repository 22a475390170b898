"""A Liger-style switch for this project's training kernels.

Users moving from `TrainingArguments(use_liger_kernel=True, liger_kernel_config={...})` keep
their dict: `liger_kernel_mapping(config, model_class=Qwen3ForCausalLM)` returns the
`KernelConfig(kernel_mapping=...)` mapping (or `apply_kernels` mapping) that loads the same
kernels from this project's Hub repo; with ``model_class`` its modules are classified by
structure (kernels.training) and given the layer names transformers does not declare for them
(what Liger's apply functions patch).
"""

from __future__ import annotations

from .errors import InvalidSpec

TRAINING_REPO = "kernels-lab/training"

# Liger's defaults for a causal LM (apply_liger_kernel_to_<model>).
DEFAULTS = {
    "rope": True,
    "rms_norm": True,
    "swiglu": True,
    "fused_linear_cross_entropy": True,
    "cross_entropy": False,
    "geglu": False,
    "layer_norm": False,
    # Liger's nemotron switch (on by default there); transformers declares no layer name for
    # it, so it maps layers only where a model_class is classified
    "relu_squared": True,
}

# key -> (layer name the model declares, layer class in the kernel repo)
LAYERS = {
    "rope": ("rotary_pos_emb", "rotary_pos_emb"),
    "rms_norm": ("RMSNorm", "RMSNorm"),
    "swiglu": ("SwiGLUMLP", "SwiGLUMLP"),
    "geglu": ("GeGLUMLP", "GeGLUMLP"),
    "layer_norm": ("LayerNorm", "LayerNorm"),
    "fused_linear_cross_entropy": ("ForCausalLM", "ForCausalLM"),
    "cross_entropy": ("ForCausalLM", "ForCausalLMCrossEntropy"),
}


def _check(config: dict) -> dict[str, bool]:
    unknown = sorted(set(config) - set(DEFAULTS))
    if unknown:
        raise InvalidSpec(
            f"unknown Liger-style keys: {', '.join(unknown)}",
            hint=f"supported keys: {', '.join(DEFAULTS)}",
        )
    merged = {**DEFAULTS, **config}
    for key, value in merged.items():
        if not isinstance(value, bool):
            raise InvalidSpec(f"{key} must be True or False, got {value!r}")
    if merged["cross_entropy"] and merged["fused_linear_cross_entropy"]:
        raise InvalidSpec(
            "cross_entropy and fused_linear_cross_entropy are both on; they replace the same loss",
            hint="keep fused_linear_cross_entropy (it never builds the logits) and set cross_entropy=False",
        )
    if merged["swiglu"] and merged["geglu"]:
        raise InvalidSpec("swiglu and geglu are both on; a model's MLP has one activation")
    return merged


# Liger key -> the layers of kernels.training's structure classes it switches on.
_KIND_LAYERS = {
    "rms_norm": ("RMSNorm", "GemmaRMSNorm", "RMSNormFloatWeight", "WeightlessRMSNorm"),
    "layer_norm": ("LayerNorm",),
    "swiglu": ("SwiGLUMLP", "FusedSwiGLUMLP", "ScaledSwiGLUMLP"),
    "geglu": ("GeGLUMLP", "FusedGeGLUMLP"),
    "relu_squared": ("ReLUSquared", "ReLUSquaredMLP"),
    "rope": (),  # every rotary layer the probes know: filled in by _model_mapping
    "fused_linear_cross_entropy": ("ForCausalLM", "MoEForCausalLM", "CausalLMHead"),
    "cross_entropy": ("ForCausalLM",),
}


def _model_mapping(model_class: type, switched: dict[str, bool], repo: str) -> dict[str, str]:
    """Classify ``model_class`` (built on the meta device from its default config) by structure,
    mark its classes, and map the layers the switched-on keys cover."""
    import torch

    from .training import classify
    from .training.probes import COMPLEX_ROTARY_LAYOUTS, ROTARY_FORMULAS

    kinds = {**_KIND_LAYERS, "rope": (*ROTARY_FORMULAS, *COMPLEX_ROTARY_LAYOUTS)}
    with torch.device("meta"):
        model = model_class(model_class.config_class())
    plan = classify(model)
    plan.mark()
    served = plan.served()
    mapping: dict[str, str] = {}
    for key, on in switched.items():
        for layer in kinds[key] if on else ():
            if layer in served:
                target = "ForCausalLMCrossEntropy" if key == "cross_entropy" else layer
                mapping[layer] = f"{repo}:{target}"
    if switched["cross_entropy"] and not any(
        v.endswith(":ForCausalLMCrossEntropy") for v in mapping.values()
    ):
        head = next((lay for lay in ("MoEForCausalLM", "CausalLMHead") if lay in served), None)
        if head is not None:
            raise InvalidSpec(
                f"cross_entropy is not served for {model_class.__name__} (its head binds {head})",
                hint="use fused_linear_cross_entropy=True, which serves it",
            )
    return mapping


def liger_kernel_mapping(
    config: dict | None = None,
    *,
    model_class: type | None = None,
    repo: str = TRAINING_REPO,
    version: int = 1,
) -> dict[str, str | tuple[str, dict]]:
    """`{layer name: "repo:Layer"}` for the keys switched on (Liger's defaults for missing keys).

    With `model_class`, its modules are classified by structure (kernels.training) and marked,
    and the mapping names the layers that model has (Gemma's norm, a fused gate_up MLP, ...),
    so KernelConfig accepts it. Conflicting keys raise InvalidSpec.
    """
    switched = _check(dict(config or {}))
    if model_class is not None:
        mapping = _model_mapping(model_class, switched, repo)
        if version == 1:
            return mapping
        return {name: (value, {"version": version}) for name, value in mapping.items()}
    mapping: dict[str, str | tuple[str, dict]] = {}
    for key, on in switched.items():
        if on and key in LAYERS:
            layer_name, layer_class = LAYERS[key]
            value = f"{repo}:{layer_class}"
            mapping[layer_name] = value if version == 1 else (value, {"version": version})
    return mapping
