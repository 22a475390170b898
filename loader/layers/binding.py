"""Binding a layer's forward onto one module instance, and undoing only our own binding.

`bind_forward` sets `module.forward = MethodType(Layer.forward, module)` on the instance (the
class is never touched). It remembers the instance-level forward that was there before (None
when the class forward was in use; otherwise e.g. a patch another library applied), so
`restore_forward` puts back exactly that, and leaves alone a forward someone set after us.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MethodType
from typing import Any

from torch import nn

_STATE = "_kernels_bound_forward"  # module.__dict__ key


@dataclass(frozen=True)
class _Bound:
    layer: type[nn.Module]
    method: MethodType
    previous: Any  # the instance forward before our first binding; None = the class forward


def bind_forward(module: nn.Module, layer: type[nn.Module]) -> None:
    """Make `layer.forward` the forward of this instance."""
    state = module.__dict__.get(_STATE)
    current = module.__dict__.get("forward")
    ours = state is not None and current is state.method
    previous = state.previous if ours else current
    method = MethodType(layer.forward, module)
    module.__dict__["forward"] = method
    module.__dict__[_STATE] = _Bound(layer, method, previous)


def restore_forward(module: nn.Module) -> None:
    """Undo `bind_forward`: back to the forward in use before it (a no-op if not bound by us)."""
    state = module.__dict__.pop(_STATE, None)
    if state is None or module.__dict__.get("forward") is not state.method:
        return
    if state.previous is None:
        del module.__dict__["forward"]
    else:
        module.__dict__["forward"] = state.previous


def bound_layer(module: nn.Module) -> type[nn.Module] | None:
    """The layer whose forward this instance currently runs because of us, if any."""
    state = module.__dict__.get(_STATE)
    if state is None or module.__dict__.get("forward") is not state.method:
        return None
    return state.layer
