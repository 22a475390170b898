"""The Liger-surface options of the training kernels on a CUDA GPU at real shapes: RMSNorm (no
weight, offset, casting modes, in-place backward), fused add + RMSNorm, cross-entropy (class
weights, z-loss, predicted tokens, accuracy), fused linear CE (fp32 d(weight), token scaling).

Run in its own pytest process (tests/kernels switches Triton to its CPU interpreter):

    python -m pytest --noconftest tests/gpu/test_options_gpu.py
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch
import torch.nn.functional as F

from tests.gpu.variant import load_variant, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        reason="TRITON_INTERPRET is set: run tests/gpu in its own pytest process",
    ),
]

MODES = ["llama", "gemma", "none"]
IGNORE = -100


@pytest.fixture(scope="module")
def kt():
    return load_variant("_kernels_training_options_gpu_test")


@pytest.fixture(autouse=True)
def _seed(request):
    seed = int(os.environ.get("KERNEL_TEST_SEED", zlib.crc32(request.node.nodeid.encode())))
    torch.manual_seed(seed)
    print(f"seed={seed}")


def check(out, ref, tol, what):
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def leaf64(t):
    return None if t is None else t.detach().double().requires_grad_()


def rms64(x, w, eps, offset):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * (offset + w)


@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no-weight"])
@pytest.mark.parametrize("mode", MODES)
def test_rms_norm_modes_at_4096x8192(kt, mode, with_weight):
    x = torch.randn(4096, 8192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = None
    if with_weight:
        w = (torch.randn(8192, device="cuda") * 0.3 + 0.2).bfloat16().requires_grad_()
    y = kt.rms_norm(x, w, 1e-6, offset=1.0, casting_mode=mode)
    dy = torch.randn_like(y)
    y.backward(dy)
    x64, w64 = leaf64(x), leaf64(w)
    rms64(x64, w64, 1e-6, 1.0).backward(dy.double())
    tol = 1.5e-2 if mode == "none" else 1e-2  # "none" rounds rstd too (see the CPU test)
    check(y, rms64(x64.detach(), None if w64 is None else w64.detach(), 1e-6, 1.0), tol, "y")
    check(x.grad, x64.grad, tol, "dx")
    if w is not None:
        check(w.grad, w64.grad, tol, "dw")


@pytest.mark.parametrize("mode", MODES)
def test_rms_norm_modes_round_where_they_say(kt, mode):
    """bf16 on the GPU (round to nearest): y equals float64 with the mode's roundings to within
    a few ulps in a handful of elements, far closer than any other mode's roundings."""
    x = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16) * 3
    w = (torch.randn(4096, device="cuda") * 0.3 + 0.2).bfloat16()

    def rounded(m):
        rstd = torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
        if m == "none":
            rstd = rstd.bfloat16().double()
        xhat = x.double() * rstd
        if m != "gemma":
            xhat = xhat.bfloat16().double()
        return (xhat * (0.5 + w.double())).bfloat16()

    y = kt.rms_norm(x, w, 1e-6, offset=0.5, casting_mode=mode)
    errs = {m: rel_err(y, rounded(m)) for m in MODES}
    assert all(errs[m] > 10 * errs[mode] for m in MODES if m != mode), errs


def test_rms_norm_in_place_at_16384x4096(kt):
    x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(4096, device="cuda") * 0.1 + 1).bfloat16()
    dy = torch.randn_like(x)
    out = {}
    for in_place in (False, True):  # out of place first: it times the geometry in place reuses
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        g = dy.clone()
        kt.rms_norm(xl, wl, 1e-6, in_place=in_place).backward(g)
        out[in_place] = (xl.grad, wl.grad, g)
    assert torch.equal(out[False][2], dy)
    assert torch.equal(out[True][2], out[False][0])  # dx was written over dy
    assert torch.equal(out[True][0], out[False][0]) and torch.equal(out[True][1], out[False][1])


def test_fused_add_gemma_mode_no_weight(kt):
    x = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn_like(x, requires_grad=True)
    y, s = kt.fused_add_rms_norm(x, r, None, 1e-6, casting_mode="gemma")
    dy, ds = torch.randn_like(y), torch.randn_like(s)
    torch.autograd.backward((y, s), (dy, ds))
    x64, r64 = leaf64(x), leaf64(r)
    s64 = x64 + r64
    torch.autograd.backward((rms64(s64, None, 1e-6, 0.0), s64), (dy.double(), ds.double()))
    check(x.grad, x64.grad, 1e-2, "dx")
    check(r.grad, r64.grad, 1e-2, "dresidual")


def ce64(logits, target, weight, smoothing, lam):
    z = logits.double()
    ce = F.cross_entropy(
        z, target, weight=weight.double(), ignore_index=IGNORE, label_smoothing=smoothing
    )
    keep = target != IGNORE
    return ce + (lam * torch.logsumexp(z, -1) ** 2 * keep).sum() / keep.sum()


def targets(n, vocab):
    t = torch.randint(0, vocab, (n,), device="cuda")
    t[torch.rand(n, device="cuda") < 0.05] = IGNORE
    return t


def test_cross_entropy_weighted_with_extras_at_2048x151936(kt):
    n, vocab = 2048, 151936
    logits = (torch.randn(n, vocab, device="cuda") * 2).bfloat16()
    target = targets(n, vocab)
    weight = torch.rand(vocab, device="cuda") * 2
    x = logits.clone().requires_grad_()
    out = kt.cross_entropy(
        x, target, weight=weight, label_smoothing=0.1, lse_square_scale=1e-4,
        return_z_loss=True, return_token_accuracy=True, return_predicted_tokens=True,
    )  # fmt: skip
    out.loss.backward()
    x64 = logits.double().requires_grad_()
    loss64 = ce64(x64, target, weight, 0.1, 1e-4)
    loss64.backward()
    check(out.loss, loss64, 1e-5, "loss")
    check(x.grad, x64.grad, 1e-2, "dlogits")
    keep = target != IGNORE
    expect = torch.where(keep, logits.argmax(-1), -1)
    assert torch.equal(out.predicted_tokens, expect)
    acc = ((expect == target) & keep).sum() / keep.sum()
    torch.testing.assert_close(out.token_accuracy, acc.float())


def test_flce_options_at_4096x1024x151936(kt):
    n, hdim, vocab = 4096, 1024, 151936
    h = (torch.randn(n, hdim, device="cuda") * 2).bfloat16()
    w = (torch.randn(vocab, hdim, device="cuda") * hdim**-0.5).bfloat16()
    target = targets(n, vocab)
    got = {}
    for accum in (None, torch.float32):
        hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
        kt.fused_linear_cross_entropy(hl, wl, target, chunk_rows=256, accum_dtype=accum).backward()
        got[accum] = wl.grad
    h64, w64 = leaf64(h), leaf64(w)
    F.cross_entropy(h64 @ w64.t(), target, ignore_index=IGNORE).backward()
    e_acc, e_default = rel_err(got[torch.float32], w64.grad), rel_err(got[None], w64.grad)
    assert e_acc < e_default, (e_acc, e_default)
    check(got[torch.float32], w64.grad, 1e-2, "dw fp32-accumulated")

    hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = kt.fused_linear_cross_entropy(hl, wl, target, use_token_scaling=True)
    loss.backward()
    h64, w64 = leaf64(h), leaf64(w)
    logits = h64 @ w64.t()
    keep = target != IGNORE
    p = torch.softmax(logits, -1).gather(1, torch.where(keep, target, 0)[:, None])[:, 0]
    rows = F.cross_entropy(logits, target, ignore_index=IGNORE, reduction="none")
    loss64 = (rows * p.detach() * keep).sum() / keep.sum()
    loss64.backward()
    check(loss, loss64, 1e-3, "token-scaled loss")
    # Token scaling weights each row by its target's probability p, so d(hidden) is dominated by
    # the few rows with the largest p, where one bf16 rounding of a target logit in [8, 16)
    # moves p by up to 3% (half an ulp, 1/32): torch's own bf16 path (bf16 logits, fp32
    # cross-entropy) lands near 1e-2 here too. Measured against float64 on the CPU at this vocab
    # (n=128-1024, 4 seeds): torch bf16 dh 2.9e-3 to 1.10e-2, ours 4.3e-3 to 1.35e-2 (1.30e-2 on
    # the Triton interpreter), ours/torch 0.61-1.52 by seed (1.23 where both exceed 1e-2): >90%
    # of the norm is in 5 rows, and which lands nearer depends on whether those rows' bf16
    # logits round alike in the two matmuls. On an H200 at n=4096 ours was 1.34e-2. So dh is
    # held to torch's bf16 error on the same data (within half again), not to a fixed 1e-2 that
    # torch's own bf16 path misses.
    hb, wb = h.clone().requires_grad_(), w.clone().requires_grad_()
    lb = (hb @ wb.t()).float()
    pb = torch.softmax(lb, -1).gather(1, torch.where(keep, target, 0)[:, None])[:, 0]
    rows_b = F.cross_entropy(lb, target, ignore_index=IGNORE, reduction="none")
    ((rows_b * pb.detach() * keep).sum() / keep.sum()).backward()
    del lb, pb, rows_b
    torch_bf16 = rel_err(hb.grad, h64.grad)
    check(hl.grad, h64.grad, max(1e-2, 1.5 * torch_bf16), f"dh (torch bf16: {torch_bf16:.3e})")
    check(wl.grad, w64.grad, max(1e-2, 1.5 * rel_err(wb.grad, w64.grad)), "dw")


def test_swiglu_in_place_allocates_only_the_product(kt):
    """16384x14336 bf16 (448 MiB a tensor): out of place a forward + backward allocates c, d(a)
    and d(b); in place only c, as Liger's does. Gradients equal either way."""
    m, n = 16384, 14336
    xa = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    xb = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dc = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    tensor_bytes = m * n * 2
    grads, extra = {}, {}
    for in_place in (False, True):
        a, b = (xa * 1).detach().requires_grad_(), (xb * 1).detach().requires_grad_()
        a_in, b_in = a * 1, b * 1  # non-leaf activations, as a model's projections give
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        c = kt.silu_mul(a_in, b_in, in_place=in_place)
        da, db = torch.autograd.grad(c, (a_in, b_in), dc)
        torch.cuda.synchronize()
        extra[in_place] = torch.cuda.max_memory_allocated() - base
        grads[in_place] = (da.clone(), db.clone())
        del c, da, db, a_in, b_in, a, b
    assert torch.equal(grads[False][0], grads[True][0])
    assert torch.equal(grads[False][1], grads[True][1])
    assert extra[True] <= 1.05 * tensor_bytes, extra
    assert extra[False] >= 2.9 * tensor_bytes, extra
