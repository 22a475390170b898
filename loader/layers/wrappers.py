"""Forwards that wrap a model's forward and must stay outermost, and where a bound forward sits.

TRL's ``add_fused_lm_head`` (trl/trainer/utils.py, TRL 1.x) sets ``model.forward`` to a wrapper
that answers ``fused_lm_head=True`` calls itself (backbone, then TRL's chunked log-prob function,
configured with the trainer's temperature and outputs) and hands every other call to the forward
it captured (``original_forward``, a closure variable). Replacing that wrapper would drop the
trainer's fused head and its configuration, so kernelize binds *beneath* it: into that closure
variable. Nothing here imports TRL; the wrapper is recognised by its code.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from types import CellType, MethodType
from typing import Any

from torch import nn

TRL_WRAPPER = "_fused_forward"  # the wrapper's function name in trl/trainer/utils.py
TRL_INNER = "original_forward"  # its closure variable holding the wrapped forward


def trl_fused_head_cell(forward: Any) -> CellType | None:
    """The closure cell holding the forward that TRL's fused-head wrapper ``forward`` wraps,
    or None when ``forward`` is not that wrapper."""
    func = getattr(forward, "__func__", forward)
    code = getattr(func, "__code__", None)
    if code is None or code.co_name != TRL_WRAPPER or TRL_INNER not in code.co_freevars:
        return None
    if not code.co_filename.replace("\\", "/").endswith("trl/trainer/utils.py"):
        return None
    return func.__closure__[code.co_freevars.index(TRL_INNER)]


@dataclass(frozen=True)
class Slot:
    """Where a module's effective forward is kept: its ``__dict__`` (None = the class forward),
    or the closure cell of the innermost TRL fused-head wrapper on it."""

    module: nn.Module
    cell: CellType | None = None

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


def _first_trl_cell(forward: Any) -> CellType | None:
    return next((c for f in links(forward) if (c := trl_fused_head_cell(f)) is not None), None)


def forward_slot(module: nn.Module) -> Slot:
    """The slot kernelize binds into: beneath TRL's fused-head wrapper (the innermost one when
    they nest), found through any wrappers set around it (accelerate's autocast), else the
    instance's own ``forward``."""
    cell = _first_trl_cell(module.__dict__.get("forward"))
    if cell is None:
        return Slot(module)
    while (inner := _first_trl_cell(cell.cell_contents)) is not None:
        cell = inner
    return Slot(module, cell)


def reaches(forward: Any, function: Any) -> bool:
    """Whether calling ``forward`` ends in ``function`` through the wrappers around it."""
    return any(getattr(f, "__func__", f) is function for f in links(forward))
