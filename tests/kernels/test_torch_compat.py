"""The training kernels on a torch without (or with a different meaning of) the private APIs
they read: each API is taken away, or made to count as an older torch counts, before a fresh
copy of the kernel package is imported, as a torch of that kind would present it. The ops must
still give the float64 answer, and anything that writes in place must decline.

Which torch releases have which API, and what each counts, is in docs/compatibility.md.
"""

from __future__ import annotations

import sys

import pytest
import torch
from _training_refs import assert_close, leaf64, rope64
from conftest import load_variant
from test_moe import reference64, routing

B, T, HQ, HK, D = 2, 5, 4, 2, 16


def _module(kt, name: str):
    return sys.modules[f"{kt.__name__}.{name}"]


def _cos_sin():
    angles = torch.randn(B, T, D // 2) * 3
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def _projections(saved_output: bool = False):
    """(leaves, q, k) as transformers makes them: [B, T, H*D] projections viewed [B, T, H, D]
    and transposed. With ``saved_output`` they pass through a sigmoid first, which saves its
    output for its backward (as a memory-efficient q_norm does): one more holder of q's memory."""
    x = torch.randn(B, T, 8, requires_grad=True)
    wq = (torch.randn(HQ * D, 8) / 3).requires_grad_()
    wk = (torch.randn(HK * D, 8) / 3).requires_grad_()
    q, k = x @ wq.T, x @ wk.T
    if saved_output:
        q, k = torch.sigmoid(q), torch.sigmoid(k)
    q = q.view(B, T, HQ, D).transpose(1, 2)
    k = k.view(B, T, HK, D).transpose(1, 2)
    return (x, wq, wk), q, k


def _rope_fwd_bwd(kt, saved_output: bool = False):
    """Runs the eager RoPE forward and backward; returns what the checks below need: whether
    the forward wrote over q, whether the backward wrote over the incoming gradient, whether q
    kept its values, and the outputs and leaf gradients next to their float64 references."""
    rope = _module(kt, "rope")
    seen = []
    real = rope._private_grad
    # Records the backward's in-place decision; the decision itself is the module's own.
    rope._private_grad = lambda g: seen.append(real(g)) or seen[-1]
    try:
        cos, sin = _cos_sin()
        leaves, q, k = _projections(saved_output)
        q_before = q.detach().clone()
        qo, ko = kt.apply_rotary_pos_emb(q, k, cos, sin)
        wrote_q = qo.data_ptr() == q.data_ptr()
        kept_q = torch.equal(q.detach(), q_before)
        gq, gk = torch.randn_like(qo), torch.randn_like(ko)
        ((qo * gq).sum() + (ko * gk).sum()).backward()  # the gradients come from an op
    finally:
        rope._private_grad = real
    leaves64 = [leaf64(t) for t in leaves]
    x64, wq64, wk64 = leaves64
    q64, k64 = x64 @ wq64.T, x64 @ wk64.T
    if saved_output:
        q64, k64 = torch.sigmoid(q64), torch.sigmoid(k64)
    q64 = q64.view(B, T, HQ, D).transpose(1, 2)
    k64 = k64.view(B, T, HK, D).transpose(1, 2)
    qr, kr = rope64(q64, k64, cos.double(), sin.double())
    ((qr * gq.double()).sum() + (kr * gk.double()).sum()).backward()
    assert_close(qo, qr, torch.float32, "q_embed")
    assert_close(ko, kr, torch.float32, "k_embed")
    for name, t, ref in zip(("dx", "dwq", "dwk"), leaves, leaves64, strict=True):
        assert_close(t.grad, ref.grad, torch.float32, name)
    return wrote_q, any(seen), kept_q


def _hide_use_count(monkeypatch):
    """Tensor._use_count is a method of a C type, which cannot be deleted; a property on
    torch.Tensor that raises AttributeError makes every tensor look like it has none."""

    def missing(self):
        raise AttributeError("_use_count")

    monkeypatch.setattr(torch.Tensor, "_use_count", property(missing))


HIDE = {
    "torch._C._storage_Use_Count": lambda mp: mp.delattr(torch._C, "_storage_Use_Count"),
    "Tensor._use_count": _hide_use_count,
    "torch._debug_has_internal_overlap": lambda mp: mp.delattr(torch, "_debug_has_internal_overlap"),
}  # fmt: skip


def test_this_torch_writes_rope_in_place(kt):
    """The baseline the tests below take away from: with every API present, both the forward
    and the backward write in place (else declining would prove nothing)."""
    wrote_q, wrote_grad, _ = _rope_fwd_bwd(kt)
    assert wrote_q and wrote_grad


def test_the_counts_are_measured_the_same_whatever_mode_imports_the_kernels(kt):
    """Kernels are often loaded while a model is built: under inference_mode, no_grad or a meta
    default device the import still measures CPU tensors with autograd (else in place would be
    off for the whole process, or measured from tensors that count otherwise)."""
    rope = _module(kt, "rope")
    assert None not in (rope._ALONE, rope._GRAD_USES)
    with torch.device("meta"), torch.inference_mode():
        other = _module(load_variant(), "rope")
    with torch.no_grad():
        third = _module(load_variant(), "rope")
    for module in (other, third):
        assert (module._ALONE, module._GRAD_USES) == (rope._ALONE, rope._GRAD_USES)


@pytest.mark.parametrize("api", list(HIDE))
def test_rope_without_a_use_count_api_declines_in_place(monkeypatch, api):
    """Without any one of the three, nothing can show that q, k or the incoming gradient is
    unshared: both directions take new buffers, with the same values."""
    HIDE[api](monkeypatch)
    kt = load_variant()
    assert _module(kt, "rope")._ALONE is None
    wrote_q, wrote_grad, kept_q = _rope_fwd_bwd(kt)
    assert not wrote_q and not wrote_grad and kept_q


def _count_as_torch_2_5(monkeypatch):
    """torch 2.5 to 2.9 count only the tensors that hold a storage; later releases also count
    the Python storage object that untyped_storage() returns (one more, here always)."""
    fresh = torch.empty(1)
    if torch._C._storage_Use_Count(fresh.untyped_storage()._cdata) != 2:
        pytest.skip("this torch counts as torch 2.5 does: test_rope_inplace runs on it as is")
    real = torch._C._storage_Use_Count
    monkeypatch.setattr(torch._C, "_storage_Use_Count", lambda cdata: real(cdata) - 1)


def test_rope_under_torch_2_5_counting_keeps_a_saved_output(monkeypatch):
    """q's memory held by one more tensor (an op's saved output): under torch 2.5's counting
    that count equals what the check used to expect of an unshared view, and q was written."""
    _count_as_torch_2_5(monkeypatch)
    fresh = load_variant()
    wrote_q, _, kept_q = _rope_fwd_bwd(fresh, saved_output=True)
    assert not wrote_q and kept_q


def test_rope_under_torch_2_5_counting_still_writes_in_place(monkeypatch):
    """The count is measured, not given up on: where q is unshared it is still written over."""
    _count_as_torch_2_5(monkeypatch)
    fresh = load_variant()
    wrote_q, wrote_grad, _ = _rope_fwd_bwd(fresh)
    assert wrote_q and wrote_grad


def _gradient_arrives_alone() -> bool:
    """Whether this torch hands an autograd Function's backward an unshared gradient with one
    use, measured here apart from the kernels' own measurement."""
    uses = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            uses.append(g._use_count())
            return g

    x = torch.randn(4, requires_grad=True)
    (Probe.apply(x) * torch.randn(4)).sum().backward()
    return uses == [1]


def _hand_over_as_torch_2_12(monkeypatch):
    """torch 2.5 to 2.12 keep a reference of their own to the gradient a Function's backward
    receives while it runs: every use count read during a backward is one higher."""
    if not _gradient_arrives_alone():
        pytest.skip("this torch hands gradients over so: test_rope_inplace runs on it as is")
    real = torch._C.TensorBase._use_count

    def uses(self):
        return lambda: real(self) + (torch._C._current_graph_task_id() >= 0)

    monkeypatch.setattr(torch.Tensor, "_use_count", property(uses))


def test_rope_under_torch_2_12_hand_over_still_writes_the_gradient(monkeypatch):
    """The gradient's use count is measured too: an unshared one is still written over (the
    check used to expect one use, and never wrote it on torch 2.5 to 2.12)."""
    _hand_over_as_torch_2_12(monkeypatch)
    fresh = load_variant()
    wrote_q, wrote_grad, _ = _rope_fwd_bwd(fresh)
    assert wrote_q and wrote_grad


def test_rope_under_torch_2_12_hand_over_keeps_a_gradient_the_caller_passed(monkeypatch):
    """``backward(g)``: g is the caller's (one use more than an unshared gradient on every
    torch): not written over."""
    _hand_over_as_torch_2_12(monkeypatch)
    fresh = load_variant()
    cos, sin = _cos_sin()
    _, q, k = _projections()
    qo, ko = fresh.apply_rotary_pos_emb(q, k, cos, sin)
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    keep = gq.clone(), gk.clone()
    torch.autograd.backward((qo, ko), (gq, gk))
    assert torch.equal(gq, keep[0]) and torch.equal(gk, keep[1])


def _silu_mul_twice(kt):
    """silu(a) * b with in_place=True, backward twice over one graph (retain_graph=True), each
    gradient checked against float64; returns whether a kept its values after the first."""
    a0 = torch.randn(6, 32, requires_grad=True)
    b0 = torch.randn(6, 32, requires_grad=True)
    a, b = a0 * 1.0, b0 * 1.0  # intermediates, as an MLP's projections are
    a_before = a.detach().clone()
    out = kt.silu_mul(a, b, in_place=True)
    dy = torch.randn_like(out)
    out.backward(dy, retain_graph=True)
    kept = torch.equal(a.detach(), a_before)
    first = a0.grad.clone(), b0.grad.clone()
    out.backward(dy)  # a gradient written over a or b would make this autograd's error
    a64, b64 = leaf64(a0), leaf64(b0)
    (torch.nn.functional.silu(a64) * b64 * dy.double()).sum().backward()
    assert_close(first[0], a64.grad, torch.float32, "da, first backward")
    assert_close(first[1], b64.grad, torch.float32, "db, first backward")
    assert_close(a0.grad, 2 * a64.grad, torch.float32, "da, accumulated over both")
    assert_close(b0.grad, 2 * b64.grad, torch.float32, "db, accumulated over both")
    return kept


def test_retain_graph_without_the_keep_graph_hook(monkeypatch):
    """Without autograd's keep-graph hook a backward cannot tell whether its graph runs again:
    in-place gradients are declined and a second backward gives the same gradients."""
    monkeypatch.delattr(torch._C._autograd, "_get_current_graph_task_keep_graph")
    kt = load_variant()
    assert _module(kt, "_common")._KEEP_GRAPH is None
    assert _silu_mul_twice(kt)


def test_retain_graph_with_the_keep_graph_hook(kt):
    """The same with the hook: it says the graph is kept, so nothing is overwritten either."""
    assert _silu_mul_twice(kt)


def test_fast_launch_without_the_cuda_launcher_api(monkeypatch):
    """Without torch._C._cuda_getDevice / _cuda_getCurrentRawStream (absent from CPU builds)
    every launch takes Triton's own path. The interpreter stands in for a GPU: RoPE's kernel is
    wrapped anew while the wrapper is told it is not interpreting, as on a GPU."""
    import torch._dynamo  # noqa: F401 - CUDA builds import the launcher functions here

    monkeypatch.delattr(torch._C, "_cuda_getDevice", raising=False)
    monkeypatch.delattr(torch._C, "_cuda_getCurrentRawStream", raising=False)
    kt = load_variant()
    common, rope = _module(kt, "_common"), _module(kt, "rope")
    assert common._CUDA_LAUNCH_API is False
    with monkeypatch.context() as gpu:
        gpu.setattr(common, "interpreting", lambda: False)
        launch = common.FastLaunch(rope._rope_kernel.fn)
    assert not launch.enabled
    monkeypatch.setattr(rope, "_rope_kernel", launch)
    for _ in range(2):  # the first launch compiles; the second would take the fast path
        _rope_fwd_bwd(kt)


def _moe_case():
    """fp32 experts whose rows are all 16-byte aligned: the grouped-matmul shape."""
    experts, hidden, inter, tokens = 6, 32, 24, 13
    w_gate_up = (torch.randn(experts, 2 * inter, hidden) * 0.3).requires_grad_()
    w_down = (torch.randn(experts, hidden, inter) * 0.3).requires_grad_()
    x = torch.randn(tokens, hidden, requires_grad=True)
    idx, w = routing(tokens, experts)
    return x, w_gate_up, w_down, idx, w.requires_grad_()


def test_moe_takes_grouped_mm_where_this_torch_has_it(kt):
    """The baseline: on the CPU, torch 2.9 and later take torch._grouped_mm for this shape."""
    x, w_gate_up, w_down, _, _ = _moe_case()
    expected = hasattr(torch, "_grouped_mm") and kt.moe._GROUPED_MM >= (2, 9)
    assert kt.moe._use_grouped_mm(x, w_gate_up, w_down) == expected


def test_moe_without_grouped_mm_loops_over_experts(monkeypatch):
    """Without torch._grouped_mm (torch before 2.8) the experts run as a loop of matmuls, with
    the float64 values and gradients."""
    monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    kt = load_variant()
    moe = _module(kt, "moe")
    assert moe._GROUPED_MM is None
    x, w_gate_up, w_down, idx, w = _moe_case()
    assert not moe._use_grouped_mm(x, w_gate_up, w_down)
    out = moe.moe_experts(x, w_gate_up, w_down, idx, w, moe.SILU, False)
    x64, wgu64, wd64, w64 = (leaf64(t) for t in (x, w_gate_up, w_down, w))
    ref = reference64(x64, wgu64, wd64, idx, w64, "silu", False)
    dy = torch.randn_like(out)
    out.backward(dy)
    ref.backward(dy.double())
    assert_close(out, ref, torch.float32, "output")
    for name, t, t64 in (
        ("d x", x, x64),
        ("d gate_up_proj", w_gate_up, wgu64),
        ("d down_proj", w_down, wd64),
        ("d top_k_weights", w, w64),
    ):
        assert_close(t.grad, t64.grad, torch.float32, name)
