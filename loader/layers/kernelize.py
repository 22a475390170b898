"""kernelize: bind kernel layers to the modules of a model that declare a layer name.

For every module whose class has `kernel_layer_name` (use_kernel_forward_from_hub), and every
function module a module calls (use_kernelized_func), kernelize looks the layer name up in the
current mapping (kernels.layers.mapping) for the model's device, the GPU capability of the
device the module sits on, and the mode; it loads the candidate's layer class, checks the layer
contract, and binds its forward to that instance (or, for a function, to that calling module).
When nothing fits, the module gets its original forward back, if the fallback flags allow it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..errors import HubUnavailable, LayerError, MissingDependency
from ..notices import notice_once
from .binding import bind_forward, restore_forward
from .decorators import functions_of
from .device import CapabilityProbe, resolve_target
from .fallback import KernelizeFallback, as_fallback
from .funcs import KernelFunction, bind_function, unbind_function
from .mapping import Candidate, Scope, current_scopes, lookup
from .mode import Mode, check_requested_mode
from .report import (
    BLOCKED,
    BOUND,
    ORIGINAL,
    PLANNED,
    SKIPPED,
    BindEntry,
    BindReport,
    kernel_origin,
    record,
)
from .validate import can_torch_compile, check_layer, check_mode_support, has_backward

# Load failures that CANNOT_LOAD may turn into "keep the original forward": the kernel is not
# there (FileNotFoundError covers KernelNotFound, RevisionNotFound, NoCompatibleVariant and
# OfflineCacheMiss), the Hub is unreachable, a package is missing, or the layer is unfit.
# Trust and integrity errors are never swallowed.
_CANNOT_LOAD = (FileNotFoundError, HubUnavailable, MissingDependency, LayerError)


@dataclass(frozen=True)
class _Site:
    """Something kernelize can bind: a module's own forward, or a function a module calls."""

    path: str
    layer_name: str
    replaced: type[nn.Module]  # whose forward the layer must match
    owner: nn.Module  # condition argument; its device decides the GPU capability
    bind: Callable[[type[nn.Module]], None]
    restore: Callable[[], None]


def _sites(model: nn.Module, only: frozenset[str] | None) -> list[_Site]:
    sites: list[_Site] = []
    for path, module in model.named_modules():
        if isinstance(module, KernelFunction):
            continue  # bound through the module that calls it, never globally
        for key, func in functions_of(module).items():
            name = func.kernel_layer_name
            if only is None or name in only:
                sites.append(
                    _Site(
                        f"{path}.{key}" if path else key,
                        name,
                        type(func),
                        module,
                        lambda layer, m=module, f=func: bind_function(m, f, layer),
                        lambda m=module, f=func: unbind_function(m, f),
                    )
                )
        name = getattr(type(module), "kernel_layer_name", None)
        if name is not None and (only is None or name in only):
            sites.append(
                _Site(
                    path,
                    name,
                    type(module),
                    module,
                    lambda layer, m=module: bind_forward(m, layer),
                    lambda m=module: restore_forward(m),
                )
            )
    return sites


class _Loader:
    """Loads and checks each candidate once per kernelize call."""

    def __init__(self) -> None:
        self._done: dict[Any, type[nn.Module] | BaseException] = {}

    def layer_for(self, candidate: Candidate, site: _Site) -> type[nn.Module]:
        repo = candidate.repo
        try:
            key: Any = (repo, site.replaced)
            hash(key)
        except TypeError:
            key = (id(repo), site.replaced)
        if key not in self._done:
            try:
                layer = repo.load()
                check_layer(layer, site.replaced, source=repo)
                check_mode_support(layer, candidate.registered, source=repo)
                self._done[key] = layer
            except _CANNOT_LOAD as exc:
                self._done[key] = exc
        result = self._done[key]
        if isinstance(result, BaseException):
            raise result
        return result


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


# What to do with one site: its report entry, and the change to make once every site is decided
# (None: leave it as it is).
_Decision = tuple[BindEntry, Callable[[], None] | None]


def _decide(
    site: _Site,
    *,
    mode: Mode,
    device_type: str,
    capability: int | None,
    fallback: KernelizeFallback,
    scopes: tuple[Scope, ...],
    loader: _Loader,
    dry_run: bool,
) -> _Decision:
    def keep(case: KernelizeFallback, reason: str, error: BaseException | None = None) -> _Decision:
        if case not in fallback:
            if dry_run:
                entry = BindEntry(site.path, site.layer_name, BLOCKED, reason=reason, fallback=case)
                return entry, None
            if error is not None:
                raise error
            raise LayerError(
                f"{site.path or '<root>'} ({site.layer_name}): {reason}",
                hint=f"register a kernel for it, or allow this case with use_fallback (KernelizeFallback.{case.name})",
            )
        entry = BindEntry(site.path, site.layer_name, ORIGINAL, reason=reason, fallback=case)
        return entry, site.restore

    condition = getattr(site.replaced, "kernel_condition", None)
    if condition is not None and not condition(site.owner):
        why = _unserved(site.owner) or {}
        reason = next(iter(why.values()), "kernel_condition is False")
        entry = BindEntry(site.path, site.layer_name, SKIPPED, reason=reason)
        return entry, site.restore

    found = lookup(site.layer_name, device_type, capability, mode, scopes)
    if found.miss is not None:
        return keep(found.miss, found.reason)
    if dry_run:
        best = found.candidates[0]
        note = "serves training if the layer has a backward" if best.promoted else ""
        entry = BindEntry(
            site.path, site.layer_name, PLANNED, str(best.repo), best.registered, note
        )
        return entry, None

    without_backward: tuple[Candidate, type[nn.Module]] | None = None
    for candidate in found.candidates:
        try:
            layer = loader.layer_for(candidate, site)
        except _CANNOT_LOAD as exc:
            if KernelizeFallback.CANNOT_LOAD in fallback:
                notice_once(
                    f"layers:cannot-load:{candidate.repo}:{site.replaced.__qualname__}",
                    f"kernels: {site.layer_name} keeps its original forward: {_first_line(exc)}",
                )
            return keep(
                KernelizeFallback.CANNOT_LOAD,
                f"cannot use {candidate.repo}: {_first_line(exc)}",
                exc,
            )
        if Mode.TRAINING in mode and not has_backward(layer):
            without_backward = (candidate, layer)
            if candidate.promoted:
                continue  # an INFERENCE entry serves training only with a backward
            break
        if Mode.TORCH_COMPILE in mode and not can_torch_compile(layer):
            return keep(
                KernelizeFallback.NO_COMPATIBLE_MODE,
                f"{candidate.repo} does not support torch.compile",
            )
        reason = "INFERENCE entry serves training" if candidate.promoted else ""
        entry = BindEntry(
            site.path,
            site.layer_name,
            BOUND,
            kernel_origin(layer, candidate.repo),
            candidate.registered,
            reason,
        )
        return entry, lambda layer=layer: site.bind(layer)

    assert without_backward is not None  # every path through the loop returns or records one
    candidate, layer = without_backward
    reason = f"{candidate.repo} has no backward, so training uses the original forward"
    if KernelizeFallback.NO_COMPATIBLE_MODE in fallback:
        notice_once(f"layers:no-backward:{site.layer_name}:{candidate.repo}", f"kernels: {reason}")
    return keep(KernelizeFallback.NO_COMPATIBLE_MODE, reason)


def _unserved(module: nn.Module) -> dict[str, str] | None:
    """{kind: reason} that kernels.training's structure probes gave this module's class."""
    return type(module).__dict__.get("_kernels_unserved")


def _unserved_entries(model: nn.Module, listed: set[str]) -> list[BindEntry]:
    """A module the training kernels cannot serve keeps its forward; say so, with the reason."""
    entries = []
    for path, module in model.named_modules():
        for kind, reason in (_unserved(module) or {}).items():
            if path not in listed:
                entries.append(BindEntry(path, kind, ORIGINAL, reason=reason))
    return entries


def run_kernelize(
    model: nn.Module,
    *,
    mode: Mode,
    device: Any = None,
    use_fallback: bool | KernelizeFallback = True,
    dry_run: bool = False,
    only: frozenset[str] | None = None,
    scopes: tuple[Scope, ...] | None = None,
) -> BindReport:
    """kernelize, returning the report; `only` limits it to some layer names, `scopes` replaces
    the context's mapping, and `dry_run` plans without loading kernels or touching the model.

    Every site is decided (kernels loaded and checked) before any is changed, so a call that
    raises leaves the model as it was."""
    mode = check_requested_mode(mode)
    fallback = as_fallback(use_fallback)
    target = resolve_target(model, device)
    probe = CapabilityProbe(target)
    scopes = current_scopes() if scopes is None else scopes
    loader = _Loader()
    decisions = [
        _decide(
            site,
            mode=mode,
            device_type=target.type,
            capability=probe.for_module(site.owner),
            fallback=fallback,
            scopes=scopes,
            loader=loader,
            dry_run=dry_run,
        )
        for site in _sites(model, only)
    ]
    if not dry_run:
        from ..training import trl_head  # which fused path serves TRL's fused_lm_head

        head_choice = trl_head.choice()  # a bad setting raises before the model changes
    for _, change in decisions:
        if change is not None:
            change()
    entries = tuple(entry for entry, _ in decisions)
    entries += tuple(_unserved_entries(model, {e.path for e in entries}))
    if not dry_run:
        entries += tuple(trl_head.sync(model, head_choice))
    report = BindReport(type(model).__name__, mode, target.type, entries, dry_run)
    if not dry_run:
        record(model, report)
    return report


def kernelize(
    model: nn.Module,
    *,
    mode: Mode,
    device: Any = None,
    use_fallback: bool | KernelizeFallback = True,
) -> nn.Module:
    """Bind kernels to `model` in place for `mode` on `device` (default: the model's device);
    returns the model. The report of what was bound is `kernels.layers.last_report(model)`."""
    run_kernelize(model, mode=mode, device=device, use_fallback=use_fallback)
    return model


def plan_kernels(
    model: nn.Module,
    *,
    mode: Mode,
    device: Any = None,
    use_fallback: bool | KernelizeFallback = True,
) -> BindReport:
    """What kernelize would do with the current mapping, without loading kernels or touching
    the model. Entries that kernelize would raise for have the status "would raise"."""
    return run_kernelize(model, mode=mode, device=device, use_fallback=use_fallback, dry_run=True)
