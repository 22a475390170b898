"""Residual add fused with RMSNorm: ``s = x + residual; y = rms_norm(s)``, returning (y, s).

The decoder-layer pattern ``hidden = residual + hidden; residual = hidden; hidden = norm(hidden)``
in one pass: x and the residual are read once, s and y written once, instead of a separate add
kernel writing s and the norm reading it back. s is rounded to the inputs' dtype before it is
normalised, exactly like the separate add. The backward keeps s and rstd; the gradient reaching s
(from the norm and from s's own later uses) is the gradient of both x and the residual, computed
by the RMSNorm backward kernel with the incoming ds added before its one rounding.

Inputs of different shapes or dtypes (where the add would broadcast or promote) run the add and
the norm separately, with the same results.

The norm takes RMSNorm's options (no weight, `offset`, `casting_mode`; see rms_norm.py), and
``in_place=True`` writes the backward's gradient of the sum over the incoming gradient of y.
"""

from typing import Optional

import torch

from ._common import needs_grad, op_name
from .rms_norm import (
    CASTING_MODES,
    LLAMA,
    _op_numerics,
    _torch_forward,
    forward,
    no_stats_backward_error,
    out_dtype,
    resolve_numerics,
    rms_norm,
    use_triton_rows,
)
from .rms_norm import _backward_any as rms_norm_backward_any
from .tensor_parallel import is_dtensor


def _forward_any(x, residual, weight, eps, gemma, stats=True):
    """(y, s, rstd): the Triton kernel where it applies, else torch ops with the same roundings;
    rstd is empty without `stats`."""
    if use_triton_rows(x):
        y, rstd, s = forward(x, weight, eps, gemma, residual=residual, stats=stats)
        return y, s, rstd
    s = (x + residual).contiguous()
    y, rstd = _torch_forward(s, weight, eps, gemma)
    return y, s, (rstd if stats else rstd.new_empty(0))


def _backward_any(dy, ds, s, weight, rstd, gemma, compute_dw, in_place=False):
    """(d of s, dW): the norm's gradient plus `ds`, the gradient of s from its other uses."""
    if dy is None:  # only s was used afterwards: the norm adds nothing
        dw = torch.zeros_like(weight) if compute_dw else s.new_empty(0)
        return ds.to(s.dtype).contiguous(), dw
    return rms_norm_backward_any(
        dy, s, weight, rstd, gemma, compute_dw, ds=ds, in_place=in_place and dy is not ds
    )


@torch.library.custom_op(op_name("add_rms_norm_fwd"), mutates_args=())
def add_rms_norm_fwd(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: Optional[torch.Tensor],  # noqa: UP045 - torch.library parses typing.Optional
    eps: float,
    gemma: bool,
    offset: float = 0.0,
    mode: int = LLAMA,
    stats: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward_any(x, residual, weight, eps, _op_numerics(gemma, offset, mode), stats)


@add_rms_norm_fwd.register_fake
def _(x, residual, weight, eps, gemma, offset=0.0, mode=LLAMA, stats=True):
    from . import inductor_note  # each sum feeds the next layer's op: see inductor_note.py

    inductor_note.shorten_fallback_note()
    y = x.new_empty(x.shape, dtype=out_dtype(x, weight, _op_numerics(gemma, offset, mode)))
    return (
        y,
        torch.empty_like(x, memory_format=torch.contiguous_format),
        x.new_empty(x.shape[:-1] if stats else (0,), dtype=torch.float32),
    )


@torch.library.custom_op(op_name("add_rms_norm_bwd"), mutates_args=())
def add_rms_norm_bwd(
    dy: torch.Tensor,
    ds: Optional[torch.Tensor],  # noqa: UP045 - torch.library parses typing.Optional
    s: torch.Tensor,
    weight: Optional[torch.Tensor],  # noqa: UP045 - torch.library parses typing.Optional
    rstd: torch.Tensor,
    gemma: bool,
    compute_dw: bool,
    offset: float = 0.0,
    mode: int = LLAMA,
) -> tuple[torch.Tensor, torch.Tensor]:
    numer = _op_numerics(gemma, offset, mode)
    return _backward_any(dy, ds, s, weight, rstd, numer, compute_dw)


@add_rms_norm_bwd.register_fake
def _(dy, ds, s, weight, rstd, gemma, compute_dw, offset=0.0, mode=LLAMA):
    dw = torch.empty_like(weight) if compute_dw else s.new_empty(0)
    return torch.empty_like(s), dw


def _save(ctx, s, weight, rstd, numer, in_place=False):
    """Keep the sum (the norm's input), the weight and rstd for the backward."""
    ctx.save_for_backward(s, weight, rstd)
    ctx.numer, ctx.in_place = numer, in_place


def _setup_context(ctx, inputs, output):
    _x, _residual, weight, _eps, gemma, offset, mode, stats = inputs
    _y, s, rstd = output
    _save(ctx, s, weight, rstd, _op_numerics(gemma, offset, mode))
    ctx.stats = stats


def _backward(ctx, dy, ds, _drstd):
    if not ctx.stats:
        raise no_stats_backward_error("add_rms_norm_fwd")
    s, weight, rstd = ctx.saved_tensors
    need_dw = weight is not None and ctx.needs_input_grad[2]
    offset, mode = ctx.numer
    dsum, dw = add_rms_norm_bwd(dy, ds, s, weight, rstd, False, need_dw, offset, mode)
    return dsum, dsum, (dw if need_dw else None), None, None, None, None, None


add_rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


class _AddRMSNormFunction(torch.autograd.Function):
    """The eager path: the same kernels without the custom-op dispatch cost on every call."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, numer, in_place):
        y, s, rstd = _forward_any(x, residual, weight, eps, numer)
        _save(ctx, s, weight, rstd, numer, in_place)
        ctx.set_materialize_grads(False)  # an unused output costs no zero-filled gradient
        if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            ctx.mark_non_differentiable(s)  # as torch's add of two tensors without grad
        return y, s

    @staticmethod
    def backward(ctx, dy, ds):
        s, weight, rstd = ctx.saved_tensors
        need_dw = weight is not None and ctx.needs_input_grad[2]
        if dy is None and ds is None:
            return None, None, None, None, None, None
        dsum, dw = _backward_any(dy, ds, s, weight, rstd, ctx.numer, need_dw, ctx.in_place)
        # Like torch's add: both summands get the same gradient tensor.
        return dsum, dsum, (dw if need_dw else None), None, None, None


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    gemma: bool = False,
    *,
    offset: float = 0.0,
    casting_mode: str | None = None,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass, the norm on the sum rounded to the
    inputs' dtype, with `rms_norm`'s `offset`, `casting_mode` and no-weight options (HF Llama
    numerics by default; ``gemma=True`` is offset 1.0 in gemma mode).

    ``in_place=True`` writes the backward's gradient of the sum over y's incoming gradient; as
    with `rms_norm`, only when nothing else reads that gradient tensor. Ignored under compile.
    """
    numer = resolve_numerics(gemma, offset, casting_mode)
    if (
        x.shape != residual.shape
        or x.dtype != residual.dtype
        or x.device != residual.device
        or is_dtensor(x)  # tensor or sequence parallel: DTensor's add, then rms_norm's shards
        or is_dtensor(residual)
    ):
        s = residual + x
        kw = {"offset": numer[0], "casting_mode": _MODE_NAMES[numer[1]], "in_place": in_place}
        return rms_norm(s, weight, eps, **kw), s
    grad = needs_grad(x, residual, weight)
    if torch.compiler.is_compiling():  # Dynamo guards on the grad mode and requires_grad
        y, s, _rstd = add_rms_norm_fwd(x, residual, weight, float(eps), False, *numer, grad)
        # A custom op's outputs all require grad when any input does; torch's add would not.
        return y, (s if x.requires_grad or residual.requires_grad else s.detach())
    if not grad:  # inference: no rstd, and no autograd node
        return _forward_any(x, residual, weight, float(eps), numer, stats=False)[:2]
    return _AddRMSNormFunction.apply(x, residual, weight, float(eps), numer, in_place)


_MODE_NAMES = {mode: name for name, mode in CASTING_MODES.items()}
