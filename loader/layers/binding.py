"""Binding a layer's forward onto one module instance, and undoing only our own binding.

`bind_forward` sets `module.forward = MethodType(Layer.forward, module)` on the instance (the
class is never touched). It remembers the instance-level forward that was there before (None
when the class forward was in use; otherwise e.g. a patch another library applied), so
`restore_forward` puts back exactly that, and leaves alone a forward someone set after us.

TRL's fused-head wrapper (`add_fused_lm_head`) stays outermost whenever it is set, before or
after us: the layer is bound beneath it, as the forward it hands its other calls to
(wrappers.py), so the trainer's fused head keeps serving `fused_lm_head=True` calls. A wrapper
set around our forward after we bound it (accelerate's autocast) is kept when kernelize binds
the same layer again (transformers re-kernelizes on every train()/eval()). Under a
tensor-parallel wrapper the layer likewise takes the place of the forward the wrapper calls, so
the plan's collectives keep running around it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MethodType
from typing import Any

from torch import nn

from .wrappers import forward_slot, reaches

_STATE = "_kernels_bound_forward"  # module.__dict__ key


@dataclass(frozen=True)
class _Bound:
    layer: type[nn.Module]
    method: MethodType
    previous: Any  # the forward before our first binding; None = the class forward


def bind_forward(module: nn.Module, layer: type[nn.Module]) -> None:
    """Make `layer.forward` the forward of this instance (beneath TRL's fused-head wrapper or a
    parallel plan's wrapper when one is set on it)."""
    state = module.__dict__.get(_STATE)
    slot = forward_slot(module)
    current = slot.get()
    if state is not None and state.layer is layer and current is not state.method:
        if reaches(current, layer.forward):
            # a wrapper set after us (accelerate's autocast) still runs this layer: keep it
            return
    ours = state is not None and current is state.method
    previous = state.previous if ours else current
    method = MethodType(layer.forward, module)
    slot.set(method)
    module.__dict__[_STATE] = _Bound(layer, method, previous)


def restore_forward(module: nn.Module) -> None:
    """Undo `bind_forward`: back to the forward in use before it (a no-op if not bound by us)."""
    state = module.__dict__.pop(_STATE, None)
    if state is None:
        return
    slot = forward_slot(module)
    if slot.get() is state.method:
        slot.set(state.previous)


def bound_layer(module: nn.Module) -> type[nn.Module] | None:
    """The layer whose forward this instance currently runs because of us, if any."""
    state = module.__dict__.get(_STATE)
    if state is None or not reaches(forward_slot(module).get(), state.layer.forward):
        return None
    return state.layer


def under_wrapper(module: nn.Module) -> bool:
    """Whether this instance's forward is TRL's fused-head wrapper (a bound layer sits beneath)."""
    return "trl" in forward_slot(module).kinds
