"""Functions as kernel layers, bound per calling module.

`use_kernel_forward_from_hub` turns a function into a `KernelFunction` instance: an nn.Module
that is called like the function. Such an instance is one object shared by every model whose
code calls it (transformers' `apply_rotary_pos_emb` is a module global), so binding a kernel to
the object itself would change every model at once. Instead, kernelize records the binding on
the *owner*: the module that lists the function in its `_kernel_funcs`
(`use_kernelized_func`). While an owner with bindings runs its forward, it is pushed on a
context-local stack (two forward hooks, installed only on owners that have bindings); a
`KernelFunction` called during that forward runs the owner's kernel, and the plain function
anywhere else. Kernelizing one model therefore never changes another model's behaviour.

Under torch.compile the stack is a plain list instead (Dynamo cannot trace a ContextVar and would
break the graph at every owner): Dynamo traces the hooks' pushes and pops as side effects, the
kernel is chosen while tracing, and the compiled graph calls it directly.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

_ACTIVE_OWNERS: ContextVar[tuple[nn.Module, ...]] = ContextVar("kernels_active_owners", default=())
# The same stack while Dynamo traces (see the module docstring); empty outside a trace.
_TRACED_OWNERS: list[nn.Module] = []
_BINDINGS = "_kernels_func_bindings"  # owner.__dict__: {KernelFunction subclass: layer class}


def _always(module: nn.Module) -> bool:
    return True


class KernelFunction(nn.Module):
    """Base class of the modules made from functions by use_kernel_forward_from_hub.

    Each decorated function gets its own subclass carrying `kernel_layer_name`; the instance
    is stateless, so copies are the instance itself and pickling refers to it by name.
    """

    kernel_layer_name: str
    __wrapped__: Callable[..., Any]

    def __deepcopy__(self, memo: dict) -> KernelFunction:
        return self

    def __reduce__(self) -> str:
        # Pickled by reference to the module-level name the decorator assigned it to.
        return self.__wrapped__.__qualname__

    def extra_repr(self) -> str:
        return f"layer={self.kernel_layer_name!r}"


def _with_self(fn: Callable[..., Any]) -> inspect.Signature:
    signature = inspect.signature(fn)
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return signature.replace(parameters=[self_param, *signature.parameters.values()])


def make_function_module(
    fn: Callable[..., Any], layer_name: str, condition: Callable[[nn.Module], bool] | None
) -> KernelFunction:
    """A KernelFunction instance that runs `fn`, or the kernel its calling owner bound."""

    def forward(self: KernelFunction, *args: Any, **kwargs: Any) -> Any:
        owners = _TRACED_OWNERS if torch.compiler.is_compiling() else _ACTIVE_OWNERS.get()
        if owners:
            cls = type(self)
            for owner in reversed(owners):
                bindings = getattr(owner, _BINDINGS, None)
                if bindings is not None and cls in bindings:
                    return bindings[cls].forward(self, *args, **kwargs)
        return fn(*args, **kwargs)

    # Layer validation compares this signature with the kernel layer's forward.
    forward.__signature__ = _with_self(fn)  # type: ignore[attr-defined]
    forward.__qualname__ = f"{fn.__qualname__}.forward"
    cls = type(
        fn.__name__,
        (KernelFunction,),
        {
            "forward": forward,
            "kernel_layer_name": layer_name,
            "kernel_condition": staticmethod(condition or _always),
            "__module__": fn.__module__,
            "__qualname__": fn.__qualname__,
            "__doc__": fn.__doc__,
        },
    )
    instance = cls()
    # `inspect.signature(instance)` follows __wrapped__ and shows the function's signature.
    instance.__dict__["__wrapped__"] = fn
    return instance


def layer_class_from_function(fn: Callable[..., Any]) -> type[nn.Module]:
    """A stateless layer class whose forward(self, *params of fn) calls `fn` (for Func repos)."""

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    forward.__signature__ = _with_self(fn)  # type: ignore[attr-defined]
    return type(
        getattr(fn, "__name__", "Func"),
        (nn.Module,),
        {
            "forward": forward,
            "has_backward": bool(getattr(fn, "has_backward", True)),
            "can_torch_compile": bool(getattr(fn, "can_torch_compile", False)),
            "__module__": getattr(fn, "__module__", __name__),
        },
    )


# -- per-owner bindings ---------------------------------------------------------------------------


def _enter_owner(module: nn.Module, args: Any) -> None:
    if torch.compiler.is_compiling():
        _TRACED_OWNERS.append(module)
        return
    _ACTIVE_OWNERS.set((*_ACTIVE_OWNERS.get(), module))


def _leave_owner(module: nn.Module, args: Any, output: Any) -> None:
    if torch.compiler.is_compiling():
        if _TRACED_OWNERS and _TRACED_OWNERS[-1] is module:
            _TRACED_OWNERS.pop()
        return
    owners = _ACTIVE_OWNERS.get()
    for i in range(len(owners) - 1, -1, -1):
        if owners[i] is module:
            _ACTIVE_OWNERS.set(owners[:i] + owners[i + 1 :])
            return


def _has_owner_hooks(owner: nn.Module) -> bool:
    return any(hook is _enter_owner for hook in owner._forward_pre_hooks.values())


def _set_owner_hooks(owner: nn.Module, wanted: bool) -> None:
    if wanted == _has_owner_hooks(owner):
        return
    if wanted:
        owner.register_forward_pre_hook(_enter_owner)
        # always_call: the owner leaves the stack even when its forward raises.
        owner.register_forward_hook(_leave_owner, always_call=True)
        return
    # Handles are not kept (a deep-copied model would share them); find ours by identity.
    for key, hook in list(owner._forward_pre_hooks.items()):
        if hook is _enter_owner:
            del owner._forward_pre_hooks[key]
    for key, hook in list(owner._forward_hooks.items()):
        if hook is _leave_owner:
            del owner._forward_hooks[key]
            owner._forward_hooks_always_called.pop(key, None)


def bind_function(owner: nn.Module, func: KernelFunction, layer: type[nn.Module]) -> None:
    """Calls of `func` during `owner`'s forward run `layer.forward` from now on."""
    current = owner.__dict__.get(_BINDINGS) or {}
    # A new dict each time (never changed in place), so a forward running now sees one state.
    owner.__dict__[_BINDINGS] = {**current, type(func): layer}
    _set_owner_hooks(owner, True)


def unbind_function(owner: nn.Module, func: KernelFunction) -> None:
    """Calls of `func` during `owner`'s forward run the plain function again."""
    current = owner.__dict__.get(_BINDINGS)
    if current is None or type(func) not in current:
        return
    remaining = {cls: layer for cls, layer in current.items() if cls is not type(func)}
    if remaining:
        owner.__dict__[_BINDINGS] = remaining
    else:
        del owner.__dict__[_BINDINGS]
        _set_owner_hooks(owner, False)


def function_binding(owner: nn.Module, func: KernelFunction) -> type[nn.Module] | None:
    """The layer bound for `func` on `owner`, if any."""
    bindings = owner.__dict__.get(_BINDINGS)
    return None if bindings is None else bindings.get(type(func))
