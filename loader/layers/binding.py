"""Binding a layer's forward onto one module instance, and undoing only our own binding.

`bind_forward` sets `module.forward = MethodType(Layer.forward, module)` on the instance (the
class is never touched). It remembers the instance-level forward that was there before (None
when the class forward was in use; otherwise e.g. a patch another library applied), so
`restore_forward` puts back exactly that, and leaves alone a forward someone set after us.
Under a tensor-parallel wrapper (wrappers.py) the layer takes the place of the forward the
wrapper calls, so the wrapper's collectives keep running around it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MethodType
from typing import Any

from torch import nn

from .wrappers import inner_cell

_STATE = "_kernels_bound_forward"  # module.__dict__ key


@dataclass(frozen=True)
class _Bound:
    layer: type[nn.Module]
    method: MethodType
    previous: Any  # the instance forward before our first binding; None = the class forward


def _current(module: nn.Module) -> Any:
    """What runs as the module's forward: the instance forward (None: the class's), or, under
    a parallel wrapper, the forward the wrapper calls."""
    forward = module.__dict__.get("forward")
    cell = inner_cell(forward)
    return forward if cell is None else cell.cell_contents


def _install(module: nn.Module, forward: Any) -> None:
    """Make `forward` (None: the class's) what runs, under the wrapper if there is one."""
    cell = inner_cell(module.__dict__.get("forward"))
    if cell is not None:
        cell.cell_contents = (
            MethodType(type(module).forward, module) if forward is None else forward
        )
    elif forward is None:
        module.__dict__.pop("forward", None)
    else:
        module.__dict__["forward"] = forward


def bind_forward(module: nn.Module, layer: type[nn.Module]) -> None:
    """Make `layer.forward` the forward of this instance."""
    state = module.__dict__.get(_STATE)
    current = _current(module)
    ours = state is not None and current is state.method
    previous = state.previous if ours else current
    method = MethodType(layer.forward, module)
    _install(module, method)
    module.__dict__[_STATE] = _Bound(layer, method, previous)


def restore_forward(module: nn.Module) -> None:
    """Undo `bind_forward`: back to the forward in use before it (a no-op if not bound by us)."""
    state = module.__dict__.pop(_STATE, None)
    if state is None or _current(module) is not state.method:
        return
    _install(module, state.previous)


def bound_layer(module: nn.Module) -> type[nn.Module] | None:
    """The layer whose forward this instance currently runs because of us, if any."""
    state = module.__dict__.get(_STATE)
    if state is None or _current(module) is not state.method:
        return None
    return state.layer
