"""Liger's VLM patch in the strongest configuration that runs on the installed transformers.

Liger 0.8.5's apply functions for Qwen2-VL, Qwen2.5-VL, Qwen3-VL (and its MoE) and GLM-4V-MoE
import their fused-loss forward (``liger_kernel.transformers.model.<type>``) at their top, and
that module imports an output class transformers 5.24 no longer has: the import fails before
anything is patched, with or without ``fused_linear_cross_entropy``. Configurations, strongest
first:

  default   ``_apply_liger_kernel_to_instance(model=model)``: Liger's defaults (its fused linear
            cross-entropy forward included)
  no-flce   the same with ``fused_linear_cross_entropy=False`` (transformers' own loss)
  modules   ``no-flce`` where even that raises on the fused-loss module's import: the apply
            function runs as written, with that one import answered by a placeholder module
            whose attributes raise if called (with the fused loss off they never are), so its
            norm / SwiGLU / GeGLU / RoPE patches are exactly Liger's

Used by scripts/bench_vlm.py (the liger setup) and scripts/probes/probe_liger_vlm.py.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

CONFIGS = ("default", "no-flce", "modules")
# Liger kernels the CPU's Triton interpreter (triton 3.9) cannot run: their patches are turned
# off for CPU plumbing runs (its RoPE, cross-entropy and fused linear cross-entropy do run)
CPU_OFF = {"rms_norm": False, "layer_norm": False, "swiglu": False, "geglu": False}


def describe(config: str, why: str = "") -> str:
    """The one-line label a table shows for a configuration (and why a stronger one did not run)."""
    text = {
        "default": "Liger default (its fused linear CE forward, norms, MLP, RoPE)",
        "no-flce": "Liger without its fused linear CE (norms, MLP, RoPE; transformers' loss)",
        "modules": "Liger's norm/MLP/RoPE patches only (its fused-loss module does not import "
        "here, so its forward was left out; transformers' loss)",
    }[config]
    return f"{text}; {why}" if why else text


def short_error(exc: BaseException, width: int = 160) -> str:
    """``Type: first line`` of an exception, the installed packages' folder written ``<site>``
    (a table that is committed names no path of the machine it ran on)."""
    text = (str(exc).splitlines() or [""])[0]
    try:
        import liger_kernel

        text = text.replace(str(Path(liger_kernel.__file__).resolve().parents[1]), "<site>")
    except ImportError:
        pass
    return f"{type(exc).__name__}: {text[:width]}"


def _loss_module(model) -> str:
    return f"liger_kernel.transformers.model.{model.config.model_type}"


def _placeholder(name: str, why: str) -> types.ModuleType:
    """A module whose every attribute is a function that raises: the apply function imports
    its fused-loss forward by name, and with the fused loss off never calls it."""
    module = types.ModuleType(name)

    def __getattr__(attr: str):  # noqa: N807 - PEP 562 module attribute hook
        def unavailable(*args, **kwargs):
            raise RuntimeError(f"{name}.{attr} is unavailable here ({why})")

        return unavailable

    module.__getattr__ = __getattr__  # type: ignore[attr-defined]
    return module


def apply(model, config: str, **kwargs) -> None:
    """Patch ``model`` with Liger in ``config`` (CONFIGS); ``kwargs`` go to its apply function
    (those it does not take are dropped, as Liger's own instance entry point does). Raises what
    Liger raises."""
    if config == "default":
        _apply(model, kwargs)
        return
    kwargs = {**kwargs, "fused_linear_cross_entropy": False}
    if config == "no-flce":
        _apply(model, kwargs)
        return
    if config != "modules":
        raise ValueError(f"unknown Liger configuration {config!r}; use one of {CONFIGS}")
    name = _loss_module(model)
    try:
        importlib.import_module(name)
    except ImportError as exc:
        why = short_error(exc, 120)
        sys.modules[name] = _placeholder(name, why)
    _apply(model, kwargs)


def _apply(model, kwargs: dict) -> None:
    """Liger's apply function for the model's type on the instance, as its
    ``_apply_liger_kernel_to_instance`` calls it, except that a function taking ``**kwargs``
    (InternVL, LLaVA, SmolVLM: they hand them to the text model's function) gets them all, so
    that switches such as ``swiglu=False`` reach the text model."""
    import inspect

    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    model_type = model.config.model_type
    fn = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if fn is None:
        raise ValueError(f"Liger has no patch for model type {model_type!r}")
    params = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    fn(model=model, **kwargs)


def apply_strongest(model, **kwargs) -> tuple[str, str]:
    """Try CONFIGS in order; (the configuration that applied, why the stronger ones did not).
    A patch that raises has changed nothing in these apply functions (the failing import is
    their first statement after transformers' own imports), so the next one starts clean."""
    why = ""
    for config in CONFIGS:
        try:
            apply(model, config, **kwargs)
            return config, why
        except ModuleNotFoundError as exc:
            if exc.name == "liger_kernel":
                raise  # no Liger at all: no configuration can run
            why = f"{config} raised {short_error(exc, 120)}"
        except Exception as exc:  # noqa: BLE001 - the next configuration, and the row says why
            why = f"{config} raised {short_error(exc, 120)}"
    raise RuntimeError(f"no Liger configuration applies ({why})")
