"""Vocab-parallel fused linear log-prob head: ``fused_linear_logprob`` (logprob.py) for a head
whose weight is a DTensor split by vocabulary rows over a one-dimensional mesh, the tokens the
same on every rank (tensor parallelism's colwise lm_head; see vocab_parallel.py).

Each rank makes the logits of its vocabulary slice, one chunk of tokens at a time, with TRL's
transform (logit scale, soft-cap, temperature). Per token the ranks combine, in fp32:

- one MAX all-reduce of [rows, 2]: the max logit, and the max logit before the label's column
  (for is_top1);
- one SUM all-reduce of [rows, 2 to 5]: sum e, the label's logit (from the rank holding it),
  and as asked sum e·z (entropy), sum e² (log sum p²), sum z (mean logit), e = exp(z - max).

The backward recomputes each chunk's logits (the per-token upstream gradients are unknown in the
forward), and sums d(hidden) over the ranks once (one all-reduce of [tokens, hidden]); d(weight)
stays on its rank. No rank holds the full weight or a [tokens, V] tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .logprob import ENTROPY, MEAN, SUM_SQ, TOP1, LogProbOutputs, _bits
from .vocab_parallel import Split, _replicated_local, tile_rows, vocab_shard


def _z(logits, bias, o):
    """TRL's transform of one chunk in fp32, and tanh's value where a soft-cap applies."""
    x = logits.float()
    if bias is not None:
        x = x + bias.float()
    y = x * o["scale"]
    if o["cap"]:
        t = torch.tanh(y / o["cap"])
        return o["cap"] * t * o["inv_t"], t
    return y * o["inv_t"], None


def _chunk_rows(n, split: Split, x):
    widest = -(-split.vocab // dist.get_world_size(split.group))
    return tile_rows(n, widest, x.element_size())


def _forward(x, w, b, labels, split: Split, o: dict):
    """(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1, log_z), fields not asked
    for empty."""
    n, local_vocab, group = x.shape[0], w.shape[0], split.group
    bits = o["bits"]
    f32 = dict(dtype=torch.float32, device=x.device)
    lp, log_z = torch.empty(n, **f32), torch.empty(n, **f32)
    ent = torch.empty(n if bits & ENTROPY else 0, **f32)
    sq = torch.empty(n if bits & SUM_SQ else 0, **f32)
    mean = torch.empty(n if bits & MEAN else 0, **f32)
    top1 = torch.empty(n if bits & TOP1 else 0, dtype=torch.bool, device=x.device)
    valid = labels != o["ignore_index"]
    in_range = (labels >= 0) & (labels < split.vocab)
    local = labels - split.start
    hit = (local >= 0) & (local < local_vocab)
    col = torch.where(hit, local, 0)[:, None]
    # the tokens' checksum rides the first MAX all-reduce (see vocab_parallel._chunks)
    check = torch.stack([x.float().sum(), labels.float().sum()])
    check = torch.cat([check, -check])
    fields = [f for f, bit in ((1, ENTROPY), (2, SUM_SQ), (3, MEAN)) if bits & bit]
    rows = _chunk_rows(n, split, x)
    buf = x.new_empty(min(rows, n), local_vocab)
    cols = torch.arange(local_vocab, device=x.device)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        logits = buf[: r1 - r0]
        torch.mm(x[r0:r1], w.t(), out=logits)
        z, _ = _z(logits, b, o)
        maxes = [z.amax(1)]
        if bits & TOP1:  # the largest logit left of the label's column
            before = cols[None, :] < local[r0:r1, None]
            maxes.append(z.masked_fill(~before, -torch.inf).amax(1))
        packed = torch.cat([torch.stack(maxes).flatten(), check] if r0 == 0 else maxes)
        dist.all_reduce(packed, dist.ReduceOp.MAX, group=group)
        m = packed[: r1 - r0]
        if r0 == 0:
            check = packed[-4:]
        e = torch.exp(z - m[:, None])
        sums = [e.sum(1), torch.where(hit[r0:r1], z.gather(1, col[r0:r1])[:, 0], 0.0)]
        for f in fields:
            sums.append((e * z).sum(1) if f == 1 else (e * e).sum(1) if f == 2 else z.sum(1))
        sums = torch.stack(sums)
        dist.all_reduce(sums, dist.ReduceOp.SUM, group=group)
        s, zt = sums[0], sums[1]
        got = dict(zip(fields, sums[2:], strict=True))
        lz = m + torch.log(s)
        v = valid[r0:r1]
        log_z[r0:r1] = lz
        lp[r0:r1] = torch.where(v, torch.where(in_range[r0:r1], zt - lz, torch.nan), 0.0)
        if 1 in got:
            ent[r0:r1] = torch.where(v, lz - got[1] / s, 0.0)
        if 2 in got:
            sq[r0:r1] = torch.where(v, torch.log(got[2]) - 2 * torch.log(s), 0.0)
        if 3 in got:
            mean[r0:r1] = torch.where(v, got[3] / split.vocab, 0.0)
        if bits & TOP1:
            mbt = packed[r1 - r0 : 2 * (r1 - r0)]
            top1[r0:r1] = v & in_range[r0:r1] & (zt >= m) & (zt > mbt)
    same = (check[:2] == -check[2:]).all()  # ranks handed different tokens: NaN, not wrong
    lp = torch.where(same, lp, torch.nan)
    return lp, ent, sq, mean, top1, log_z


def _backward(x, w, b, labels, split: Split, o: dict, log_z, ent, glp, gent, need):
    """d(hidden) summed over the ranks, and this rank's d(weight) and fp32 d(bias) rows."""
    n, local_vocab = x.shape[0], w.shape[0]
    need_x, need_w, need_b = need
    valid = labels != o["ignore_index"]
    local = labels - split.start
    hit = (local >= 0) & (local < local_vocab)
    col = torch.where(hit, local, 0)[:, None]
    dx = torch.empty_like(x) if need_x else None
    dw = torch.empty_like(w) if need_w else None
    db = torch.zeros(local_vocab, dtype=torch.float32, device=x.device) if need_b else None
    zeros = torch.zeros(n, dtype=torch.float32, device=x.device)
    a_all = torch.where(valid, glp.float(), 0.0) if glp is not None else zeros
    b_all = torch.where(valid, gent.float(), 0.0) if gent is not None else None
    rows = _chunk_rows(n, split, x)
    buf = x.new_empty(min(rows, n), local_vocab)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        xc, logits = x[r0:r1], buf[: r1 - r0]
        torch.mm(xc, w.t(), out=logits)
        z, t = _z(logits, b, o)
        logp = z - log_z[r0:r1, None]
        p = torch.exp(logp)
        a = a_all[r0:r1]
        # d(log p_y)/dz = onehot - p; d(entropy)/dz = -p (log p + entropy)
        g = -p * a[:, None]
        if b_all is not None:
            g -= p * b_all[r0:r1, None] * (logp + ent[r0:r1, None])
        g.scatter_add_(1, col[r0:r1], torch.where(hit[r0:r1], a, 0.0)[:, None])
        g *= o["scale"] * o["inv_t"]
        if t is not None:
            g *= 1 - t * t
        if need_b:
            db += g.sum(0)
        gd = g if g.dtype == x.dtype else logits.copy_(g)
        if need_x:
            torch.mm(gd, w, out=dx[r0:r1])
        if need_w:
            if r0 == 0:
                torch.mm(gd.t(), xc, out=dw)
            else:
                dw.addmm_(gd.t(), xc)
    if need_x:
        dist.all_reduce(dx, dist.ReduceOp.SUM, group=split.group)
    return dx, dw, db


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, split: Split, o: dict):
        lp, ent, sq, mean, top1, log_z = _forward(hidden, weight, bias, labels, split, o)
        ctx.set_materialize_grads(False)
        ctx.split, ctx.o = split, o
        ctx.save_for_backward(
            hidden, weight, bias, labels, log_z, ent if o["bits"] & ENTROPY else None
        )
        ctx.mark_non_differentiable(sq, mean, top1)
        if not o["bits"] & ENTROPY:
            ctx.mark_non_differentiable(ent)
        return lp, ent, sq, mean, top1

    @staticmethod
    def backward(ctx, glp, gent, *_unused):
        hidden, weight, bias, labels, log_z, ent = ctx.saved_tensors
        if ent is None:
            gent = None
        need = tuple(ctx.needs_input_grad[:3])
        need = (need[0], need[1], need[2] and bias is not None)
        if (glp is None and gent is None) or not any(need):
            return (None,) * 6
        dx, dw, db = _backward(
            hidden, weight, bias, labels, ctx.split, ctx.o, log_z, ent, glp, gent, need
        )
        return dx, dw, None if db is None else db.to(bias.dtype), None, None, None


@torch.compiler.disable
def vocab_parallel_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    outputs: tuple[str, ...] = ("log_probs",),
    ignore_index: int = -100,
) -> LogProbOutputs:
    """``fused_linear_logprob`` for a vocab-sharded DTensor `weight` (``is_vocab_sharded``);
    `hidden` and `labels` the same on every rank (a DTensor `hidden` is made replicated). The
    outputs are the same on every rank; the weight's gradient is its Shard(0) gradient."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal hidden shape without its last "
            f"dimension, {tuple(hidden.shape[:-1])}"
        )
    if not temperature or temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    bits = _bits(outputs)
    shard = vocab_shard(weight, bias)
    hidden = _replicated_local(hidden)
    w, b = shard.weight, shard.bias
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, w = hidden.to(dtype), w.to(dtype)
    if hidden.dtype != w.dtype:
        raise ValueError(
            f"hidden ({hidden.dtype}) and weight ({w.dtype}) must share a dtype; "
            "cast them or run under torch.autocast"
        )
    rows = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    flat = labels.reshape(-1).to(device=hidden.device, dtype=torch.int64).contiguous()
    o = {
        "scale": float(logit_scale),
        "cap": float(softcap) if softcap else 0.0,
        "inv_t": 1.0 / float(temperature),
        "bits": bits,
        "ignore_index": int(ignore_index),
    }
    lp, ent, sq, mean, top1 = _VocabParallelLogProb.apply(
        rows, w.contiguous(), None if b is None else b.contiguous(), flat, shard.split, o
    )
    shape = labels.shape
    return LogProbOutputs(
        lp.view(shape),
        ent.view(shape) if bits & ENTROPY else None,
        sq.view(shape) if bits & SUM_SQ else None,
        mean.view(shape) if bits & MEAN else None,
        top1.view(shape) if bits & TOP1 else None,
    )
