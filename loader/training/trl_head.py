"""TRL's fused LM head on this package's kernels, for the models whose loss head it bound.

TRL 1.16 wraps each policy and reference model with ``add_fused_lm_head``: the wrapper answers
``model(..., labels=..., fused_lm_head=True)`` itself (the backbone, then the module global
``trl.trainer.utils._ChunkedLogProbFunction``), and the distillation trainer calls the global
``trl.trainer.distillation_trainer.ChunkedDivergenceFunction``. The bound loss head never sees
those calls. So while some model has this package's fused loss head bound (``ForCausalLM``,
``MoEForCausalLM``, ``CausalLMHead``), those two globals are stand-ins that send each call to
exactly one function: the kernel repo's ``logprob.trl_chunked_logprob`` or
``divergence.trl_chunked_divergence`` (TRL's arguments, in TRL's order) when the call's head
weight is such a model's own ``lm_head`` weight (the student's, for distillation), TRL's
original function otherwise. Models without our head run TRL's code unchanged; the stand-ins
are removed when the last registered model is unbound.

The stand-ins go in only where TRL's functions have the 1.16 signatures; ``KERNELS_TRL_HEAD=trl``
keeps TRL's own for every model bound from then on. ``kernels.last_report(model)`` carries one
``fused_lm_head`` entry per bound head saying which serves. A TRL imported after the binding is
patched as its modules finish importing (a ``sys.meta_path`` hook), without importing TRL here.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import inspect
import sys
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from torch import nn

from .. import settings
from ..layers.binding import bound_layer, under_wrapper
from ..layers.report import ORIGINAL, ROUTED, BindEntry, kernel_origin
from ..notices import notice_once

# The training kernels' fused loss heads (loss_layers.py): they compute from the hidden states.
HEAD_LAYERS = frozenset({"ForCausalLM", "MoEForCausalLM", "CausalLMHead"})
FUSED_ENTRY = "fused_lm_head"  # the report entry's layer name


@dataclass(frozen=True)
class _Target:
    """One TRL module global to stand in for, and the kernel function that serves it."""

    module: str
    attr: str
    params: tuple[str, ...]  # TRL 1.16's forward(ctx, ...) parameter names
    kernel_module: str  # the kernel repo's module with the function
    kernel_function: str
    weight_arg: int  # which positional argument is this model's head weight


LOGPROB = _Target(
    "trl.trainer.utils",
    "_ChunkedLogProbFunction",
    ("hidden", "weight", "bias", "targets", "temperature", "chunk_size",
     "final_logit_softcapping", "logit_scale", "outputs"),
    "logprob",
    "trl_chunked_logprob",
    1,
)  # fmt: skip
DIVERGENCE = _Target(
    "trl.trainer.distillation_trainer",
    "ChunkedDivergenceFunction",
    ("student_hidden", "student_weight", "student_bias", "teacher_hidden", "teacher_weight",
     "teacher_bias", "beta", "temperature", "student_logit_scale",
     "student_final_logit_softcapping", "teacher_logit_scale", "teacher_final_logit_softcapping"),
    "divergence",
    "trl_chunked_divergence",
    1,
)  # fmt: skip
TARGETS = (LOGPROB, DIVERGENCE)


@dataclass(frozen=True)
class Route:
    """The kernel functions one model's TRL calls go to (None: TRL's own serves that one)."""

    functions: dict[str, Callable | None]  # _Target.attr -> function


_lock = threading.RLock()
_routes: weakref.WeakKeyDictionary[nn.Module, Route] = weakref.WeakKeyDictionary()
# (module name, attr) -> TRL's original object, while our stand-in is installed there
_originals: dict[tuple[str, str], Any] = {}
_served: Counter[tuple[str, str]] = Counter()  # (target attr, "kernels" | "trl") -> calls


def served_calls() -> dict[tuple[str, str], int]:
    """Calls each stand-in sent to ("kernels") or past ("trl") this package, since the start."""
    with _lock:
        return dict(_served)


def signature_problem(original: Any, target: _Target) -> str:
    """Why TRL's ``original`` cannot be stood in for ("" when its forward has 1.16's parameters)."""
    forward = getattr(original, "forward", None)
    try:
        names = tuple(inspect.signature(forward).parameters)[1:] if forward else ()
    except (TypeError, ValueError):
        names = ()
    if names == target.params:
        return ""
    return (
        f"{target.module}.{target.attr} takes ({', '.join(names)}), not TRL 1.16's arguments: "
        "TRL's own serves"
    )


class StandIn:
    """Stands in for a TRL autograd Function class: ``apply(*args)`` runs the kernel function
    when the head weight argument is a registered model's, TRL's ``apply`` otherwise; any other
    attribute is TRL's."""

    def __init__(self, original: Any, target: _Target) -> None:
        self.original = original
        self.target = target

    def apply(self, *args: Any) -> Any:
        fn = _function_for(args[self.target.weight_arg], self.target.attr)
        with _lock:
            _served[(self.target.attr, "trl" if fn is None else "kernels")] += 1
        if fn is None:
            return self.original.apply(*args)
        return fn(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.original, name)


def _head_weight(model: nn.Module) -> Any:
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else getattr(model, "lm_head", None)
    return getattr(head, "weight", None)


def _function_for(weight: Any, attr: str) -> Callable | None:
    with _lock:
        routes = list(_routes.items())
    for model, route in routes:
        if _head_weight(model) is weight:
            return route.functions.get(attr)
    return None


# -- installing the stand-ins -----------------------------------------------------------------


def _install_into(module: ModuleType, target: _Target) -> str:
    """Put the stand-in for ``target`` into ``module`` (idempotent); the problem, if any."""
    with _lock:
        current = getattr(module, target.attr, None)
        if isinstance(current, StandIn):
            return ""
        if current is None:
            return f"{target.module} has no {target.attr}: TRL's own serves"
        problem = signature_problem(current, target)
        if problem:
            notice_once(f"trl-head:signature:{target.attr}", f"kernels: {problem}")
            return problem
        _originals[(target.module, target.attr)] = current
        setattr(module, target.attr, StandIn(current, target))
        return ""


def _install() -> None:
    """Stand-ins into the TRL modules already imported; a hook for the ones imported later."""
    for target in TARGETS:
        module = sys.modules.get(target.module)
        if module is not None:
            _install_into(module, target)
    if not all(t.module in sys.modules for t in TARGETS):
        _AfterImport.add()


def _uninstall() -> None:
    """TRL's originals back (where our stand-in is still what the module holds)."""
    with _lock:
        for (name, attr), original in list(_originals.items()):
            module = sys.modules.get(name)
            if module is not None and isinstance(getattr(module, attr, None), StandIn):
                setattr(module, attr, original)
            del _originals[(name, attr)]
        _AfterImport.remove()


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then puts the stand-in into the module it made."""

    def __init__(self, inner: importlib.abc.Loader, target: _Target) -> None:
        self.inner = inner
        self.target = target

    def create_module(self, spec):  # noqa: ANN001, ANN201 - importlib's protocol
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        with _lock:
            wanted = bool(_routes)
        if wanted:
            _install_into(module, self.target)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patches a TRL module imported after a head was bound, once it has run."""

    _hook: _AfterImport | None = None

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        watched = next((t for t in TARGETS if t.module == fullname), None)
        if watched is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, watched)
        return spec

    @classmethod
    def add(cls) -> None:
        with _lock:
            if cls._hook is None:
                cls._hook = cls()
                sys.meta_path.insert(0, cls._hook)

    @classmethod
    def remove(cls) -> None:
        with _lock:
            if cls._hook is not None:
                if cls._hook in sys.meta_path:
                    sys.meta_path.remove(cls._hook)
                cls._hook = None


# -- kernelize's side ---------------------------------------------------------------------------


def _kernel_function(layer: type, target: _Target) -> Callable | None:
    """``target``'s function in the kernel package the layer class comes from, if it has one."""
    package = layer.__module__.rpartition(".")[0]
    if not package:
        return None
    try:
        module = importlib.import_module(f"{package}.{target.kernel_module}")
    except ImportError:
        return None
    return getattr(module, target.kernel_function, None)


def _register(model: nn.Module, route: Route) -> None:
    with _lock:
        _routes[model] = route
    _install()


def _unregister(model: nn.Module) -> None:
    with _lock:
        if _routes.pop(model, None) is not None and not _routes:
            _uninstall()


def choice() -> str:
    """Which kernel serves TRL's fused-head calls on models bound now (KERNELS_TRL_HEAD)."""
    return settings.trl_head()


def _entry(path: str, model: nn.Module, layer: type, head_choice: str) -> BindEntry:
    """Register (or not) ``model``'s TRL calls for our kernels; the report entry saying which
    fused path serves its ``fused_lm_head`` calls."""
    logprob = _kernel_function(layer, LOGPROB)
    if logprob is None:
        _unregister(model)
        return BindEntry(
            path,
            FUSED_ENTRY,
            ORIGINAL,
            reason="this build of the training kernels has no log-prob head: TRL's own "
            "ChunkedLogProbFunction serves TRL's fused_lm_head calls",
        )
    if head_choice == "trl":
        _unregister(model)
        return BindEntry(
            path,
            FUSED_ENTRY,
            ORIGINAL,
            reason="KERNELS_TRL_HEAD=trl: TRL's own ChunkedLogProbFunction serves TRL's "
            "fused_lm_head calls (the head's own fused_lm_head=True calls stay on this kernel)",
        )
    divergence = _kernel_function(layer, DIVERGENCE)
    _register(model, Route({LOGPROB.attr: logprob, DIVERGENCE.attr: divergence}))
    problems = {t.attr: _installed_problem(t) for t in TARGETS}
    if problems[LOGPROB.attr]:
        return BindEntry(path, FUSED_ENTRY, ORIGINAL, reason=problems[LOGPROB.attr])
    notes = ["serves fused_lm_head=True calls, TRL's add_fused_lm_head included"]
    if divergence is None:
        notes.append(
            "no divergence kernel in this build: TRL's ChunkedDivergenceFunction serves distillation"
        )
    elif problems[DIVERGENCE.attr]:
        notes.append(problems[DIVERGENCE.attr])
    else:
        notes.append("as a distillation student, trl_chunked_divergence serves the divergence")
    if under_wrapper(model):
        notes.append("bound beneath TRL's fused-head wrapper")
    return BindEntry(
        path, FUSED_ENTRY, ROUTED, kernel_origin(logprob, None), reason="; ".join(notes)
    )


def _installed_problem(target: _Target) -> str:
    """Why ``target``'s stand-in is not in its TRL module ("" when it is, or TRL's module is not
    imported yet: the import hook checks it then)."""
    module = sys.modules.get(target.module)
    if module is None:
        return ""
    current = getattr(module, target.attr, None)
    return "" if isinstance(current, StandIn) else signature_problem(current, target)


def sync(root: nn.Module, head_choice: str) -> list[BindEntry]:
    """After kernelize changed ``root``: register each module running one of our fused heads
    (and unregister the others); one ``fused_lm_head`` report entry per head."""
    entries = []
    for path, module in root.named_modules():
        layer = bound_layer(module)
        if layer is not None and layer.__name__ in HEAD_LAYERS:
            entries.append(_entry(path, module, layer, head_choice))
        else:
            _unregister(module)
    return entries


def release_all() -> None:
    """Forget every registered model and put TRL's own functions back (the bound heads stay
    bound; their TRL calls run TRL's kernels until kernelize runs on them again)."""
    with _lock:
        _routes.clear()
        _uninstall()
