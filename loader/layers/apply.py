"""apply_kernels: bind kernels named by spec strings, without transformers, and say what happened.

    report = apply_kernels(model, {"RMSNorm": "kernels-lab/training:RMSNorm"})
    print(report)

Keys are the layer names the model declares (use_kernel_forward_from_hub); values are spec
strings ("org/repo:Layer" means version 1, "org/repo@v2:Layer", "org/repo@<branch|tag|commit>:Layer",
"/abs/path:Layer") or repository objects. Only the named layers are touched; the mapping applies
to the model's device in any mode (a layer without a backward keeps the original forward in
training).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from ..errors import InvalidSpec, LayerError
from ..spec import parse_spec
from .decorators import functions_of
from .device import resolve_target
from .fallback import KernelizeFallback
from .kernelize import run_kernelize
from .mapping import Scope, normalize
from .mode import Mode
from .report import BindReport
from .repos import LayerRepository, LocalLayerRepository


def as_repository(value: object, *, trust_remote_code: bool = False) -> Any:
    """A spec string as a repository (plain 'org/repo:Layer' means version 1); repositories pass."""
    if isinstance(value, str):
        spec = parse_spec(value, default_version=1)
        if spec.layer is None:
            raise InvalidSpec(
                f"{value!r} names no layer",
                hint=f'append the layer class: "{value}:RMSNorm"',
            )
        if spec.path is not None:
            return LocalLayerRepository(spec.path, layer_name=spec.layer)
        return LayerRepository(
            spec.repo_id,  # type: ignore[arg-type]
            layer_name=spec.layer,
            revision=spec.revision,
            version=spec.version,
            trust_remote_code=trust_remote_code,
        )
    if callable(getattr(value, "load", None)):
        return value
    raise InvalidSpec(
        f"mapping values must be spec strings or repositories, got {value!r}",
        hint='use "org/repo:Layer", "org/repo@v2:Layer", "/abs/path:Layer" or LayerRepository(...)',
    )


def declared_layer_names(model: nn.Module) -> frozenset[str]:
    """Every layer name some module of `model` declares (its class, or a function it calls)."""
    names: set[str] = set()
    for module in model.modules():
        name = getattr(type(module), "kernel_layer_name", None)
        if name is not None:
            names.add(name)
        names.update(func.kernel_layer_name for func in functions_of(module).values())
    return frozenset(names)


def apply_kernels(
    model: nn.Module,
    mapping: Mapping[str, str | LayerRepository],
    *,
    mode: Mode | None = None,
    device: Any = None,
    dry_run: bool = False,
    fallback: bool | KernelizeFallback = KernelizeFallback.DEFAULT,
    trust_remote_code: bool = False,
) -> BindReport:
    """Bind the kernels `mapping` names to the model's matching layers; return the report.

    mode defaults to TRAINING or INFERENCE after `model.training`; device to the model's.
    dry_run plans without importing kernels or touching the model. fallback (DEFAULT: keep the
    original forward only when the mode does not fit; load errors raise) as in kernelize.
    """
    if not isinstance(mapping, Mapping):
        raise InvalidSpec(
            f"apply_kernels takes a dict of layer name -> spec, got {type(mapping).__name__}",
            hint='use {"RMSNorm": "org/repo:RMSNorm"}',
        )
    repos = {
        name: as_repository(v, trust_remote_code=trust_remote_code) for name, v in mapping.items()
    }
    declared = declared_layer_names(model)
    unknown = sorted(set(repos) - declared)
    if unknown:
        raise LayerError(
            f"{type(model).__name__} declares no layer named {', '.join(map(repr, unknown))}; "
            f"it declares: {', '.join(sorted(declared)) or 'none'}",
            hint="key the mapping by the names the model's layers declare (use_kernel_forward_from_hub)",
        )
    if mode is None:
        mode = Mode.TRAINING if model.training else Mode.INFERENCE
    target = resolve_target(model, device)
    scope = Scope({}, overlay=True).merged(
        normalize({name: {target.type: repo} for name, repo in repos.items()})
    )
    return run_kernelize(
        model,
        mode=mode,
        device=device,
        use_fallback=fallback,
        dry_run=dry_run,
        only=frozenset(repos),
        scopes=(scope,),
    )
