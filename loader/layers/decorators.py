"""Marking layers that kernels may replace: classes, functions, and the modules that call them."""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

from ..errors import LayerError
from .funcs import KernelFunction, _always, make_function_module

T = TypeVar("T")
Condition = Callable[[nn.Module], bool]


def _check_name(layer_name: object) -> str:
    if not isinstance(layer_name, str) or not layer_name:
        raise LayerError(
            f"a kernel layer name must be a non-empty str, got {layer_name!r}",
            hint='use the name the kernel mapping is keyed by, e.g. "RMSNorm"',
        )
    return layer_name


def replace_kernel_forward_from_hub(
    cls: type, layer_name: str, condition: Condition | None = None
) -> None:
    """Mark an existing (e.g. third-party) layer class as replaceable under `layer_name`.

    `condition(module)` is asked per instance at kernelize time; False keeps that instance's own forward.
    """
    if not isinstance(cls, type):
        raise LayerError(f"replace_kernel_forward_from_hub needs a class, got {cls!r}")
    cls.kernel_layer_name = _check_name(layer_name)  # type: ignore[attr-defined]
    cls.kernel_condition = staticmethod(condition or _always)  # type: ignore[attr-defined]


def use_kernel_forward_from_hub(
    layer_name: str, condition: Condition | None = None
) -> Callable[[T], T]:
    """Decorator: a class becomes replaceable under `layer_name`; a function becomes a
    KernelFunction module, called like the function, that kernels bind per calling module
    (attach it to its callers with use_kernelized_func)."""
    _check_name(layer_name)

    def decorate(target: Any) -> Any:
        if inspect.isclass(target):
            replace_kernel_forward_from_hub(target, layer_name, condition)
            return target
        if callable(target):
            return make_function_module(target, layer_name, condition)
        raise LayerError(
            f"use_kernel_forward_from_hub decorates classes and functions, not {target!r}"
        )

    return decorate


def use_kernel_func_from_hub(func_name: str) -> Callable[[T], T]:
    """Deprecated alias of use_kernel_forward_from_hub(func_name)."""
    warnings.warn(
        "use_kernel_func_from_hub is deprecated since kernels 0.16 and was due for removal in "
        "kernels 0.17; use use_kernel_forward_from_hub",
        DeprecationWarning,
        stacklevel=2,
    )
    return use_kernel_forward_from_hub(func_name)


def function_key(fn: Any) -> str:
    """The `_kernel_funcs` key of a function module: its __name__, else its layer name.

    KernelFunction instances have no __name__, so they are keyed by their layer name (what
    transformers' KernelConfig validates against)."""
    return getattr(fn, "__name__", None) or fn.kernel_layer_name


def use_kernelized_func(*fns: Any) -> Callable[[type[T]], type[T]]:
    """Class decorator: each instance lists `fns` in `self.__dict__["_kernel_funcs"]`, so
    kernelize binds kernels for them per instance (see kernels.layers.funcs)."""
    for fn in fns:
        if not isinstance(fn, KernelFunction):
            name = getattr(fn, "__name__", None) or repr(fn)
            # The reference's words: its tests and users match "Function `f` is not decorated".
            raise LayerError(
                f"Function `{name}` is not decorated with @use_kernel_forward_from_hub and "
                "cannot be used with @use_kernelized_func",
                hint="decorate the function with @use_kernel_forward_from_hub(name) first",
            )

    def decorate(cls: type[T]) -> type[T]:
        original_init = cls.__init__

        @functools.wraps(original_init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original_init(self, *args, **kwargs)
            # A plain dict in __dict__, not submodules: the functions are shared singletons.
            funcs = self.__dict__.setdefault("_kernel_funcs", {})
            for fn in fns:
                funcs[function_key(fn)] = fn

        cls.__init__ = __init__  # type: ignore[method-assign]
        return cls

    return decorate


def functions_of(module: nn.Module) -> dict[str, KernelFunction]:
    """The function modules `module` owns: its `_kernel_funcs` plus KernelFunction children."""
    found = dict(module.__dict__.get("_kernel_funcs") or {})
    for name, child in module._modules.items():
        if isinstance(child, KernelFunction):
            found.setdefault(name, child)
    return found
