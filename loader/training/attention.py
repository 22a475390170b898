"""Fused-qkv attention modules, recognised by structure: one Linear making [q | k | v] and one
output Linear, as Phi-3's ``qkv_proj`` / ``o_proj``.

A module is a candidate when its two Linear children fit together as a fused projection
[(Hq + 2 Hk) D, hidden] and an output projection [hidden, Hq D], with ``head_dim`` = D, in a
forward that calls transformers' attention functions. A candidate is served by the training
repo's ``FusedQKVAttention`` only if nothing else is in it (a q/k norm, an activation), its
forward takes (hidden_states, position_embeddings, attention_mask, cache, **kwargs), it hands
the attention function the dropout, scaling and sliding window the layer hands it, and a
numerical probe (probes.probe_qkv_attention) shows it computes split, rotate-half RoPE,
attention and output projection; otherwise the reason is reported.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

from torch import nn

from . import multimodal, probes

LAYER = "FusedQKVAttention"
# The vision towers' packed attention (the Qwen2-VL family's): segments of cu_seqlens.
VISION_LAYER = "VisionVarlenAttention"
_VISION_ARGS = ("hidden_states", "cu_seqlens", "position_embeddings", "max_seqlen")
# The class attribute the layer reads: (fused projection, output projection) child names.
QKV_PROJECTIONS = "kernels_qkv_projections"

_ARGS = ("hidden_states", "position_embeddings", "attention_mask")
# What the layer passes the attention function after (module, q, k, v, mask), as the family's
# forward must write it (compared as parsed code, so the formatting does not matter).
_CALL_KEYWORDS = {
    "dropout": "0.0 if not self.training else self.attention_dropout",
    "scaling": "self.scaling",
    "sliding_window": "getattr(self.config, 'sliding_window', None)",
    None: "kwargs",  # **kwargs
}


def _linears(module: nn.Module) -> dict[str, nn.Module]:
    return {
        n: m
        for n, m in module._modules.items()
        if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward
    }


def _projections(module: nn.Module) -> tuple[str, str] | None:
    """(fused qkv child, output child) when two Linear children fit the fused-qkv shapes."""
    head_dim = getattr(module, "head_dim", None)
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0:
        return None
    linears = _linears(module)
    if len(linears) != 2:  # separate q/k/v projections (a gated q among them) are no fused qkv
        return None
    for qkv_name, qkv in linears.items():
        for out_name, out in linears.items():
            width, hidden = qkv.weight.shape
            out_hidden, q_width = out.weight.shape
            kv = width - q_width
            if (
                qkv is not out
                and hidden == out_hidden
                and q_width % head_dim == 0
                and kv > 0
                and kv % (2 * head_dim) == 0
            ):
                return qkv_name, out_name
    return None


def _calls_attention_functions(cls: type) -> bool:
    forward = inspect.unwrap(cls.forward)
    code = getattr(forward, "__code__", None)
    if code is None:
        return False
    names = set(code.co_names)
    namespace = forward.__globals__
    return (
        "ALL_ATTENTION_FUNCTIONS" in names
        and "ALL_ATTENTION_FUNCTIONS" in namespace
        and "eager_attention_forward" in namespace
    )


def _signature_problem(cls: type) -> str:
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return "its forward's signature cannot be read"
    names = tuple(p.name for p in params)
    kinds_ok = all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params[:-1]) and (
        bool(params) and params[-1].kind is params[-1].VAR_KEYWORD
    )
    if (
        not kinds_ok
        or len(names) != 5
        or names[:3] != _ARGS
        or names[3] not in ("cache", "past_key_values")
    ):
        return (
            f"forward takes ({', '.join(names)}), not "
            "(hidden_states, position_embeddings, attention_mask, cache, **kwargs)"
        )
    return ""


def _is_packed_vision(cls: type) -> bool:
    """forward(hidden_states, cu_seqlens, position_embeddings, max_seqlen, **kwargs)."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    # the names match only with a fifth parameter after them, so params[-1] exists
    return (
        tuple(p.name for p in params[:-1]) == _VISION_ARGS
        and params[-1].kind is params[-1].VAR_KEYWORD
    )


def _attribute_problem(module: nn.Module) -> str:
    for name in ("scaling", "attention_dropout"):
        value = getattr(module, name, None)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"no numeric {name} attribute"
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return "no config._attn_implementation"
    return ""


def _passes_the_layers_arguments(source: str) -> bool:
    """Whether the forward makes exactly one call with a ``scaling=`` keyword (the attention
    function's), with five positional arguments and the keywords the layer passes."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return False
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and any(k.arg == "scaling" for k in node.keywords)
    ]
    if len(calls) != 1 or len(calls[0].args) != 5:
        return False
    keywords = {k.arg: ast.unparse(k.value) for k in calls[0].keywords}
    return keywords == _CALL_KEYWORDS


def qkv_attention_verdict(module: nn.Module) -> tuple[str | None, str, tuple] | None:
    """None when ``module`` is no fused-qkv attention at all; else (the layer or None, the
    reason when None, the class attributes the layer reads). A vision tower's packed attention
    (forward(hidden_states, cu_seqlens, position_embeddings, max_seqlen, **kwargs)) is probed
    for VisionVarlenAttention instead."""
    cls = type(module)
    pair = _projections(module)
    if pair is None or not _calls_attention_functions(cls):
        return None
    others = sorted(set(module._modules) - set(pair))
    if others:
        return None, f"holds more than its two projections: {', '.join(others)}", ()
    if _is_packed_vision(cls):
        heads = getattr(module, "num_heads", None)
        problem = _attribute_problem(module)
        if not problem and (not isinstance(heads, int) or isinstance(heads, bool)):
            problem = "no integer num_heads attribute"
        reason = problem or multimodal.probe_vision_attention(module, *pair)
        if reason:
            return None, reason, ()
        return VISION_LAYER, "", ((QKV_PROJECTIONS, pair),)
    problem = _signature_problem(cls) or _attribute_problem(module)
    if problem:
        return None, problem, ()
    try:
        source = inspect.getsource(inspect.unwrap(cls.forward))
    except (OSError, TypeError):
        return None, "its forward's source cannot be read", ()
    if not _passes_the_layers_arguments(source):
        return (
            None,
            "hands its attention function other arguments than (dropout, scaling, sliding_window)",
            (),
        )
    reason = probes.probe_qkv_attention(module, *pair)
    if reason:
        return None, reason, ()
    return LAYER, "", ((QKV_PROJECTIONS, pair),)
