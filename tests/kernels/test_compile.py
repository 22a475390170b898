"""torch.compile(fullgraph=True) over the ops: no graph breaks, same values and gradients.

The ops are torch.library custom ops with fake and autograd registrations. On the CPU the
compiled graph calls them opaquely, so their Triton kernels still run in the interpreter; the
``aot_eager`` backend traces forward and backward through Dynamo and AOTAutograd (what decides
graph breaks) without generating C++ for the surrounding graph.
"""

from __future__ import annotations

import pytest
import torch


def _grads(fn, *inputs):
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    loss = sum((o.float() * (i + 1)).sum() for i, o in enumerate(outs))
    grads = torch.autograd.grad(loss, [t for t in inputs if t.requires_grad])
    return outs, grads


def _cases(kt):
    x = torch.randn(6, 40, requires_grad=True)
    w = torch.randn(40, requires_grad=True)
    bias = torch.randn(40, requires_grad=True)
    a, b = torch.randn(5, 24, requires_grad=True), torch.randn(5, 24, requires_grad=True)
    q = torch.randn(2, 3, 4, 16).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 3, 2, 16).transpose(1, 2).requires_grad_()
    cos, sin = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    return {
        "rms_norm": (lambda x, w: kt.rms_norm(x, w, 1e-6), (x, w)),
        "gemma_rms_norm": (lambda x, w: kt.rms_norm(x, w, 1e-6, gemma=True), (x, w)),
        "rms_norm_save_output": (
            lambda x, w: kt.rms_norm(x, w, 1e-6, save_output=True),
            (x, (torch.rand(40) + 0.5).requires_grad_()),
        ),
        "fused_add_rms_norm": (
            lambda x, r, w: kt.fused_add_rms_norm(x, r, w, 1e-6),
            (x, torch.randn(6, 40, requires_grad=True), w),
        ),
        "layer_norm": (lambda x, w, b: kt.layer_norm(x, w, b, 1e-5), (x, w, bias)),
        "silu_mul": (kt.silu_mul, (a, b)),
        "gelu_mul": (kt.gelu_mul, (a, b)),
        "silu": (kt.silu, (a,)),
        "glu_halves": (
            lambda gu: kt.layers.glu_halves(gu * 1, kt.layers.SILU, in_place=True),
            (torch.randn(5, 48, requires_grad=True),),
        ),
        "rope": (lambda q, k: kt.apply_rotary_pos_emb(q, k, cos, sin), (q, k)),
    }


@pytest.mark.parametrize(
    "op",
    [
        "rms_norm",
        "gemma_rms_norm",
        "rms_norm_save_output",
        "fused_add_rms_norm",
        "layer_norm",
        "silu_mul",
        "gelu_mul",
        "silu",
        "glu_halves",
        "rope",
    ],
)
def test_fullgraph_compile_matches_eager(kt, op):
    torch._dynamo.reset()
    fn, inputs = _cases(kt)[op]
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    outs_c, grads_c = _grads(compiled, *inputs)
    outs_e, grads_e = _grads(fn, *inputs)
    for c, e in zip(outs_c + grads_c, outs_e + grads_e, strict=True):
        torch.testing.assert_close(c, e, rtol=0, atol=0)
