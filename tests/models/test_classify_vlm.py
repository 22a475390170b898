"""The structure classifier on the vision-language models' own modules, built here under names
no family uses: what a module computes decides its layer (classify() alone, no kernel repo)."""

from __future__ import annotations

import torch
from kernels.training import classify
from torch import nn

# -- multimodal rotary embeddings ---------------------------------------------------------------


class SectionRotary(nn.Module):
    """A rotary embedding whose frequencies take the positions of three axes (time, height,
    width): cut into sections, or interleaved t h w t h w...; columns [f, f] or pairs."""

    def __init__(self, sections=(2, 3, 3), layout="chunked", pairs=False, reorder=False):
        super().__init__()
        half = sum(sections)
        self.register_buffer("inv_freq", 1.0 / (1000.0 ** (torch.arange(half) / half)))
        self.mrope_section = list(sections)
        self.attention_scaling = 0.9
        self.rope_type = "default"
        self.layout, self.pairs, self.reorder = layout, pairs, reorder

    def forward(self, x, position_ids):
        pos = position_ids.expand(3, -1, -1)
        freqs = pos[..., None].float() * self.inv_freq  # [3, B, T, half]
        if self.layout == "chunked":
            parts = freqs.split(self.mrope_section, -1)
            if self.reorder:  # h and w first, then t (an order no layout here has)
                freq = torch.cat([parts[1][1], parts[2][2], parts[0][0]], -1)
            else:
                freq = torch.cat([m[i % 3] for i, m in enumerate(parts)], -1)
        else:
            freq = freqs[0].clone()
            for axis in (1, 2):
                idx = slice(axis, 3 * self.mrope_section[axis], 3)
                freq[..., idx] = freqs[axis, ..., idx]
        emb = freq.repeat_interleave(2, -1) if self.pairs else torch.cat((freq, freq), -1)
        scale = self.attention_scaling
        return (emb.cos() * scale).to(x.dtype), (emb.sin() * scale).to(x.dtype)


class Holder(nn.Module):
    def __init__(self, *children):
        super().__init__()
        self.parts = nn.ModuleList(children)


def _verdict(module: nn.Module):
    return classify(Holder(module)).classes[type(module)]


def test_multimodal_rotary_layouts_are_told_apart_by_running_them():
    for layout, pairs, sections in (
        ("chunked", False, (2, 3, 3)),
        ("chunked", True, (4, 2, 2)),
        ("interleaved", False, (4, 2, 2)),
        ("interleaved", True, (2, 3, 3)),
    ):
        cls = type(f"Rotary_{layout}_{pairs}", (SectionRotary,), {})
        verdict = _verdict(cls(sections, layout, pairs))
        assert verdict.layer == "MultimodalRotaryEmbedding", (layout, pairs, verdict)
        assert dict(verdict.attributes)["kernels_mrope_layout"] == (layout, pairs)


def test_an_unknown_axis_order_keeps_its_forward_with_the_reason():
    verdict = _verdict(type("ReorderedRotary", (SectionRotary,), {})(reorder=True))
    assert verdict.layer is None
    assert verdict.reason == "assigns frequencies to position axes in an order no layout here knows"


def test_dynamic_rope_instances_keep_their_forward():
    verdict = _verdict(SectionRotary())
    dynamic = SectionRotary()
    dynamic.rope_type = "dynamic"
    assert verdict.condition(SectionRotary()) and not verdict.condition(dynamic)


# -- the vision towers' rotary function and GELU MLPs -------------------------------------------


def _rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def apply_rotary_pos_emb_patches(q, k, cos, sin):
    """[S, H, D] q and k, [S, D] cos/sin, in fp32 (named like no family's function)."""
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    qf, kf = q.float(), k.float()
    qo = qf * cos + _rotate_half(qf) * sin
    return qo.to(q.dtype), (kf * cos + _rotate_half(kf) * sin).to(k.dtype)


def apply_rotary_swapped(q, k, cos, sin):
    """Rotates the halves the other way: not rotate-half RoPE."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return q * cos - _rotate_half(q) * sin, k * cos - _rotate_half(k) * sin


class PatchAttention(nn.Module):
    rotary = staticmethod(apply_rotary_pos_emb_patches)

    def forward(self, q, k, cos, sin):
        return apply_rotary_pos_emb_patches(q, k, cos, sin)


class SwappedAttention(nn.Module):
    def forward(self, q, k, cos, sin):
        return apply_rotary_swapped(q, k, cos, sin)


def test_vision_rotary_functions_bind_by_what_they_compute():
    plan = classify(Holder(PatchAttention(), SwappedAttention()))
    uses = {u.owner.__name__: u.verdict for u in plan.rotary}
    assert uses["PatchAttention"].layer == "vision_rotary_pos_emb"
    assert uses["SwappedAttention"].layer is None
    assert "not rotate-half RoPE over [S, H, D]" in uses["SwappedAttention"].reason


class QuickGate(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class Softplus(nn.Module):
    def forward(self, x):
        return torch.nn.functional.softplus(x)


class TowerMLP(nn.Module):
    """fc_in -> act -> fc_out, child names no family uses, the output one declared first."""

    def __init__(self, act):
        super().__init__()
        self.fc_out = nn.Linear(96, 32)
        self.fc_in = nn.Linear(32, 96)
        self.activation_fn = act

    def forward(self, hidden_states):
        return self.fc_out(self.activation_fn(self.fc_in(hidden_states)))


def test_gelu_mlps_bind_with_the_gelu_they_compute():
    for act, kind in (
        (nn.GELU(), "gelu"),
        (nn.GELU(approximate="tanh"), "gelu_tanh"),
        (QuickGate(), "quick_gelu"),
    ):
        cls = type(f"TowerMLP_{kind}", (TowerMLP,), {})
        verdict = _verdict(cls(act))
        assert verdict.layer == "GELUMLP", (kind, verdict)
        attrs = dict(verdict.attributes)
        assert attrs["kernels_mlp_activation"] == kind
        assert attrs["kernels_mlp_projections"] == ("fc_in", "fc_out")


def test_a_non_gelu_activation_leaves_the_mlp_unbound():
    verdict = _verdict(type("SoftplusMLP", (TowerMLP,), {})(Softplus()))
    assert verdict.layer is None and verdict.reason.startswith("not gated")
