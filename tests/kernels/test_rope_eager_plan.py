"""RoPE's eager plan (rope.py, `_EagerPlan`): one plan per q/k/cos/sin layouts carries the
Triton-or-torch answer and the forward's rotate plans; the backward looks its plan up by the
tensors it holds. Each test makes consecutive calls that one plan serves, changing what no
plan may assume (the gradients' layouts, q's and k's layouts, cos/sin's dtype, the layout a
saved-tensor hook gives cos/sin, the interpreter switch), and checks every call against float64
on the Triton interpreter."""

from __future__ import annotations

import pytest
import torch
from _training_refs import assert_close, check_rope, rope64

# Shapes no other RoPE test uses, so these tests make their plans' first calls.
B, T, HQ, HK, D = 2, 7, 3, 1, 12


def _cos_sin(dtype=torch.float32, t=T, d=D):
    angles = torch.randn(B, t, d // 2) * 3
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _grad(layout: str, shape, unsqueeze_dim: int) -> torch.Tensor:
    """A gradient shaped like `shape` ([B, H, T, D] for unsqueeze_dim 1, else [B, T, H, D]) in
    one of three layouts: contiguous, the other dim order's transposed view, and head_dim
    strided (which the plan copies to a unit stride)."""
    if layout == "contiguous":
        return torch.randn(shape)
    if layout == "transposed":
        b, x, y, d = shape
        return torch.randn(b, y, x, d).transpose(1, 2)
    assert layout == "head_dim_strided"
    return torch.randn(*shape[:-1], 2 * shape[-1])[..., ::2]


def _check(kt, q, k, cos, sin, gq, gk, unsqueeze_dim, dtype=torch.float32):
    """The eager forward and backward of q, k (leaves) against float64."""
    qo, ko = kt.rope.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
    check_rope(q, k, cos, sin, qo, ko, unsqueeze_dim, dtype, grads=(gq, gk))


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_each_backward_runs_the_plan_of_its_gradients_layout(kt, unsqueeze_dim):
    """One forward plan, backwards whose gradients change layout from call to call (and come
    back): each must run the rotate plan of its own gradients' strides, not another call's."""
    qs = (B, HQ, T, D) if unsqueeze_dim == 1 else (B, T, HQ, D)
    ks = (B, HK, T, D) if unsqueeze_dim == 1 else (B, T, HK, D)
    cos, sin = _cos_sin()
    layouts = ["contiguous", "transposed", "transposed", "head_dim_strided", "contiguous"]
    for q_layout, k_layout in zip(layouts, layouts[1:] + layouts[:1], strict=True):
        q = torch.randn(qs).requires_grad_()
        k = torch.randn(ks).requires_grad_()
        gq, gk = _grad(q_layout, qs, unsqueeze_dim), _grad(k_layout, ks, unsqueeze_dim)
        _check(kt, q, k, cos, sin, gq, gk, unsqueeze_dim)


def test_each_forward_runs_the_plan_of_its_inputs_layout(kt):
    """Same shapes, a different q layout, k layout or cos/sin dtype per call: the eager plan is
    per layout and dtype, so none runs another's strides."""
    shape = (B, HQ, T, D)
    for layout, cos_dtype in [
        ("contiguous", torch.float32),
        ("transposed", torch.float32),
        ("contiguous", torch.float64),
        ("transposed", torch.float32),
    ]:
        q = _grad(layout, shape, 1).requires_grad_()
        k = _grad("transposed" if layout == "contiguous" else "contiguous", (B, HK, T, D), 1)
        k.requires_grad_()
        cos, sin = _cos_sin(cos_dtype)
        gq, gk = torch.randn(shape), torch.randn(B, HK, T, D)
        _check(kt, q, k, cos, sin, gq, gk, 1)


def test_the_interpreter_switch_is_read_on_every_call(kt, monkeypatch):
    """The plan keeps only the layout half of triton_supported: with TRITON_INTERPRET turned
    off for a later call of the same layouts, CPU tensors take the torch composite (new
    outputs), where the Triton path rotated q and k in their own memory."""
    cos, sin = _cos_sin()
    q, k = torch.randn(B, HQ, T, D), torch.randn(B, HK, T, D)
    qo, ko = kt.rope.apply_rotary_pos_emb(q, k, cos, sin)
    assert qo.data_ptr() == q.data_ptr() and ko.data_ptr() == k.data_ptr()  # in place
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k = torch.randn(B, HQ, T, D), torch.randn(B, HK, T, D)
    q_before, k_before = q.clone(), k.clone()
    qo, ko = kt.rope.apply_rotary_pos_emb(q, k, cos, sin)
    assert qo.data_ptr() != q.data_ptr() and torch.equal(q, q_before)
    assert ko.data_ptr() != k.data_ptr() and torch.equal(k, k_before)
    qr, kr = rope64(q.double(), k.double(), cos.double(), sin.double())
    assert_close(qo, qr, torch.float32, "q_embed")
    assert_close(ko, kr, torch.float32, "k_embed")


def test_a_saved_tensor_hook_that_changes_cos_layout_gets_its_own_backward(kt):
    """Activation offloading (``save_on_cpu``, or any pack hook that copies) hands the backward
    a contiguous cos/sin where the forward had a slice of a longer cache: the backward must
    rotate with the strides of the cos/sin it unpacks, not with a plan made for another call's.
    Alternating steps, as layers that share one cos but only some of which offload."""
    cache_c, cache_s = _cos_sin(t=T + 5)
    cos, sin = cache_c[:, :T], cache_s[:, :T]  # batch stride (T + 5) * D: not contiguous
    for step in range(4):
        q = torch.randn(B, HQ, T, D).requires_grad_()
        k = torch.randn(B, HK, T, D).requires_grad_()
        gq, gk = torch.randn(B, HQ, T, D), torch.randn(B, HK, T, D)
        if step % 2:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t.contiguous(), lambda t: t):
                _check(kt, q, k, cos, sin, gq, gk, 1)
        else:
            _check(kt, q, k, cos, sin, gq, gk, 1)


def test_forwards_alternating_cos_layout_and_q_dtype_each_get_their_plan(kt):
    """Same shapes call to call, but cos/sin sliced from a longer cache or not, and q and k in
    fp32 or bf16: the eager plan is per cos/sin strides (one made for another call's would read
    cos with the wrong batch stride: this fails when the key leaves them out). The dtype
    alternation is checked against float64 too, but cannot fail on a key without q's dtype: the
    launch specialises on the tensors' own dtypes, and the outputs take q's."""
    cache_c, cache_s = _cos_sin(t=T + 5)
    whole_c, whole_s = _cos_sin()
    for sliced, dtype in [(False, torch.float32), (True, torch.float32), (True, torch.bfloat16),
                          (False, torch.bfloat16), (False, torch.float32)]:  # fmt: skip
        cos, sin = (cache_c[:, :T], cache_s[:, :T]) if sliced else (whole_c, whole_s)
        q = torch.randn(B, HQ, T, D).to(dtype).requires_grad_()
        k = torch.randn(B, HK, T, D).to(dtype).requires_grad_()
        gq, gk = torch.randn(B, HQ, T, D), torch.randn(B, HK, T, D)
        _check(kt, q, k, cos, sin, gq, gk, 1, dtype)
