"""Fused-qkv attention told apart by structure and by what it computes (classify() alone, no
kernel repo): Phi-3's attention binds FusedQKVAttention; variants the layer would get wrong
keep their forward with a one-line reason."""

from __future__ import annotations

import linecache
import sys
import types

import pytest
from kernels.training import classify


@pytest.fixture
def family():
    """A throwaway modeling file: Phi-3's globals, attention classes defined in it."""
    import transformers.models.phi3.modeling_phi3 as phi3

    module = types.ModuleType("tests_models_fake_qkv_family")
    module.__dict__.update({k: v for k, v in vars(phi3).items() if not k.startswith("__")})
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


def _config():
    from transformers import Phi3Config

    config = Phi3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    return config


def _verdict(attention_cls):
    from torch import nn

    holder = nn.Module()  # the top module is classified as the model's head
    holder.self_attn = attention_cls(_config(), layer_idx=0)
    return classify(holder).classes[attention_cls]


# Phi-3's forward, with {split} and {call} swapped in by each variant.
_FORWARD = """
class Variant(Phi3Attention):
    def forward(self, hidden_states, position_embeddings, attention_mask, {params}, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        qkv = self.qkv_proj(hidden_states)
{split}
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            {call},
            sliding_window=getattr(self.config, "sliding_window", None),
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights
"""
_BLOCKS = """\
        q_end = self.config.num_attention_heads * self.head_dim
        k_end = q_end + self.num_key_value_heads * self.head_dim
        query_states = qkv[..., :q_end].view(hidden_shape).transpose(1, 2)
        key_states = qkv[..., q_end:k_end].view(hidden_shape).transpose(1, 2)
        value_states = qkv[..., k_end:].view(hidden_shape).transpose(1, 2)"""
# [k | q | v]: the same shapes, another layout
_SWAPPED = (
    _BLOCKS.replace("qkv[..., :q_end]", "QQ")
    .replace("qkv[..., q_end:k_end]", "qkv[..., :k_end - q_end]")
    .replace("QQ", "qkv[..., k_end - q_end:k_end]")
)


def _variant(family, split=_BLOCKS, call="scaling=self.scaling", params="cache=None"):
    source = _FORWARD.format(split=split, call=call, params=params)
    filename = f"<{family.__name__}-{len(linecache.cache)}>"
    # the classifier reads the forward's source, as it does a modeling file's
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), family.__dict__)
    return family.Variant


def test_phi3_attention_binds_the_fused_qkv_layer():
    from transformers.models.phi3.modeling_phi3 import Phi3Attention

    verdict = _verdict(Phi3Attention)
    assert verdict.layer == "FusedQKVAttention", verdict
    assert dict(verdict.attributes)["kernels_qkv_projections"] == ("qkv_proj", "o_proj")


def test_the_same_forward_written_out_binds(family):
    assert _verdict(_variant(family)).layer == "FusedQKVAttention"


def test_another_block_order_is_not_bound(family):
    verdict = _verdict(_variant(family, split=_SWAPPED))
    assert verdict.layer is None
    assert (
        verdict.reason == "does not compute attention over [q | k | v] blocks with rotate-half RoPE"
    )


def test_a_qk_norm_is_not_bound(family):
    from torch import nn

    cls = _variant(family)

    class WithNorm(cls):
        def __init__(self, config, layer_idx=None):
            super().__init__(config, layer_idx)
            self.q_norm = nn.LayerNorm(self.head_dim)

    verdict = _verdict(WithNorm)
    assert verdict.layer is None
    assert verdict.reason == "holds more than its two projections: q_norm"


def test_other_attention_arguments_are_not_bound(family):
    verdict = _verdict(_variant(family, call="scaling=self.scaling, softcap=30.0"))
    assert verdict.layer is None
    assert verdict.reason == (
        "hands its attention function other arguments than (dropout, scaling, sliding_window)"
    )
    verdict = _verdict(_variant(family, call="scaling=2 * self.scaling"))
    assert verdict.layer is None


def test_another_signature_is_not_bound(family):
    verdict = _verdict(_variant(family, params="position_ids, cache=None"))
    assert verdict.layer is None
    assert verdict.reason.startswith(
        "forward takes (hidden_states, position_embeddings, attention_mask, position_ids"
    )


def test_a_probe_does_not_touch_the_model():
    """The probe runs a copy with small random projections and eager attention."""
    from torch import nn
    from transformers.models.phi3.modeling_phi3 import Phi3Attention

    holder = nn.Module()
    module = holder.self_attn = Phi3Attention(_config(), layer_idx=0)
    before = {n: p.clone() for n, p in module.named_parameters()}
    assert classify(holder).classes[Phi3Attention].layer == "FusedQKVAttention"
    assert module.config._attn_implementation == "sdpa"
    assert all((p == before[n]).all() for n, p in module.named_parameters())


@pytest.fixture
def mirror(hub):
    from pathlib import Path

    hub.build(Path(__file__).resolve().parents[2] / "hub_kernels")
    return hub


@pytest.mark.parametrize("rotary", [1.0, 0.5], ids=["full", "partial"])
def test_phi3_sweep_binds_the_attention_and_matches(mirror, rotary):
    """The sweep's 3 AdamW steps (torch ops on the CPU: the layer's own path without Triton)."""
    from .registry import run_one

    overrides = None if rotary == 1.0 else {"rope_parameters": {"partial_rotary_factor": rotary}}
    outcome = run_one("phi3", overrides=overrides)
    assert outcome.status == "match", outcome
    assert outcome.classes["Phi3Attention"] == "FusedQKVAttention", outcome
