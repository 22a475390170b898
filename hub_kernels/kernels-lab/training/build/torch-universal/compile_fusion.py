"""Under torch.compile (Inductor), fuse the residual adds into the RMSNorm ops around them.

A decoder layer's ``hidden = residual + hidden; residual = hidden; hidden = norm(hidden)``
compiles to an ``aten.add`` kernel writing the sum and the ``rms_norm_fwd`` op reading it back;
the norm's op is opaque to Inductor, which cannot fuse the add into it. In the backward, the
sum's gradient is the norm's dx plus the residual stream's gradient: an ``rms_norm_bwd`` op
writing dx and an add kernel reading it back. This pass rewrites both pairs, in the graphs
Inductor compiles after AOTAutograd (its post-grad custom pass):

- forward: ``s = add(a, b); y, rstd = rms_norm_fwd(s, ...)`` becomes
  ``y, s, rstd = add_rms_norm_fwd(a, b, ...)``: the same values (the kernel rounds the fp32 sum
  once to the inputs' dtype, as torch's add does);
- backward: ``dx, dw = rms_norm_bwd(dy, x, ...); g = add(dx, other)`` becomes
  ``g, dw = add_rms_norm_bwd(dy, other, x, ...)``: ``other`` is added to dx in fp32 before its
  one rounding (the separate ops round dx first), so g may differ in the last bit.

Only same-shape, same-dtype, contiguous sums are rewritten (no broadcast or promotion), and
only a dx read by nothing but the add.

This module also holds the slot for the kernels' other rewriters (compile_grad_scale.py).
Inductor reads its pass from ``torch._inductor.config.post_grad_custom_post_pass``; `install`
puts one there when the slot is empty, or chains it after a pass already there that Inductor
can cache (a ``CustomGraphPass``), and adds a rewriter to the pass. A plain callable in the slot
is left alone: no rewrite then. ``KERNELS_COMPILE_FUSION=0`` in the environment turns every
rewrite off for the compiles that follow (it is read by each compile, and is part of Inductor's
cache key).
"""

from __future__ import annotations

import inspect
import operator
import os

import torch
from torch import fx

from .add_rms_norm import add_rms_norm_bwd, add_rms_norm_fwd
from .rms_norm import rms_norm_bwd, rms_norm_fwd

_ADD = torch.ops.aten.add.Tensor
_RMS_FWD = rms_norm_fwd._opoverload
_RMS_BWD = rms_norm_bwd._opoverload
_FUSED_FWD = add_rms_norm_fwd._opoverload
_FUSED_BWD = add_rms_norm_bwd._opoverload
# The pass object in Inductor's slot carries this attribute: the rewriters of every copy of
# this module loaded in the process (kernel variants have their own op namespaces).
MARK = "kernels_training_rewriters"


def fuse_residual_adds(graph: fx.Graph) -> int:
    """Rewrite the graph's add -> RMSNorm forward pairs and RMSNorm backward -> add pairs (see
    the module docstring); returns how many were fused."""
    fused = 0
    for node in list(graph.nodes):
        if node._erased:  # by an earlier rewrite
            continue
        if node.target is _RMS_FWD:
            fused += _fuse_forward(graph, node)
        elif node.target is _ADD:
            fused += _fuse_backward(graph, node)
    if fused:
        from torch._inductor.pattern_matcher import stable_topological_sort

        # A rewritten node sits where the add was; dW's readers may have come before it.
        stable_topological_sort(graph)
        graph.lint()
    return fused


def _val(node) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _plain_sum(add: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(a, b) when `add` is a + b of two tensors of its own shape and dtype, contiguous."""
    if add.target is not _ADD or len(add.args) != 2 or add.kwargs:
        return None
    a, b = add.args
    va, vb, vs = _val(a), _val(b), _val(add)
    if va is None or vb is None or vs is None:
        return None
    if not (va.shape == vb.shape == vs.shape and va.dtype == vb.dtype == vs.dtype):
        return None
    if va.device != vb.device or not vs.is_contiguous():
        return None
    return a, b


def _traced(args) -> bool:
    """Whether every graph node among `args` carries the fake tensor `_call` computes with."""
    return all(_val(a) is not None for a in args if isinstance(a, fx.Node))


def _call(graph: fx.Graph, op, args: tuple, outputs: int) -> list[fx.Node]:
    """Insert op(*args) and its `outputs` getitems, with fake values for Inductor (`args` must
    be `_traced`)."""
    node = graph.call_function(op, args)
    fake = [_val(a) if isinstance(a, fx.Node) else a for a in args]
    from torch._guards import detect_fake_mode

    with detect_fake_mode([f for f in fake if isinstance(f, torch.Tensor)]):
        node.meta["val"] = op(*fake)
    items = []
    for i in range(outputs):
        item = graph.call_function(operator.getitem, (node, i))
        item.meta["val"] = node.meta["val"][i]
        items.append(item)
    return items


def _outputs(node: fx.Node) -> dict[int, fx.Node] | None:
    """The getitem readers of a multi-output op by index; None if anything else reads it."""
    items = {}
    for user in node.users:
        if user.target is not operator.getitem:
            return None
        items[user.args[1]] = user
    return items


def _fuse_forward(graph: fx.Graph, norm: fx.Node) -> int:
    x, weight, eps, gemma, _save_output, *numerics = _args(norm, _RMS_FWD)
    sum_ = _plain_sum(x) if isinstance(x, fx.Node) else None
    items = _outputs(norm)
    args = (*sum_, weight, eps, gemma, *numerics) if sum_ is not None else ()
    if sum_ is None or items is None or not _traced(args):
        return 0
    with graph.inserting_before(x):
        y, s, rstd = _call(graph, _FUSED_FWD, args, 3)
    for index, new in ((0, y), (1, rstd)):
        if index in items:
            items[index].replace_all_uses_with(new)
            graph.erase_node(items[index])
    graph.erase_node(norm)
    x.replace_all_uses_with(s)
    graph.erase_node(x)
    return 1


def _fuse_backward(graph: fx.Graph, add: fx.Node) -> int:
    sum_ = _plain_sum(add)
    if sum_ is None:
        return 0
    for dx, other in (sum_, sum_[::-1]):
        bwd = dx.args[0] if dx.target is operator.getitem and dx.args[1] == 0 else None
        if not isinstance(bwd, fx.Node) or bwd.target is not _RMS_BWD or len(dx.users) != 1:
            continue
        dy, saved, weight, rstd, gemma, compute_dw, from_y, x_dtype, *numerics = _args(
            bwd, _RMS_BWD
        )
        items = _outputs(bwd)
        args = (dy, other, saved, weight, rstd, gemma, compute_dw, *numerics)
        if from_y or items is None or x_dtype != _val(add).dtype or not _traced(args):
            continue  # from y: x̂ is y / w, which add_rms_norm_bwd does not take
        with graph.inserting_before(add):
            g, dw = _call(graph, _FUSED_BWD, args, 2)
        add.replace_all_uses_with(g)
        graph.erase_node(add)
        if 1 in items:
            items[1].replace_all_uses_with(dw)
            graph.erase_node(items[1])
        graph.erase_node(dx)
        graph.erase_node(bwd)
        return 1
    return 0


def _args(node: fx.Node, op) -> list:
    """The node's arguments in schema order, defaults filled in."""
    out = []
    for i, arg in enumerate(op._schema.arguments):
        if i < len(node.args):
            out.append(node.args[i])
        elif arg.name in node.kwargs:
            out.append(node.kwargs[arg.name])
        else:
            out.append(arg.default_value)
    return out


def install(rewrite=None) -> bool:
    """Put `rewrite` (default: the residual-add fusion) among the rewriters of the kernels' pass
    in Inductor's post-grad custom pass slot (once per process, copy of this module and
    rewriter); False where a plain callable holds the slot (left alone) or
    ``KERNELS_COMPILE_FUSION=0`` turns the kernels' rewrites off."""
    rewrite = fuse_residual_adds if rewrite is None else rewrite
    if not enabled():
        return False
    from torch._inductor import config

    current = config.post_grad_custom_post_pass
    rewriters = getattr(current, MARK, None)
    if rewriters is not None:
        if rewrite not in rewriters:
            rewriters.append(rewrite)
        return True
    from torch._inductor.custom_graph_pass import CustomGraphPass

    if current is not None and not isinstance(current, CustomGraphPass):
        return False
    config.post_grad_custom_post_pass = _pass_class()(current, rewrite)
    return True


def enabled() -> bool:
    """Whether the environment leaves the rewrite on (``KERNELS_COMPILE_FUSION`` is not 0)."""
    return os.environ.get("KERNELS_COMPILE_FUSION", "1") != "0"


def _pass_class():
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class KernelsGraphPass(CustomGraphPass):
        """Runs the pass it replaced in the slot (if any), then every registered rewriter."""

        def __init__(self, before, rewrite) -> None:
            self.before = before
            setattr(self, MARK, [rewrite])

        def __call__(self, graph: fx.Graph) -> None:
            if self.before is not None:
                self.before(graph)
            if enabled():
                for rewrite in getattr(self, MARK):
                    rewrite(graph)

        def uuid(self):
            # Inductor's cache key: the bytes of the files the rewriters come from (every copy
            # of a file is the same code), the packages they belong to (the ops a rewrite puts
            # in are named after the package: code cached with one must not load with another),
            # whether they are on, and the chained pass's own key.
            before = None if self.before is None else self.before.uuid()
            rewriters = getattr(self, MARK)
            files = tuple(sorted({inspect.getfile(r) for r in rewriters}))
            packages = tuple(sorted({r.__module__ for r in rewriters}))
            return (get_hash_for_files(files), packages, enabled(), before)

    return KernelsGraphPass
