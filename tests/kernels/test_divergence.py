"""Chunked distillation divergences (divergence.py) on the Triton CPU interpreter and on the torch
path, against float64 references from the full logits and against TRL 1.16's
ChunkedDivergenceFunction and its GKD trainer's generalized_jsd_loss."""

from __future__ import annotations

import importlib
import itertools
import os

import pytest
import torch
from _training_refs import assert_close

SOAK = os.environ.get("KERNELS_SOAK", "").strip() not in ("", "0")
N, HS, HT, V = 37, 48, 40, 333
# Tiles cutting tokens and vocabulary (2 x 3, both with a remainder), only the vocabulary, only
# the tokens, or one tile (see test_logprob.py).
TILES = {"both": (19, 120), "vocab": (N, 128), "tokens": (5, V), "one": None}
# 16-bit inputs: the logits are fp32 (no rounding), the gradient tile and the matmuls' inputs
# and outputs are not; test_logprob.py's measured factor for the same two roundings.
GRAD_FACTOR = {torch.float32: 1.0, torch.bfloat16: 2.0, torch.float16: 2.0}


@pytest.fixture(scope="module")
def dv(kt):
    return importlib.import_module(f"{kt.__name__}.divergence")


def _path(monkeypatch, path: str) -> None:
    if path == "torch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")


def make(dtype=torch.float32, s_bias=False, t_bias=False, n=N):
    """Student and teacher heads over one vocabulary; the teacher a perturbed copy of the
    student's logits' scale so the distributions overlap as in distillation."""
    hs = torch.randn(n, HS).to(dtype)
    ws = (torch.randn(V, HS) * 2 / HS**0.5).to(dtype)
    ht = torch.randn(n, HT).to(dtype)
    wt = (torch.randn(V, HT) * 2 / HT**0.5).to(dtype)
    bs = (torch.randn(V) * 0.5).to(dtype) if s_bias else None
    bt = (torch.randn(V) * 0.5).to(dtype) if t_bias else None
    ignore = torch.zeros(n, dtype=torch.bool)
    ignore[torch.tensor([0, n // 2])] = True
    return hs, ws, bs, ht, wt, bt, ignore


def leaves(*ts):
    return [None if t is None else t.detach().clone().requires_grad_() for t in ts]


def _z(h, w, b, scale, cap, temperature):
    y = (h @ w.t() + (0 if b is None else b)) * scale
    return (cap * torch.tanh(y / cap) if cap else y) / temperature


def reference(hs, ws, bs, ht, wt, bt, kind, beta, temperature, ss, sc, ts, tc, ignore):
    """(divergence, student entropy) per token in float64 from the full logits."""
    lps = torch.log_softmax(_z(hs, ws, bs, ss, sc, temperature), -1)
    lpt = torch.log_softmax(_z(ht, wt, bt, ts, tc, temperature), -1)
    ps, pt = lps.exp(), lpt.exp()
    if kind == "forward_kl":
        d = (pt * (lpt - lps)).sum(-1)
    elif kind == "reverse_kl":
        d = (ps * (lps - lpt)).sum(-1)
    elif kind == "jsd":
        log_m = torch.log((1 - beta) * ps + beta * pt)
        d = (beta * pt * (lpt - log_m) + (1 - beta) * ps * (lps - log_m)).sum(-1)
    else:
        d = 0.5 * (ps - pt).abs().sum(-1)
    ent = -(ps * lps).sum(-1)
    zero = torch.zeros((), dtype=d.dtype)
    keep = ~ignore if ignore is not None else torch.ones_like(d, dtype=torch.bool)
    return torch.where(keep, d, zero), torch.where(keep, ent, zero).detach()


CASES = {
    # kind, beta, dtype, (student bias, teacher bias), (T, s_scale, s_cap, t_scale, t_cap), tile
    "fkl-fp32-both": ("forward_kl", 0.0, torch.float32, (False, False), (1.0, 1, None, 1, None),
                      "both"),
    "rkl-fp32-transforms-vocab": ("reverse_kl", 1.0, torch.float32, (True, True),
                                  (0.7, 1.3, 5.0, 0.8, 7.0), "vocab"),
    "jsd-bf16-tokens": ("jsd", 0.3, torch.bfloat16, (True, False), (1.2, 1.0, 6.0, 1.0, None),
                        "tokens"),
    "tvd-fp32-both": ("tvd", 0.5, torch.float32, (False, True), (0.7, 1.0, None, 1.2, None),
                      "both"),
    "jsd-fp32-one": ("jsd", 0.7, torch.float32, (True, True), (1.0, 1.0, 4.0, 1.0, 4.0), "one"),
}  # fmt: skip


def run_case(dv, kind, beta, dtype, biases, transform, tile, grads_of="hwb"):
    temperature, ss, sc, ts, tc = transform
    hs, ws, bs, ht, wt, bt, ignore = make(dtype, *biases)
    hl, wl, bl, htl, wtl = leaves(hs, ws, bs, ht, wt)
    for t, key in ((hl, "h"), (wl, "w"), (bl, "b")):
        if t is not None:
            t.requires_grad_(key in grads_of)
    div, ent = dv.fused_linear_divergence(
        hl, wl, htl, wtl, kind=kind, beta=beta, temperature=temperature, student_bias=bl,
        teacher_bias=bt, student_logit_scale=ss, teacher_logit_scale=ts, student_softcap=sc,
        teacher_softcap=tc, ignore_mask=ignore, return_entropy=True, tile=TILES[tile],
    )  # fmt: skip
    as64 = leaves(*(None if t is None else t.double() for t in (hs, ws, bs)))
    d64, e64 = reference(*as64, ht.double(), wt.double(), None if bt is None else bt.double(),
                         kind, beta, temperature, ss, sc, ts, tc, ignore)  # fmt: skip
    assert div.dtype == ent.dtype == torch.float32 and div.shape == (N,)
    # A divergence is a small difference of large terms: held to the dtype's bound relative to
    # the entropy's scale as well as its own.
    assert_close(div, d64, torch.float32, "divergence")
    assert_close(ent, e64, torch.float32, "entropy")
    assert torch.all(div[ignore] == 0) and torch.all(ent[ignore] == 0)
    assert not ent.requires_grad
    g = torch.randn(N)
    mine = [t for t in (hl, wl, bl) if t is not None and t.requires_grad]
    theirs = [
        t64 for t, t64 in zip((hl, wl, bl), as64, strict=True) if t is not None and t.requires_grad
    ]
    grads = torch.autograd.grad((div * g).sum(), mine + [htl, wtl], allow_unused=True)
    grads64 = torch.autograd.grad((d64 * g.double()).sum(), theirs)
    assert grads[-2] is None and grads[-1] is None  # the teacher gets no gradient
    for t, gr, g64 in zip(mine, grads[:-2], grads64, strict=True):
        assert gr.dtype == t.dtype and gr.shape == t.shape
        assert_close(gr, g64, dtype, f"grad {tuple(t.shape)}", GRAD_FACTOR[dtype])
    assert torch.all(grads[0][ignore] == 0) if "h" in grads_of else True


# Every kind on the interpreter (two of them with chunked vocabulary), all cases on the torch
# path (the rest: the KERNELS_SOAK sweep).
ON_INTERPRETER = ("fkl-fp32-both", "rkl-fp32-transforms-vocab", "jsd-bf16-tokens", "tvd-fp32-both")


@pytest.mark.parametrize(
    "path,case",
    [("triton", c) for c in ON_INTERPRETER] + [("torch", c) for c in CASES],
)
def test_matches_float64(dv, monkeypatch, path, case):
    _path(monkeypatch, path)
    run_case(dv, *CASES[case])


@pytest.mark.slow
@pytest.mark.skipif(not SOAK, reason="the full sweep: set KERNELS_SOAK=1")
@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize(
    "kind,beta,dtype,biases,transform,tile",
    [
        (k, b, d, bi, tr, ti)
        for (k, b), d, bi, tr, ti in itertools.product(
            [("forward_kl", 0.0), ("reverse_kl", 1.0), ("jsd", 0.5), ("jsd", 0.1), ("tvd", 0.5)],
            [torch.float32, torch.bfloat16],
            [(False, False), (True, True)],
            [(1.0, 1.0, None, 1.0, None), (0.6, 1.5, 5.0, 0.7, 9.0)],
            list(TILES),
        )
    ],
)
def test_matches_float64_sweep(dv, monkeypatch, path, kind, beta, dtype, biases, transform, tile):
    _path(monkeypatch, path)
    run_case(dv, kind, beta, dtype, biases, transform, tile)


@pytest.mark.parametrize(
    "path,beta,dtype,transforms",
    [
        ("torch", 0.0, torch.float32, True),
        ("torch", 1.0, torch.float32, False),
        ("torch", 0.4, torch.float32, True),
        ("torch", 0.4, torch.bfloat16, True),
        ("triton", 0.0, torch.float32, False),
        ("triton", 0.4, torch.bfloat16, True),
    ],
    ids=[
        "torch-fkl-fp32-tf",
        "torch-rkl-fp32",
        "torch-jsd-fp32-tf",
        "torch-jsd-bf16-tf",
        "triton-fkl-fp32",
        "triton-jsd-bf16-tf",
    ],  # fmt: skip
)
def test_drop_in_for_trl_chunked_divergence(dv, monkeypatch, path, beta, dtype, transforms):
    """trl_chunked_divergence takes ChunkedDivergenceFunction.apply's arguments and returns what
    it returns (TRL's torch path on the CPU): divergence, entropy and the student's gradients."""
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    _path(monkeypatch, path)
    hs, ws, bs, ht, wt, bt, _ = make(dtype, True, True)
    extra = (0.8, 1.2, 6.0, 0.9, 8.0) if transforms else ()
    g = torch.randn(N)
    results = []
    for fn in (ChunkedDivergenceFunction.apply, dv.trl_chunked_divergence):
        hl, wl, bl = leaves(hs, ws, bs)
        div, ent = fn(hl, wl, bl, ht, wt, bt, beta, *extra)
        assert not ent.requires_grad
        results.append((div, ent, *torch.autograd.grad((div * g).sum(), [hl, wl, bl])))
    for name, t, o in zip(("div", "entropy", "dh", "dw", "db"), *results, strict=True):
        assert o.dtype == t.dtype and o.shape == t.shape, name
        # The same fp32 logits; in bf16 the gradient tile and matmuls round where TRL's do.
        tol = 1e-5 if dtype == torch.float32 or name in ("div", "entropy") else 1e-2
        err = ((o.double() - t.double()).norm() / t.double().norm()).item()
        assert err <= tol, (name, err)


def test_matches_trl_generalized_jsd_loss(dv, monkeypatch):
    """The GKD trainer's generalized_jsd_loss (full logits, labels -100 masked, summed over
    num_items_in_batch) equals this per-token JSD summed the same way, for beta 0, 1 and 0.5."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    _path(monkeypatch, "torch")
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    hs, ws, _, ht, wt, _, ignore = make()
    labels = torch.where(ignore, -100, 1)
    for beta in (0.0, 1.0, 0.5):
        div = dv.fused_linear_divergence(
            hs, ws, ht, wt, beta=beta, temperature=0.9, ignore_mask=ignore
        )
        theirs = GKDTrainer.generalized_jsd_loss(
            hs @ ws.t(), ht @ wt.t(), labels=labels, beta=beta, temperature=0.9,
            num_items_in_batch=torch.tensor(29.0),
        )  # fmt: skip
        torch.testing.assert_close(div.sum() / 29.0, theirs, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_beta_ends_are_the_kls(dv, monkeypatch, path):
    """TRL's reading of beta: 0 is the forward KL, 1 the reverse KL."""
    _path(monkeypatch, path)
    hs, ws, _, ht, wt, _, _ = make(n=8 if path == "triton" else N)
    for beta, kind in ((0.0, "forward_kl"), (1.0, "reverse_kl")):
        a = dv.fused_linear_divergence(hs, ws, ht, wt, kind="jsd", beta=beta)
        b = dv.fused_linear_divergence(hs, ws, ht, wt, kind=kind)
        assert torch.equal(a, b)
    # Between the ends it is neither, and equals the reference (test_matches_float64)
    mid = dv.fused_linear_divergence(hs, ws, ht, wt, beta=0.5)
    assert not torch.equal(mid, dv.fused_linear_divergence(hs, ws, ht, wt, kind="forward_kl"))


def test_no_grad_keeps_nothing(dv, monkeypatch):
    """Under no_grad nothing is saved; with grad, the inputs and three per-row statistics."""
    _path(monkeypatch, "torch")
    hs, ws, bs, ht, wt, bt, ignore = make(torch.float32, True, True)
    hl, wl, bl = leaves(hs, ws, bs)
    packed = []

    def pack(t):
        packed.append(tuple(t.shape))
        return t

    kw = {"student_bias": bl, "teacher_bias": bt, "ignore_mask": ignore, "beta": 0.3}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.no_grad():
            out = dv.fused_linear_divergence(hl, wl, ht, wt, **kw)
        assert packed == [] and out.grad_fn is None
        out = dv.fused_linear_divergence(hl, wl, ht, wt, **kw)
    assert sorted(packed) == sorted(
        [(N, HS), (V, HS), (V,), (N, HT), (V, HT), (V,), (N,), (N,), (N,), (N,)]
    )
    assert out.requires_grad


def test_compile_fullgraph_matches_eager(dv, monkeypatch):
    """torch.compile(fullgraph=True) of a function calling the op: no graph break, the same
    values and gradients as eager (torch path)."""
    _path(monkeypatch, "torch")
    torch._dynamo.reset()
    hs, ws, bs, ht, wt, bt, ignore = make(torch.float32, True, True)

    def fn(h, w, b):
        div, ent = dv.fused_linear_divergence(
            h, w, ht, wt, kind="jsd", beta=0.4, temperature=0.9, student_bias=b,
            teacher_bias=bt, student_softcap=6.0, ignore_mask=ignore, return_entropy=True,
            tile=TILES["both"],
        )  # fmt: skip
        return div.sum() / 35, ent

    results = []
    for f in (torch.compile(fn, fullgraph=True, backend="aot_eager"), fn):
        hl, wl, bl = leaves(hs, ws, bs)
        loss, ent = f(hl, wl, bl)
        assert not ent.requires_grad
        results.append((loss, ent, *torch.autograd.grad(loss, [hl, wl, bl])))
    for c, e in zip(*results, strict=True):
        torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-7)


def test_bad_arguments(dv):
    hs, ws, _, ht, wt, _, ignore = make()
    with pytest.raises(ValueError, match="kind must be"):
        dv.fused_linear_divergence(hs, ws, ht, wt, kind="kl")
    with pytest.raises(ValueError, match="beta must be"):
        dv.fused_linear_divergence(hs, ws, ht, wt, beta=1.5)
    with pytest.raises(ValueError, match="w_t must be"):
        dv.fused_linear_divergence(hs, ws, ht, wt[:-1])
    with pytest.raises(ValueError, match="h_t has"):
        dv.fused_linear_divergence(hs, ws, ht[:-1], wt)
    with pytest.raises(ValueError, match="ignore_mask shape"):
        dv.fused_linear_divergence(hs, ws, ht, wt, ignore_mask=ignore[:-1])


def test_exports(kt, dv):
    assert kt.fused_linear_divergence is dv.fused_linear_divergence
    assert kt.trl_chunked_divergence is dv.trl_chunked_divergence
