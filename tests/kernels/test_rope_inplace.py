"""RoPE in place: the forward writes the rotation over q and k, the backward over the incoming
gradient, where nothing else reads them; elsewhere new buffers. Triton interpreter vs float64."""

from __future__ import annotations

import sys

import pytest
import torch
from _live_bytes import extra_peak
from _training_refs import DTYPES, assert_close, leaf64, rope64

B, T, HQ, HK, D = 2, 5, 4, 2, 16


def cos_sin(dtype, t=T, d=D):
    angles = torch.randn(B, t, d // 2) * 3
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention:
    """q and k as transformers makes them: projections of x viewed [B, T, H, D], transposed to
    [B, H, T, D] (``norm``: through an elementwise op first, as Qwen3's q_norm/k_norm)."""

    def __init__(self, dtype, norm=False):
        self.x = torch.randn(B, T, 8, dtype=dtype, requires_grad=True)
        self.wq = (torch.randn(HQ * D, 8, dtype=dtype) / 3).requires_grad_()
        self.wk = (torch.randn(HK * D, 8, dtype=dtype) / 3).requires_grad_()
        self.norm = norm

    def qk(self, x, wq, wk):
        q = (x @ wq.T).view(B, T, HQ, D)
        k = (x @ wk.T).view(B, T, HK, D)
        if self.norm:
            q, k = q * 1.5, k * 0.5
        return q.transpose(1, 2), k.transpose(1, 2)

    def leaves(self):
        return self.x, self.wq, self.wk

    def reference_grads(self, cos, sin, gq, gk):
        """float64 gradients of sum(rope(q) * gq) + sum(rope(k) * gk) w.r.t. x, wq, wk."""
        leaves = [leaf64(t) for t in self.leaves()]
        qr, kr = rope64(*self.qk(*leaves), cos.double(), sin.double())
        ((qr * gq.double()).sum() + (kr * gk.double()).sum()).backward()
        return qr, kr, [t.grad for t in leaves]


def run(kt, att, cos, sin, gq, gk):
    """Forward and backward; the upstream gradient comes from an op (as SDPA's does), not from
    the caller. Returns (q, k, q_embed, k_embed, grads)."""
    q, k = att.qk(*att.leaves())
    qo, ko = kt.apply_rotary_pos_emb(q, k, cos, sin)
    ((qo * gq).sum() + (ko * gk).sum()).backward()
    return q, k, qo, ko, [t.grad for t in att.leaves()]


@pytest.mark.parametrize("norm", [False, True], ids=["llama", "qwen3 norm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_in_place_matches_float64(kt, dtype, norm):
    """The rotation lands in q's and k's own memory and every gradient matches float64."""
    att = Attention(dtype, norm)
    cos, sin = cos_sin(dtype)
    gq, gk = torch.randn(B, HQ, T, D, dtype=dtype), torch.randn(B, HK, T, D, dtype=dtype)
    q, k, qo, ko, grads = run(kt, att, cos, sin, gq, gk)
    assert qo.data_ptr() == q.data_ptr() and ko.data_ptr() == k.data_ptr()
    qr, kr, refs = att.reference_grads(cos, sin, gq, gk)
    assert_close(qo, qr, dtype, "q_embed")
    assert_close(ko, kr, dtype, "k_embed")
    for name, got, ref in zip(("dx", "dWq", "dWk"), grads, refs, strict=True):
        assert_close(got, ref, dtype, name)


def test_unsqueeze_dim_2_in_place(kt):
    """[B, T, H, D] q/k (no transpose) with unsqueeze_dim=2, in place, against float64."""
    x = torch.randn(B, T, 8, requires_grad=True)
    w = torch.randn(HQ * D, 8, requires_grad=True)
    cos, sin = cos_sin(torch.float32)
    q, k = (x @ w.T).view(B, T, HQ, D), (x @ w.T * 2).view(B, T, HQ, D)
    qo, ko = kt.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    assert qo.data_ptr() == q.data_ptr() and ko.data_ptr() == k.data_ptr()
    g = torch.randn_like(qo)
    ((qo * g).sum() + (ko * g).sum()).backward()
    x64, w64 = leaf64(x), leaf64(w)
    q64, k64 = (x64 @ w64.T).view(B, T, HQ, D), (x64 @ w64.T * 2).view(B, T, HQ, D)
    qr, kr = rope64(q64, k64, cos.double(), sin.double(), 2)
    ((qr * g.double()).sum() + (kr * g.double()).sum()).backward()
    assert_close(qo, qr, torch.float32, "q_embed")
    assert_close(x.grad, x64.grad, torch.float32, "dx")
    assert_close(w.grad, w64.grad, torch.float32, "dW")


@pytest.mark.parametrize("saver", ["q", "projection"])
def test_a_saved_q_raises_instead_of_a_wrong_gradient(kt, saver):
    """Something saved q (or the projection output q views) for its backward before the
    rotation overwrote it: autograd must refuse the backward, not differentiate at the rotated
    values."""
    att = Attention(torch.float32)
    cos, sin = cos_sin(torch.float32)
    q, k = att.qk(*att.leaves())
    saved = q.pow(2).sum() if saver == "q" else q._base.pow(2).sum()  # pow saves its input
    qo, ko = kt.apply_rotary_pos_emb(q, k, cos, sin)
    assert qo.data_ptr() == q.data_ptr()  # the in-place path is the one under test
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (qo.sum() + ko.sum() + saved).backward()


def _fallback_inputs(case: str):
    """(q, k, leaves) for each case where the forward must not write over q or k."""
    x = torch.randn(B, T, 8, requires_grad=True)
    wq = torch.randn(HQ * D, 8, requires_grad=True)
    wk = torch.randn(HK * D, 8, requires_grad=True)
    if case == "leaf":
        q = torch.randn(B, HQ, T, D, requires_grad=True)
        k = torch.randn(B, HK, T, D, requires_grad=True)
        return q, k, [q, k]
    if case == "view of a leaf":
        qb, kb = (
            torch.randn(B, T, HQ * D, requires_grad=True),
            torch.randn(B, T, HK * D, requires_grad=True),
        )
        return qb.view(B, T, HQ, D).transpose(1, 2), kb.view(B, T, HK, D).transpose(1, 2), [qb, kb]
    if case == "split of fused qkv":  # DeepSeek/phi3: other parts of the buffer are read later
        qkv = (x @ torch.cat((wq, wk)).T).view(B, T, HQ + HK, D)
        q, k = qkv.split([HQ, HK], dim=2)
        return q.transpose(1, 2), k.transpose(1, 2), [x]
    if case == "q is k":
        q = (x @ wq.T).view(B, T, HQ, D).transpose(1, 2)
        return q, q, [x]
    if case == "output saved by its op":  # as MemoryEfficientRMSNorm saves q_norm's output
        q = torch.sigmoid(x @ wq.T).view(B, T, HQ, D).transpose(1, 2)
        k = torch.sigmoid(x @ wk.T).view(B, T, HK, D).transpose(1, 2)
        return q, k, [x]
    raise AssertionError(case)


FALLBACKS = ["leaf", "view of a leaf", "split of fused qkv", "q is k", "output saved by its op"]


@pytest.mark.parametrize("case", FALLBACKS)
def test_fallbacks_leave_q_and_k_alone(kt, case):
    """Where in place is unsafe the inputs keep their values, and the values and the gradients
    reaching q and k match float64 (a split's siblings, a saved output and q-is-k would
    otherwise raise or be wrong)."""
    q, k, _ = _fallback_inputs(case)
    for t in (q, k):
        if not t.is_leaf:
            t.retain_grad()
    cos, sin = cos_sin(torch.float32)
    q_before, k_before = q.detach().clone(), k.detach().clone()
    qo, ko = kt.apply_rotary_pos_emb(q, k, cos, sin)
    assert qo.data_ptr() != q.data_ptr() and ko.data_ptr() != k.data_ptr()
    assert torch.equal(q, q_before) and torch.equal(k, k_before)
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    ((qo * gq).sum() + (ko * gk).sum()).backward()
    q64 = leaf64(q_before).requires_grad_()
    k64 = q64 if case == "q is k" else leaf64(k_before).requires_grad_()
    qr, kr = rope64(q64, k64, cos.double(), sin.double())
    ((qr * gq.double()).sum() + (kr * gk.double()).sum()).backward()
    assert_close(qo, qr, torch.float32, "q_embed")
    assert_close(ko, kr, torch.float32, "k_embed")
    assert_close(q.grad, q64.grad, torch.float32, "dq")
    assert_close(k.grad, k64.grad, torch.float32, "dk")


def test_inference_mode_is_not_written(kt):
    """Inference tensors have no version counter to bump: new buffers, q and k untouched."""
    cos, sin = cos_sin(torch.float32)
    with torch.inference_mode():
        x = torch.randn(B, T, HQ * D)
        q = (x * 1.0).view(B, T, HQ, D).transpose(1, 2)
        k = (x * 2.0).view(B, T, HQ, D).transpose(1, 2)
        before = q.clone()
        qo, ko = kt.apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(q, before) and qo.data_ptr() != q.data_ptr()
    qr, _ = rope64(before.double(), k.double(), cos.double(), sin.double())
    assert_close(qo, qr, torch.float32, "q_embed")


def test_a_gradient_the_caller_passed_is_not_overwritten(kt):
    """backward(gradient=g): g is the caller's; Liger's RoPE rotates it in place."""
    att = Attention(torch.float32)
    cos, sin = cos_sin(torch.float32)
    q, k = att.qk(*att.leaves())
    qo, ko = kt.apply_rotary_pos_emb(q, k, cos, sin)
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    keep = gq.clone(), gk.clone()
    torch.autograd.backward((qo, ko), (gq, gk))
    assert torch.equal(gq, keep[0]) and torch.equal(gk, keep[1])
    _, _, refs = att.reference_grads(cos, sin, keep[0], keep[1])
    assert_close(att.x.grad, refs[0], torch.float32, "dx")


def test_a_gradient_shared_with_another_input_is_not_overwritten(kt):
    """``q_embed + a``: autograd hands one gradient tensor to both; whichever node runs first
    must not change what the other reads (a is made first, so the rope node runs first)."""
    cos, sin = cos_sin(torch.float32)
    a_leaf = torch.randn(B, HQ, T, D, requires_grad=True)
    a = a_leaf * 1.0
    att = Attention(torch.float32)
    q, k = att.qk(*att.leaves())
    qo, ko = kt.apply_rotary_pos_emb(q, k, cos, sin)
    w = torch.randn_like(qo)
    ((qo + a) * w).sum().backward()
    torch.testing.assert_close(a_leaf.grad, w, rtol=0, atol=0)  # d/da of sum((qo + a) * w)
    _, _, refs = att.reference_grads(cos, sin, w, torch.zeros(B, HK, T, D))
    assert_close(att.x.grad, refs[0], torch.float32, "dx")


def test_one_gradient_for_both_q_and_k_is_not_overwritten(kt):
    """``q_embed + k_embed`` (as many heads of each): autograd hands the one gradient tensor to
    both; written over for both, q and k would get one buffer as their two gradients, which a
    later in-place backward (an in-place q_norm's) then overwrites for the other."""
    cos, sin = cos_sin(torch.float32)
    x = torch.randn(B, T, 8, requires_grad=True)
    wq, wk = (torch.randn(HK * D, 8, requires_grad=True) for _ in range(2))

    def qk(x, wq, wk):
        return [(x @ w.T).view(B, T, HK, D).transpose(1, 2) for w in (wq, wk)]

    q, k = qk(x, wq, wk)
    grads = []
    for t in (q, k):
        t.register_hook(grads.append)
    qo, ko = kt.apply_rotary_pos_emb(q, k, cos, sin)
    w = torch.randn_like(qo)
    ((qo + ko) * w).sum().backward()
    dq, dk = grads
    assert dq.untyped_storage().data_ptr() != dk.untyped_storage().data_ptr()
    leaves = [leaf64(t) for t in (x, wq, wk)]
    qr, kr = rope64(*qk(*leaves), cos.double(), sin.double())
    ((qr + kr) * w.double()).sum().backward()
    for got, ref, name in zip(
        (x.grad, wq.grad, wk.grad), leaves, ("dx", "dwq", "dwk"), strict=True
    ):
        assert_close(got, ref.grad, torch.float32, name)


def _fwd_bwd_peak(kt, norm: bool, rope: bool) -> int:
    """Extra peak bytes of one fwd+bwd from q/k made as in transformers (made before the
    probe, as a projection's output is) to the leaves' gradients."""
    cos, sin = cos_sin(torch.float32, t=64, d=32)
    x = torch.randn(B, 64, 8, requires_grad=True)
    wq, wk = torch.randn(8 * 32, 8, requires_grad=True), torch.randn(2 * 32, 8, requires_grad=True)
    gq, gk = torch.randn(B, 8, 64, 32), torch.randn(B, 2, 64, 32)
    q, k = (x @ wq.T).view(B, 64, 8, 32), (x @ wk.T).view(B, 64, 2, 32)
    if norm:
        q, k = q * 1.5, k * 0.5
    qk = [q.transpose(1, 2), k.transpose(1, 2)]
    del q, k  # only the [B, H, T, D] views stay, as in the attention's forward

    def fwd_bwd():
        q, k = qk
        if rope:
            q, k = kt.apply_rotary_pos_emb(q, k, cos, sin)
        # The upstream gradients are made by the products' backward, as attention's are.
        ((q * gq).sum() + (k * gk).sum()).backward()

    return extra_peak(fwd_bwd)[0]


@pytest.mark.parametrize("norm", [False, True], ids=["llama", "qwen3 norm"])
def test_in_place_allocates_nothing(kt, norm):
    """The peak of a fwd+bwd through the rotation is the peak without it: no q/k-sized output
    in the forward and no gradient buffer in the backward (out of place: four of them)."""
    without, with_rope = _fwd_bwd_peak(kt, norm, False), _fwd_bwd_peak(kt, norm, True)
    assert with_rope == without, (with_rope, without)


def test_the_tuner_may_launch_any_number_of_times(kt, monkeypatch):
    """On a GPU the first call of a shape times every candidate by launching it, several times
    each; in place, those launches must not rotate q, k or their gradients again. The
    interpreter skips timing, so a tuner that launches each candidate three times stands in."""
    rope = sys.modules[f"{kt.__name__}.rope"]

    def tuner(key, candidates, launch, cold=None):
        for cfg in candidates * 3:
            launch(cfg)
        return candidates[0]

    monkeypatch.setattr(rope, "pick_config", tuner)
    att = Attention(torch.float32)
    cos, sin = cos_sin(torch.float32)
    gq, gk = torch.randn(B, HQ, T, D), torch.randn(B, HK, T, D)
    q, k, qo, ko, grads = run(kt, att, cos, sin, gq, gk)
    assert qo.data_ptr() == q.data_ptr()  # the in-place path ran
    qr, kr, refs = att.reference_grads(cos, sin, gq, gk)
    assert_close(qo, qr, torch.float32, "q_embed")
    assert_close(ko, kr, torch.float32, "k_embed")
    for name, got, ref in zip(("dx", "dWq", "dWk"), grads, refs, strict=True):
        assert_close(got, ref, torch.float32, name)


def test_a_frozen_parameter_is_not_written(kt):
    """q and k that view frozen parameters (requires_grad=False: no leaf check fires) keep
    their values; the rotation goes to new tensors."""
    cos, sin = cos_sin(torch.float32)
    wq = torch.nn.Parameter(torch.randn(B, T, HQ * D), requires_grad=False)
    wk = torch.nn.Parameter(torch.randn(B, T, HK * D), requires_grad=False)
    before = wq.detach().clone(), wk.detach().clone()
    q = wq.view(B, T, HQ, D).transpose(1, 2)
    k = wk.view(B, T, HK, D).transpose(1, 2)
    qo, ko = kt.apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(wq, before[0]) and torch.equal(wk, before[1])
    assert qo.data_ptr() != wq.data_ptr()
