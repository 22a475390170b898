"""Fused linear log-prob head (logprob.py) on the Triton CPU interpreter and on its torch path,
against float64 references from the full logits and against TRL 1.16's ChunkedLogProbFunction."""

from __future__ import annotations

import importlib
import itertools
import os

import pytest
import torch
from _training_refs import assert_close

IGNORE = -100
SOAK = os.environ.get("KERNELS_SOAK", "").strip() not in ("", "0")
N, H, V = 37, 48, 333
# Tiles that cut tokens and vocabulary (19 x 120: 2 x 3 tiles, both with a remainder), only the
# vocabulary (all rows x 128), only the tokens (5 rows x all columns), or nothing (one tile).
# The interpreter runs each program on its own (~10 ms each here): the cases stay this small.
TILES = {"both": (19, 120), "vocab": (N, 128), "tokens": (5, V), "one": None}


@pytest.fixture(scope="module")
def lpm(kt):
    return importlib.import_module(f"{kt.__name__}.logprob")


def _path(monkeypatch, path: str) -> None:
    if path == "torch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")


def make(dtype=torch.float32, bias=False, n=N, hdim=H, vocab=V):
    """Random inputs; a third of the labels are each row's argmax (so is_top1 is exercised),
    three rows are ignored, row 0 among them."""
    h = torch.randn(n, hdim).to(dtype)
    w = (torch.randn(vocab, hdim) * 2 / hdim**0.5).to(dtype)
    b = (torch.randn(vocab) * 0.5).to(dtype) if bias else None
    labels = torch.randint(0, vocab, (n,))
    top = (h.double() @ w.double().t()).argmax(-1)
    pick = torch.rand(n) < 0.33
    labels[pick] = top[pick]
    labels[torch.tensor([0, n // 2, n - 1])] = IGNORE
    return h, w, b, labels


def leaves(*ts):
    return [None if t is None else t.detach().clone().requires_grad_() for t in ts]


def reference(h, w, b, labels, temperature=1.0, softcap=None, scale=1.0):
    """Every field in float64 from the full [N, V] logits, through autograd."""
    x = h @ w.t() + (0 if b is None else b)
    y = x * scale
    z = (softcap * torch.tanh(y / softcap) if softcap else y) / temperature
    logp = torch.log_softmax(z, -1)
    valid = labels != IGNORE
    lab = torch.where(valid, labels, 0)
    lp = logp.gather(1, lab[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    sq = torch.logsumexp(2 * logp, -1)
    mean = z.mean(-1)
    top1 = z.argmax(-1) == lab  # argmax: the first maximum
    zero = torch.zeros((), dtype=z.dtype)
    return (
        torch.where(valid, lp, zero),
        torch.where(valid, ent, zero),
        torch.where(valid, sq, zero).detach(),
        torch.where(valid, mean, zero).detach(),
        top1 & valid,
        z.detach(),
    )


def check_top1(out, ref, z64, labels, dtype):
    """is_top1 exactly, except (bf16) rows whose label logit is within rounding of the max."""
    if dtype == torch.float32:
        assert torch.equal(out, ref)
        return
    lab = torch.where(labels == IGNORE, 0, labels)
    gap = (z64.max(-1).values - z64.gather(1, lab[:, None])[:, 0]).abs()
    others = z64.clone()
    others.scatter_(1, lab[:, None], -torch.inf)
    margin = torch.minimum(gap, (z64.gather(1, lab[:, None])[:, 0] - others.max(-1).values).abs())
    clear = margin > 0.1
    assert torch.equal(out[clear], ref[clear])


CASES = {
    # dtype, bias, (temperature, softcap, logit_scale), tile, upstream grads, leaves with grad
    "fp32-plain-both": (torch.float32, False, (1.0, None, 1.0), "both", "lp+ent", "hwb"),
    "fp32-transforms-vocab": (torch.float32, True, (0.7, 5.0, 1.3), "vocab", "lp", "hwb"),
    "bf16-transforms-tokens": (torch.bfloat16, True, (1.3, 8.0, 0.8), "tokens", "ent", "hwb"),
    "fp32-temperature-one": (torch.float32, True, (0.5, None, 2.0), "one", "lp+ent", "hw"),
    "bf16-softcap-both": (torch.bfloat16, False, (1.0, 4.0, 1.0), "both", "lp+ent", "w"),
}


# The gradients in 16-bit dtypes carry two roundings of the logits' dtype that TRL's head has
# too (the logits, and the gradient tile fed to the matmuls), and the entropy gradient's terms
# cancel: over 40 seeds of the bf16 plain case, d(hidden) was off float64 by 0.8e-2 (median) and
# 1.5e-2 (max) here and by the same in TRL's ChunkedLogProbFunction. Hence twice the dtype's
# bound (test_flce.py holds FLCE's bf16 gradients to the same 2e-2).
GRAD_FACTOR = {torch.float32: 1.0, torch.bfloat16: 2.0, torch.float16: 2.0}


def run_case(lpm, dtype, bias, transform, tile, upstream, grads_of, keep=False):
    temperature, softcap, scale = transform
    h, w, b, labels = make(dtype, bias)
    hl, wl, bl = leaves(h, w, b)
    for t, key in ((hl, "h"), (wl, "w"), (bl, "b")):
        if t is not None:
            t.requires_grad_(key in grads_of)
    out = lpm.fused_linear_logprob(
        hl, wl, labels, bl, temperature=temperature, softcap=softcap, logit_scale=scale,
        outputs=lpm.OUTPUTS, tile=TILES[tile], keep_logits=keep,
    )  # fmt: skip
    h64, w64, b64 = leaves(*(None if t is None else t.double() for t in (h, w, b)))
    ref = reference(h64, w64, b64, labels, temperature, softcap, scale)
    for name, o, r in zip(lpm.OUTPUTS[:4], out[:4], ref[:4], strict=True):
        assert o.dtype == torch.float32 and o.shape == labels.shape
        assert_close(o, r, dtype, name)
    assert out.is_top1.dtype == torch.bool
    check_top1(out.is_top1, ref[4], ref[5], labels, dtype)
    g_lp = torch.randn(N) if "lp" in upstream else None
    g_ent = torch.randn(N) if "ent" in upstream else None
    loss = sum((o * g).sum() for o, g in ((out[0], g_lp), (out[1], g_ent)) if g is not None)
    loss64 = sum(
        (r * g.double()).sum() for r, g in ((ref[0], g_lp), (ref[1], g_ent)) if g is not None
    )
    mine = [t for t in (hl, wl, bl) if t is not None and t.requires_grad]
    theirs = [
        t64
        for t, t64 in zip((hl, wl, bl), (h64, w64, b64), strict=True)
        if t is not None and t.requires_grad
    ]
    grads = torch.autograd.grad(loss, mine)
    grads64 = torch.autograd.grad(loss64, theirs)
    for t, g, g64 in zip(mine, grads, grads64, strict=True):
        assert g.dtype == t.dtype and g.shape == t.shape
        assert_close(g, g64, dtype, f"grad {tuple(t.shape)}", GRAD_FACTOR[dtype])


# The interpreter runs the three cases that between them cut tokens, vocabulary and both, with
# every transform and dtype; the torch path runs all (the rest: the KERNELS_SOAK sweep).
ON_INTERPRETER = ("fp32-plain-both", "fp32-transforms-vocab", "bf16-transforms-tokens")


@pytest.mark.parametrize(
    "path,case",
    [("triton", c) for c in ON_INTERPRETER] + [("torch", c) for c in CASES],
)
def test_matches_float64(lpm, monkeypatch, path, case):
    _path(monkeypatch, path)
    run_case(lpm, *CASES[case])


@pytest.mark.parametrize(
    "path,case",
    [("triton", "fp32-plain-both")] + [("torch", c) for c in CASES],
)
def test_kept_logits_match_float64(lpm, monkeypatch, path, case):
    """keep_logits: the backward reads the forward's tiles instead of recomputing them."""
    _path(monkeypatch, path)
    run_case(lpm, *CASES[case], keep=True)


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_kept_logits_skip_the_recompute_and_survive_retain_graph(lpm, monkeypatch, path):
    """With the logits kept, the backward makes no logits matmul; it leaves them intact, so a
    second backward (retain_graph) gives the same gradients bit for bit, and they are the
    recomputing path's (to fp32 rounding: whole-row matmuls against tiles)."""
    _path(monkeypatch, path)
    h, w, b, labels = make(bias=True)
    grads, calls, real_mm = {}, [], torch.mm

    def mm(a, b_, **kw):
        calls.append(tuple(a.shape) + tuple(b_.shape))
        return real_mm(a, b_, **kw)

    for keep in (False, True):
        hl, wl, bl = leaves(h, w, b)
        out = lpm.fused_linear_logprob(
            hl, wl, labels, bl, outputs=("entropy",), tile=TILES["both"], keep_logits=keep
        )
        loss = out.log_probs.sum() + 0.5 * out.entropy.sum()
        calls.clear()
        monkeypatch.setattr(torch, "mm", mm)
        grads[keep] = torch.autograd.grad(loss, [hl, wl, bl], retain_graph=True)
        monkeypatch.setattr(torch, "mm", real_mm)
        logits_mm = [c for c in calls if c[1] == H and c[2] == H]  # [rows, H] @ [H, cols]
        assert bool(logits_mm) != keep, calls
        if keep:
            again = torch.autograd.grad(loss, [hl, wl, bl])
            for g1, g2 in zip(grads[True], again, strict=True):
                assert torch.equal(g1, g2)
    for g0, g1 in zip(grads[False], grads[True], strict=True):
        # kept logits come from whole-row matmuls, recomputed ones from tiles: fp32 sum order
        torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-6)


def test_keep_logits_budget(lpm, monkeypatch):
    """keep_logits=None keeps the [N, V] logits only when they fit KEEP_LOGITS_BYTES (0 by
    default: never); an explicit True or False wins."""
    _path(monkeypatch, "torch")
    h, w, _, labels = make()
    logits_bytes = N * V * h.element_size()

    def kept(budget, keep=None):
        monkeypatch.setattr(lpm, "KEEP_LOGITS_BYTES", budget)
        shapes = []
        hl, wl = leaves(h, w)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(t.shape) or t,
                                                      lambda t: t):  # fmt: skip
            lpm.fused_linear_logprob(hl, wl, labels, keep_logits=keep)
        return (N * V,) in shapes

    assert lpm.KEEP_LOGITS_BYTES == 0 or os.environ.get("KERNELS_LOGPROB_KEEP_BYTES")
    assert not kept(0)
    assert not kept(logits_bytes - 1)
    assert kept(logits_bytes)
    assert not kept(logits_bytes, keep=False)
    assert kept(0, keep=True)


@pytest.mark.slow
@pytest.mark.skipif(not SOAK, reason="the full sweep: set KERNELS_SOAK=1")
@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize(
    "dtype,bias,transform,tile,upstream",
    list(
        itertools.product(
            [torch.float32, torch.bfloat16, torch.float16],
            [False, True],
            [(1.0, None, 1.0), (0.6, 6.0, 1.5), (1.7, None, 0.5)],
            list(TILES),
            ["lp", "ent", "lp+ent"],
        )
    ),
)
def test_matches_float64_sweep(lpm, monkeypatch, path, dtype, bias, transform, tile, upstream):
    _path(monkeypatch, path)
    run_case(lpm, dtype, bias, transform, tile, upstream, "hwb")


OPTIONAL = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_each_outputs_combination(lpm, monkeypatch, path):
    """Every subset of the optional fields: exactly those are returned, with the values of the
    all-fields call (which test_matches_float64 holds to float64); log_probs is always there."""
    _path(monkeypatch, path)
    h, w, b, labels = make(bias=True, n=6)
    # Vocabulary chunks, so the merge of each field's statistics runs too.
    kw = {"temperature": 0.8, "softcap": 6.0, "tile": (6, 128 if path == "torch" else 200)}
    full = lpm.fused_linear_logprob(h, w, labels, b, outputs=lpm.OUTPUTS, **kw)
    subsets = [s for k in range(len(OPTIONAL) + 1) for s in itertools.combinations(OPTIONAL, k)]
    for subset in subsets:
        out = lpm.fused_linear_logprob(h, w, labels, b, outputs=("log_probs", *subset), **kw)
        assert torch.equal(out.log_probs, full.log_probs), subset
        for name in OPTIONAL:
            got = getattr(out, name)
            if name in subset:
                assert torch.equal(got, getattr(full, name)), (subset, name)
            else:
                assert got is None, (subset, name)
    # log_probs need not be named
    assert lpm.fused_linear_logprob(h, w, labels, b, outputs=(), **kw).entropy is None


@pytest.mark.parametrize("path,upstream", [("triton", "lp"), ("torch", "ent")])
def test_missing_upstream_grad_costs_nothing(lpm, monkeypatch, path, upstream):
    """Entropy computed but only log_probs used (or the reverse): the backward's tile pass gets
    no gradient for the unused field, so it neither reads nor computes it."""
    _path(monkeypatch, path)
    name = "_bwd_tile_triton" if path == "triton" else "_bwd_tile_torch"
    seen = []
    real = getattr(lpm, name)

    def spy(tile, labels, bias, log_z, ent, glp, gent, col0, o, dest=None):
        seen.append((glp is None, gent is None))
        return real(tile, labels, bias, log_z, ent, glp, gent, col0, o, dest)

    monkeypatch.setattr(lpm, name, spy)
    h, w, _, labels = make()
    hl, wl = leaves(h, w)
    out = lpm.fused_linear_logprob(hl, wl, labels, outputs=("entropy",), tile=TILES["vocab"])
    (out.log_probs if upstream == "lp" else out.entropy).sum().backward()
    assert seen and all(s == ((False, True) if upstream == "lp" else (True, False)) for s in seen)


def test_ignored_rows_and_bad_labels(lpm, monkeypatch):
    """ignore_index rows: 0 in every field and zero gradient rows; a label outside [0, V) that
    is not ignore_index: NaN log-prob (loud, no host sync)."""
    h, w, _, labels = make()
    labels[5] = V + 3
    labels[6] = -7
    hl, wl = leaves(h, w)
    out = lpm.fused_linear_logprob(hl, wl, labels, outputs=lpm.OUTPUTS, tile=TILES["both"])
    ignored = labels == IGNORE
    for name in ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits"):
        assert torch.all(getattr(out, name)[ignored] == 0), name
    assert not out.is_top1[ignored].any()
    assert torch.isnan(out.log_probs[5]) and torch.isnan(out.log_probs[6])
    assert not out.is_top1[5] and not out.is_top1[6]
    keep = ~ignored
    keep[5] = keep[6] = False
    assert torch.isfinite(out.log_probs[keep]).all()
    # Every row gets an upstream gradient (nan_to_num passes none to the NaN rows).
    (out.log_probs.nan_to_num().sum() + out.entropy.sum()).backward()
    assert torch.all(hl.grad[ignored] == 0)
    assert torch.isfinite(hl.grad).all() and torch.isfinite(wl.grad).all()
    # A custom ignore_index (the masking is the same code on either path; the torch one is faster)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    other = torch.where(ignored, 7, labels)
    other[5] = other[6] = 3
    out2 = lpm.fused_linear_logprob(h, w, torch.where(ignored, V + 50, other), ignore_index=V + 50)
    assert torch.all(out2.log_probs[ignored] == 0)
    ref = lpm.fused_linear_logprob(h, w, other).log_probs
    assert torch.equal(out2.log_probs[~ignored], ref[~ignored])


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_is_top1_first_maximum_on_ties(lpm, monkeypatch, path):
    """Two columns with the same logit (in different vocabulary chunks): only the first counts as
    top-1, as torch.argmax."""
    _path(monkeypatch, path)
    h, w, _, _ = make()
    a = int((h[0] @ w.t()).argmax())
    b = (a + 150) % V  # another chunk of 120 columns
    w[b] = w[a]
    h[2] = h[0]
    labels = torch.randint(0, V, (N,))
    labels[0], labels[2] = min(a, b), max(a, b)
    out = lpm.fused_linear_logprob(h, w, labels, outputs=("is_top1",), tile=TILES["both"])
    assert bool(out.is_top1[0]) and not bool(out.is_top1[2])


def _trl_inputs(dtype, bias):
    h, w, b, labels = make(dtype, bias)
    return h, w, b, torch.where(labels == IGNORE, 3, labels)  # TRL's callers pass valid labels


@pytest.mark.parametrize(
    "path,mode",
    [
        ("torch", "fp32"),
        ("torch", "fp32-bias-transforms"),
        ("torch", "bf16-transforms"),
        ("torch", "fp32-hidden-bf16-weight"),
        ("triton", "fp32-bias-transforms"),
        ("triton", "bf16-transforms"),
    ],
)
def test_drop_in_for_trl_chunked_logprob(lpm, monkeypatch, path, mode):
    """trl_chunked_logprob takes ChunkedLogProbFunction.apply's arguments and returns what it
    returns (TRL's torch path on the CPU), fields and gradients, with entropy and log-prob
    upstream gradients."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    _path(monkeypatch, path)
    dtype = torch.bfloat16 if mode.startswith("bf16") else torch.float32
    h, w, b, labels = _trl_inputs(dtype, "bias" in mode or mode.startswith("bf16"))
    if mode == "fp32-hidden-bf16-weight":  # TRL's cast_lm_head_to_fp32: hidden fp32, head not
        w = w.to(torch.bfloat16)
    args = (0.7, 128, 5.0, 1.3) if "transforms" in mode else (1.0, 128)
    g_lp, g_ent = torch.randn(N), torch.randn(N)
    results = []
    for fn in (ChunkedLogProbFunction.apply, lpm.trl_chunked_logprob):
        hl, wl, bl = leaves(h, w, b)
        out = fn(hl, wl, bl, labels, *args)
        assert len(out) == 5 and all(o is not None for o in out)
        loss = (out[0] * g_lp).sum() + (out[1] * g_ent).sum()
        results.append((out, torch.autograd.grad(loss, [t for t in (hl, wl, bl) if t is not None])))
    (trl, trl_grads), (ours, our_grads) = results
    # fp32: the same arithmetic up to summation order. bf16: the same bf16 logits, except that
    # TRL rounds logits + bias to bf16 where this adds the bias in fp32.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, t, o in zip(lpm.OUTPUTS, trl, ours, strict=True):
        if name == "is_top1":
            assert o.dtype == t.dtype == torch.bool
            assert (o != t).sum() <= (0 if dtype == torch.float32 else 1)
        else:
            assert o.dtype == t.dtype and o.shape == t.shape
            torch.testing.assert_close(o, t, rtol=tol, atol=tol * 10, msg=name)
    for t, o in zip(trl_grads, our_grads, strict=True):
        assert o.dtype == t.dtype
        err = ((o.double() - t.double()).norm() / t.double().norm()).item()
        # A bf16 gradient of fp32 arithmetic (the bf16 head with fp32 hidden): both sum in fp32
        # and round once, so at most the elements that round the other way differ, by an ulp.
        assert err <= (tol if o.dtype == torch.float32 else max(tol, 2**-8)), err


def test_autocast_matches_trl(lpm):
    """Under autocast the logits are made in autocast's dtype (TRL's compute dtype); the fp32
    weight gets an fp32 gradient."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    h, w, b, labels = _trl_inputs(torch.float32, False)
    results = []
    for fn in (ChunkedLogProbFunction.apply, lpm.trl_chunked_logprob):
        hl, wl = leaves(h, w)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(hl, wl, None, labels, 1.0, 128, None, 1.0, ("entropy",))
        loss = out[0].sum() + out[1].sum()
        results.append((out[:2], torch.autograd.grad(loss, [hl, wl])))
    (trl, trl_grads), (ours, our_grads) = results
    for t, o in zip(trl, ours, strict=True):
        torch.testing.assert_close(o, t, rtol=1e-4, atol=1e-4)
    for t, o in zip(trl_grads, our_grads, strict=True):
        assert o.dtype == t.dtype == torch.float32
        err = ((o - t).norm() / t.norm()).item()
        assert err <= 1e-2, err


def test_no_grad_keeps_nothing(lpm, monkeypatch):
    """Under no_grad (a reference model) nothing is saved for a backward; with grad, only the
    inputs and the per-row log-normaliser and entropy."""
    _path(monkeypatch, "torch")  # what is saved does not depend on the path
    h, w, b, labels = make(bias=True)
    hl, wl, bl = leaves(h, w, b)
    packed = []

    def pack(t):
        packed.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.no_grad():
            out = lpm.fused_linear_logprob(hl, wl, labels, bl, outputs=lpm.OUTPUTS)
        assert packed == [] and out.log_probs.grad_fn is None
        out = lpm.fused_linear_logprob(hl, wl, labels, bl, outputs=lpm.OUTPUTS)
    assert sorted(packed) == sorted([(N, H), (V, H), (V,), (N,), (N,), (N,)])
    assert out.log_probs.requires_grad and out.entropy.requires_grad
    for name in ("log_sum_sq_probs", "mean_logits", "is_top1"):
        assert not getattr(out, name).requires_grad, name


@pytest.mark.parametrize("keep", [False, True], ids=["recompute", "keep_logits"])
def test_compile_fullgraph_matches_eager(lpm, monkeypatch, keep):
    """torch.compile(fullgraph=True) of a function calling the op: no graph break (the custom
    ops' fake and autograd registrations), the same values and gradients as eager (torch path;
    the compiled graph calls the op opaquely, so the path inside does not matter to tracing)."""
    _path(monkeypatch, "torch")
    torch._dynamo.reset()
    h, w, b, labels = make(bias=True)

    def fn(h, w, b):
        out = lpm.fused_linear_logprob(
            h, w, labels, b, temperature=0.9, softcap=7.0, logit_scale=1.1,
            outputs=("log_probs", "entropy", "mean_logits", "is_top1"), tile=TILES["both"],
            keep_logits=keep,
        )  # fmt: skip
        loss = -(out.log_probs.sum()) + 0.1 * out.entropy.sum()
        return loss, out.mean_logits, out.is_top1

    results = []
    for f in (torch.compile(fn, fullgraph=True, backend="aot_eager"), fn):
        hl, wl, bl = leaves(h, w, b)
        loss, mean, top1 = f(hl, wl, bl)
        assert not mean.requires_grad
        results.append((loss, mean, top1, *torch.autograd.grad(loss, [hl, wl, bl])))
    for c, e in zip(*results, strict=True):
        torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-6)


def test_tile_shape(lpm):
    """All tokens and evened-out aligned vocabulary chunks at the benchmark shapes; tokens split
    only when MIN_TILE_COLS columns of all of them would not fit; one tile when all fits."""
    budget = lpm.MAX_TILE_BYTES
    assert lpm.tile_shape(16384, 151936, 2) == (16384, 15360)
    assert lpm.tile_shape(1024, 151936, 2) == (1024, 151936)
    rows, cols = lpm.tile_shape(200_000, 151936, 2)
    assert cols == lpm.MIN_TILE_COLS and rows * cols * 2 <= budget and rows < 200_000
    for n, vocab, size in [(16384, 151936, 2), (5000, 128256, 4), (65536, 32000, 2)]:
        rows, cols = lpm.tile_shape(n, vocab, size)
        assert rows * cols * size <= budget and cols % lpm.COL_ALIGN == 0


def test_bad_arguments(lpm):
    h, w, _, labels = make()
    with pytest.raises(ValueError, match="labels shape"):
        lpm.fused_linear_logprob(h, w, labels[:-1])
    with pytest.raises(ValueError, match="weight must be"):
        lpm.fused_linear_logprob(h, w[:, :-1], labels)
    with pytest.raises(ValueError, match="outputs must be among"):
        lpm.fused_linear_logprob(h, w, labels, outputs=("logprobs",))
    with pytest.raises(ValueError, match="temperature"):
        lpm.fused_linear_logprob(h, w, labels, temperature=0.0)


def test_leading_dims_and_exports(kt, lpm, monkeypatch):
    """[B, T, H] hidden with [B, T] labels gives [B, T] fields; the package exports the op."""
    _path(monkeypatch, "torch")
    h, w, _, labels = make()
    out = kt.fused_linear_logprob(h[:36].view(4, 9, H), w, labels[:36].view(4, 9))
    flat = lpm.fused_linear_logprob(h[:36], w, labels[:36])
    assert out.log_probs.shape == (4, 9)
    assert torch.equal(out.log_probs.reshape(-1), flat.log_probs)
    assert kt.trl_chunked_logprob is lpm.trl_chunked_logprob


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_no_tokens(lpm, monkeypatch, path):
    """Zero tokens (an all-masked micro-batch compacted away): empty fields, zero gradients."""
    _path(monkeypatch, path)
    h, w, b, _ = make(bias=True)
    hl, wl, bl = leaves(h[:0], w, b)
    # Uninitialised memory reads as NaN, so a gradient left unwritten shows.
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        out = lpm.fused_linear_logprob(hl, wl, torch.zeros(0, dtype=torch.long), bl,
                                       outputs=lpm.OUTPUTS)  # fmt: skip
        assert all(o.shape == (0,) for o in out)
        (out.log_probs.sum() + out.entropy.sum()).backward()
    finally:
        torch.use_deterministic_algorithms(was)
    assert hl.grad.shape == (0, H)
    assert torch.all(wl.grad == 0) and torch.all(bl.grad == 0)
