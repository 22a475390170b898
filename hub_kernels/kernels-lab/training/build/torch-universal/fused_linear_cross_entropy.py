"""Linear layer + cross-entropy without materialising the [N, V] logits.

``loss = cross_entropy(hidden @ weight.T + bias, target)`` with the options of
``cross_entropy.cross_entropy``. The tokens are cut into chunks of ``chunk_rows`` rows; for each
chunk one [chunk_rows, V] buffer (reused; its rows padded to 64 elements) receives the logits
from a cuBLAS matmul, the cross-entropy kernel overwrites it with d(loss)/d(logits), and two more
matmuls turn it into that chunk's rows of d(hidden) and its contribution to d(weight). The gradients are therefore computed
in the forward (6·N·H·V flops in all) and the backward only rescales them by grad_output, which is
skipped on the device when grad_output is 1.

Extra memory is the logits buffer (at most ``MAX_CHUNK_BYTES``, 504 MiB, and at most
``row_cap`` rows: no larger than d(weight) where that is over 1024 rows) plus O(N + V)
fp32 scratch. d(weight) is accumulated in the weight's dtype: ``addmm`` adds each chunk's fp32
product to it and rounds once per chunk. In bf16 that costs about sqrt(chunks / 2) times the
rounding of a single product (measured in docs/losses.md); an fp32 accumulator would be exact but
costs 4·V·H bytes (2 GiB at V=128256, H=4096), more than the whole budget, so chunks are made as
large as the budget and ``row_cap`` allow, which also keeps the matmuls near the device's peak rate.
``row_cap`` does trade some of that accuracy for memory: it takes Phi-3-mini's 8192-token step
from 1 chunk to 4, so in bf16 its d(weight) carries about sqrt(4 / 2) = 1.4 times a single
product's rounding where one chunk carried one rounding.

``reduction="none"`` with a gradient needs the per-token grad_output before d(weight) can be
summed, so that case defers all gradient work to the backward, where the logits are recomputed
(8·N·H·V flops instead of 6).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ._common import op_name
from .cross_entropy import (
    CrossEntropyOutput,
    Scratch,
    ce_rows,
    check_options,
    check_target_range,
    check_weight,
    grad_scale_tensor,
    reduce_with_options,
    scale_rows_,
)
from .vocab_parallel import is_vocab_sharded, refuse_options, vocab_parallel_cross_entropy
from .zero3 import check_gathered

# The logits buffer's budget: with the O(N + V) scratch next to it, one call stays under
# 512 MiB of extra memory (502 MiB measured on an H200 at V=128256, docs/losses.md).
MAX_CHUNK_BYTES = 504 * 2**20


def default_chunk_rows(n: int, vocab: int, itemsize: int, max_bytes: int = MAX_CHUNK_BYTES) -> int:
    """Rows per chunk: all n when they fit `max_bytes`, else the largest power of two that does,
    unless that fills under 55 % of the budget: then the largest multiple of 64 that fits.

    Fewer chunks mean fewer read-modify-write passes over d(weight) and fewer roundings of it;
    power-of-two row counts tile the matmuls without remainder (the sizes measured fastest where
    they fill most of the budget).
    """
    cap = max(1, max_bytes // max(1, vocab * itemsize))
    if n <= cap:
        return max(1, n)
    rows = 1 << (cap.bit_length() - 1)
    # A power of two just over half the budget (V 262144: 512 rows where 1008 fit) costs nearly
    # twice the chunks. There the budget's largest multiple of 64 measured faster on an H200
    # (N8192 H2048: 960 rows 40.9 and 42.3 ms against 42.7 and 44.0 at V 262144 in two runs;
    # 1984 rows 19.5 against 20.1 at V 131072); where the power of two fills 59 % (V 151936)
    # larger chunks were no faster (1536 rows 22.39 against 22.38; 1664-1728 2-3 % slower).
    # docs/losses.md, "Rows per chunk".
    if rows < 0.55 * cap and cap >= 128:
        rows = cap // 64 * 64
    return rows


# The training-step cap on rows per chunk (row_cap). In a training step the loss head runs
# while every layer's activations are alive, so its logits buffer adds to the step's peak: a
# 501 MiB single chunk at Phi-3-mini's 8192 tokens x 32064 vocabulary put the step 0.43 GiB
# above Liger's (1024 rows, 63 MiB). The cap keeps the buffer no larger than d(weight) [V, H],
# which the head holds anyway (rows <= H): Phi-3 gets 2048 rows, 125 MiB, in 4 chunks (3 more
# read-modify-writes of its 188 MiB d(weight), ~0.25 ms at an H200's bandwidth, in a 419 ms
# step). It never goes below MIN_CAP_ROWS rows, the size the fused loss was measured fastest at
# (N16384 H1024 V151936: 16 chunks of 1024 rows), nor below what fits SMALL_CHUNK_BYTES (small
# vocabularies keep one chunk: their matmuls are too short to split). The op benchmarks' shapes
# keep their rows: H1024 V151936 1024 (the byte budget's), H4096 V128256 2048 (the budget's).
MIN_CAP_ROWS = 1024
SMALL_CHUNK_BYTES = 64 * 2**20


def _prev_pow2(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def row_cap(hidden: int, vocab: int, itemsize: int) -> int:
    """The most rows per chunk a training step's loss head takes: the larger of H,
    MIN_CAP_ROWS and the rows fitting SMALL_CHUNK_BYTES (powers of two); see above."""
    small = SMALL_CHUNK_BYTES // max(1, vocab * itemsize)
    return max(MIN_CAP_ROWS, _prev_pow2(hidden), _prev_pow2(small))


@dataclass(frozen=True)
class _Options:
    ignore_index: int
    label_smoothing: float
    lse_square_scale: float
    softcap: float | None
    reduction: str
    chunk_rows: int | None
    class_weight: torch.Tensor | None = None  # fp32 [V], contiguous
    accum_fp32: bool = False
    token_scaling: bool = False
    want: tuple[bool, bool, bool] = (False, False, False)  # z-loss, accuracy, predicted tokens


def _chunked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    opts: _Options,
    gscale: torch.Tensor,
    row_scale: torch.Tensor | None,
    need: tuple[bool, bool, bool],
    zscale: torch.Tensor | None = None,
):
    """Loss rows, and (when `need` asks) d(hidden), d(weight), fp32 d(bias), chunk by chunk;
    then the rows' log-sum-exp, token-scaling factors and argmax where the options ask."""
    n = hidden.shape[0]
    vocab = weight.shape[0]
    need_x, need_w, need_b = need
    write_grad = need_x or need_w or need_b
    vpad = -(-vocab // 64) * 64  # the buffer's row length (below); the budgets count it
    rows = opts.chunk_rows or min(
        default_chunk_rows(n, vpad, hidden.element_size()),
        row_cap(hidden.shape[1], vpad, hidden.element_size()),
    )
    # An odd vocabulary (GPT-2's 50257) made cuBLAS's three matmuls 5x slower (H200, N8192
    # H2048: 40.7 ms against 8.1 for torch.compile, which pads): every vocabulary-sized dimension
    # and row stride of theirs was odd. Now the chunk's rows are padded to 64 elements (the chunk
    # is a [rows, V] view) and each matmul is split at the last multiple of 64 below V: an
    # aligned bulk, and a remainder of < 64 vocabulary rows. Nothing is copied.
    padded = torch.empty(min(rows, n), vpad, dtype=hidden.dtype, device=hidden.device)
    buf = padded[:, :vocab]
    bulk = vocab - vocab % 64
    cols = [slice(0, bulk), slice(bulk, vocab)] if 0 < bulk < vocab else [slice(0, vocab)]
    loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
    dx = torch.empty_like(hidden) if need_x else None
    # accum_fp32: d(weight) summed in fp32 over chunks (each chunk's product rounded once, then
    # added exactly enough), at 4·V·H bytes more; rounded to the weight's dtype at the end.
    dw_dtype = torch.float32 if opts.accum_fp32 else weight.dtype
    dw = torch.empty(weight.shape, dtype=dw_dtype, device=weight.device) if need_w else None
    db = torch.zeros(vocab, dtype=torch.float32, device=hidden.device) if need_b else None
    want_z, want_acc, want_pred = opts.want
    keep_lse = want_z or opts.token_scaling or opts.class_weight is not None
    lse_all = torch.empty(n, dtype=torch.float32, device=hidden.device) if keep_lse else None
    # The kernel writes each chunk's loss (and log-sum-exp) straight into these: no per-chunk
    # buffers and no copies.
    lse_buf = lse_all if keep_lse else torch.empty(len(buf), dtype=torch.float32, device=buf.device)
    pred = None
    if want_acc or want_pred:
        pred = torch.empty(n, dtype=torch.int64, device=hidden.device)
    factor = (
        torch.empty(n, dtype=torch.float32, device=hidden.device) if opts.token_scaling else None
    )
    wt = weight.t()
    # The CE kernel's slots and counters for every chunk at once: no allocation or fill per
    # chunk, so the host stays further ahead of the GPU.
    scratch = Scratch(-(-n // rows))
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        x = hidden[r0:r1]
        logits = buf[: r1 - r0]
        for c in cols:
            if bias is None:
                torch.mm(x, wt[:, c], out=logits[:, c])
            else:
                torch.addmm(bias[c], x, wt[:, c], out=logits[:, c])
        t = target[r0:r1]
        if opts.token_scaling:  # the target logits, read before the kernel overwrites them
            keep = (t != opts.ignore_index) & (t >= 0) & (t < vocab)
            zy = logits.gather(1, torch.where(keep, t, 0)[:, None])[:, 0].float()
            if opts.softcap:
                zy = opts.softcap * torch.tanh(zy / opts.softcap)
        lse = lse_buf[r0:r1] if keep_lse else lse_buf[: r1 - r0]
        ce_rows(
            logits,
            t,
            logits if write_grad else None,
            gscale,
            row_scale=None if row_scale is None else row_scale[r0:r1],
            ignore_index=opts.ignore_index,
            label_smoothing=opts.label_smoothing,
            lse_square_scale=opts.lse_square_scale,
            softcap=opts.softcap,
            weight=opts.class_weight,
            z_scale=zscale,
            pred=None if pred is None else pred[r0:r1],
            out=(loss[r0:r1], lse),
            scratch=scratch,
        )
        if opts.token_scaling:
            # Liger's token scaling: each row's loss and gradient times its target's softmax
            # probability, held constant (no gradient through it); one more pass over the chunk.
            p = torch.where(keep, torch.exp(zy - lse), 0.0)
            factor[r0:r1] = p
            loss[r0:r1] *= p
            if write_grad:  # on whole padded rows: the scale kernel takes contiguous rows
                scale_rows_(padded[: r1 - r0], p)
        if need_x:
            torch.mm(logits[:, cols[0]], weight[cols[0]], out=dx[r0:r1])
            for c in cols[1:]:
                dx[r0:r1].addmm_(logits[:, c], weight[c])
        if need_w:
            for c in cols:
                if opts.accum_fp32:
                    product = logits[:, c].t() @ x
                    if r0 == 0:
                        dw[c].copy_(product)
                    else:
                        dw[c].add_(product)
                    del product
                elif r0 == 0:
                    torch.mm(logits[:, c].t(), x, out=dw[c])
                else:
                    dw[c].addmm_(logits[:, c].t(), x)
        if need_b:
            db += logits.sum(0, dtype=torch.float32)
    if dw is not None and dw.dtype != weight.dtype:
        dw = dw.to(weight.dtype)
    return loss, dx, dw, db, (lse_all, factor, pred)


def _forward(hidden, weight, bias, target, opts: _Options, num_items, need):
    """The loss (reduced), the extras (z-loss, accuracy, predicted tokens; None where not asked
    for) and the gradients (d(hidden), d(weight), fp32 d(bias); None where not needed or
    deferred to the backward), computed as `FusedLinearCrossEntropyFunction` and the custom op
    both do. Returns (total, extras, grads, deferred)."""
    cw = opts.class_weight
    gscale = grad_scale_tensor(opts.reduction, target, opts.ignore_index, num_items, cw)
    zscale = None
    if cw is not None:  # the z-loss is unweighted: its mean has the row count
        zscale = grad_scale_tensor(opts.reduction, target, opts.ignore_index, num_items)
    deferred = opts.reduction == "none" and any(need)
    with torch.autocast(hidden.device.type, enabled=False):
        loss, dx, dw, db, extras = _chunked(
            hidden, weight, bias, target, opts, gscale, None,
            (False, False, False) if deferred else need, zscale,
        )  # fmt: skip
    lse, factor, pred = extras
    total, out = reduce_with_options(
        loss, lse, target, pred, reduction=opts.reduction, gscale=gscale, zscale=zscale,
        lse_square_scale=opts.lse_square_scale, ignore_index=opts.ignore_index,
        want_z=opts.want[0], want_acc=opts.want[1], row_factor=factor,
    )  # fmt: skip
    return total, out, (dx, dw, db), deferred


def _deferred_grads(hidden, weight, bias, target, opts: _Options, grad_rows, need):
    """reduction="none": (d(hidden), d(weight), fp32 d(bias)) for the per-token upstream
    gradient `grad_rows`, the logits recomputed chunk by chunk."""
    ones = torch.ones(1, dtype=torch.float32, device=hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):
        _, dx, dw, db, _ = _chunked(
            hidden, weight, bias, target, opts, ones,
            grad_rows.detach().float().reshape(-1).contiguous(), need,
        )  # fmt: skip
    return dx, dw, db


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd wrapper over `_chunked` (the eager path); see the module docstring for where the
    work happens.

    Returns (loss, z_loss, token_accuracy, predicted_tokens), the last three empty unless asked
    for and never differentiable.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, opts: _Options, num_items, need):
        total, out, grads, deferred = _forward(hidden, weight, bias, target, opts, num_items, need)
        ctx.opts, ctx.deferred = opts, deferred
        if deferred:
            ctx.save_for_backward(hidden, weight, bias, target)
            ctx.grads = None
        else:
            ctx.grads = grads
        ctx.bias_dtype = None if bias is None else bias.dtype
        empty = total.new_empty(0)
        outs = [t if t is not None else empty for t in out]
        ctx.mark_non_differentiable(*outs)
        # No zero-filled gradients for the extras (never differentiable) on every backward.
        ctx.set_materialize_grads(False)
        return (total, *outs)

    @staticmethod
    def backward(ctx, grad_out, *_extras):
        if grad_out is None:  # no gradient reached the loss
            ctx.grads = None
            return (None,) * 7
        if ctx.deferred:
            hidden, weight, bias, target = ctx.saved_tensors
            dx, dw, db = _deferred_grads(
                hidden, weight, bias, target, ctx.opts, grad_out, tuple(ctx.needs_input_grad[:3])
            )
            db = None if db is None else db.to(bias.dtype)
            return dx, dw, db, None, None, None, None
        if ctx.grads is None:
            return (None,) * 7
        (dx, dw, db), ctx.grads = ctx.grads, None
        # Popped off ctx so that autograd can take these buffers as .grad without a copy.
        if dx is not None:
            scale_rows_(dx, grad_out)
        if dw is not None:
            scale_rows_(dw, grad_out)
        if db is not None:
            db = (db * grad_out.float()).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None, None


# --- torch.library ops: what torch.compile sees -----------------------------------------------
#
# One opaque forward that returns the loss, the extras and the gradients it computed (or empty
# tensors), so AOTAutograd saves exactly what the eager path keeps (d(hidden), d(weight),
# d(bias); or, deferred, the inputs); the backward scales them by grad_output with plain torch
# ops that Inductor fuses (and may write over the saved buffer: AOTAutograd donates saved
# tensors to the backward). Outputs are fresh tensors, never None: a tensor of size 0 stands
# for "not asked for". Chunk counts and configs are decided inside the op at run time, so
# nothing here depends on the number of tokens.


def _op_options(ignore_index, label_smoothing, lse_square_scale, softcap, reduction, chunk_rows,
                class_weight, accum_fp32, token_scaling, want_z, want_acc, want_pred):  # fmt: skip
    return _Options(
        ignore_index, label_smoothing, lse_square_scale, softcap, reduction,
        chunk_rows or None, class_weight, accum_fp32, token_scaling, (want_z, want_acc, want_pred),
    )  # fmt: skip


def _none_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0, dtype=torch.float32) if t is None else t


@torch.library.custom_op(op_name("flce_fwd"), mutates_args=())
def flce_fwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],  # noqa: UP045 - torch.library parses typing.Optional
    target: torch.Tensor,
    class_weight: Optional[torch.Tensor],  # noqa: UP045
    num_items: Optional[torch.Tensor],  # noqa: UP045
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: Optional[float],  # noqa: UP045
    reduction: str,
    chunk_rows: int,
    accum_fp32: bool,
    token_scaling: bool,
    want_z: bool,
    want_acc: bool,
    want_pred: bool,
    need_x: bool,
    need_w: bool,
    need_b: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:  # fmt: skip
    opts = _op_options(ignore_index, label_smoothing, lse_square_scale, softcap, reduction,
                       chunk_rows, class_weight, accum_fp32, token_scaling, want_z, want_acc,
                       want_pred)  # fmt: skip
    need = (need_x, need_w, need_b)
    total, out, grads, _ = _forward(hidden, weight, bias, target, opts, num_items, need)
    return (total, *(_none_empty(t, total) for t in (*out, *grads)))


@flce_fwd.register_fake
def _(hidden, weight, bias, target, class_weight, num_items, ignore_index, label_smoothing,
      lse_square_scale, softcap, reduction, chunk_rows, accum_fp32, token_scaling, want_z,
      want_acc, want_pred, need_x, need_w, need_b):  # fmt: skip
    # Traced for a compile: the saved gradients' scaling runs in place (compile_grad_scale.py).
    from . import compile_grad_scale

    compile_grad_scale.install()
    n = hidden.shape[0]
    f32 = dict(dtype=torch.float32)
    total = hidden.new_empty((n,) if reduction == "none" else (), **f32)
    nothing = lambda: hidden.new_empty(0, **f32)  # noqa: E731
    z = total.new_empty(total.shape) if want_z else nothing()
    acc = hidden.new_empty((n,) if reduction == "none" else (), **f32) if want_acc else nothing()
    pred = hidden.new_empty(n, dtype=torch.int64) if want_acc or want_pred else nothing()
    deferred = reduction == "none" and (need_x or need_w or need_b)
    dx = hidden.new_empty(hidden.shape) if need_x and not deferred else nothing()
    dw = weight.new_empty(weight.shape) if need_w and not deferred else nothing()
    db = hidden.new_empty(weight.shape[0], **f32) if need_b and not deferred else nothing()
    return total, z, acc, pred, dx, dw, db


@torch.library.custom_op(op_name("flce_bwd_deferred"), mutates_args=())
def flce_bwd_deferred(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],  # noqa: UP045
    target: torch.Tensor,
    class_weight: Optional[torch.Tensor],  # noqa: UP045
    grad_rows: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: Optional[float],  # noqa: UP045
    chunk_rows: int,
    token_scaling: bool,
    need_x: bool,
    need_w: bool,
    need_b: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    opts = _op_options(ignore_index, label_smoothing, lse_square_scale, softcap, "none",
                       chunk_rows, class_weight, False, token_scaling, False, False, False)  # fmt: skip
    grads = _deferred_grads(hidden, weight, bias, target, opts, grad_rows, (need_x, need_w, need_b))
    return tuple(_none_empty(t, grad_rows) for t in grads)


@flce_bwd_deferred.register_fake
def _(hidden, weight, bias, target, class_weight, grad_rows, ignore_index, label_smoothing,
      lse_square_scale, softcap, chunk_rows, token_scaling, need_x, need_w, need_b):  # fmt: skip
    nothing = lambda: hidden.new_empty(0, dtype=torch.float32)  # noqa: E731
    return (
        hidden.new_empty(hidden.shape) if need_x else nothing(),
        weight.new_empty(weight.shape) if need_w else nothing(),
        hidden.new_empty(weight.shape[0], dtype=torch.float32) if need_b else nothing(),
    )


def _op_setup(ctx, inputs, output):
    hidden, weight, bias, target, class_weight = inputs[:5]
    reduction, need = inputs[10], inputs[17:20]
    ctx.deferred = reduction == "none" and any(need)
    ctx.need = need
    ctx.bias_dtype = None if bias is None else bias.dtype
    if ctx.deferred:
        # accum_fp32 is not passed on: a deferred backward sums d(weight) as eager's does
        ctx.args = (*inputs[6:10], inputs[11], inputs[13])
        ctx.save_for_backward(hidden, weight, bias, target, class_weight)
    else:
        ctx.save_for_backward(*output[4:7])


def _scaled(grad: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """grad * g in fp32, rounded once to `dtype` (as the eager path's scale kernel)."""
    return (grad.float() * g.float()).to(dtype)


def _op_backward(ctx, g_total, *_unused):
    need_x, need_w, need_b = ctx.need
    if ctx.deferred:
        hidden, weight, bias, target, class_weight = ctx.saved_tensors
        dx, dw, db = flce_bwd_deferred(
            hidden, weight, bias, target, class_weight, g_total, *ctx.args, need_x, need_w, need_b
        )
    else:
        dx, dw, db = ctx.saved_tensors
        dx = _scaled(dx, g_total, dx.dtype) if need_x else None
        dw = _scaled(dw, g_total, dw.dtype) if need_w else None
        db = db * g_total.float() if need_b else None
    db = db.to(ctx.bias_dtype) if need_b else None
    return (dx if need_x else None, dw if need_w else None, db) + (None,) * 17


flce_fwd.register_autograd(_op_backward, setup_context=_op_setup)


def _gather_dtensor(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor (e.g. an FSDP2 shard read outside its module's hooks) as its full local value.

    The gradient flows back as a Partial (sum) placement, i.e. it is reduce-scattered into the
    shards as the sum over ranks of each rank's loss gradient.
    """
    if t is None or type(t).__name__ != "DTensor":
        return t
    from torch.distributed.tensor import Partial

    return t.full_tensor(grad_placements=[Partial()] * t.device_mesh.ndim)


def fused_linear_cross_entropy(
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
    class_weight: torch.Tensor | None = None,
    accum_dtype: torch.dtype | None = None,
    use_token_scaling: bool = False,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False,
    check_targets: bool = False,
) -> torch.Tensor | CrossEntropyOutput:
    """Cross-entropy of ``hidden[..., H] @ weight[V, H].T (+ bias)`` against ``target[...]``.

    Same options and fp32 result as ``cross_entropy`` (``class_weight`` is its ``weight``;
    the ``return_*`` flags return a `CrossEntropyOutput`); never holds more than one chunk of
    logits. ``accum_dtype=torch.float32`` sums d(weight) over chunks in fp32 (4·V·H bytes more,
    one rounding at the end). ``use_token_scaling=True`` (Liger's) multiplies each token's loss
    and gradient by its target's predicted probability, treated as a constant.
    """
    check_options(reduction, label_smoothing, softcap)
    if accum_dtype not in (None, torch.float32) and accum_dtype != weight.dtype:
        raise ValueError(f"accum_dtype must be None or torch.float32, got {accum_dtype}")
    if target.shape != hidden.shape[:-1]:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal hidden shape without its last "
            f"dimension, {tuple(hidden.shape[:-1])}"
        )
    check_gathered(weight)
    if is_vocab_sharded(weight):  # a colwise (tensor-parallel) head: each rank keeps its rows
        refuse_options(
            class_weight=class_weight, use_token_scaling=use_token_scaling,
            return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy,
            return_predicted_tokens=return_predicted_tokens,
        )  # fmt: skip
        return vocab_parallel_cross_entropy(
            hidden, weight, target, bias, ignore_index=ignore_index,
            label_smoothing=label_smoothing, lse_square_scale=lse_square_scale, softcap=softcap,
            reduction=reduction, num_items=num_items, chunk_rows=chunk_rows,
            accum_dtype=accum_dtype, check_targets=check_targets,
        )  # fmt: skip
    weight, bias = _gather_dtensor(weight), _gather_dtensor(bias)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be [V, H] with H = hidden.shape[-1] = {hidden.shape[-1]}, "
            f"got {tuple(weight.shape)}"
        )
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        # Cast once here (differentiably), as autocast would for F.linear, not once per chunk.
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise ValueError(
            f"hidden ({hidden.dtype}), weight ({weight.dtype}) and bias must share a dtype; "
            "cast them or run under torch.autocast"
        )
    check_weight(class_weight, weight.shape[0], hidden.device)
    if check_targets:
        check_target_range(target, weight.shape[0], ignore_index)
    rows = hidden.reshape(-1, hidden.shape[-1])
    want = (return_z_loss, return_token_accuracy, return_predicted_tokens)
    # Not ctx.needs_input_grad, which stays True under torch.no_grad().
    need = tuple(
        torch.is_grad_enabled() and t is not None and t.requires_grad for t in (rows, weight, bias)
    )
    if torch.compiler.is_compiling():
        loss, z, acc, pred = _compiled_call(
            rows, weight, bias, target, class_weight, num_items, ignore_index, label_smoothing,
            lse_square_scale, softcap, reduction, chunk_rows, accum_dtype, use_token_scaling,
            want, need,
        )  # fmt: skip
        return _shaped(loss, z, acc, pred, target.shape, reduction, want)
    opts = _Options(
        ignore_index,
        float(label_smoothing),
        float(lse_square_scale),
        softcap,
        reduction,
        chunk_rows,
        None if class_weight is None else class_weight.detach().float().contiguous(),
        accum_dtype == torch.float32 and weight.dtype != torch.float32,
        use_token_scaling,
        want,
    )
    loss, z, acc, pred = FusedLinearCrossEntropyFunction.apply(
        rows.contiguous(),
        weight.contiguous(),
        bias,
        target.reshape(-1).contiguous(),
        opts,
        num_items,
        need,
    )
    return _shaped(loss, z, acc, pred, target.shape, reduction, want)


def _compiled_call(rows, weight, bias, target, class_weight, num_items, ignore_index,
                   label_smoothing, lse_square_scale, softcap, reduction, chunk_rows, accum_dtype,
                   token_scaling, want, need):  # fmt: skip
    """The custom op's call (under torch.compile): (loss, z, accuracy, predicted tokens)."""
    if num_items is not None and not isinstance(num_items, torch.Tensor):
        # A number becomes a 0-d tensor in the graph, so a new value is no new graph.
        num_items = torch.full((), num_items, dtype=torch.float32, device=rows.device)
    out = flce_fwd(
        rows.contiguous(),
        weight.contiguous(),
        bias,
        target.reshape(-1).contiguous(),
        None if class_weight is None else class_weight.detach().float().contiguous(),
        num_items,
        ignore_index,
        float(label_smoothing),
        float(lse_square_scale),
        None if softcap is None else float(softcap),
        reduction,
        chunk_rows or 0,
        accum_dtype == torch.float32 and weight.dtype != torch.float32,
        token_scaling,
        *want,
        *need,
    )
    return out[:4]


def _shaped(loss, z, acc, pred, shape, reduction: str, want) -> torch.Tensor | CrossEntropyOutput:
    """The loss alone, or the `CrossEntropyOutput` the ``return_*`` flags ask for, in `shape`
    (the target's) where the reduction keeps one value per token."""
    return_z_loss, return_token_accuracy, return_predicted_tokens = want
    if reduction == "none":
        loss = loss.view(shape)
    if not any(want):
        return loss
    shaped = reduction == "none"
    return CrossEntropyOutput(
        loss,
        (z.view(shape) if shaped else z) if return_z_loss else None,
        (acc.view(shape) if shaped else acc) if return_token_accuracy else None,
        pred.view(shape) if return_predicted_tokens else None,
    )
