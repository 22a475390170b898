"""One line to train any causal LM on this project's training kernels.

    model = AutoModelForCausalLM.from_pretrained(
        path, use_kernels=True, kernel_config=kernels.training_kernel_config(path))   # GPU
    report = kernels.apply_training_kernels(model)                                   # any device

The model's modules are classified by structure (classify.py); the classes the kernels serve
get layer names, the others keep their forward and carry the reason, which
``kernels.last_report(model)`` lists next to what was bound.

The kernels come from `kernels-lab/training` at the endpoint (or the cache). When the default
request (that repo, version 1) finds neither, the copy bundled with this package stands in
(kernels/bundled.py), with one notice; a repo, version or revision the caller names never does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import (
    HubUnavailable,
    InvalidSpec,
    KernelNotFound,
    MissingDependency,
    OfflineCacheMiss,
)
from .classify import Plan, classify

TRAINING_REPO = "kernels-lab/training"
# What the endpoint says when it cannot serve the repo: then the bundled copy may stand in.
# Not a missing version or revision, a trust refusal or a digest mismatch: those are answers.
_NOT_SERVED = (HubUnavailable, KernelNotFound, OfflineCacheMiss)


def _spec(repo: str, version: int | None, revision: str | None, layer: str) -> str:
    if revision is not None:
        return f"{repo}@{revision}:{layer}"
    return f"{repo}:{layer}" if version in (None, 1) else f"{repo}@v{version}:{layer}"


def _require_triton(device: str) -> None:
    """MissingDependency, before anything is bound, when the kernels would launch Triton (on
    `device`) and it is not installed; the CPU's torch formulas need none."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        raise MissingDependency(
            f"triton is not installed, and the training kernels need it on {device}",
            hint="pip install 'kernels[training]' (or pip install triton)",
        )


def _named_locally(repo: str) -> bool:
    """Whether LOCAL_KERNELS maps `repo` to a folder: the user's choice, never replaced."""
    import os

    if not os.environ.get("LOCAL_KERNELS"):
        return False
    from ..local_kernels import override_for

    return override_for(repo) is not None


@dataclass(frozen=True)
class _Source:
    """The loaded kernel repo, and the verified tree of the bundled copy when that stands in."""

    kernel: Any
    bundled: Path | None = None

    def spec(self, repo: str, version: int | None, revision: str | None, layer: str) -> str:
        if self.bundled is not None:
            return f"{self.bundled}:{layer}"  # a local spec: the tree the bundle installed
        return _spec(repo, version, revision, layer)


def _load_repo(repo: str, version: int | None, revision: str | None) -> _Source:
    from ..api import get_kernel

    if revision is not None:
        return _Source(get_kernel(repo, revision=revision))
    try:
        return _Source(get_kernel(repo, version=version or 1))
    except _NOT_SERVED as exc:
        if repo != TRAINING_REPO or version not in (None, 1) or _named_locally(repo):
            raise
        from ..bundled import load

        found = load(exc)
        if found is None:
            raise
        return _Source(*found)


def repo_checks(
    kernel: Any,
) -> tuple[Callable[[str], str | None], Callable[[nn.Module], str | None] | None]:
    """(which layer classes the loaded kernel repo has, its experts check if it has one)."""
    layers = getattr(kernel, "layers", None)
    names = set(dir(layers)) if layers is not None else set()
    moe = getattr(kernel, "moe", None)
    if moe is not None:
        names |= {n for n in dir(moe) if n == "MoEExperts"}

    def available(layer: str) -> str | None:
        if layer in names:
            return None
        if layer == "MoEExperts":
            return "no experts kernel in this build"
        return f"no {layer} layer in this build of the training kernels"

    return available, getattr(moe, "experts_supported", None)


def _model_from(source: Any, model_class: Any = None) -> nn.Module:
    """A model to classify: the model itself, or one built on the meta device (no memory, no
    weights) from a config, a local checkpoint folder or a Hub repo id: with ``model_class``
    (a model class or an Auto class), else the causal LM of the config's type, else its
    image-text-to-text model (a VLM: Qwen2-VL, LLaVA, ...)."""
    if isinstance(source, nn.Module):
        return source
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        PretrainedConfig,
    )
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    if isinstance(source, PretrainedConfig):
        config = source
    elif isinstance(source, str):
        config = AutoConfig.from_pretrained(source)
    else:
        raise InvalidSpec(
            f"training kernels need a model, a config, a checkpoint path or a repo id, got {type(source).__name__}",
            hint='pass e.g. "Qwen/Qwen3-0.6B", a saved folder, model.config or the model',
        )
    if model_class is None:
        kind = getattr(config, "model_type", None)
        vlm = kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        vlm = vlm and kind in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
        model_class = AutoModelForImageTextToText if vlm else AutoModelForCausalLM
    with torch.device("meta"):
        if hasattr(model_class, "from_config"):  # an Auto class
            return model_class.from_config(config)
        return model_class._from_config(config)


def plan_training_kernels(
    source: Any,
    *,
    repo: str = TRAINING_REPO,
    version: int | None = 1,
    revision: str | None = None,
    model_class: Any = None,
) -> Plan:
    """Classify ``source`` (model, config, path or repo id) against the kernel repo's layers
    and mark its classes; the plan lists what is served and what is not (with the reason).
    ``model_class`` picks what a config is built as (see ``training_kernel_config``)."""
    return _plan(source, _load_repo(repo, version, revision), model_class)


def _plan(source: Any, loaded: _Source, model_class: Any) -> Plan:
    import torch

    model = _model_from(source, model_class)
    available, experts_check = repo_checks(loaded.kernel)
    # the probes build small modules (nn.Linear draws its init from the global generator):
    # the caller's random stream (set_seed before the trainer samples) stays as it was
    with torch.random.fork_rng(devices=[]):
        plan = classify(model, available, experts_check)
    plan.mark(model if source is model else None)
    return plan


def training_kernel_mapping(
    source: Any,
    *,
    repo: str = TRAINING_REPO,
    version: int | None = 1,
    revision: str | None = None,
    model_class: Any = None,
) -> dict[str, str]:
    """``{layer name: "repo:Layer"}`` for every module kind of ``source`` the training kernels
    serve (for ``apply_kernels`` or ``KernelConfig(kernel_mapping=...)``); ``"/tree:Layer"``,
    the verified tree in the cache, when the bundled copy stands in."""
    return _mapping(source, repo, version, revision, model_class)[0]


def _mapping(
    source: Any, repo: str, version: int | None, revision: str | None, model_class: Any
) -> tuple[dict[str, str], bool]:
    """The mapping, and whether its values are local paths (the bundled copy)."""
    loaded = _load_repo(repo, version, revision)
    plan = _plan(source, loaded, model_class)
    mapping = {
        layer: loaded.spec(repo, version, revision, layer) for layer in sorted(plan.served())
    }
    return mapping, loaded.bundled is not None


def training_kernel_config(
    source: Any,
    *,
    repo: str = TRAINING_REPO,
    version: int | None = 1,
    revision: str | None = None,
    model_class: Any = None,
):
    """A transformers ``KernelConfig`` for ``from_pretrained(..., use_kernels=True,
    kernel_config=...)``, reusable across loads (TRL loads its reference model with the same
    one; kernel_config.py). transformers accepts KernelConfig on accelerators only; on the CPU
    use ``apply_training_kernels(model)``.

    A config (or path, or repo id) is classified as the model ``model_class`` builds from it
    (the class or Auto class you load with): by default the type's causal LM, or its
    image-text-to-text model where the type has no causal LM (Qwen2-VL, LLaVA, InternVL, ...).
    Types with both (Mllama, Llama 4, Qwen3.5) map their causal LM unless you pass
    ``model_class=AutoModelForImageTextToText``."""
    import torch

    from .kernel_config import reusable_kernel_config

    if torch.cuda.is_available():
        _require_triton("CUDA")
    mapping, local = _mapping(source, repo, version, revision, model_class)
    if local:  # transformers loads "/path:Layer" values with use_local_kernel
        return reusable_kernel_config(mapping, use_local_kernel=True)
    if revision is None and version in (None, 1):
        return reusable_kernel_config(mapping)
    meta = {"revision": revision} if revision is not None else {"version": version}
    # transformers does not parse "@rev" in a KernelConfig: the tuple form carries it
    return reusable_kernel_config({name: (f"{repo}:{name}", dict(meta)) for name in mapping})


def apply_training_kernels(
    model: nn.Module,
    *,
    repo: str = TRAINING_REPO,
    version: int | None = 1,
    revision: str | None = None,
    mode: Any = None,
):
    """Classify ``model``, bind the training kernels to every module they serve, and return
    the ``BindReport`` (modules left as they are appear with status "original" and the reason).
    Works on any device, under the Trainer, FSDP2 and torch.compile."""
    from ..layers import apply_kernels

    if any(p.is_cuda for p in model.parameters()):
        _require_triton("CUDA")
    mapping = training_kernel_mapping(model, repo=repo, version=version, revision=revision)
    return apply_kernels(model, mapping, mode=mode)
