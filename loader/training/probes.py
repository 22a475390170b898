"""Numerical probes: what a module or a function computes, told apart by running it.

Attributes say what a module holds; only running it says what it computes (a ``1 + weight``
offset, where the cast to the input dtype happens, which half of a fused projection is the gate,
the rotary layout). Each probe runs the module's own forward (or the function) on a small random
input on the CPU, next to the plain-torch formula of each kernel layer that could serve it, and
names the formula that matches. Probes never touch the model's parameters: a module is probed
through a copy with small random weights.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# Formulas agree with the module's forward to this relative error in fp32 (the same math in
# another order), and are told apart by far larger gaps (an offset of 1, a cast).
_FP32_RTOL = 1e-4


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float) -> bool:
    if a.shape != b.shape:
        return False
    scale = b.float().abs().max().clamp_min(1e-6)
    return bool(((a.float() - b.float()).abs().max() / scale) <= rtol)


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.shape == b.shape else float("inf")


def eps_of(module: nn.Module) -> float | None:
    """The norm's epsilon, under the names transformers uses."""
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def one_tensor_forward(cls: type) -> bool:
    """forward(self, x) with no other required argument."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    required = [
        p
        for p in params
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    others = [p for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    return len(required) == 1 and len(others) == 1


def _materialized(module: nn.Module, seed: int) -> nn.Module:
    """A CPU fp32 copy of a small module with random parameters (meta tensors allowed)."""
    probe = copy.deepcopy(module)
    if any(p.is_meta for p in probe.parameters()) or any(b.is_meta for b in probe.buffers()):
        probe = probe.to_empty(device="cpu")
    probe = probe.to(device="cpu", dtype=torch.float32)
    probe.__dict__.pop("forward", None)  # a kernel bound earlier: probe the module's own forward
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in probe.parameters():
            # weights around 0.5: an offset of one (Gemma) or a zero-centred weight both show
            p.copy_(torch.rand(p.shape, generator=gen) + 0.25)
    return probe


# -- norms ------------------------------------------------------------------------------------


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


NORM_FORMULAS: dict[str, Callable[[torch.Tensor, nn.Module, float], torch.Tensor]] = {
    # Llama: normalise in fp32, cast, then scale by the weight in the input dtype.
    "RMSNorm": lambda x, m, eps: m.weight * _rms(x, eps).to(x.dtype),
    # Gemma: (1 + weight), all in fp32, one cast at the end.
    "GemmaRMSNorm": lambda x, m, eps: (_rms(x, eps) * (1.0 + m.weight.float())).to(x.dtype),
    # OLMo2-style: the weight multiplies the fp32 normalised value, one cast at the end.
    "RMSNormFloatWeight": lambda x, m, eps: (_rms(x, eps) * m.weight.float()).to(x.dtype),
    "WeightlessRMSNorm": lambda x, m, eps: _rms(x, eps).to(x.dtype),
    "LayerNorm": lambda x, m, eps: F.layer_norm(
        x.float(),
        x.shape[-1:],
        None if getattr(m, "weight", None) is None else m.weight.float(),
        None if getattr(m, "bias", None) is None else m.bias.float(),
        eps,
    ).to(x.dtype),
}


def norm_width(module: nn.Module) -> int | None:
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.shape[-1] if weight.dim() == 1 else None
    for name in ("normalized_shape", "hidden_size", "dim", "d_model"):
        value = getattr(module, name, None)
        if isinstance(value, int):
            return value
        if isinstance(value, tuple) and len(value) == 1:
            return int(value[0])
    return None


def probe_norm(module: nn.Module) -> tuple[str | None, str]:
    """(the norm formula the module computes, or None; a one-line reason when None).

    fp32 picks the formulas that agree; bf16 then picks among them the one whose casts match
    (Llama, OLMo2 and a weight-less norm are the same math in fp32)."""
    eps = eps_of(module)
    if eps is None:
        return None, "no epsilon attribute (variance_epsilon / eps)"
    width = norm_width(module)
    params = dict(module.named_parameters(recurse=False))
    if width is None and not params:
        width = 8  # a norm with no parameters fixes no width (MuseGlimmer's scale-free norms)
    if width is None:
        return None, "weight is not one vector over the last dim"
    if set(params) - {"weight", "bias"}:
        return None, f"parameters {sorted(params)} are not weight/bias"
    has_weight, has_bias = "weight" in params, "bias" in params
    if has_bias:
        candidates = ["LayerNorm"]
    elif has_weight:
        candidates = ["RMSNorm", "GemmaRMSNorm", "RMSNormFloatWeight", "LayerNorm"]
    else:
        candidates = ["WeightlessRMSNorm", "LayerNorm"]
    try:
        probe = _materialized(module, seed=0)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(2, 3, width, generator=gen)
        # row 0: a mean, so LayerNorm shows; row 1: mean square near eps, so where eps goes shows
        x[:, 0] = x[:, 0] * 2 + 0.5
        x[:, 1] = x[:, 1] * eps**0.5
        with torch.no_grad():
            out = probe(x)
            fits = [
                c for c in candidates if _close(NORM_FORMULAS[c](x, probe, eps), out, _FP32_RTOL)
            ]
            if len(fits) > 1:
                xb, pb = x.bfloat16(), probe.bfloat16()
                outb = pb(xb)
                fits.sort(key=lambda c: _gap(NORM_FORMULAS[c](xb, pb, eps), outb))
    except Exception as exc:  # noqa: BLE001 - any failure means: not one of ours
        return None, f"its forward failed on a probe input ({type(exc).__name__})"
    if not fits:
        return None, "computes none of RMSNorm, Gemma (1 + weight) RMSNorm or LayerNorm"
    return fits[0], ""


def casts_to_weight_dtype(module: nn.Module) -> bool:
    """Whether the norm casts x̂ to its weight's dtype when that is 16-bit (T5LayerNorm and its
    copies), found by running it on an fp32 input with a bf16 weight: Llama's norm returns fp32
    there, T5's bf16. With x and the weight in one dtype the two compute the same."""
    try:
        probe = _materialized(module, seed=0)
        width = norm_width(module) or 8
        probe.weight.data = probe.weight.data.bfloat16()
        x = torch.randn(2, width, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            return probe(x).dtype == torch.bfloat16
    except Exception:  # noqa: BLE001 - a forward that refuses mixed dtypes casts to neither
        return False


# -- MLPs -------------------------------------------------------------------------------------

SILU_NAMES = frozenset({"SiLUActivation", "SiLU"})
GELU_NAMES = frozenset(
    {
        "GELUActivation",
        "GELU",
        "GELUTanh",
        "PytorchGELUTanh",
        "NewGELUActivation",
        "FastGELUActivation",
        "GELUTanhActivation",
        "QuickGELUActivation",
    }
)
ACT_ATTRS = ("act_fn", "activation_fn", "act")


def activation_of(module: nn.Module) -> nn.Module | None:
    for name in ACT_ATTRS:
        act = getattr(module, name, None)
        if isinstance(act, nn.Module):
            return act
    return None


def _small_linear(weight_like: nn.Module, n_in: int, n_out: int, gen: torch.Generator) -> nn.Linear:
    lin = nn.Linear(n_in, n_out, bias=getattr(weight_like, "bias", None) is not None)
    with torch.no_grad():
        for p in lin.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return lin


MULTIPLIERS = ("gate_multiplier", "down_multiplier")


def has_multipliers(module: nn.Module) -> bool:
    """Whether the MLP holds numeric gate/down multipliers (Falcon-H1's muP scaling)."""
    return all(
        isinstance(getattr(module, n, None), (int, float))
        and not isinstance(getattr(module, n), bool)
        for n in MULTIPLIERS
    )


def probe_mlp(module: nn.Module, fused: bool, scaled: bool = False) -> bool:
    """Whether the MLP computes down(act(gate(x)) * up(x)) (separate projections) or, with
    ``fused``, the same with gate and up the two halves of gate_up_proj(x), gate first; with
    ``scaled``, down(act(gate(x) * gate_multiplier) * up(x)) * down_multiplier.

    The probe is a shallow copy whose projections are small random Linears (a 70B MLP is
    never materialised); the module's own activation is used. Scaled, the copy's multipliers
    are set to values other than one, so the probe tells where each one goes whatever the
    checkpoint's are."""
    hidden, inner = 8, 12
    gen = torch.Generator().manual_seed(2)
    probe = _probe_shell(module)
    if fused:
        probe._modules["gate_up_proj"] = _small_linear(module.gate_up_proj, hidden, 2 * inner, gen)
    else:
        probe._modules["gate_proj"] = _small_linear(module.gate_proj, hidden, inner, gen)
        probe._modules["up_proj"] = _small_linear(module.up_proj, hidden, inner, gen)
    probe._modules["down_proj"] = _small_linear(module.down_proj, inner, hidden, gen)
    g = d = 1.0
    if scaled:
        g, d = probe.gate_multiplier, probe.down_multiplier = 0.7, 1.3
    act = activation_of(probe)
    x = torch.randn(2, 3, hidden, generator=gen)
    try:
        with torch.no_grad():
            out = probe(x)
            if fused:
                gate, up = probe.gate_up_proj(x).chunk(2, dim=-1)
            else:
                gate, up = probe.gate_proj(x), probe.up_proj(x)
            want = probe.down_proj(act(gate * g) * up) * d
    except Exception:  # noqa: BLE001 - a forward that needs more than x is not one of ours
        return False
    return _close(out if isinstance(out, torch.Tensor) else out[0], want, _FP32_RTOL)


def _unhooked(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` that runs its own forward and none of its hooks (the user's
    hooks must not see probe inputs)."""
    probe = copy.copy(module)
    probe._forward_hooks = type(module._forward_hooks)()
    probe._forward_pre_hooks = type(module._forward_pre_hooks)()
    probe.__dict__.pop("forward", None)  # a kernel bound earlier: probe the module's own forward
    return probe


def _probe_shell(module: nn.Module) -> nn.Module:
    """``_unhooked``, with the children in a dict of its own (the probe swaps some for small
    Linears without touching the module) and no parameters or buffers of its own."""
    probe = _unhooked(module)
    probe._modules = dict(module._modules)
    probe._parameters = {}
    probe._buffers = {}
    return probe


def _computes(act: nn.Module, reference, x: torch.Tensor) -> bool:
    """Whether a parameter-free module computes ``reference`` elementwise on ``x``, whatever
    its class is called."""
    if act._parameters or act._buffers or act._modules:
        return False
    try:
        with torch.no_grad():
            out = _unhooked(act)(x)
    except Exception:  # noqa: BLE001 - not a one-tensor elementwise module
        return False
    return isinstance(out, torch.Tensor) and _close(out, reference(x), _FP32_RTOL)


def computes_silu(act: nn.Module) -> bool:
    """x * sigmoid(x) (the gated layers' "silu" kind)."""
    return _computes(act, F.silu, torch.linspace(-5.0, 5.0, 101))


def computes_relu_squared(act: nn.Module) -> bool:
    """relu(x)^2 (transformers' ReLUSquaredActivation, Primer's squared ReLU), on values of
    both signs and 0, where relu bends."""
    return _computes(act, lambda x: torch.relu(x) ** 2, torch.linspace(-3.0, 3.0, 61))


def computes_relu(act: nn.Module) -> bool:
    """relu(x) (nn.ReLU, T5's "relu"), on values of both signs and 0."""
    return _computes(act, torch.relu, torch.linspace(-3.0, 3.0, 61))


class _Marker(nn.Module):
    """Stands in for a norm between the projections: an affine map no activation computes, so
    the probe sees where the forward calls it."""

    def forward(self, x):
        return x * 1.5 + 0.25


def probe_plain_mlp(module: nn.Module, first: str, second: str, norm: str | None = None) -> bool:
    """Whether the MLP computes second(act(first(x))) with its own activation, or with ``norm``
    second(norm(act(first(x)))): probed through a shallow copy whose two projections are small
    random Linears (as probe_mlp does) and whose norm is a marker map."""
    hidden, inner = 8, 12
    gen = torch.Generator().manual_seed(5)
    probe = _probe_shell(module)
    probe._modules[first] = _small_linear(module._modules[first], hidden, inner, gen)
    probe._modules[second] = _small_linear(module._modules[second], inner, hidden, gen)
    between = _Marker() if norm else nn.Identity()
    if norm:
        probe._modules[norm] = between
    for name in ACT_ATTRS:
        if isinstance(probe._modules.get(name), nn.Module):
            probe._modules[name] = _unhooked(probe._modules[name])
    act = activation_of(probe)
    x = torch.randn(2, 3, hidden, generator=gen)
    try:
        with torch.no_grad():
            out = probe(x)
            want = probe._modules[second](between(act(probe._modules[first](x))))
    except Exception:  # noqa: BLE001 - a forward that needs more than x is not one of ours
        return False
    return _close(out if isinstance(out, torch.Tensor) else out[0], want, _FP32_RTOL)


# -- rotary functions -------------------------------------------------------------------------

ROTARY_PARAMS = ("q", "k", "cos", "sin", "unsqueeze_dim")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_reference(q, k, cos, sin, unsqueeze_dim=1):
    """Rotate-half RoPE over the first cos.shape[-1] dims of each head; the rest passes."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    d = cos.shape[-1]

    def one(x):
        rot = x[..., :d] * cos + _rotate_half(x[..., :d]) * sin
        return torch.cat((rot, x[..., d:]), dim=-1) if d < x.shape[-1] else rot

    return one(q), one(k)


def _cos_sin(batch: int, seq: int, dim: int, gen: torch.Generator):
    freqs = torch.rand(batch, seq, dim // 2, generator=gen) * 3
    emb = torch.cat((freqs, freqs), dim=-1)  # what transformers' rotary embeddings return
    return emb.cos(), emb.sin()


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def interleaved_reference(q, k, cos, sin, unsqueeze_dim=1):
    """GPT-J-style RoPE: dims (2i, 2i+1) rotate as a pair by the cos/sin at those dims (cos
    already repeated per pair, as Cohere's rotary embedding returns it); dims past
    cos.shape[-1] pass."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    d = cos.shape[-1]

    def one(x):
        rot = x[..., :d] * cos + _rotate_pairs(x[..., :d]) * sin
        return torch.cat((rot, x[..., d:]), dim=-1) if d < x.shape[-1] else rot

    return one(q), one(k)


def half_interleaved_reference(q, k, cos, sin, unsqueeze_dim=1):
    """GLM-style: transformers' [f, f] cos/sin, whose first half is repeated per pair, then
    the interleaved rotation over cos.shape[-1] dims."""
    half = cos.shape[-1] // 2
    cos = cos[..., :half].repeat_interleave(2, dim=-1)
    sin = sin[..., :half].repeat_interleave(2, dim=-1)
    return interleaved_reference(q, k, cos, sin, unsqueeze_dim)


def half_cos_reference(q, k, cos, sin, unsqueeze_dim=1):
    """GPT-OSS-style: rotate-half with one cos/sin value per pair ([B, T, d/2], not repeated)."""
    return rotate_half_reference(
        q, k, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1), unsqueeze_dim
    )


# layer name -> the formula it computes (the kernel repo's layer classes of those names)
ROTARY_FORMULAS = {
    "rotary_pos_emb": rotate_half_reference,
    "half_rotary_pos_emb": half_cos_reference,
    "interleaved_rotary_pos_emb": interleaved_reference,
    "half_interleaved_rotary_pos_emb": half_interleaved_reference,
}


def _formula_fits(name: str, got, q, k, cos, sin) -> bool:
    try:
        want = ROTARY_FORMULAS[name](q, k, cos, sin)
    except RuntimeError:  # the formula does not take cos/sin of that width
        return False
    return all(_close(a, b, _FP32_RTOL) for a, b in zip(got, want, strict=False))


def complex_reference(q, k, freqs_cis, time_dim: int = 1):
    """Llama-4-style RoPE: each pair (2i, 2i+1) of a head is the complex number x_2i + i x_2i+1,
    multiplied by ``freqs_cis`` [B, T, d/2] (complex; any magnitude) in fp32, cast back.
    ``time_dim`` is where T sits in q and k: 1 for [B, T, H, D], 2 for [B, H, T, D]."""
    freqs = freqs_cis.unsqueeze(3 - time_dim)

    def one(x):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs).flatten(3).type_as(x)

    return one(q), one(k)


# layer name -> where T sits in q/k for complex (freqs_cis) rotary functions of (q, k, freqs)
COMPLEX_ROTARY_LAYOUTS = {"complex_rotary_emb": 1, "complex_rotary_emb_bhtd": 2}


def probe_complex_rotary(fn: Callable) -> tuple[str | None, str]:
    """(the complex-rotary layer computing what ``fn(q, k, freqs_cis)`` does, or None; the
    reason). Tried with q/k laid out [B, T, H, D] and [B, H, T, D] (T != H, so only the layout
    the function broadcasts over runs)."""
    gen = torch.Generator().manual_seed(4)
    b, t, h, d = 2, 5, 3, 16
    freqs = torch.polar(
        torch.rand(b, t, d // 2, generator=gen) + 0.5, torch.rand(b, t, d // 2, generator=gen) * 3
    )
    for layer, time_dim in COMPLEX_ROTARY_LAYOUTS.items():
        shape = (b, t, h, d) if time_dim == 1 else (b, h, t, d)
        q, k = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        try:
            with torch.no_grad():
                got = fn(q, k, freqs)
        except Exception:  # noqa: BLE001, S112 - not this layout
            continue
        want = complex_reference(q, k, freqs, time_dim)
        if isinstance(got, tuple) and all(
            _close(a, w, _FP32_RTOL) for a, w in zip(got, want, strict=False)
        ):
            return layer, ""
    return None, "takes complex freqs_cis but is not a pairwise complex rotation: no kernel layer"


def probe_rotary(fn: Callable) -> tuple[str | None, str]:
    """(the rotary layer computing what ``fn`` does, or None; the reason when None). ``fn``
    must have transformers' signature, or take (q, k, freqs_cis) (Llama 4, DeepSeek-V2); it is
    run at full and partial rotary width (a function that only takes full width is served at
    full width)."""
    try:
        names = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None, "its signature cannot be read"
    if len(names) == 3 and names[2] == "freqs_cis":
        return probe_complex_rotary(fn)
    if names != ROTARY_PARAMS:
        return None, f"takes ({', '.join(names)}), not (q, k, cos, sin, unsqueeze_dim)"
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 4, 5, 16, generator=gen), torch.randn(2, 2, 5, 16, generator=gen)
    fits, ran, failure = list(ROTARY_FORMULAS), 0, ""
    for width in (16, 8):  # as wide as the head, then half (partial rotary, or one per pair)
        cos, sin = _cos_sin(2, 5, width, gen)
        try:
            with torch.no_grad():
                got = fn(q, k, cos, sin)
        except Exception as exc:  # noqa: BLE001 - that width is not one the function takes
            failure = failure or f"failed on a probe input ({type(exc).__name__})"
            continue
        ran += 1
        fits = [name for name in fits if _formula_fits(name, got, q, k, cos, sin)]
    if not ran:
        return None, failure
    if not fits:
        return None, "neither rotate-half nor interleaved-pair RoPE: no kernel layer for it"
    return fits[0], ""


# -- fused-qkv attention ----------------------------------------------------------------------


def _eager_config(config: object) -> object:
    """A shallow copy of ``config`` that selects transformers' eager attention (the probe runs
    on the CPU, where flash kernels do not), leaving the model's config alone."""
    probe = copy.copy(config)
    probe.__dict__["_attn_implementation_internal"] = "eager"
    if getattr(probe, "_attn_implementation", None) != "eager":  # another transformers layout
        probe._attn_implementation = "eager"
    return probe


def qkv_attention_reference(
    x: torch.Tensor, qkv: nn.Module, out: nn.Module, head_dim: int, scaling: float, cos, sin
) -> torch.Tensor:
    """What FusedQKVAttention computes (no mask, no dropout): qkv(x) split into [q | k | v]
    blocks of heads, rotate-half RoPE over cos.shape[-1] dims of q and k, softmax attention
    with k/v heads shared by groups, then ``out``."""
    b, t = x.shape[:2]
    heads = out.weight.shape[1] // head_dim
    kv_heads = (qkv.weight.shape[0] - heads * head_dim) // (2 * head_dim)
    fused = qkv(x)
    q, k, v = fused.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), -1)
    q, k, v = (y.reshape(b, t, -1, head_dim).transpose(1, 2) for y in (q, k, v))
    q, k = rotate_half_reference(q, k, cos, sin)
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    weights = torch.softmax((q @ k.transpose(-1, -2)) * scaling, dim=-1)
    return out((weights @ v).transpose(1, 2).reshape(b, t, heads * head_dim))


def probe_qkv_attention(module: nn.Module, qkv_name: str, out_name: str) -> str:
    """ "" when the module's own forward computes ``qkv_attention_reference`` at full and half
    rotary width, else the one-line reason. Probed through a shallow copy: its head counts and
    head_dim, the model width cut to 8 (small random projections), eager attention, no mask."""
    hidden = 8
    gen = torch.Generator().manual_seed(6)
    probe = _probe_shell(module)
    probe.training = False  # no dropout
    width, q_width = (
        module._modules[qkv_name].weight.shape[0],
        module._modules[out_name].weight.shape[1],
    )
    qkv = probe._modules[qkv_name] = _small_linear(module._modules[qkv_name], hidden, width, gen)
    out = probe._modules[out_name] = _small_linear(module._modules[out_name], q_width, hidden, gen)
    probe.config = _eager_config(module.config)
    head_dim = module.head_dim
    x = torch.randn(2, 5, hidden, generator=gen)
    for rotary in dict.fromkeys((head_dim, head_dim // 2 // 2 * 2)):
        if rotary == 0:
            continue
        cos, sin = _cos_sin(2, 5, rotary, gen)
        reason = _forward_computes(
            lambda cos=cos, sin=sin: (
                probe(hidden_states=x, position_embeddings=(cos, sin), attention_mask=None),
                qkv_attention_reference(x, qkv, out, head_dim, module.scaling, cos, sin),
            ),
            "does not compute attention over [q | k | v] blocks with rotate-half RoPE",
        )
        if reason:
            return reason
    return ""


def _forward_computes(run: Callable[[], tuple], mismatch: str) -> str:
    """ "" when ``run()`` (the module's output, the reference's) agree to fp32 rounding without
    a gradient; else `mismatch`, or why the module's forward failed."""
    try:
        with torch.no_grad():
            got, want = run()
    except Exception as exc:  # noqa: BLE001 - a forward that needs more than these
        return f"its forward failed on a probe input ({type(exc).__name__})"
    got = got[0] if isinstance(got, tuple) else got
    ok = isinstance(got, torch.Tensor) and _close(got, want, _FP32_RTOL)
    return "" if ok else mismatch


# -- gated MLPs under other names -------------------------------------------------------------

# The gated layers' activations, by the name the layers read from ``kernels_mlp_activation``:
# an MLP that calls one inline (``F.silu(self.w1(x))``) holds no activation module to read.
GATED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": lambda x: F.gelu(x),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def gated_orders(module: nn.Module) -> list[tuple[str, str, str]]:
    """The (gate, up, down) child names a gated MLP could have: exactly three Linear children,
    two [inner, hidden] and one [hidden, inner], whatever they are called (LFM2's w1/w3/w2,
    T5's wi_0/wi_1/wo). Every assignment the shapes allow; the probe picks the one computed."""
    linears = {n: m.weight.shape for n, m in module._modules.items() if _plain_linear(m)}
    if len(linears) != 3:
        return []
    orders = []
    for down, shape in linears.items():
        ins = [n for n in linears if n != down]
        if all(linears[n] == shape[::-1] for n in ins):
            orders += [(ins[0], ins[1], down), (ins[1], ins[0], down)]
    return orders


def _plain_linear(m: object) -> bool:
    w = getattr(m, "weight", None)
    return (
        isinstance(m, nn.Module) and isinstance(w, torch.Tensor) and w.dim() == 2 and not m._modules
    )


def probe_gated_mlp(module: nn.Module, order: tuple[str, str, str]) -> str | None:
    """Which activation ("silu", "gelu", "gelu_tanh") makes the module's own forward compute
    down(act(gate(x)) * up(x)) with the children ``order`` names, or None. Probed through a
    shallow copy whose projections are small random Linears (gate and up told apart: act(a) * b
    is not act(b) * a). The output alone names the activation, whatever module computes it:
    the layers then read ``kernels_mlp_activation``, not the module."""
    hidden, inner = 8, 12
    gen = torch.Generator().manual_seed(9)
    probe = _probe_shell(module)
    gate, up, down = order
    for name, n_in, n_out in ((gate, hidden, inner), (up, hidden, inner), (down, inner, hidden)):
        probe._modules[name] = _small_linear(module._modules[name], n_in, n_out, gen)
    for name, child in module._modules.items():
        if isinstance(child, nn.Dropout):
            probe._modules[name] = nn.Identity()  # what it computes; the verdict says dropout
    x = torch.randn(2, 3, hidden, generator=gen)
    try:
        with torch.no_grad():
            out = probe(x)
    except Exception:  # noqa: BLE001 - a forward that needs more than x is not one of ours
        return None
    out = out if isinstance(out, torch.Tensor) else out[0]
    with torch.no_grad():
        g, u = probe._modules[gate](x), probe._modules[up](x)
        for kind, fn in GATED_ACTIVATIONS.items():
            if _close(out, probe._modules[down](fn(g) * u), _FP32_RTOL):
                return kind
    return None


# -- heads ------------------------------------------------------------------------------------


def computes_linear(head: nn.Module) -> bool:
    """Whether an ``nn.Linear`` subclass with a forward of its own computes
    ``F.linear(x, weight, bias)`` and nothing more (Idefics' decoupled head without extra
    vocabulary rows): no parameter or buffer but weight and bias, and the same output on random
    inputs with its own weights (random ones for meta weights)."""
    if not isinstance(head, nn.Linear):
        return False
    # a parameter or buffer beyond weight and bias takes part (Dory's learned per-token logit
    # scale, all ones at init, where the values alone would not show it)
    if {n for n, _ in head.named_parameters()} - {"weight", "bias"} or any(head.buffers()):
        return False
    probe = _materialized(head, 0) if head.weight.is_meta else head
    weight = probe.weight
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, probe.in_features, generator=gen).to(weight.device, weight.dtype)
    with torch.no_grad():
        try:
            out = type(probe).forward(probe, x)
        except Exception:  # noqa: BLE001 - a forward that cannot run here is not a Linear's
            return False
        want = F.linear(x, weight, probe.bias)
    return (
        isinstance(out, torch.Tensor)
        and out.shape == want.shape
        and torch.allclose(out.float(), want.float(), rtol=1e-5, atol=1e-6)
    )
