"""Under torch.compile (Inductor), scale the loss ops' saved gradients in place, and not at all
when grad_output is exactly 1.

The loss ops (cross-entropy, fused linear cross-entropy) compute their inputs' gradients in the
forward and save them; their backward only multiplies them by grad_output, which is exactly 1
under a plain ``loss.backward()``. Eager's scale kernel reads that factor on the device and
writes nothing then. In a compiled backward the multiply is a kernel that reads and writes the
whole gradient: 0.49 ms a step for Llama-3-8B's 1 GiB d(weight) on an H200. A functional graph
cannot say "in place" of a backward input (Inductor re-inplaces a mutation of a graph input only
where the graph copies it back), so this post-grad pass says it where it is safe:

- the saved gradient ``P`` is one of AOTAutograd's donated buffers for this backward: a saved
  tensor no forward input or output and no gradient aliases, which the backward reads once
  (AOTAutograd refuses a ``retain_graph=True`` backward of such a graph before it runs), and
  which shares its storage with no other input of the graph;
- the graph is the top-level backward the donation record belongs to: not a forward, not the
  graph of a higher-order op inside it (a nested_compile_region's), and not one that CUDA
  graphs without trees would run twice on the same inputs (their warm-up);
- ``P``'s only reader is the multiply, ``P * g`` (``g`` one fp32 element) or, for a 16-bit ``P``,
  ``(P.float() * g).to(P.dtype)``, each step read by nothing else;
- ``P`` is contiguous and has at least one dimension.

Such a chain becomes ``scale_grad_(P, g)`` and its readers read ``P``: the same values bit for
bit (one fp32 product, rounded once), and no pass over ``P`` where ``g == 1``.
"""

from __future__ import annotations

import torch
from torch import fx

from . import compile_fusion
from ._common import op_name
from .compile_fusion import _val
from .cross_entropy import scale_rows_

_MUL = torch.ops.aten.mul.Tensor
_DETACH = torch.ops.aten.detach.default
_CASTS = (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)
_SCALED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@torch.library.custom_op(op_name("scale_grad_"), mutates_args=("grad",))
def scale_grad_(grad: torch.Tensor, g: torch.Tensor) -> None:
    """``grad *= g`` in place, the product in fp32 rounded once to grad's dtype (what the
    compiled multiply computes); nothing is written where ``g`` (one element) is exactly 1."""
    scale_rows_(grad, g)  # reads g on the device: no sync; the rewrite takes contiguous grads


@scale_grad_.register_fake
def _(grad, g):
    return None


def install() -> bool:
    """Add the rewrite to the kernels' pass in Inductor's slot (compile_fusion.install)."""
    return compile_fusion.install(scale_saved_grads_in_place)


def scale_saved_grads_in_place(graph: fx.Graph) -> int:
    """Rewrite each donated saved gradient's scaling chain (module docstring) into
    ``scale_grad_``; returns how many were rewritten. A graph that is not a backward, or is
    compiled without AOTAutograd's donation record, is left as it is."""
    rewritten = 0
    for saved in _donated(graph):
        chain = _scaling_chain(saved)
        if chain is None:
            continue
        *steps, g = chain
        with graph.inserting_before(steps[-1]):
            graph.call_function(scale_grad_._opoverload, (saved, g)).meta["val"] = None
        steps[-1].replace_all_uses_with(saved)
        for node in reversed(steps):
            graph.erase_node(node)
        rewritten += 1
    if rewritten:
        graph.lint()
    return rewritten


def _donated(graph: fx.Graph) -> list[fx.Node]:
    """The placeholders of a top-level backward graph that AOTAutograd donated and that share
    their storage with no other placeholder (empty for any other graph)."""
    from torch._inductor import config

    if config.triton.cudagraphs and not config.triton.cudagraph_trees:
        # CUDA graphs without trees run a warm-up on the real inputs before they capture and
        # replay: an in-place scale of an input would be applied twice.
        return []
    placeholders = list(graph.find_nodes(op="placeholder"))
    names = [str(p.target) for p in placeholders]
    # A backward graph takes grad_outputs, named tangents_N; a forward or inference graph takes
    # none. The donation record read below is the backward's, also present while the forward
    # compiles: it must not be applied to a forward's placeholders. Nor to the graphs of a
    # higher-order op inside it (a nested_compile_region's backward), which Inductor passes
    # first, in the same context: AOTAutograd numbers its tangents from 1, those from 0.
    if not any(n.startswith("tangents") for n in names) or "tangents_0" in names:
        return []
    try:
        from torch._inductor.utils import get_donated_idxs
    except ImportError:  # a torch without donated buffers
        return []
    indices = get_donated_idxs() or ()
    # A donated buffer is a forward intermediate: never an input (primals_N) of the forward nor
    # a grad_output. An index landing on one means the record is another graph's: use none.
    if any(i >= len(names) or names[i].startswith(("primals", "tangents")) for i in indices):
        return []
    storages = [_storage(p) for p in placeholders]
    # AOTAutograd checks a donated buffer against the forward's inputs and outputs and the
    # backward's outputs, not against the other saved tensors: a view saved beside its base
    # would see an in-place scale. Only a storage no other placeholder holds is taken.
    held = [st for st in storages if st is not None]
    return [
        placeholders[i] for i in indices if storages[i] is not None and held.count(storages[i]) == 1
    ]


def _storage(node: fx.Node):
    """A handle of the node's fake tensor's storage (equal for tensors sharing one), or None."""
    from torch.multiprocessing.reductions import StorageWeakRef

    value = _val(node)
    try:
        return None if value is None else StorageWeakRef(value.untyped_storage())
    except (NotImplementedError, RuntimeError):  # a tensor without storage (sparse, subclass)
        return None


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _cast_to(node: fx.Node | None, source: fx.Node, dtype: torch.dtype) -> bool:
    """Whether `node` is `source` converted to `dtype` and nothing else (no layout or device)."""
    if node is None or node.target not in _CASTS or not node.args or node.args[0] is not source:
        return False
    if node.target is _CASTS[0]:
        return len(node.args) == 2 and node.args[1] == dtype and not node.kwargs
    return len(node.args) == 1 and node.kwargs == {"dtype": dtype}


def _factor(mul: fx.Node | None, operand: fx.Node) -> fx.Node | None:
    """g, where `mul` is ``operand * g`` (either order) with g one fp32 element on its device."""
    if mul is None or mul.target is not _MUL or len(mul.args) != 2 or mul.kwargs:
        return None
    a, b = mul.args
    g = b if a is operand else a if b is operand else None
    vg, vo = _val(g), _val(operand)
    if g is None or g is operand or vg is None or vo is None:
        return None
    if (
        vg.dtype != torch.float32
        or vg.numel() != 1
        or vg.dim() > vo.dim()
        or vg.device != vo.device
    ):
        return None
    return g


def _scaling_chain(saved: fx.Node) -> list[fx.Node] | None:
    """[step, ..., last step, g] of ``saved``'s scaling chain, or None where it has none.
    Detaches on the way are steps (graphs not decomposed by Inductor keep them)."""
    val = _val(saved)
    if val is None or val.dtype not in _SCALED_DTYPES or not val.is_contiguous() or not val.dim():
        return None  # scale_rows_ scales rows: a 0-d tensor has none
    steps, operand, first = [], saved, _only_user(saved)
    while first is not None and first.target is _DETACH:
        steps.append(first)
        operand, first = first, _only_user(first)
    if val.dtype == torch.float32:
        g = _factor(first, operand)
        return None if g is None else [*steps, first, g]
    if not _cast_to(first, operand, torch.float32):
        return None
    mul = _only_user(first)
    g = _factor(mul, first)
    last = _only_user(mul) if g is not None else None
    if not _cast_to(last, mul, val.dtype) or _val(last) is None or _val(last).shape != val.shape:
        return None
    return [*steps, first, mul, last, g]
