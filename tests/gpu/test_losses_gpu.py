"""CrossEntropy and fused Linear+CE on a CUDA GPU at real shapes, against fp32/fp64 torch references.

Each test also records the Triton launches (tests/gpu/launches.py), host side and on the device:
the torch fallback computes the same values, so only the launches show the Triton path ran, with
the launch shape asked for. Run in its own pytest process (see conftest.py):
``python -m pytest tests/gpu/test_losses_gpu.py``.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.gpu.launches import TritonLaunches

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VARIANT = (
    Path(__file__).resolve().parents[2] / "hub_kernels/kernels-lab/training/build/torch-universal"
)


@pytest.fixture(scope="module")
def kt():
    """The kernel folder as a package, without running its __init__ (only the loss modules)."""
    name = "_kernels_training_losses_gpu"
    if name not in sys.modules:
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(VARIANT)]
        sys.modules[name] = pkg
    return sys.modules[name]


@pytest.fixture(scope="module")
def ce(kt):
    return importlib.import_module(f"{kt.__name__}.cross_entropy")


@pytest.fixture(scope="module")
def fl(kt):
    return importlib.import_module(f"{kt.__name__}.fused_linear_cross_entropy")


@pytest.fixture
def launches(ce):
    with TritonLaunches(ce, device=True) as recorder:
        yield recorder


def default_kernel(ce, vocab: int) -> str:
    """The CE kernel the shipped default config launches at this vocabulary."""
    return (
        "_ce_lean_kernel"
        if ce.default_config(vocab, torch.device("cuda")).lean
        else ("_ce_fwd_kernel")
    )


def ce_ran_on_gpu(launches: TritonLaunches, kernel: str, **options) -> None:
    launches.assert_launched(kernel, **options)
    launches.assert_device_matches()


@pytest.fixture(autouse=True)
def _exact_fp32_matmuls():
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = prev


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def targets(n: int, vocab: int, frac: float = 0.1) -> torch.Tensor:
    t = torch.randint(0, vocab, (n,), device="cuda")
    t[torch.rand(n, device="cuda") < frac] = -100
    return t


def test_ce_anchor_shape_bf16(ce, launches):
    """8192 x 151936 bf16 (the anchor): loss and in-place gradient vs fp32 torch."""
    n, vocab = 8192, 151936
    logits = torch.randn(n, vocab, device="cuda", dtype=torch.bfloat16) * 3
    t = targets(n, vocab)
    x32 = logits.float().requires_grad_(True)
    ref = F.cross_entropy(x32, t)
    (ref_grad,) = torch.autograd.grad(ref, x32)
    del x32
    x = logits.clone().requires_grad_(True)
    loss = ce.cross_entropy(x, t)
    (grad,) = torch.autograd.grad(loss, x)
    ce_ran_on_gpu(launches, default_kernel(ce, vocab), WRITE_GRAD=True)
    assert rel_err(loss, ref) < 1e-5
    assert rel_err(grad, ref_grad) < 1e-2
    assert (grad[t == -100] == 0).all()


def _flce_reference(h, w, b, t, **kw):
    h32 = h.detach().float().requires_grad_(True)
    w32 = w.detach().float().requires_grad_(True)
    leaves = [h32, w32]
    logits = h32 @ w32.t()
    if b is not None:
        b32 = b.detach().float().requires_grad_(True)
        leaves.append(b32)
        logits = logits + b32
    loss = F.cross_entropy(logits, t, **kw)
    return loss.detach(), torch.autograd.grad(loss, leaves)


def test_flce_llama_head_bf16(fl, ce, launches):
    """N 4096, H 4096, V 128256 bf16, several chunks: loss and grads vs fp32 torch."""
    n, hdim, vocab = 4096, 4096, 128256
    h = torch.randn(n, hdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hdim, device="cuda") * hdim**-0.5 * 2).bfloat16().requires_grad_()
    t = targets(n, vocab)
    ref, (ref_dh, ref_dw) = _flce_reference(h, w, None, t)
    loss = fl.fused_linear_cross_entropy(h, w, t)
    dh, dw = torch.autograd.grad(loss * 2.5, [h, w])  # grad_output != 1 too
    ce_ran_on_gpu(launches, default_kernel(ce, vocab))
    assert rel_err(loss, ref) < 1e-3
    assert rel_err(dh, 2.5 * ref_dh) < 1e-2
    assert rel_err(dw, 2.5 * ref_dw) < 1e-2


def test_flce_bias_none_reduction_qwen_vocab(fl, ce, launches):
    """H 1024, V 151936 with bias, smoothing; reduction none takes the recompute path."""
    n, hdim, vocab = 2048, 1024, 151936
    h = torch.randn(n, hdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hdim, device="cuda") * hdim**-0.5 * 2).bfloat16().requires_grad_()
    b = (torch.randn(vocab, device="cuda") * 0.1).bfloat16().requires_grad_()
    t = targets(n, vocab)
    g_out = torch.rand(n, device="cuda") + 0.5
    h32, w32, b32 = (p.detach().float().requires_grad_(True) for p in (h, w, b))
    ref = F.cross_entropy(h32 @ w32.t() + b32, t, reduction="none", label_smoothing=0.1)
    ref_grads = torch.autograd.grad(ref, [h32, w32, b32], g_out)
    loss = fl.fused_linear_cross_entropy(
        h, w, t, b, reduction="none", label_smoothing=0.1, chunk_rows=768
    )
    grads = torch.autograd.grad(loss, [h, w, b], g_out)
    ce_ran_on_gpu(launches, default_kernel(ce, vocab))
    assert rel_err(loss, ref) < 1e-3
    for got, want in zip(grads, ref_grads, strict=True):
        assert rel_err(got, want) < 1e-2


def test_flce_tied_embedding(fl, ce, launches):
    vocab, hdim, n = 32000, 1024, 2048
    emb = torch.nn.Embedding(vocab, hdim, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        emb.weight.mul_(0.05)
    ids = torch.randint(0, vocab, (n,), device="cuda")
    t = torch.roll(ids, -1)
    loss = fl.fused_linear_cross_entropy(emb(ids) * 0.5, emb.weight, t)
    (dw,) = torch.autograd.grad(loss, emb.weight)
    w32 = emb.weight.detach().float().requires_grad_(True)
    ref = F.cross_entropy((w32[ids] * 0.5) @ w32.t(), t)
    (ref_dw,) = torch.autograd.grad(ref, w32)
    ce_ran_on_gpu(launches, default_kernel(ce, vocab))
    assert rel_err(loss, ref) < 1e-3 and rel_err(dw, ref_dw) < 1e-2


@pytest.mark.parametrize("num_items", [None, 3000, "host-tensor", "device-tensor"])
def test_default_paths_never_wait_for_the_gpu(kt, ce, fl, num_items):
    """The default CE, fused linear CE and ForCausalLMLoss, forward and backward, under
    torch.cuda.set_sync_debug_mode("error"): any device-to-host sync (an .item(), a bool of a
    device tensor, a nonzero, a copy from pageable host memory such as a host-held num_items
    moved to the device) raises. A sync would expose the host's work after it as GPU idle time
    on every call; then the results against fp32 torch. ForCausalLMLoss gets its labels on the
    host, as a caller that never moved them would pass them."""
    layers = importlib.import_module(f"{kt.__name__}.loss_layers")
    if num_items == "host-tensor":
        num_items = torch.tensor(3000)
    elif num_items == "device-tensor":
        num_items = torch.tensor(3000, device="cuda")
    n, hdim, vocab = 4096, 256, 50257  # CE rows not 16-byte aligned (the fused CE pads its own)
    logits = torch.randn(n, vocab, device="cuda", dtype=torch.bfloat16) * 3
    h = torch.randn(n, hdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hdim, device="cuda") * hdim**-0.5 * 2).bfloat16().requires_grad_()
    t = targets(n, vocab)
    t_host = t.cpu()

    def calls():
        x = logits.clone().requires_grad_(True)
        (dx,) = torch.autograd.grad(ce.cross_entropy(x, t, num_items=num_items), x)
        y = logits.clone().requires_grad_(True)
        loss = layers.ForCausalLMLoss(y[None], t_host[None], vocab, num_items_in_batch=num_items)
        (dy,) = torch.autograd.grad(loss, y)
        flce = fl.fused_linear_cross_entropy(h, w, t, num_items=num_items, chunk_rows=1024)
        return dx, dy, flce, torch.autograd.grad(flce, [h, w])

    calls()  # compile every kernel first (outside the checked region)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        dx, dy, flce, (dh, dw) = calls()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    denom = 3000 if num_items is not None else None
    x32 = logits.float().requires_grad_(True)
    ref = F.cross_entropy(x32, t, reduction="sum" if denom else "mean") / (denom or 1)
    (ref_dx,) = torch.autograd.grad(ref, x32)
    assert rel_err(dx, ref_dx) < 1e-2
    shifted = torch.cat([t[1:], t.new_full((1,), -100)])  # ForCausalLMLoss shifts the labels
    y32 = logits.float().requires_grad_(True)
    ref_y = F.cross_entropy(y32, shifted, reduction="sum" if denom else "mean") / (denom or 1)
    (ref_dy,) = torch.autograd.grad(ref_y, y32)
    assert rel_err(dy, ref_dy) < 1e-2
    ref_fl, (ref_dh, ref_dw) = _flce_reference(h, w, None, t, reduction="sum" if denom else "mean")
    ref_fl = ref_fl / (denom or 1)
    assert rel_err(flce, ref_fl) < 1e-3
    assert rel_err(dh, ref_dh / (denom or 1)) < 1e-2
    assert rel_err(dw, ref_dw / (denom or 1)) < 1e-2


# Last: a spinning variant that hung would stop only this test (run it under a timeout).
@pytest.mark.parametrize(
    "config",
    [
        None,
        dict(chunk=16384, block=4096, num_warps=8, spin=False),
        dict(chunk=16384, block=16384, num_warps=16, spin=True, one_pass=True),
        dict(chunk=8192, block=2048, num_warps=4, spin=True, evict=True),
        dict(chunk=155648, block=8192, num_warps=16),
    ],
    ids=["default", "last-arriver", "spin-one-pass", "spin-two-reads", "one-program-per-row"],
)
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
def test_ce_options_every_launch_shape(ce, config, inplace, launches):
    """Smoothing + z-loss + softcap, reduction none with per-token upstream gradients; the
    gradient into its own buffer, or over the logits (where a read of the target logit after
    a sibling thread's store would corrupt the loss). Each launch shape is checked as launched:
    chunk, block, warps, spin, one pass and cache policy as the config asks."""
    n, vocab = 1024, 151936
    logits = torch.randn(n, vocab, device="cuda", dtype=torch.bfloat16) * 3
    t = targets(n, vocab)
    g_out = torch.rand(n, device="cuda") + 0.5
    x64 = logits.double().requires_grad_(True)
    z = 20.0 * torch.tanh(x64 / 20.0)
    logp = torch.log_softmax(z, -1)
    lse = torch.logsumexp(z, -1)
    valid = t != -100
    per_row = 0.9 * -logp.gather(1, torch.where(valid, t, 0)[:, None])[:, 0]
    per_row = torch.where(valid, per_row + 0.1 * -logp.mean(-1) + 1e-3 * lse**2, 0.0)
    (ref_grad,) = torch.autograd.grad(per_row, x64, g_out.double())
    grad = logits.clone() if inplace else torch.full_like(logits, float("nan"))
    source = grad if inplace else logits
    cfg = None if config is None else ce.CEConfig(**config)
    opts = dict(label_smoothing=0.1, lse_square_scale=1e-3, softcap=20.0, config=cfg)
    loss, _ = ce.ce_rows(source, t, grad, torch.ones(1, device="cuda"), row_scale=g_out, **opts)
    asked = cfg or ce.default_config(vocab, logits.device)
    several = vocab > asked.chunk  # spinning and one-pass programs need several chunks per row
    if asked.lean:  # the default may be the lean kernel (test_ce_lean_variants covers it)
        ce_ran_on_gpu(launches, "_ce_lean_kernel", CHUNK=asked.chunk, num_warps=asked.num_warps)
    else:
        ce_ran_on_gpu(
            launches, "_ce_fwd_kernel", CHUNK=asked.chunk, BLOCK=asked.block,
            num_warps=asked.num_warps, SPIN=asked.spin and several,
            ONE_PASS=asked.one_pass and (asked.spin and several or not several),
            LOAD_POLICY="evict_last" if asked.evict else "",
        )  # fmt: skip
    assert rel_err(loss, per_row) < 1e-5
    assert rel_err(grad, ref_grad) < 1e-2


# The lean kernel's variants (CEConfig(lean=True, ...)); the pid ones wait on siblings that only
# the GPU's in-order dispatch guarantees to run, so they come last.
LEAN = {
    "default-spin-r40": dict(chunk=8192, block=2048, num_warps=4, spin=True, lean=True, maxnreg=40),
    "spin": dict(chunk=8192, block=2048, num_warps=4, spin=True, lean=True),
    "spin-r40-persist8": dict(chunk=8192, block=2048, num_warps=4, spin=True, lean=True, maxnreg=40, persist=8),
    "queue-r32-persist12": dict(chunk=8192, block=2048, num_warps=4, lean=True, queue=True, maxnreg=32, persist=12),
    "spin-16384-w8-evict": dict(chunk=16384, block=4096, num_warps=8, spin=True, lean=True, evict=True),
    "queue": dict(chunk=8192, block=2048, num_warps=4, lean=True, queue=True),
    "queue-4096-lag1-reverse": dict(chunk=4096, block=1024, num_warps=4, lean=True, queue=True, lag=1, reverse=True),
    "queue-r32": dict(chunk=8192, block=2048, num_warps=4, lean=True, queue=True, maxnreg=32),
    "pair": dict(chunk=8192, block=2048, num_warps=4, lean=True, queue=True, pair=True),
    "queue-pid": dict(chunk=8192, block=2048, num_warps=4, lean=True, queue=True, ticket=False),
    # a fixed grid of 8 programs per SM, tiles by program id: every program must be resident
    "spin-r40-persist8-pid": dict(chunk=8192, block=2048, num_warps=4, spin=True, lean=True, maxnreg=40, persist=8, ticket=False),
}  # fmt: skip


@pytest.mark.parametrize("config", list(LEAN.values()), ids=list(LEAN))
@pytest.mark.parametrize("vocab", [151936, 50257])
@pytest.mark.parametrize("options", [False, True], ids=["plain", "options"])
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
def test_ce_lean_variants(ce, config, vocab, options, inplace, launches):
    """Each lean variant, plain (the fast path) and with smoothing + z-loss + softcap and
    per-token upstream gradients, at a real vocabulary and at one whose rows are not 16-byte
    aligned (50257: the aligned-read path), in place and into its own buffer, vs float64."""
    n = 512
    logits = torch.randn(n, vocab, device="cuda", dtype=torch.bfloat16) * 3
    t = targets(n, vocab)
    g_out = torch.rand(n, device="cuda") + 0.5
    cap, eps, lam = (20.0, 0.1, 1e-3) if options else (None, 0.0, 0.0)
    x64 = logits.double().requires_grad_(True)
    z = cap * torch.tanh(x64 / cap) if cap else x64
    logp = torch.log_softmax(z, -1)
    lse = torch.logsumexp(z, -1)
    valid = t != -100
    per_row = (1 - eps) * -logp.gather(1, torch.where(valid, t, 0)[:, None])[:, 0]
    per_row = torch.where(valid, per_row + eps * -logp.mean(-1) + lam * lse**2, 0.0)
    (ref_grad,) = torch.autograd.grad(per_row, x64, g_out.double())
    grad = logits.clone() if inplace else torch.full_like(logits, float("nan"))
    source = grad if inplace else logits
    cfg = ce.CEConfig(**config)
    loss, _ = ce.ce_rows(
        source, t, grad, torch.ones(1, device="cuda"), row_scale=g_out, label_smoothing=eps,
        lse_square_scale=lam, softcap=cap, config=cfg,
    )  # fmt: skip
    launches.assert_launched(
        "_ce_lean_kernel", CHUNK=cfg.chunk, num_warps=cfg.num_warps, QUEUE=cfg.queue,
        TICKET=cfg.ticket, ALIGN=vocab % 16 != 0, REVERSE=cfg.reverse,
        LOAD_POLICY="evict_last" if cfg.evict else "", PERSIST=cfg.persist > 0,
    )  # fmt: skip
    launches.assert_device_matches()
    assert rel_err(loss, per_row) < 1e-5
    assert rel_err(grad, ref_grad) < 1e-2
    assert (grad[~valid] == 0).all()
