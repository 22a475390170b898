"""Eager calls of the losses, the log-prob head and the gated MLP skip their torch.library ops.

The custom ops exist for torch.compile; called eagerly they cost host time per call on top of
the autograd.Function (dispatcher, the op's autograd wrapper, empty placeholder outputs;
scripts/probes/probe_host_cpu.py measures it). A forward and backward outside a trace must
dispatch no op of the kernel package's namespace.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _OpsSeen(TorchDispatchMode):
    """Records the namespace of every op dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.namespaces: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.namespaces.add(func.namespace)
        return func(*args, **(kwargs or {}))


def _mlp(kt):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

    mlp = Qwen3MLP(Qwen3Config(hidden_size=16, intermediate_size=32))
    return types.MethodType(kt.layers.SwiGLUMLP.forward, mlp), list(mlp.parameters())


def _calls(kt) -> dict:
    """name -> (a call returning one tensor to differentiate, the leaves)."""
    h = torch.randn(2, 5, 16, requires_grad=True)
    w = torch.randn(48, 16, requires_grad=True)
    labels = torch.randint(0, 48, (2, 5))
    logits = torch.randn(10, 48, requires_grad=True)
    mlp, mlp_params = _mlp(kt)
    loss_layers = sys.modules[kt.__name__ + ".loss_layers"]
    head_model = torch.nn.Module()
    head_model.lm_head = torch.nn.Linear(16, 48, bias=False)
    return {
        # a copy: the in-place kernel writes its gradient over the logits it is given
        "cross_entropy": (lambda: kt.cross_entropy(logits * 1, labels.reshape(-1)), [logits]),
        "fused_linear_cross_entropy": (
            lambda: kt.fused_linear_cross_entropy(h, w, labels),
            [h, w],
        ),
        "ForCausalLM loss head": (
            lambda: loss_layers.fused_causal_lm_loss(head_model, h, labels, None, {}),
            [h, head_model.lm_head.weight],
        ),
        "fused_linear_logprob": (
            lambda: kt.fused_linear_logprob(h, w, labels).log_probs.sum(),
            [h, w],
        ),
        "SwiGLUMLP": (lambda: mlp(h).sum(), [h, *mlp_params]),
    }


@pytest.mark.parametrize(
    "name",
    [
        "cross_entropy",
        "fused_linear_cross_entropy",
        "ForCausalLM loss head",
        "fused_linear_logprob",
        "SwiGLUMLP",
    ],
)
def test_eager_forward_and_backward_dispatch_no_custom_op(kt, name):
    namespace = sys.modules[kt.__name__ + "._common"].NAMESPACE
    fn, leaves = _calls(kt)[name]
    with _OpsSeen() as seen:
        out = fn()
        grads = torch.autograd.grad(out, leaves)
    assert all(g is not None for g in grads)
    assert "aten" in seen.namespaces  # the mode saw the call's ops
    assert namespace not in seen.namespaces, f"{name} went through the custom op in eager"
