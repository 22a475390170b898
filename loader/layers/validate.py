"""The layer contract: what a kernel layer class must be to replace a module's forward.

A layer is bound as `module.forward = MethodType(Layer.forward, module)`, so it must be
stateless (it reads the module's own attributes, e.g. `self.weight`) and its forward must take
the same arguments as the forward it replaces.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

from ..errors import LayerError
from .mode import Mode, mode_name

if TYPE_CHECKING:
    from torch import nn

ALLOWED_MEMBERS = frozenset({"can_torch_compile", "has_backward"})
_ANY_ARGUMENTS = [
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
    inspect.Parameter.VAR_POSITIONAL,
    inspect.Parameter.VAR_KEYWORD,
]


def has_backward(layer: type) -> bool:
    """Whether the layer supports autograd (default True, as in the reference)."""
    return bool(getattr(layer, "has_backward", True))


def can_torch_compile(layer: type) -> bool:
    """Whether the layer may run under torch.compile (default False)."""
    return bool(getattr(layer, "can_torch_compile", False))


def _describe(fn: object) -> str:
    try:
        return f"({', '.join(str(p) for p in inspect.signature(fn).parameters.values())})"
    except (TypeError, ValueError):
        return "(?)"


def check_layer(layer: object, replaced: type[nn.Module], *, source: object) -> None:
    """Raise LayerError unless `layer` may replace the forward of `replaced` instances."""
    from torch import nn

    if not (isinstance(layer, type) and issubclass(layer, nn.Module)):
        raise LayerError(f"{source}: {layer!r} is not an nn.Module subclass")
    if layer.__init__ is not nn.Module.__init__:
        raise LayerError(
            f"{source}: layer {layer.__name__} defines __init__; layers must be stateless",
            hint="drop __init__ and read the replaced module's attributes (self.weight, ...) in forward",
        )
    # nn.Module's members are read on every check, not cached: libraries add methods to it after
    # import (transformers sets nn.Module.smart_apply when it first initialises a model's
    # weights), and every layer inherits those.
    extra = set(dir(layer)) - set(dir(nn.Module)) - ALLOWED_MEMBERS
    if extra:
        raise LayerError(
            f"{source}: layer {layer.__name__} has members besides forward, can_torch_compile and "
            f"has_backward: {', '.join(sorted(extra))}",
            hint="inline helpers into forward or move them to module-level functions of the kernel",
        )
    mine = [p.kind for p in inspect.signature(layer.forward).parameters.values()]
    theirs = [p.kind for p in inspect.signature(replaced.forward).parameters.values()]
    if mine == _ANY_ARGUMENTS:
        return  # forward(self, *args, **kwargs) binds the replaced forward's arguments itself
    if mine != theirs:
        raise LayerError(
            f"{source}: {layer.__name__}.forward{_describe(layer.forward)} does not match "
            f"{replaced.__name__}.forward{_describe(replaced.forward)}",
            hint="the layer's forward must take as many arguments, of the same kinds, as the one it replaces",
        )


def check_mode_support(layer: type, registered: Mode, *, source: object) -> None:
    """Raise LayerError if `layer` cannot do what the mode it was registered for promises."""
    if Mode.TRAINING in registered and not has_backward(layer):
        raise LayerError(
            f"{source} is registered for {mode_name(registered)} but {layer.__name__} has no backward",
            hint="register it for Mode.INFERENCE, or use a layer with has_backward = True",
        )
    if Mode.TORCH_COMPILE in registered and not can_torch_compile(layer):
        raise LayerError(
            f"{source} is registered for {mode_name(registered)} but {layer.__name__} "
            "does not declare can_torch_compile = True",
            hint="register it without Mode.TORCH_COMPILE, or use a layer that supports torch.compile",
        )
