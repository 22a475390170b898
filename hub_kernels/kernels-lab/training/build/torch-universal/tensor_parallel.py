"""DTensor inputs (tensor and sequence parallelism) for the norms, RoPE, the gated products and
the gated MLP: each op computes on this rank's shard where the math allows.

- Row-local ops (RMSNorm and LayerNorm over whole rows, RoPE over whole heads, the gated
  products elementwise) run the kernel on the local tensor and hand back a DTensor with the
  input's placements: nothing is communicated. A norm weight used with rows spread over ranks
  gets a partial gradient there, summed over those ranks by DTensor (one all-reduce of the
  weight's size, as any replicated parameter's gradient).
- RMSNorm over a hidden dimension split across ranks needs each row's sum of squares: one
  all-reduce of one fp32 value per token in the forward, and one of sum(dy·w·x̂) per token in
  the backward. The activations are never gathered.
- The gated MLP of a Megatron split (gate and up colwise, down rowwise, as transformers' TP
  plans lay them out) runs the lean autograd function of gated_mlp.py on the local shards
  between an identity-forward/all-reduce-backward and an all-reduce-forward/identity-backward:
  the two collectives of [tokens, hidden] the plan's own layers would do, and no others.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


def is_dtensor(t: object) -> bool:
    """Whether `t` is a DTensor (without importing torch.distributed.tensor unless it is)."""
    return type(t).__name__ == "DTensor" and isinstance(t, _dtensor())


def _dtensor():
    from torch.distributed.tensor import DTensor

    return DTensor


def _placements():
    from torch.distributed.tensor import Partial, Replicate, Shard

    return Partial, Replicate, Shard


def _is_shard(p, dim: int, ndim: int) -> bool:
    _, _, Shard = _placements()
    return isinstance(p, Shard) and p.dim % ndim == dim % ndim


def _without_partial(x):
    """A DTensor whose pending sums (Partial placements) are done: a norm of a partial value is
    not the partial of a norm."""
    Partial, Replicate, _ = _placements()
    if any(isinstance(p, Partial) for p in x.placements):
        x = x.redistribute(
            placements=[Replicate() if isinstance(p, Partial) else p for p in x.placements]
        )
    return x


def _param_local(w: torch.Tensor | None, x, grad_partial: list[bool]) -> torch.Tensor | None:
    """A replicated parameter (DTensor or plain) as this rank's full copy, its gradient marked
    Partial on the mesh dims where `x`'s rows are split (each rank saw only its rows) and
    Replicate elsewhere, so DTensor sums it where needed."""
    if w is None:
        return None
    Partial, Replicate, _ = _placements()
    mesh = x.device_mesh
    if not is_dtensor(w):
        # a plain parameter next to DTensor activations: its gradient is summed through from_local
        w = _dtensor().from_local(w, mesh, [Replicate()] * mesh.ndim, run_check=False)
    if any(not isinstance(p, Replicate) for p in w.placements):
        w = w.redistribute(placements=[Replicate()] * mesh.ndim)
    grads = [Partial() if partial else Replicate() for partial in grad_partial]
    return w.to_local(grad_placements=grads)


def rowwise(fn: Callable, x, params: list):
    """``fn(x_local, *params_local)`` for an op that treats each row (the last dim) on its own,
    `x` a DTensor whose rows are whole on every rank (split along other dims, or replicated).
    Returns a DTensor with x's placements."""
    x = _without_partial(x)
    mesh, placements = x.device_mesh, x.placements
    rows_split = [p.is_shard() for p in placements]
    local = fn(x.to_local(), *[_param_local(p, x, rows_split) for p in params])
    return _dtensor().from_local(local, mesh, placements, run_check=False)


def hidden_split(x) -> bool:
    """Whether `x` (a DTensor) is split along its last dimension."""
    return any(_is_shard(p, x.ndim - 1, x.ndim) for p in x.placements)


# -- RMSNorm over a split hidden dimension ----------------------------------------------------


class _SplitHiddenRMSNorm(torch.autograd.Function):
    """RMSNorm of rows whose columns are spread over `group`: x̂ = x · rsqrt(mean(x²) + eps)
    with the mean over all `width` columns (one all-reduce per row each way), numerics as
    rms_norm.py's torch path: `offset`, `mode` 0 llama / 1 gemma / 2 none."""

    @staticmethod
    def forward(ctx, x, weight, eps, width, group, offset, mode, out_dtype):
        xf = x.float()
        ss = xf.square().sum(-1)
        dist.all_reduce(ss, group=group)
        rstd = torch.rsqrt(ss / width + eps)
        if mode == 2:
            rstd = rstd.to(x.dtype).float()
        xhat = xf * rstd[..., None]
        if mode != 1:
            xhat = xhat.to(x.dtype).float()
        y = xhat if weight is None else xhat * (weight.float() + offset)
        ctx.save_for_backward(x, weight, rstd)
        ctx.width, ctx.group, ctx.offset, ctx.mode = width, group, offset, mode
        return y.to(out_dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        w = 1.0 if weight is None else weight.float() + ctx.offset
        xhat = x.float() * rstd[..., None]
        g = dy.float() * w
        dot = (g * xhat).sum(-1)
        dist.all_reduce(dot, group=ctx.group)
        dx = (g - xhat * (dot / ctx.width)[..., None]) * rstd[..., None]
        dw = None
        if weight is not None and ctx.needs_input_grad[1]:
            xw = xhat if ctx.mode == 1 else xhat.to(x.dtype).float()
            dw = (dy.float() * xw).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        return dx.to(x.dtype), dw, None, None, None, None, None, None


def split_hidden_rms_norm(x, weight, eps: float, offset: float, mode: int, out_dtype):
    """RMSNorm of a DTensor split along its last dim over a one-dimensional mesh."""
    _, Replicate, Shard = _placements()
    mesh = x.device_mesh
    if mesh.ndim != 1:
        raise ValueError(
            f"RMSNorm over a hidden dim split on a {mesh.ndim}-D mesh is not served; "
            "split the hidden dim over a 1-D mesh or replicate it before the norm"
        )
    w = None
    if weight is not None:
        if not is_dtensor(weight):
            weight = _dtensor().from_local(weight, mesh, [Replicate()], run_check=False)
        if weight.placements != (Shard(0),):
            # this rank's columns of the weight; its gradient comes back through the same split
            weight = weight.redistribute(placements=[Shard(0)])
        w = weight.to_local()
    y = _SplitHiddenRMSNorm.apply(
        x.to_local(), w, float(eps), x.shape[-1], mesh.get_group(), float(offset), mode, out_dtype
    )
    return _dtensor().from_local(
        y, mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride()
    )


_MODE_NAMES = {0: "llama", 1: "gemma", 2: "none"}


def dtensor_rms_norm(norm: Callable, x, weight, eps, numer, save_output, in_place, out_dtype):
    """rms_norm.rms_norm (passed as `norm`) of a DTensor: the local kernel over whole rows, or
    the split-hidden path (one all-reduce per token each way)."""
    offset, mode = numer
    if hidden_split(x):
        return split_hidden_rms_norm(x, weight, eps, offset, mode, out_dtype(x, weight, numer))
    kw = dict(save_output=save_output, offset=offset, casting_mode=_MODE_NAMES[mode])

    def local(xl, wl):
        return norm(xl, wl, eps, in_place=in_place, **kw)

    return rowwise(local, x, [weight])


def dtensor_layer_norm(norm: Callable, x, weight, bias, eps):
    """layer_norm.layer_norm (passed as `norm`) of a DTensor whose rows are whole on each rank."""
    if hidden_split(x):
        raise ValueError(
            "LayerNorm over a hidden dim split across ranks is not served; "
            "replicate the hidden dim before the norm (or use RMSNorm)"
        )
    return rowwise(lambda xl, wl, bl: norm(xl, wl, bl, eps), x, [weight, bias])


# -- RoPE --------------------------------------------------------------------------------------


def _local(t):
    if not is_dtensor(t):
        return t
    return _without_partial(t).to_local()


def rope(fn: Callable, q, k, cos, sin, unsqueeze_dim: int):
    """``fn(q, k, cos, sin, unsqueeze_dim)`` on the local shards of DTensor q and k split over
    heads, tokens or batch (rotation pairs lie within a head's last dim, which must be whole);
    cos and sin as given (plain, or DTensors split like q's tokens). Returns DTensors laid out
    as q and k."""
    for t in (q, k):
        if is_dtensor(t) and hidden_split(t):
            raise ValueError(
                "RoPE needs each head's dims on one rank; got q/k split along head_dim: "
                "split heads, tokens or the batch instead"
            )
    qo, ko = fn(_local(q), _local(k), _local(cos), _local(sin), unsqueeze_dim)
    out = []
    for t, local in ((q, qo), (k, ko)):
        if is_dtensor(t):
            t = _without_partial(t)
            local = _dtensor().from_local(local, t.device_mesh, t.placements, run_check=False)
        out.append(local)
    return tuple(out)


# -- the gated product -------------------------------------------------------------------------


def elementwise(fn: Callable, *tensors, **kwargs):
    """``fn(*locals, **kwargs)`` for an elementwise op of DTensors laid out alike (same mesh and
    placements): local in, local out, the result with the same layout."""
    first = next(t for t in tensors if is_dtensor(t))
    layouts = {(t.device_mesh, tuple(t.placements)) for t in tensors if is_dtensor(t)}
    if len(layouts) != 1 or not all(is_dtensor(t) for t in tensors):
        raise ValueError(
            "the gated product needs gate and up as DTensors of one layout; "
            "redistribute one to the other's placements"
        )
    first = _without_partial(first)
    locals_ = [_without_partial(t).to_local() for t in tensors]
    out = fn(*locals_, **kwargs)
    return _dtensor().from_local(out, first.device_mesh, first.placements, run_check=False)


# -- the gated MLP under a Megatron split ------------------------------------------------------


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; the backward sums the ranks' partial gradients (a replicated input
    feeding colwise layers)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """Sums the ranks' partial outputs (a rowwise layer's Partial -> Replicate); identity
    backward."""

    @staticmethod
    def forward(ctx, x, group):
        dist.all_reduce(x, group=group)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _style(module: torch.nn.Module):
    """The transformers TP style whose wrapper is `module`'s forward, or None."""
    fn = module.__dict__.get("forward")
    code = getattr(fn, "__code__", None)
    if code is None or not getattr(fn, "__module__", "").startswith("transformers.distributed"):
        return None
    if "self" not in code.co_freevars:
        return None
    return fn.__closure__[code.co_freevars.index("self")].cell_contents


def megatron_split(gate_proj, up_proj, down_proj):
    """The TP process group when the three Linears are transformers' colwise / colwise /
    rowwise layers on one 1-D mesh with local outputs (the plan's "colwise" and "rowwise"
    styles: down's output summed to a replicated tensor), else None."""
    _, Replicate, Shard = _placements()
    weights = [m.weight for m in (gate_proj, up_proj, down_proj)]
    if not all(is_dtensor(w) for w in weights):
        return None
    mesh = weights[0].device_mesh
    if mesh.ndim != 1 or any(w.device_mesh != mesh for w in weights):
        return None
    if [w.placements for w in weights] != [(Shard(0),), (Shard(0),), (Shard(1),)]:
        return None
    styles = [_style(m) for m in (gate_proj, up_proj, down_proj)]
    names = [type(s).__name__ for s in styles]
    if names != ["ColwiseParallel", "ColwiseParallel", "RowwiseParallel"]:
        return None
    col_ok = all(s.use_local_output and _is_shard(s.output_layouts, -1, 2) for s in styles[:2])
    row = styles[2]
    if not (col_ok and row.use_local_output and isinstance(row.output_layouts, Replicate)):
        return None
    return mesh.get_group()


def megatron_gated_mlp(lean: Callable, x, gate_proj, up_proj, down_proj, act):
    """``down(act(gate(x)) * up(x))`` on this rank's intermediate columns, or None when the
    Linears are not a Megatron split this function serves (the caller composes the modules,
    whose own TP forwards then run). `lean(x, w_gate, w_up, w_down, act)` is the single-device
    autograd function; x must be a plain (replicated) tensor."""
    if is_dtensor(x):
        return None
    group = megatron_split(gate_proj, up_proj, down_proj)
    if group is None:
        return None
    local = [m.weight.to_local() for m in (gate_proj, up_proj, down_proj)]
    out = lean(_CopyToGroup.apply(x, group), *local, act)
    return _ReduceFromGroup.apply(out, group)
