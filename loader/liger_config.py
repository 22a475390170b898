"""A Liger-style switch for this project's training kernels.

Users moving from `TrainingArguments(use_liger_kernel=True, liger_kernel_config={...})` keep
their dict: `liger_kernel_mapping(config, model_class=Qwen3ForCausalLM)` returns the
`KernelConfig(kernel_mapping=...)` mapping (or `apply_kernels` mapping) that loads the same
kernels from this project's Hub repo, and gives the model's MLP and causal-LM head classes the
layer names transformers does not declare for them (what Liger's apply functions patch).
"""

from __future__ import annotations

import sys

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


def _mark_classes(model_class: type, switched: dict[str, bool]) -> None:
    """Give the model's MLP and causal-LM classes the layer names the mapping uses."""
    from .layers import replace_kernel_forward_from_hub

    module = sys.modules[model_class.__module__]
    prefix = model_class.__name__.removesuffix("ForCausalLM")
    if switched["swiglu"] or switched["geglu"]:
        mlp = getattr(module, f"{prefix}MLP", None)
        if mlp is None:
            raise InvalidSpec(f"{module.__name__} has no {prefix}MLP class to bind swiglu/geglu to")
        replace_kernel_forward_from_hub(mlp, LAYERS["swiglu" if switched["swiglu"] else "geglu"][0])
    if switched["fused_linear_cross_entropy"] or switched["cross_entropy"]:
        if not model_class.__name__.endswith("ForCausalLM"):
            raise InvalidSpec(f"{model_class.__name__} is not a *ForCausalLM class")
        replace_kernel_forward_from_hub(model_class, "ForCausalLM")
    if switched["layer_norm"]:
        import torch

        replace_kernel_forward_from_hub(torch.nn.LayerNorm, "LayerNorm")


def liger_kernel_mapping(
    config: dict | None = None,
    *,
    model_class: type | None = None,
    repo: str = TRAINING_REPO,
    version: int = 1,
) -> dict[str, str | tuple[str, dict]]:
    """`{layer name: "repo:Layer"}` for the keys switched on (Liger's defaults for missing keys).

    With `model_class`, its MLP and causal-LM head classes are marked so KernelConfig accepts
    the mapping. Conflicting keys raise InvalidSpec.
    """
    switched = _check(dict(config or {}))
    if model_class is not None:
        _mark_classes(model_class, switched)
    mapping: dict[str, str | tuple[str, dict]] = {}
    for key, on in switched.items():
        if on:
            layer_name, layer_class = LAYERS[key]
            value = f"{repo}:{layer_class}"
            mapping[layer_name] = value if version == 1 else (value, {"version": version})
    return mapping
