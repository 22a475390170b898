"""Forward wrappers that a parallelism library installs on a module instance and that must stay
outermost when a kernel is bound.

transformers' tensor- and expert-parallel plans replace ``module.forward`` with a closure that
lays the inputs out, calls the forward it found then (``original_forward``), and lays the output
out or registers gradient hooks: ``replicated_with_grad_allreduce`` on Qwen3's q_norm/k_norm
sums their weights' gradients over the TP ranks, ``moe_tp_experts`` all-reduces the experts'
output. A kernel bound over such a closure would drop those collectives and train with wrong
gradients or outputs; bound as the forward the closure calls, the plan's work stays around it.
"""

from __future__ import annotations

from types import CellType
from typing import Any

# Where transformers defines its parallel styles' wrappers (tensor_parallel.py, expert_parallel.py)
_WRAPPER_MODULES = ("transformers.distributed.", "transformers.integrations.tensor_parallel")
_INNER = "original_forward"


def inner_cell(forward: Any) -> CellType | None:
    """The closure cell holding the forward that `forward` calls, when `forward` is one of
    transformers' parallel-style wrappers; else None."""
    code = getattr(forward, "__code__", None)
    module = getattr(forward, "__module__", None) or ""
    if code is None or not module.startswith(_WRAPPER_MODULES) or _INNER not in code.co_freevars:
        return None
    return forward.__closure__[code.co_freevars.index(_INNER)]
