"""The decoder's token embedding inside a compiled step: F.embedding forward, eager's backward.

Inductor decomposes ``embedding_dense_backward`` into a zero-filled fp32 [V, H] buffer plus a
scatter-add, then a cast (2 GiB of fp32 at Llama-3's 128256 x 4096; 0.42 ms a step more than
eager's kernel on an H200, docs/compile.md). Here the backward is an opaque op that runs
torch's own kernel (on CUDA: sorted indices, the weight's dtype), so a compiled step does what
an eager one does. The forward is F.embedding. Outside a trace, `token_embedding` calls the
module as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._common import has_hooks, op_name
from .tensor_parallel import is_dtensor


@torch.library.custom_op(op_name("embedding_fwd"), mutates_args=())
def embedding_fwd(weight: torch.Tensor, ids: torch.Tensor, padding_idx: int) -> torch.Tensor:
    return F.embedding(ids, weight, None if padding_idx < 0 else padding_idx)


@embedding_fwd.register_fake
def _(weight, ids, padding_idx):
    return weight.new_empty((*ids.shape, weight.shape[1]))


@torch.library.custom_op(op_name("embedding_bwd"), mutates_args=())
def embedding_bwd(
    grad: torch.Tensor, ids: torch.Tensor, num_weights: int, padding_idx: int
) -> torch.Tensor:
    # CUDA: no host sync, so a CUDA graph records it (reduce-overhead); checked on an H200 with
    # new ids replayed (docs/benchmarks/compile-h200-2026-12-02-s7)
    return torch.ops.aten.embedding_dense_backward(grad, ids, num_weights, padding_idx, False)


@embedding_bwd.register_fake
def _(grad, ids, num_weights, padding_idx):
    return grad.new_empty((num_weights, grad.shape[-1]))


def _setup_context(ctx, inputs, output):
    weight, ids, padding_idx = inputs
    ctx.save_for_backward(ids)
    ctx.rows, ctx.padding_idx = weight.shape[0], padding_idx


def _backward(ctx, grad):
    (ids,) = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:
        return None, None, None
    return embedding_bwd(grad, ids, ctx.rows, ctx.padding_idx), None, None


embedding_fwd.register_autograd(_backward, setup_context=_setup_context)


def _plain(module: nn.Module, kind: str) -> bool:
    """Whether calling the op is calling the module: still the class the probe saw (PEFT may
    have wrapped or replaced it since), F.embedding's defaults (no renorm, dense), no hook
    around its forward (FSDP2 and ZeRO-3 gather the weight in one, tensor parallel shards in
    one) and a plain tensor for a weight."""
    cls = type(module)
    if kind == "plain":
        seen = cls is nn.Embedding
    else:  # the probe read the forward of a transformers *ScaledWordEmbedding
        seen = (cls.__bases__ == (nn.Embedding,) and cls.__name__.endswith("ScaledWordEmbedding")
                and hasattr(module, "embed_scale"))  # fmt: skip
    return (
        seen
        and module.max_norm is None
        and not module.sparse
        and not module.scale_grad_by_freq
        and not has_hooks(module)
        and not is_dtensor(module.weight)
    )


def token_embedding(module: nn.Module, ids: torch.Tensor, kind: str) -> torch.Tensor:
    """``module(ids)`` for an input embedding of `kind`: "plain" (an ``nn.Embedding``) or
    "scaled" (transformers' ``*ScaledWordEmbedding``: the rows times ``embed_scale`` in the
    weight's dtype), which the loader's probe checked; through the ops while Dynamo traces."""
    if not torch.compiler.is_compiling() or not _plain(module, kind):
        return module(ids)
    pad = -1 if module.padding_idx is None else module.padding_idx
    rows = embedding_fwd(module.weight, ids, pad)
    if kind == "scaled":
        return rows * module.embed_scale.to(module.weight.dtype)
    return rows
