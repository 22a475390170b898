"""The structure classifier on modules of our own: what a module computes decides its layer,
not its name or the layer name it was given (no kernel repo needed: classify() alone)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from kernels.layers import use_kernel_forward_from_hub
from kernels.training import classify
from torch import nn


@pytest.fixture
def family():
    """A throwaway module standing in for a transformers modeling file."""
    module = types.ModuleType("tests_models_fake_family")
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


def _define(family, source: str) -> None:
    exec(compile(source, f"<{family.__name__}>", "exec"), family.__dict__)


class LlamaNorm(nn.Module):
    def __init__(self, n=32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


@use_kernel_forward_from_hub("RMSNorm")  # named like Llama's, computes Gemma's
class OffsetNorm(LlamaNorm):
    def forward(self, hidden_states):
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (x * (1.0 + self.weight.float())).type_as(hidden_states)


class EpsOutsideNorm(LlamaNorm):
    def forward(self, hidden_states):
        rms = hidden_states.pow(2).mean(-1, keepdim=True).sqrt()
        return self.weight * hidden_states / (rms + self.variance_epsilon)


class GatedMLP(nn.Module):
    def __init__(self, swap=False):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(32, 64), nn.Linear(32, 64)
        self.down_proj, self.act_fn, self.swap = nn.Linear(64, 32), nn.SiLU(), swap

    def forward(self, x):
        a, b = (
            (self.up_proj(x), self.gate_proj(x))
            if self.swap
            else (self.gate_proj(x), self.up_proj(x))
        )
        return self.down_proj(self.act_fn(a) * b)


def _verdicts(model):
    return {cls.__name__: v for cls, v in classify(model).classes.items()}


def test_norms_are_told_apart_by_what_they_compute():
    model = nn.Sequential(LlamaNorm(), OffsetNorm(), EpsOutsideNorm(), nn.LayerNorm(32))
    verdicts = _verdicts(model)
    assert verdicts["LlamaNorm"].layer == "RMSNorm"
    assert verdicts["OffsetNorm"].layer == "GemmaRMSNorm"
    assert verdicts["LayerNorm"].layer == "LayerNorm"
    assert verdicts["EpsOutsideNorm"].layer is None
    assert verdicts["EpsOutsideNorm"].reason.startswith("computes none of RMSNorm")


@pytest.fixture
def restore_marks():
    """Marking names classes process-wide; put these test classes back as they were."""
    attrs = ("kernel_layer_name", "kernel_condition", "_kernels_unserved")
    saved = {
        (c, a): c.__dict__[a]
        for c in (OffsetNorm, EpsOutsideNorm)
        for a in attrs
        if a in c.__dict__
    }
    yield
    for cls in (OffsetNorm, EpsOutsideNorm):
        for attr in attrs:
            if (cls, attr) in saved:
                setattr(cls, attr, saved[cls, attr])
            elif attr in cls.__dict__:
                delattr(cls, attr)


def test_marking_renames_a_misnamed_norm_and_the_report_names_the_unserved(restore_marks):
    model = nn.Sequential(OffsetNorm(), EpsOutsideNorm())
    classify(model).mark(model)
    assert OffsetNorm.kernel_layer_name == "GemmaRMSNorm"
    assert "computes none" in EpsOutsideNorm._kernels_unserved["norm"]


def test_a_gated_mlp_with_gate_and_up_swapped_is_not_bound():
    verdicts = _verdicts(nn.ModuleList([GatedMLP(), nn.ModuleList([GatedMLP(swap=True)])]))
    # one class, two behaviours: the first instance decides; check each on its own
    assert verdicts["GatedMLP"].layer == "SwiGLUMLP"
    swapped = _verdicts(nn.Sequential(GatedMLP(swap=True)))["GatedMLP"]
    assert swapped.layer is None and "does not compute down(act(gate(x)) * up(x))" in swapped.reason


_ATTENTION = """
import torch
from torch import nn

def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)

def rotate_pairs(x):
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)

def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    d = cos.shape[-1]
    qr = q[..., :d] * cos + rotate_half(q[..., :d]) * sin
    kr = k[..., :d] * cos + rotate_half(k[..., :d]) * sin
    return torch.cat((qr, q[..., d:]), -1), torch.cat((kr, k[..., d:]), -1)

def apply_rotary_pos_emb_pairs(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_pairs(q) * sin, k * cos + rotate_pairs(k) * sin

class PartialAttention(nn.Module):
    def forward(self, q, k, cos, sin):
        return apply_rotary_pos_emb(q, k, cos, sin)

def apply_rotary_pos_emb_inverse(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos - rotate_half(q) * sin, k * cos - rotate_half(k) * sin

class PairsAttention(nn.Module):
    def forward(self, q, k, cos, sin):
        return apply_rotary_pos_emb_pairs(q, k, cos, sin)

class InverseAttention(nn.Module):
    def forward(self, q, k, cos, sin):
        return apply_rotary_pos_emb_inverse(q, k, cos, sin)
"""


def test_undecorated_rotary_functions_are_found_probed_and_routed_per_caller(family):
    _define(family, _ATTENTION)
    original = family.apply_rotary_pos_emb
    model = nn.Sequential(
        family.PartialAttention(), family.PairsAttention(), family.InverseAttention()
    )
    plan = classify(model)
    uses = {u.owner.__name__: u.verdict for u in plan.rotary}
    assert uses["PartialAttention"].layer == "rotary_pos_emb"
    assert uses["PairsAttention"].layer == "interleaved_rotary_pos_emb"
    assert uses["InverseAttention"].layer is None
    assert "neither rotate-half nor interleaved" in uses["InverseAttention"].reason
    plan.mark(model)
    wrapped = family.apply_rotary_pos_emb
    assert wrapped is not original and wrapped.__wrapped__ is original
    assert model[0].__dict__["_kernel_funcs"]["rotary_pos_emb"] is wrapped
    assert "interleaved_rotary_pos_emb" in model[1].__dict__["_kernel_funcs"]
    assert family.InverseAttention._kernels_unserved["rotary"].startswith("neither")
    # unbound, the wrapper computes what the function did
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    cos, sin = torch.randn(1, 3, 4), torch.randn(1, 3, 4)
    for a, b in zip(model[0](q, k, cos, sin), original(q, k, cos, sin), strict=True):
        assert torch.equal(a, b)
    # new instances list it too
    assert "rotary_pos_emb" in family.PartialAttention().__dict__["_kernel_funcs"]


def test_experts_map_to_moe_experts_only_with_the_routed_forward():
    """qwen3_moe's experts take (hidden_states, top_k_index, top_k_weights): MoEExperts. Llama4's
    have the same 3-D weights but forward(hidden_states) over pre-sorted tokens: unbound."""
    from tests.models.registry import build

    for model_type, layer in (("qwen3_moe", "MoEExperts"), ("llama4_text", None)):
        plan = classify(build(model_type))
        (verdict,) = [v for c, v in plan.classes.items() if c.__name__.endswith("Experts")]
        assert (verdict.kind, verdict.layer) == ("experts", layer), model_type
        assert bool(verdict.reason) == (layer is None)


_COMPLEX_ROTARY = """
import torch
from torch import nn

def _pairs(x):
    return torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))

def apply_rotary_emb(xq, xk, freqs_cis):  # Llama 4: [B, T, H, D]
    f = freqs_cis[:, :, None, :]
    return (torch.view_as_real(_pairs(xq) * f).flatten(3).type_as(xq),
            torch.view_as_real(_pairs(xk) * f).flatten(3).type_as(xk))

class TimeFirstAttention(nn.Module):
    def forward(self, q, k, freqs):
        return apply_rotary_emb(q, k, freqs)
"""

# DeepSeek-V2 lays q/k out [B, H, T, D]; a conjugate product rotates the other way
_COMPLEX_VARIANTS = {
    "HeadsFirstAttention": "f = freqs_cis.unsqueeze(1)",
    "ConjugateAttention": "f = freqs_cis[:, :, None, :].conj()",
}


def test_complex_rotary_functions_are_told_apart_by_layout(family):
    source = _COMPLEX_ROTARY
    for owner, line in _COMPLEX_VARIANTS.items():
        fn = f"apply_rotary_emb_{owner.lower()}"
        source += (
            f"\ndef {fn}(xq, xk, freqs_cis):\n    {line}\n"
            "    return (torch.view_as_real(_pairs(xq) * f).flatten(3).type_as(xq),\n"
            "            torch.view_as_real(_pairs(xk) * f).flatten(3).type_as(xk))\n"
            f"\nclass {owner}(nn.Module):\n    def forward(self, q, k, freqs):\n"
            f"        return {fn}(q, k, freqs)\n"
        )
    _define(family, source)
    model = nn.Sequential(
        family.TimeFirstAttention(), family.HeadsFirstAttention(), family.ConjugateAttention()
    )
    uses = {u.owner.__name__: u.verdict for u in classify(model).rotary}
    assert uses["TimeFirstAttention"].layer == "complex_rotary_emb"
    assert uses["HeadsFirstAttention"].layer == "complex_rotary_emb_bhtd"
    assert uses["ConjugateAttention"].layer is None
    assert uses["ConjugateAttention"].reason.startswith("takes complex freqs_cis but is not")


class ScaledMLP(GatedMLP):
    """Falcon-H1's MLP: muP multipliers on the gate's input and the output."""

    def __init__(self, after_act=False):
        super().__init__()
        self.gate_multiplier, self.down_multiplier, self.after_act = 1.0, 1.0, after_act

    def forward(self, x):
        if self.after_act:  # the gate multiplier where the layer does not put it
            y = self.up_proj(x) * self.act_fn(self.gate_proj(x)) * self.gate_multiplier
        else:
            y = self.up_proj(x) * self.act_fn(self.gate_proj(x) * self.gate_multiplier)
        return self.down_proj(y) * self.down_multiplier


def test_an_mlp_with_multipliers_is_probed_with_multipliers_off_one():
    """With multipliers of one (a default config) both placements compute the same thing; the
    probe sets its own, so the verdict holds for any checkpoint's multipliers."""
    assert _verdicts(nn.Sequential(ScaledMLP()))["ScaledMLP"].layer == "ScaledSwiGLUMLP"
    after = _verdicts(nn.Sequential(ScaledMLP(after_act=True)))["ScaledMLP"]
    assert after.layer is None
    assert after.reason == "does not compute down(act(gate(x) * g) * up(x)) * d"


class _Decoder(nn.Module):
    def __init__(self, multiplier):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.lm_head_multiplier = multiplier

    def forward(self, input_ids):
        return self.embed(input_ids)


class MultipliedHeadForCausalLM(nn.Module):
    """Falcon-H1's head: the logits times a multiplier held by the decoder."""

    def __init__(self, multiplier):
        super().__init__()
        self.model, self.lm_head = _Decoder(multiplier), nn.Linear(4, 8, bias=False)

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        hidden_states = self.model(input_ids)
        logits = self.lm_head(hidden_states) * self.model.lm_head_multiplier
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=8, **kwargs)
        return loss, logits


def test_a_logit_multiplier_on_the_decoder_is_read_from_the_forward():
    verdict = _verdicts(MultipliedHeadForCausalLM(0.25))["MultipliedHeadForCausalLM"]
    assert verdict.layer == "ForCausalLM"
    ops = dict(verdict.attributes)["kernels_logit_ops"]
    assert ops == (("model", "model.lm_head_multiplier", "*"),)
    # a tensor multiplier (a learned scale) is not a constant the fused loss can fold in
    learned = MultipliedHeadForCausalLM(nn.Parameter(torch.tensor(0.25)))
    verdict = _verdicts(learned)["MultipliedHeadForCausalLM"]
    assert verdict.layer is None
    assert verdict.reason == "its model.lm_head_multiplier is a Parameter, not a number"
