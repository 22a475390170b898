"""The variant folder follows the Hub kernel-repo rules that the loader and kernelize rely on."""

from __future__ import annotations

import ast
import inspect
import sys

import pytest
import torch
from conftest import VARIANT, load_variant

LAYERS = [
    "RMSNorm", "MemoryEfficientRMSNorm", "GemmaRMSNorm", "FusedAddRMSNorm", "rotary_pos_emb",
    "SiLU", "SwiGLUMLP", "GeGLUMLP", "LayerNorm",
]  # fmt: skip


def _add_norm_forward(self, hidden_states, residual):
    """The forward FusedAddRMSNorm is written for (as Liger's LigerFusedAddRMSNorm's)."""


def _replaced_forwards():
    from transformers.activations import SiLUActivation
    from transformers.models.gemma.modeling_gemma import GemmaMLP, GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm
    from transformers.models.qwen3 import modeling_qwen3

    rope = modeling_qwen3.apply_rotary_pos_emb
    rope_fn = rope if inspect.isfunction(rope) else type(rope).forward
    return {
        "RMSNorm": [modeling_qwen3.Qwen3RMSNorm.forward, LlamaRMSNorm.forward],
        "MemoryEfficientRMSNorm": [modeling_qwen3.Qwen3RMSNorm.forward, LlamaRMSNorm.forward],
        "GemmaRMSNorm": [GemmaRMSNorm.forward],
        "FusedAddRMSNorm": [_add_norm_forward],
        "rotary_pos_emb": [rope_fn],
        "SiLU": [SiLUActivation.forward],
        "SwiGLUMLP": [modeling_qwen3.Qwen3MLP.forward, LlamaMLP.forward],
        "GeGLUMLP": [GemmaMLP.forward],
        "LayerNorm": [torch.nn.LayerNorm.forward],
    }


def _kinds(fn, drop_self: bool):
    params = list(inspect.signature(fn).parameters.values())
    if drop_self:
        params = params[1:]
    return [(p.kind, p.default is not inspect.Parameter.empty) for p in params]


@pytest.mark.parametrize("name", LAYERS)
def test_layer_class_shape(kt, name):
    cls = getattr(kt.layers, name)
    assert issubclass(cls, torch.nn.Module)
    assert "__init__" not in vars(cls)
    members = {k for k in vars(cls) if not k.startswith("__")} - {"forward"}
    assert members <= {"has_backward", "can_torch_compile"}
    assert cls.has_backward is True and cls.can_torch_compile is True
    ours = _kinds(cls.forward, drop_self=True)
    for replaced in _replaced_forwards()[name]:
        is_method = "self" in inspect.signature(replaced).parameters
        assert ours == _kinds(replaced, drop_self=is_method), f"{name} vs {replaced.__qualname__}"


def test_only_relative_imports_of_the_variant():
    """The folder is imported under a content-derived name: no absolute self or `kernels` import."""
    siblings = {p.stem for p in VARIANT.glob("*.py")}
    for path in VARIANT.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module.split(".")[0]]
            else:
                continue
            bad = [n for n in names if n == "kernels" or n in siblings]
            assert not bad, f"{path.name}: absolute import of {bad}"


def test_two_builds_side_by_side_register_distinct_ops(kt):
    """The op namespace comes from the package name, so a second build registers its own ops."""
    other = load_variant("_kernels_training_other_build")
    ns_a = sys.modules[kt.__name__ + "._common"].NAMESPACE
    ns_b = sys.modules[other.__name__ + "._common"].NAMESPACE
    assert ns_a == kt.__name__.strip("_") and ns_b == "kernels_training_other_build"
    for ns in (ns_a, ns_b):
        assert hasattr(getattr(torch.ops, ns), "rms_norm_fwd")
    x, w = torch.randn(3, 8), torch.randn(8)
    torch.testing.assert_close(kt.rms_norm(x, w, 1e-6), other.rms_norm(x, w, 1e-6))
