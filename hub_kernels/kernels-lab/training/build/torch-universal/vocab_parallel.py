"""Vocab-parallel fused linear cross-entropy: the head's weight split by vocabulary rows across
the ranks of a process group, the tokens the same on every rank.

This is the layout of transformers' colwise ``lm_head`` under a tensor-parallel plan: the weight
is a DTensor sharded on dim 0 over a one-dimensional mesh and the hidden states are replicated.
Each rank makes the logits of its own vocabulary slice only, one chunk of tokens at a time, and
the ranks combine per token what the loss needs, with all-reduces of O(tokens):

- the running max of the logits (MAX), then the sum of exp(z - max), the target's logit (only
  the rank whose slice holds the target contributes it) and, with label smoothing, the sum of
  the logits (one SUM of [rows, 2 or 3] fp32 values);
- d(hidden): every rank's partial product d(logits_slice) @ weight_slice, summed once at the end
  (one SUM of [tokens, hidden]; the same collective a rowwise layer's backward does).

d(weight) stays on its rank ([V / ranks, hidden], the shard's own gradient) and no rank ever
holds the full weight or a [tokens, V] tensor: per chunk one [rows, V / ranks] tile in the
inputs' dtype and one in fp32 (two with ``softcap`` and a gradient).

Per token, with z the (soft-capped) logits, lse = log sum exp z, eps the label smoothing and
lambda the z-loss scale: ``loss = lse - (1 - eps) z_y - (eps / V) sum_j z_j + lambda lse^2``, the
formula of cross_entropy.py; the elementwise work runs as torch ops (the matmuls dominate).
Like the single-device function, the gradients are computed in the forward (6·N·H·V/ranks
flops per rank) and the backward only scales them; ``reduction="none"`` recomputes the tiles in
the backward from the saved log-sum-exp (no collective but d(hidden)'s).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .cross_entropy import check_options, check_target_range, grad_scale_tensor, scale_rows_

# Both tiles of a chunk (the logits in the inputs' dtype and their fp32 working copy) fit this.
MAX_TILE_BYTES = 512 * 2**20


@dataclass(frozen=True)
class Split:
    """Where this rank's rows lie: rows ``start ...`` of a ``vocab``-row head split over `group`."""

    group: dist.ProcessGroup
    start: int
    vocab: int


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows of a vocab-sharded head (autograd leads back to the DTensor parameter)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    split: Split


def _dtensor_type():
    from torch.distributed.tensor import DTensor

    return DTensor


def is_vocab_sharded(weight: torch.Tensor) -> bool:
    """Whether `weight` is a DTensor split by rows (``Shard(0)``) over a one-dimensional mesh of
    more than one rank: the layout this module serves."""
    # the name first: a plain tensor never imports torch.distributed.tensor
    if type(weight).__name__ != "DTensor" or not isinstance(weight, _dtensor_type()):
        return False
    if weight.device_mesh.ndim != 1:
        return False
    from torch.distributed.tensor import Shard

    return weight.placements == (Shard(0),) and weight.device_mesh.size() > 1


def _local_rows(t: torch.Tensor | None, start: int, rows: int) -> torch.Tensor | None:
    """A bias as this rank's rows: its local shard, or its slice when replicated."""
    if t is None:
        return None
    if not isinstance(t, _dtensor_type()):
        return t[start : start + rows]
    from torch.distributed.tensor import Shard

    if t.placements == (Shard(0),):
        return t.to_local()
    return t.to_local()[start : start + rows]


def vocab_shard(weight: torch.Tensor, bias: torch.Tensor | None = None) -> VocabShard:
    """Split a vocab-sharded DTensor head (``is_vocab_sharded``) into this rank's rows.

    DTensor's Shard(0) gives rank r the rows [r·c, (r + 1)·c) with c = ceil(V / ranks), the last
    rank fewer. A rank left with no rows (V too small for the group) is refused on every rank
    alike, so no rank waits in a collective the others never enter.
    """
    mesh = weight.device_mesh
    ranks, rank = mesh.size(), mesh.get_local_rank()
    vocab = weight.shape[0]
    per = -(-vocab // ranks)
    if per * (ranks - 1) >= vocab:
        raise ValueError(
            f"a vocabulary of {vocab} split over {ranks} ranks leaves a rank without rows; "
            "shard the head over fewer ranks or pass weight.full_tensor()"
        )
    local = weight.to_local()
    start = rank * per
    if local.shape[0] != min(per, vocab - start):
        raise ValueError(
            f"rank {rank} holds {local.shape[0]} rows of a {vocab}-row Shard(0) head, expected "
            f"{min(per, vocab - start)}; pass weight.full_tensor() for uneven custom shards"
        )
    bias = _local_rows(bias, start, local.shape[0])
    return VocabShard(local, bias, Split(mesh.get_group(), start, vocab))


def tile_rows(n: int, local_vocab: int, itemsize: int, max_bytes: int = MAX_TILE_BYTES) -> int:
    """Tokens per chunk: all of them when both tiles fit `max_bytes`, else the most that do
    (a multiple of 64 from 64 rows on, so the matmuls tile evenly)."""
    fit = max(1, max_bytes // max(1, local_vocab * (itemsize + 4)))
    if n <= fit:
        return max(1, n)
    return fit // 64 * 64 if fit >= 64 else fit


@dataclass(frozen=True)
class _Options:
    ignore_index: int
    label_smoothing: float
    lse_square_scale: float
    softcap: float | None
    reduction: str
    chunk_rows: int | None
    accum_fp32: bool


def _chunks(x, w, b, target, split: Split, opts: _Options, need, coef=None, lse=None):
    """One pass over the tokens, chunk by chunk.

    Without `lse`: the statistics (with their collectives), giving (loss [N], lse [N]). With
    `coef` (fp32, one element or one per token: d(total)/d(loss_t)) and `need`: the gradients
    too, in the same pass, d(hidden) summed over the ranks. Returns (loss, lse, dx, dw, db).

    The statistics' first all-reduce also carries a checksum of the tokens (hidden states and
    targets): ranks that were handed different tokens (data parallelism, e.g. an FSDP2 shard
    read outside its module's hooks) get a NaN loss instead of a silently wrong one.
    """
    n, vocab = x.shape[0], split.vocab
    local_vocab = w.shape[0]
    group = split.group
    eps, lam, cap = opts.label_smoothing, opts.lse_square_scale, opts.softcap
    need_x, need_w, need_b = need if coef is not None else (False, False, False)
    grads = need_x or need_w or need_b
    stats = lse is None
    # sized by the widest shard, so that every rank cuts the tokens alike (one collective each)
    widest = -(-vocab // dist.get_world_size(group))
    rows = opts.chunk_rows or tile_rows(n, widest, x.element_size())
    keep = target != opts.ignore_index
    local_t = target - split.start
    owned = (local_t >= 0) & (local_t < local_vocab)
    col = torch.where(owned, local_t, 0)[:, None]
    f32 = dict(dtype=torch.float32, device=x.device)
    if stats:
        lse = torch.empty(n, **f32)
        loss = torch.empty(n, **f32)
    else:
        loss = None
    if grads:
        # the per-token factor: the reduction's scale (or the upstream gradient), 0 if ignored
        c_all = torch.where(keep, coef.reshape(-1).to(torch.float32).expand(n), 0.0)
    dx = torch.empty_like(x) if need_x else None
    dw_dtype = torch.float32 if opts.accum_fp32 else w.dtype
    dw = torch.empty(w.shape, dtype=dw_dtype, device=w.device) if need_w else None
    db = torch.zeros(local_vocab, **f32) if need_b else None
    if stats:
        check = torch.stack([x.float().sum(), target.float().sum()])
        check = torch.cat([check, -check])  # MAX of both signs: equal on all ranks iff same
    buf = x.new_empty(min(rows, n), local_vocab)
    wt = w.t()
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        xc, logits = x[r0:r1], buf[: r1 - r0]
        if b is None:
            torch.mm(xc, wt, out=logits)
        else:
            torch.addmm(b, xc, wt, out=logits)
        # fp32 working tile; an fp32 input is worked on in its own buffer
        z = logits.float() if logits.dtype != torch.float32 else logits
        if cap:
            z.div_(cap).tanh_().mul_(cap)
        capf = torch.square(z / cap).neg_().add_(1.0) if cap and grads else None
        if stats:
            own = owned[r0:r1]
            packed = torch.empty(3 if eps else 2, r1 - r0, **f32)
            zy = torch.where(own, z.gather(1, col[r0:r1])[:, 0], 0.0)
            if eps:
                torch.sum(z, 1, out=packed[2])
            m = z.amax(1)
            if r0 == 0:
                m = torch.cat([m, check])
            dist.all_reduce(m, dist.ReduceOp.MAX, group=group)
            if r0 == 0:
                m, check = m[: r1 - r0], m[r1 - r0 :]
            z.sub_(m[:, None]).exp_()  # e = exp(z - max)
            torch.sum(z, 1, out=packed[0])
            packed[1].copy_(zy)
            dist.all_reduce(packed, dist.ReduceOp.SUM, group=group)
            s = packed[0]
            lse_c = m + torch.log(s)
            row = lse_c - (1.0 - eps) * packed[1] + lam * lse_c * lse_c
            if eps:
                row = row - (eps / vocab) * packed[2]
            valid = (target[r0:r1] >= 0) & (target[r0:r1] < vocab)
            row = torch.where(valid, row, float("nan"))  # a label no rank holds: loud
            loss[r0:r1] = torch.where(keep[r0:r1], row, 0.0)
            lse[r0:r1] = lse_c
            p_scale = torch.reciprocal(s)
        else:
            lse_c = lse[r0:r1]
            z.sub_(lse_c[:, None]).exp_()  # p = exp(z - lse)
            p_scale = 1.0
        if not grads:
            continue
        c = c_all[r0:r1]
        # d(loss)/d(z_j) = p_j (1 + 2 lambda lse) - eps / V - (1 - eps) [j = y], times c
        z.mul_((c * (1.0 + 2.0 * lam * lse_c) * p_scale)[:, None])
        if eps:
            z.sub_((c * (eps / vocab))[:, None])
        target_part = torch.where(owned[r0:r1], -(1.0 - eps) * c, 0.0)
        z.scatter_add_(1, col[r0:r1], target_part[:, None])
        if capf is not None:
            z.mul_(capf)  # the soft-cap's derivative, 1 - (z / cap)^2
            del capf
        if need_b:
            db += z.sum(0)
        g = z if z.dtype == x.dtype else logits.copy_(z)
        del z
        if need_x:
            torch.mm(g, w, out=dx[r0:r1])
        if need_w:
            if r0 == 0 and not opts.accum_fp32:
                torch.mm(g.t(), xc, out=dw)
            elif r0 == 0:
                dw.copy_(g.t() @ xc)
            elif opts.accum_fp32:
                dw.add_(g.t() @ xc)
            else:
                dw.addmm_(g.t(), xc)
    if stats:
        same = (check[:2] == -check[2:]).all()
        loss = torch.where(same, loss, float("nan"))
    if need_x:
        dist.all_reduce(dx, dist.ReduceOp.SUM, group=group)
    if dw is not None and dw.dtype != w.dtype:
        dw = dw.to(w.dtype)
    return loss, lse, dx, dw, db


class VocabParallelCrossEntropyFunction(torch.autograd.Function):
    """Autograd over `_chunks`; `split` carries the group and this rank's vocabulary offset."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, split: Split, opts: _Options, num_items, need):
        gscale = grad_scale_tensor(opts.reduction, target, opts.ignore_index, num_items)
        ctx.deferred = opts.reduction == "none" and any(need)
        coef = None if ctx.deferred or not any(need) else gscale
        loss, lse, dx, dw, db = _chunks(hidden, weight, bias, target, split, opts, need, coef)
        ctx.split, ctx.opts, ctx.need = split, opts, need
        ctx.bias_dtype = None if bias is None else bias.dtype
        if ctx.deferred:
            ctx.save_for_backward(hidden, weight, bias, target, lse)
            ctx.grads = None
        else:
            ctx.grads = (dx, dw, db) if any(need) else None
        ctx.set_materialize_grads(False)
        if opts.reduction == "none":
            return loss
        total = loss.sum()
        return total * gscale[0] if opts.reduction == "mean" else total

    @staticmethod
    def backward(ctx, grad_out):
        nones = (None,) * 5
        if grad_out is None:
            ctx.grads = None
            return (None, None, None, *nones)
        if ctx.deferred:
            hidden, weight, bias, target, lse = ctx.saved_tensors
            _, _, dx, dw, db = _chunks(
                hidden, weight, bias, target, ctx.split, ctx.opts, ctx.need,
                coef=grad_out.detach(), lse=lse,
            )  # fmt: skip
        else:
            if ctx.grads is None:
                return (None, None, None, *nones)
            (dx, dw, db), ctx.grads = ctx.grads, None
            if dx is not None:
                scale_rows_(dx, grad_out)
            if dw is not None:
                scale_rows_(dw, grad_out)
            if db is not None:
                db = db * grad_out.float()
        if db is not None:
            db = db.to(ctx.bias_dtype)
        return (dx, dw, db, *nones)


def refuse_options(**options) -> None:
    """ValueError naming the options this path does not take, when any is set."""
    given = [name for name, value in options.items() if value is not None and value is not False]
    if given:
        raise ValueError(
            f"{', '.join(given)} not supported with a vocab-sharded weight; "
            "pass weight.full_tensor() to compute on the gathered weight"
        )


def _replicated_local(t: torch.Tensor) -> torch.Tensor:
    """Hidden states as this rank's full copy: a DTensor is first made replicated (the gather a
    plan with sharded activations asks for before a colwise head); its gradient comes back
    replicated, as the d(hidden) all-reduce makes it."""
    if not isinstance(t, _dtensor_type()):
        return t
    from torch.distributed.tensor import Replicate

    full = [Replicate()] * t.device_mesh.ndim
    if tuple(t.placements) != tuple(full):
        t = t.redistribute(placements=full)
    return t.to_local()


@torch.compiler.disable
def vocab_parallel_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    reduction: str = "mean",
    num_items: int | float | torch.Tensor | None = None,
    chunk_rows: int | None = None,
    accum_dtype: torch.dtype | None = None,
    check_targets: bool = False,
) -> torch.Tensor:
    """Cross-entropy of ``hidden[..., H] @ weight[V, H].T (+ bias)`` for a `weight` that is a
    DTensor split by vocabulary rows over a one-dimensional mesh (``is_vocab_sharded``).

    `hidden` and `target` must be the same on every rank of the weight's mesh (tensor
    parallelism's replicated activations; a DTensor `hidden` is made replicated first). The loss
    is the same on every rank; the weight's gradient is its Shard(0) gradient, d(hidden) the full
    one. Options as ``fused_linear_cross_entropy``'s of the same names.
    """
    check_options(reduction, label_smoothing, softcap)
    if accum_dtype not in (None, torch.float32) and accum_dtype != weight.dtype:
        raise ValueError(f"accum_dtype must be None or torch.float32, got {accum_dtype}")
    if target.shape != hidden.shape[:-1]:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal hidden shape without its last "
            f"dimension, {tuple(hidden.shape[:-1])}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be [V, H] with H = hidden.shape[-1] = {hidden.shape[-1]}, "
            f"got {tuple(weight.shape)}"
        )
    shard = vocab_shard(weight, bias)
    hidden = _replicated_local(hidden)
    w, b = shard.weight, shard.bias
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, w = hidden.to(dtype), w.to(dtype)
        b = None if b is None else b.to(dtype)
    if hidden.dtype != w.dtype or (b is not None and b.dtype != w.dtype):
        raise ValueError(
            f"hidden ({hidden.dtype}), weight ({w.dtype}) and bias must share a dtype; "
            "cast them or run under torch.autocast"
        )
    if check_targets:
        check_target_range(target, shard.split.vocab, ignore_index)
    rows = hidden.reshape(-1, hidden.shape[-1])
    opts = _Options(
        ignore_index,
        float(label_smoothing),
        float(lse_square_scale),
        softcap,
        reduction,
        chunk_rows,
        accum_dtype == torch.float32 and w.dtype != torch.float32,
    )
    need = tuple(
        torch.is_grad_enabled() and t is not None and t.requires_grad for t in (rows, w, b)
    )
    loss = VocabParallelCrossEntropyFunction.apply(
        rows.contiguous(),
        w.contiguous(),
        b,
        target.reshape(-1).contiguous(),
        shard.split,
        opts,
        num_items,
        need,
    )
    return loss.view(target.shape) if reduction == "none" else loss
