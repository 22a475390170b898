"""What the vision-language models' own modules compute, told apart by running them: the
multimodal rotary embedding (which position axis each frequency takes), the vision towers'
rotary function and packed attention, and the non-gated GELU MLP's activation.

Like probes.py, each probe runs the module's (or function's) own forward on small random CPU
inputs next to the formula of the kernel layer that could serve it; nothing is read from a
family's name.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable

import torch
from torch import nn

from .probes import (
    _close,
    _cos_sin,
    _eager_config,
    _forward_computes,
    _probe_shell,
    _small_linear,
    _unhooked,
    rotate_half_reference,
)

# -- the multimodal rotary embedding ----------------------------------------------------------

MROPE_LAYOUTS = (
    ("chunked", False),
    ("chunked", True),
    ("interleaved", False),
    ("interleaved", True),
)


def frequency_axes(sections: list[int], layout: str) -> torch.Tensor:
    """Which position axis (0 time, 1 height, 2 width) each rotary frequency takes: in
    ``chunked`` sections, section k's frequencies take axis k % 3; ``interleaved`` (Qwen3-VL),
    frequency i takes axis i % 3 while i < 3 * that axis's section, else axis 0."""
    half = sum(sections)
    if layout == "chunked":
        owners = torch.arange(len(sections)) % 3
        return torch.repeat_interleave(owners, torch.tensor(sections))
    i = torch.arange(half)
    axes = i % 3
    limit = 3 * torch.tensor([half, sections[1], sections[2]])[axes]
    return torch.where((axes > 0) & (i < limit), axes, 0)


def mrope_reference(position_ids, inv_freq, sections, layout, pairs, scaling):
    """cos, sin [B, T, D] as the kernel layer computes them (fp32 angles)."""
    pos = position_ids.expand(3, -1, -1) if position_ids.dim() == 2 else position_ids
    angles = pos[..., None].float() * inv_freq.float()  # [3, B, T, D/2]
    axes = frequency_axes(sections, layout)
    picked = angles.gather(0, axes.view(1, 1, 1, -1).expand(1, *angles.shape[1:])).squeeze(0)
    cols = picked.repeat_interleave(2, -1) if pairs else torch.cat((picked, picked), -1)
    return cols.cos() * scaling, cols.sin() * scaling


def _two_inputs(cls: type) -> bool:
    try:
        params = list(inspect.signature(cls.forward).parameters)[1:]
    except (TypeError, ValueError):
        return False
    return params == ["x", "position_ids"]


def is_multimodal_rotary(module: nn.Module) -> bool:
    """A rotary embedding with sections of frequencies per position axis: an inv_freq buffer,
    an int list ``mrope_section``; any forward (probe_mrope tells whether it is one we serve)."""
    sections = getattr(module, "mrope_section", None)
    inv = module._buffers.get("inv_freq")
    return (
        isinstance(sections, list)
        and bool(sections)
        and all(isinstance(s, int) for s in sections)
        and isinstance(inv, torch.Tensor)
        and inv.dim() == 1
    )


def probe_mrope(module: nn.Module) -> tuple[tuple[str, bool] | None, str]:
    """((layout, pairs) of the module's cos/sin, or None; the reason when None). Run on random
    positions per axis, so each frequency's axis shows."""
    if not _two_inputs(type(module)):
        return None, "forward is not (x, position_ids)"
    sections = list(module.mrope_section)
    half = module._buffers["inv_freq"].numel()
    if sum(sections) != half:
        return None, f"sections {sections} do not cover its {half} frequencies"
    # Stand-in frequencies (distinct, so each column's axis and frequency show; a meta model's
    # buffer has no values): the probe asks how the forward composes them, not what they are.
    probe = _unhooked(module)
    probe._buffers = dict(module._buffers)
    inv = probe._buffers["inv_freq"] = 1.0 / (100.0 ** (torch.arange(half) / half))
    gen = torch.Generator().manual_seed(7)
    pos = torch.randint(0, 512, (3, 2, 5), generator=gen)
    scaling = float(getattr(module, "attention_scaling", 1.0))
    try:
        with torch.no_grad():
            cos, sin = probe(torch.zeros(1, dtype=torch.float32), pos)
    except Exception as exc:  # noqa: BLE001 - not the forward we know
        return None, f"its forward failed on probe positions ({type(exc).__name__})"
    layouts = MROPE_LAYOUTS if len(sections) == 3 else MROPE_LAYOUTS[:2]
    for layout, pairs in layouts:
        want = mrope_reference(pos, inv, sections, layout, pairs, scaling)
        if all(_close(g, w, 1e-5) for g, w in zip((cos, sin), want, strict=True)):
            return (layout, pairs), ""
    return None, "assigns frequencies to position axes in an order no layout here knows"


def dynamic_rope(module: nn.Module) -> bool:
    """Whether its forward updates inv_freq as it goes (dynamic and long-RoPE scaling)."""
    kind = getattr(module, "rope_type", "default")
    return not isinstance(kind, str) or "dynamic" in kind or "longrope" in kind


# -- the vision towers' rotary function -------------------------------------------------------

VISION_ROTARY_PARAMS = ("q", "k", "cos", "sin")


def vision_rotary_reference(q, k, cos, sin):
    """q, k [S, H, D], cos/sin [S, D]: rotate-half in fp32, each rounded to its dtype."""
    qo, ko = rotate_half_reference(q.float(), k.float(), cos.float(), sin.float(), -2)
    return qo.to(q.dtype), ko.to(k.dtype)


def probe_vision_rotary(fn: Callable) -> tuple[str | None, str]:
    """("vision_rotary_pos_emb", "") when ``fn(q, k, cos, sin)`` rotates q, k [S, H, D] by
    cos/sin [S, D] (rotate-half, every dim), else (None, the reason)."""
    gen = torch.Generator().manual_seed(8)
    s, h, d = 6, 3, 16
    q, k = torch.randn(s, h, d, generator=gen), torch.randn(s, h, d, generator=gen)
    cos, sin = (t[0] for t in _cos_sin(1, s, d, gen))
    try:
        with torch.no_grad():
            got = fn(q, k, cos, sin)
    except Exception as exc:  # noqa: BLE001 - not this layout
        return None, f"takes (q, k, cos, sin) but fails on [S, H, D] inputs ({type(exc).__name__})"
    want = vision_rotary_reference(q, k, cos, sin)
    if isinstance(got, tuple) and all(_close(a, b, 1e-4) for a, b in zip(got, want, strict=False)):
        return "vision_rotary_pos_emb", ""
    return None, "takes (q, k, cos, sin) but is not rotate-half RoPE over [S, H, D]"


# -- the non-gated MLP's GELU -----------------------------------------------------------------

GELU_FORMULAS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": lambda x: 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0))),
    "gelu_tanh": lambda x: (
        0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    ),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


def gelu_kind(act: nn.Module) -> str | None:
    """Which GELU a parameter-free activation module computes ("gelu" with erf, "gelu_tanh",
    "quick_gelu"), whatever its class is called; None for any other function. Told apart on
    [-5, 5], where the three differ by far more than fp32 rounding."""
    if act._parameters or act._buffers or act._modules:
        return None
    probe = _unhooked(copy.copy(act))
    x = torch.linspace(-5.0, 5.0, 201, dtype=torch.float64)
    try:
        with torch.no_grad():
            out = probe(x.float())
    except Exception:  # noqa: BLE001 - not an elementwise module
        return None
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        return None
    for name, formula in GELU_FORMULAS.items():
        if (out.double() - formula(x)).abs().max() <= 1e-5:
            return name
    return None


# -- the vision towers' packed attention ------------------------------------------------------


def vision_attention_reference(x, qkv, out, heads: int, scaling: float, cu_seqlens, cos, sin):
    """What VisionVarlenAttention computes (no dropout): qkv(x) [S, 3, heads, D] split, q and k
    rotated (rotate-half, cos/sin [S, D], in fp32), softmax attention within each
    ``cu_seqlens`` segment, then ``out``."""
    s = x.shape[0]
    q, k, v = qkv(x).reshape(s, 3, heads, -1).permute(1, 0, 2, 3).unbind(0)
    q, k = vision_rotary_reference(q, k, cos, sin)
    pieces = []
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))  # [H, L, D]
        weights = torch.softmax((qs @ ks.transpose(-1, -2)) * scaling, dim=-1)
        pieces.append((weights @ vs).transpose(0, 1))
    return out(torch.cat(pieces).reshape(s, -1))


def probe_vision_attention(module: nn.Module, qkv_name: str, out_name: str) -> str:
    """ "" when the module's own forward computes ``vision_attention_reference``, else the
    one-line reason. Probed through a shallow copy: 2 heads of 4, projections cut to width 8,
    eager attention, three segments of unequal lengths."""
    heads, head_dim = 2, 4
    width = heads * head_dim
    gen = torch.Generator().manual_seed(7)
    probe = _probe_shell(module)
    probe.training = False  # no dropout
    probe.num_heads, probe.head_dim = heads, head_dim
    probe.scaling = head_dim**-0.5
    qkv = probe._modules[qkv_name] = _small_linear(module._modules[qkv_name], width, 3 * width, gen)
    out = probe._modules[out_name] = _small_linear(module._modules[out_name], width, width, gen)
    probe.config = _eager_config(module.config)
    x = torch.randn(11, width, generator=gen)
    cu_seqlens = torch.tensor([0, 4, 8, 11], dtype=torch.int32)
    cos, sin = (t[0] for t in _cos_sin(1, 11, head_dim, gen))
    return _forward_computes(
        lambda: (
            probe(x, cu_seqlens=cu_seqlens, position_embeddings=(cos, sin)),
            vision_attention_reference(x, qkv, out, heads, probe.scaling, cu_seqlens, cos, sin),
        ),
        "does not compute rotate-half attention within each cu_seqlens segment",
    )
