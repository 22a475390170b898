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


def _grads_of(out, *inputs):
    outs = out if isinstance(out, tuple) else (out,)
    return torch.autograd.grad(outs, inputs, [torch.randn_like(o) for o in outs])


def _rope_call(kt, x, w):
    q, k = x.view(2, 4, 3, 16), (x * 2).view(2, 4, 3, 16)
    return _grads_of(kt.apply_rotary_pos_emb(q, k, w[:48].view(1, 3, 16), w[:48].view(1, 3, 16)), x)


# op -> (call on x [8, 48] and w [48], both requiring grad; the Triton kernels it must launch)
_OPS = {
    "rms_norm": (
        lambda kt, x, w: _grads_of(kt.rms_norm(x, w, 1e-6), x, w),
        {"_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel", "_column_sum_kernel"},
    ),
    "fused_add_rms_norm": (
        lambda kt, x, w: _grads_of(kt.fused_add_rms_norm(x, x * 0.5, w, 1e-6), x, w),
        {"_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel", "_column_sum_kernel"},
    ),
    "layer_norm": (
        lambda kt, x, w: _grads_of(kt.layer_norm(x, w, w * 0.1, 1e-5), x, w),
        {"_layer_norm_fwd_kernel", "_layer_norm_bwd_kernel"},
    ),
    "rope": (_rope_call, {"_rope_kernel"}),
    "silu_mul": (
        lambda kt, x, w: _grads_of(kt.silu_mul(x, x * w), x),
        {"_glu_fwd_kernel", "_glu_bwd_kernel"},
    ),
    "gelu_mul": (
        lambda kt, x, w: _grads_of(kt.gelu_mul(x, x * w), x),
        {"_glu_fwd_kernel", "_glu_bwd_kernel"},
    ),
    "silu": (lambda kt, x, w: _grads_of(kt.silu(x), x), {"_act_fwd_kernel", "_act_bwd_kernel"}),
    "cross_entropy": (
        lambda kt, x, w: _grads_of(kt.cross_entropy(x, torch.arange(8) % 48), x),
        {"_ce_lean_kernel"},  # the default; class weights or predicted tokens: _ce_fwd_kernel
    ),
    "fused_linear_cross_entropy": (
        lambda kt, x, w: _grads_of(
            kt.fused_linear_cross_entropy(x, w.view(1, 48).expand(40, 48) * 0.1, torch.arange(8)),
            x,
        ),
        {"_ce_lean_kernel"},
    ),
}


@pytest.mark.parametrize("op", list(_OPS))
def test_every_op_launches_its_triton_kernels(kt, op):
    """Value checks cannot tell the Triton path from the torch fallback (same formulas): this
    records the kernel launches themselves, so a dispatch that skips Triton fails here."""
    from tests.gpu.launches import TritonLaunches

    call, expected = _OPS[op]
    modules = [m for name, m in sys.modules.items() if name.startswith(kt.__name__ + ".")]
    x = torch.randn(8, 48, requires_grad=True)
    w = (torch.rand(48) + 0.5).requires_grad_()
    with TritonLaunches(*modules) as launches:
        call(kt, x, w)
    assert expected <= set(launches.counts()), dict(launches.counts())


def test_gpu_tests_skip_in_a_run_that_switches_the_interpreter_on():
    """A run that collects tests/gpu before tests/kernels (as the whole suite does) leaves the GPU
    tests out with the interpreter's reason, one line for the folder (tests/gpu/conftest.py),
    instead of running them through Triton's CPU interpreter, and a test outside tests/kernels
    runs the kernels' torch path (tests/conftest.py). Checked in a fresh process that starts with
    the interpreter off."""
    import os
    import subprocess

    root = VARIANT.parents[4]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    gpu = "tests/gpu/test_losses_gpu.py"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", gpu,
         "tests/kernels/test_package.py::test_only_relative_imports_of_the_variant",
         "tests/test_suite_hygiene.py::test_kernels_take_their_torch_path_outside_tests_kernels"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("tests/gpu:")]
    assert len(lines) == 1 and "tests skipped: TRITON_INTERPRET is on" in lines[0], out.stdout
    assert "2 passed" in out.stdout and "skipped" in out.stdout
