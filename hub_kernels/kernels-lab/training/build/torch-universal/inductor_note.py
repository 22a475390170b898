"""Inductor's note on a custom op's first lowering names the op's arguments in one line each.

The first time Inductor lowers an op it has no lowering for (every custom op), it logs
"Creating implicit fallback for:" with ``OperatorIssue.operator_str(target, args, kwargs)``.
torch 2.11 and earlier build that text even when the log is off (later releases build it only
for an enabled log), and it prints each IR argument with its producers, recursively. Between
opaque ops (a fused add + RMSNorm whose sum feeds the next layer's, the matmuls between them) the
producers form a graph in which every layer is reached by two paths, printed as a tree: 2^56
branches at Qwen3-0.6B's 28 layers, and the compile never finishes (seen on the H200, torch 2.11).
`shorten_fallback_note` replaces the method with one that prints each IR argument as its kind,
name, size and dtype; the log keeps its shape and nothing else changes.
"""

from __future__ import annotations

import textwrap
from typing import Any

_MARK = "_kernels_short_note"
_LIMIT = 200  # characters per argument in the note


def shorten_fallback_note() -> None:
    """Install the short argument text in Inductor's OperatorIssue (once per process; nothing
    where a torch release has no such method: the note is Inductor's internals)."""
    try:
        from torch._inductor.exc import OperatorIssue

        current = OperatorIssue.operator_str
    except (ImportError, AttributeError):
        return
    if getattr(current, _MARK, False):
        return
    setattr(_operator_str, _MARK, True)
    OperatorIssue.operator_str = staticmethod(_operator_str)


def _operator_str(target: Any, args: Any, kwargs: Any) -> str:
    lines = [f"target: {target}"] + [f"args[{i}]: {_brief(a)}" for i, a in enumerate(args)]
    if kwargs:
        lines.append("kwargs: {" + ", ".join(f"{k}: {_brief(v)}" for k, v in kwargs.items()) + "}")
    return textwrap.indent("\n".join(lines), "  ")


def _brief(value: Any) -> str:
    from torch._inductor.ir import IRNode

    if isinstance(value, (list, tuple)):
        inner = ", ".join(_brief(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if not isinstance(value, IRNode):
        return repr(value)[:_LIMIT]
    parts = [type(value).__name__]
    for getter in ("get_name", "get_size", "get_dtype"):
        try:  # an unrealized node has no name; a NoneLayout has no size
            parts.append(str(getattr(value, getter)()))
        except Exception:  # noqa: BLE001 - the note only leaves out what it cannot read
            continue
    return " ".join(parts)[:_LIMIT]
