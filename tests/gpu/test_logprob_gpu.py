"""The fused log-prob head and the distillation divergences on a CUDA GPU at real shapes (bf16),
against fp32 references from the full logits and against TRL 1.16's own Triton kernels.

The Triton launches are recorded (tests/gpu/launches.py): the torch path computes the same
values, so only the launches show the kernels ran. Run in its own pytest process (see
conftest.py): ``python -m pytest tests/gpu/test_logprob_gpu.py``.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import pytest
import torch

from tests.gpu.launches import TritonLaunches
from tests.gpu.variant import rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VARIANT = (
    Path(__file__).resolve().parents[2] / "hub_kernels/kernels-lab/training/build/torch-universal"
)
QWEN_VOCAB = 151936


@pytest.fixture(scope="module")
def kt():
    """The kernel folder as a package, without running its __init__."""
    name = "_kernels_training_logprob_gpu"
    if name not in sys.modules:
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(VARIANT)]
        sys.modules[name] = pkg
    return sys.modules[name]


@pytest.fixture(scope="module")
def lpm(kt):
    return importlib.import_module(f"{kt.__name__}.logprob")


@pytest.fixture(scope="module")
def dv(kt):
    return importlib.import_module(f"{kt.__name__}.divergence")


@pytest.fixture(autouse=True)
def _exact_fp32_matmuls():
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = prev


def head(n, hdim, vocab, bias=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(n, hdim, device="cuda", generator=g).bfloat16()
    w = (torch.randn(vocab, hdim, device="cuda", generator=g) * 2 * hdim**-0.5).bfloat16()
    b = (torch.randn(vocab, device="cuda", generator=g) * 0.5).bfloat16() if bias else None
    return h, w, b


def labels_for(n, vocab, ignored=0.05):
    y = torch.randint(0, vocab, (n,), device="cuda")
    y[torch.rand(n, device="cuda") < ignored] = -100
    return y


def leaves(*ts):
    return [None if t is None else t.detach().clone().requires_grad_() for t in ts]


def logprob_reference(h, w, b, y, temperature=1.0, softcap=None, scale=1.0):
    """fp32 log_probs and entropy from the full logits (fp32 leaves, through autograd)."""
    x = (h @ w.t() + (0 if b is None else b)) * scale
    z = (softcap * torch.tanh(x / softcap) if softcap else x) / temperature
    logp = torch.log_softmax(z, -1)
    valid = y != -100
    lp = logp.gather(1, torch.where(valid, y, 0)[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)


@pytest.mark.parametrize(
    "n,hdim,bias,transform,tile,keep",
    [
        (4096, 1024, False, (1.0, None, 1.0), None, False),  # Qwen3-0.6B's head, default tiling
        (4096, 2048, True, (0.7, 30.0, 1.25), None, False),  # bias, temperature, softcap, scale
        (3000, 1024, False, (1.0, None, 1.0), (1024, 40000), False),  # token and vocab chunks
        (4096, 1024, False, (1.0, None, 1.0), None, True),  # the logits kept for the backward
        (3000, 2048, True, (0.7, 30.0, 1.25), (1024, 40000), True),  # kept, read in chunks
    ],
    ids=["qwen-0.6b", "bias-transforms", "split-tokens", "keep-logits", "keep-logits-chunks"],
)
def test_logprob_matches_fp32(lpm, n, hdim, bias, transform, tile, keep):
    """bf16 fields and gradients (upstream on log_probs and entropy) against fp32 torch; the
    Triton forward and backward kernels launched."""
    temperature, softcap, scale = transform
    h, w, b = head(n, hdim, QWEN_VOCAB, bias)
    y = labels_for(n, QWEN_VOCAB)
    g_lp = torch.randn(n, device="cuda")
    g_ent = torch.randn(n, device="cuda")
    hl, wl, bl = leaves(h, w, b)
    with TritonLaunches(lpm, device=True) as launches:
        out = lpm.fused_linear_logprob(
            hl, wl, y, bl, temperature=temperature, softcap=softcap, logit_scale=scale,
            outputs=("log_probs", "entropy", "is_top1"), tile=tile, keep_logits=keep,
        )  # fmt: skip
        grads = torch.autograd.grad(
            [out.log_probs, out.entropy], [t for t in (hl, wl, bl) if t is not None],
            [g_lp, g_ent],
        )  # fmt: skip
        torch.cuda.synchronize()
    launches.assert_launched("_fwd_kernel")
    launches.assert_launched("_bwd_kernel")
    launches.assert_device_matches()
    h32, w32, b32 = leaves(*(None if t is None else t.float() for t in (h, w, b)))
    lp, ent = logprob_reference(h32, w32, b32, y, temperature, softcap, scale)
    ref = torch.autograd.grad(
        [lp, ent], [t for t in (h32, w32, b32) if t is not None], [g_lp, g_ent]
    )
    assert rel_err(out.log_probs, lp) < 1e-2
    assert rel_err(out.entropy, ent) < 1e-2
    for got, want in zip(grads, ref, strict=True):
        assert got.dtype == torch.bfloat16
        assert rel_err(got, want) < 2e-2  # tests/kernels/test_logprob.py's GRAD_FACTOR


def test_logprob_matches_trl_kernel(lpm):
    """trl_chunked_logprob against TRL's ChunkedLogProbFunction (its Triton path) on the same
    inputs: every field and the gradients."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    n, hdim = 4096, 1024
    h, w, _ = head(n, hdim, QWEN_VOCAB, seed=1)
    y = torch.randint(0, QWEN_VOCAB, (n,), device="cuda")
    g_lp, g_ent = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    results = []
    for fn in (ChunkedLogProbFunction.apply, lpm.trl_chunked_logprob):
        hl, wl = leaves(h, w)
        out = fn(hl, wl, None, y, 0.9, 32768, 30.0, 1.0)
        grads = torch.autograd.grad([out[0], out[1]], [hl, wl], [g_lp, g_ent])
        results.append((out, grads))
    (trl, trl_grads), (ours, our_grads) = results
    for name, t, o in zip(lpm.OUTPUTS, trl, ours, strict=True):
        if name == "is_top1":
            assert (t != o).float().mean() < 1e-3  # bf16 near-ties may differ
        else:
            assert rel_err(o, t) < 1e-3, name
    for t, o in zip(trl_grads, our_grads, strict=True):
        assert rel_err(o, t) < 1e-2


def test_logprob_memory_and_no_grad(lpm):
    """N 16384, H 1024, V 151936: a fwd+bwd's peak stays within the tile budget plus the fp32
    d(hidden) sum; under no_grad nothing outlives the call but the outputs."""
    n, hdim = 16384, 1024
    h, w, _ = head(n, hdim, QWEN_VOCAB, seed=2)
    y = labels_for(n, QWEN_VOCAB)
    hl, wl = leaves(h, w)
    # A first call times the kernels' configs (a scratch tile and an L2 flush buffer): warm up.
    out = lpm.fused_linear_logprob(hl, wl, y, outputs=("log_probs", "entropy"))
    torch.autograd.grad(out.log_probs.sum() + out.entropy.sum(), [hl, wl])
    del out
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        out = lpm.fused_linear_logprob(hl, wl, y, outputs=("log_probs", "entropy"))
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - base <= 2 * n * 4 + (1 << 20)  # the two fields
    del out
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = lpm.fused_linear_logprob(hl, wl, y, outputs=("log_probs", "entropy"))
    dh, dw = torch.autograd.grad(out.log_probs.sum() + out.entropy.sum(), [hl, wl])
    torch.cuda.synchronize()
    grads = dh.numel() * 2 + dw.numel() * 2
    extra = torch.cuda.max_memory_allocated() - base - grads
    assert extra <= lpm.MAX_TILE_BYTES + 4 * n * hdim + (64 << 20), extra / 2**20


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_divergence_matches_fp32_and_trl(dv, beta):
    """Student Qwen3-0.6B-like head, teacher 1.7B-like (H 2048), bf16: TRL's reading of beta,
    against fp32 torch from the full logits and against TRL's ChunkedDivergenceFunction."""
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    n = 2048
    hs, ws, _ = head(n, 1024, QWEN_VOCAB, seed=3)
    ht, wt, _ = head(n, 2048, QWEN_VOCAB, seed=4)
    g = torch.randn(n, device="cuda")
    results = []
    for fn in (ChunkedDivergenceFunction.apply, dv.trl_chunked_divergence):
        hl, wl = leaves(hs, ws)
        with TritonLaunches(dv, device=True) as launches:
            div, ent = fn(hl, wl, None, ht, wt, None, beta, 0.9)
            grads = torch.autograd.grad((div * g).sum(), [hl, wl])
            torch.cuda.synchronize()
        results.append((div, ent, *grads))
    launches.assert_launched("_stats_kernel")
    launches.assert_launched("_bwd_kernel")
    if 0.0 < beta < 1.0:
        launches.assert_launched("_second_kernel")
    h32, w32 = leaves(hs.float(), ws.float())
    lps = torch.log_softmax(h32 @ w32.t() / 0.9, -1)
    lpt = torch.log_softmax(ht.float() @ wt.float().t() / 0.9, -1)
    ps, pt = lps.exp(), lpt.exp()
    if beta == 0.0:
        d = (pt * (lpt - lps)).sum(-1)
    elif beta == 1.0:
        d = (ps * (lps - lpt)).sum(-1)
    else:
        log_m = torch.log((1 - beta) * ps + beta * pt)
        d = (beta * pt * (lpt - log_m) + (1 - beta) * ps * (lps - log_m)).sum(-1)
    ref = (
        d.detach(),
        -(ps * lps).sum(-1).detach(),
        *torch.autograd.grad((d * g).sum(), [h32, w32]),
    )
    trl, ours = results
    for name, o, t, r in zip(("div", "entropy", "dh", "dw"), ours, trl, ref, strict=True):
        tol = 1e-3 if name in ("div", "entropy") else 2e-2
        assert rel_err(o, r) < tol, (name, rel_err(o, r))
        assert rel_err(o, t) < tol, (name, rel_err(o, t))


def test_tvd_matches_fp32(dv):
    n = 2048
    hs, ws, _ = head(n, 1024, QWEN_VOCAB, seed=5)
    ht, wt, _ = head(n, 2048, QWEN_VOCAB, seed=6)
    hl, wl = leaves(hs, ws)
    div = dv.fused_linear_divergence(hl, wl, ht, wt, kind="tvd")
    dh, dw = torch.autograd.grad(div.sum(), [hl, wl])
    h32, w32 = leaves(hs.float(), ws.float())
    d = 0.5 * (torch.softmax(h32 @ w32.t(), -1) - torch.softmax(ht.float() @ wt.float().t(), -1))
    d = d.abs().sum(-1)
    rh, rw = torch.autograd.grad(d.sum(), [h32, w32])
    assert rel_err(div, d) < 1e-3
    assert rel_err(dh, rh) < 2e-2 and rel_err(dw, rw) < 2e-2
