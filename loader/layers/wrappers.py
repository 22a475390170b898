"""Forwards that wrap a module's forward and must stay outermost, and where a bound forward sits.

Two kinds of wrapper are set on a module instance and capture the forward that was there
(``original_forward``, a closure variable); replacing either would drop its work, so kernelize
binds *beneath* it, into that closure variable:

- TRL's ``add_fused_lm_head`` (trl/trainer/utils.py, TRL 1.x) sets ``model.forward`` to a wrapper
  that answers ``fused_lm_head=True`` calls itself (backbone, then TRL's chunked log-prob
  function, configured with the trainer's temperature and outputs) and hands every other call on;
- transformers' tensor- and expert-parallel plans replace ``module.forward`` with a closure that
  lays the inputs out, calls the forward, and lays the output out or registers gradient hooks
  (``replicated_with_grad_allreduce`` on Qwen3's q_norm/k_norm sums their weights' gradients over
  the TP ranks; ``moe_tp_experts`` all-reduces the experts' output). A kernel bound over such a
  closure would train with wrong gradients or outputs.

Nothing here imports TRL or transformers; each wrapper is recognised by its code.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from types import CellType, MethodType
from typing import Any

from torch import nn

INNER = "original_forward"  # both wrappers' closure variable holding the wrapped forward
TRL_WRAPPER = "_fused_forward"  # the TRL wrapper's function name in trl/trainer/utils.py
# Where transformers defines its parallel styles' wrappers (tensor_parallel.py, expert_parallel.py)
_PARALLEL_MODULES = ("transformers.distributed.", "transformers.integrations.tensor_parallel")


def _inner_cell(func: Any) -> CellType | None:
    code = getattr(func, "__code__", None)
    if code is None or INNER not in code.co_freevars:
        return None
    return func.__closure__[code.co_freevars.index(INNER)]


def trl_fused_head_cell(forward: Any) -> CellType | None:
    """The closure cell holding the forward that TRL's fused-head wrapper ``forward`` wraps,
    or None when ``forward`` is not that wrapper."""
    func = getattr(forward, "__func__", forward)
    code = getattr(func, "__code__", None)
    if code is None or code.co_name != TRL_WRAPPER:
        return None
    if not code.co_filename.replace("\\", "/").endswith("trl/trainer/utils.py"):
        return None
    return _inner_cell(func)


def parallel_wrapper_cell(forward: Any) -> CellType | None:
    """The closure cell holding the forward that ``forward`` calls, when ``forward`` is one of
    transformers' parallel-style wrappers; else None."""
    module = getattr(forward, "__module__", None) or ""
    if not module.startswith(_PARALLEL_MODULES):
        return None
    return _inner_cell(forward)


def _wrapper_cell(forward: Any) -> tuple[str, CellType] | None:
    cell = trl_fused_head_cell(forward)
    if cell is not None:
        return "trl", cell
    cell = parallel_wrapper_cell(forward)
    return None if cell is None else ("parallel", cell)


@dataclass(frozen=True)
class Slot:
    """Where a module's effective forward is kept: its ``__dict__`` (None = the class forward),
    or the closure cell of the innermost wrapper on it; ``kinds`` names the wrappers passed on
    the way in ("trl", "parallel"), outermost first."""

    module: nn.Module
    cell: CellType | None = None
    kinds: tuple[str, ...] = ()

    def get(self) -> Any:
        if self.cell is not None:
            return self.cell.cell_contents
        return self.module.__dict__.get("forward")

    def set(self, forward: Any) -> None:
        if self.cell is not None:
            # a wrapper always needs a callable: None (the class forward) as a bound method
            if forward is None:
                forward = MethodType(type(self.module).forward, self.module)
            self.cell.cell_contents = forward
        elif forward is None:
            self.module.__dict__.pop("forward", None)
        else:
            self.module.__dict__["forward"] = forward

    @property
    def under_wrapper(self) -> bool:
        return self.cell is not None


def links(forward: Any) -> Iterator[Any]:
    """``forward`` and what it wraps, outermost first: a bound method's function, a decorator's
    ``__wrapped__`` (accelerate's mixed-precision wrappers set it), and so on."""
    seen: set[int] = set()
    while forward is not None and id(forward) not in seen:
        seen.add(id(forward))
        yield forward
        inner = getattr(forward, "__func__", None)
        forward = inner if inner is not None else getattr(forward, "__wrapped__", None)


def _first_wrapper(forward: Any) -> tuple[str, CellType] | None:
    return next((w for f in links(forward) if (w := _wrapper_cell(f)) is not None), None)


def forward_slot(module: nn.Module) -> Slot:
    """The slot kernelize binds into: beneath the innermost wrapper (TRL's fused head, a
    parallel plan's), found through any wrappers set around it (accelerate's autocast), else the
    instance's own ``forward``."""
    found = _first_wrapper(module.__dict__.get("forward"))
    if found is None:
        return Slot(module)
    kinds, cell = [found[0]], found[1]
    while (inner := _first_wrapper(cell.cell_contents)) is not None:
        kinds.append(inner[0])
        cell = inner[1]
    return Slot(module, cell, tuple(kinds))


def reaches(forward: Any, function: Any) -> bool:
    """Whether calling ``forward`` ends in ``function`` through the wrappers around it."""
    return any(getattr(f, "__func__", f) is function for f in links(forward))
