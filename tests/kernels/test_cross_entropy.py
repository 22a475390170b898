"""CrossEntropy kernel on the Triton CPU interpreter against an independent float64 reference."""

from __future__ import annotations

import importlib

import pytest
import torch
from _training_refs import rel_err
from cross_entropy_variants import ce_variant  # noqa: F401 - a fixture

from tests.gpu.launches import TritonLaunches
from tests.sweep import sweep_param


@pytest.fixture(scope="module")
def ce(kt):
    return importlib.import_module(f"{kt.__name__}.cross_entropy")


def reference(
    logits,
    target,
    *,
    ignore_index=-100,
    smoothing=0.0,
    zloss=0.0,
    softcap=None,
    reduction="mean",
    num_items=None,
    grad_out=None,
):
    """float64 loss and d(loss)/d(logits) through autograd, from the textbook definitions."""
    x = logits.detach().double().requires_grad_(True)
    z = softcap * torch.tanh(x / softcap) if softcap else x
    logp = torch.log_softmax(z, dim=-1)
    lse = torch.logsumexp(z, dim=-1)
    valid = target != ignore_index
    t = torch.where(valid, target, 0)
    nll = -logp.gather(-1, t[..., None])[..., 0]
    uniform = -logp.mean(-1)
    per_row = (1 - smoothing) * nll + smoothing * uniform + zloss * lse**2
    per_row = torch.where(valid, per_row, 0.0)
    if reduction == "none":
        loss = per_row
    elif reduction == "sum":
        loss = per_row.sum()
    else:
        denom = valid.sum().double() if num_items is None else float(num_items)
        loss = per_row.sum() / denom
    g = torch.ones_like(loss) if grad_out is None else grad_out.double()
    (dx,) = torch.autograd.grad(loss, x, g)
    return loss.detach(), dx


def make_inputs(n, vocab, dtype, ignore_frac=0.25, ignore_index=-100, scale=4.0):
    logits = (torch.randn(n, vocab) * scale).to(dtype)
    target = torch.randint(0, vocab, (n,))
    drop = torch.rand(n) < ignore_frac
    drop[0] = True  # always at least one ignored row
    drop[1] = False  # and at least one counted row
    target[drop] = ignore_index
    return logits, target


TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}

OPTIONS = [
    {},
    {"smoothing": 0.1},
    {"zloss": 1e-3},
    {"softcap": 15.0},
    {"smoothing": 0.2, "zloss": 1e-2, "softcap": 10.0},
]


# Every option set with every reduction; the (dtype, vocab) pair cycles so that fp32 and bf16,
# and a power-of-two-free vocab split over two programs per row, are each covered many times.
PAIRS = [
    (torch.float32, 1000),
    (torch.bfloat16, 1531),
    (torch.float32, 1531),
    (torch.bfloat16, 1000),
]
CASES = [
    (opts, red, *PAIRS[i % len(PAIRS)])
    for i, (opts, red) in enumerate((o, r) for o in OPTIONS for r in ("mean", "sum", "none"))
]


@pytest.mark.usefixtures("ce_variant")
@pytest.mark.parametrize(
    "opts,reduction,dtype,vocab",
    CASES,
    ids=[f"{'-'.join(o) or 'plain'}-{r}-{str(d)[6:]}-{v}" for o, r, d, v in CASES],
)
def test_loss_and_grad(ce, vocab, dtype, opts, reduction):
    logits, target = make_inputs(20, vocab, dtype)
    grad_out = torch.rand(20) + 0.5 if reduction == "none" else torch.tensor(1.7)
    ref_loss, ref_dx = reference(logits, target, reduction=reduction, grad_out=grad_out, **opts)
    x = logits.clone().requires_grad_(True)
    loss = ce.cross_entropy(
        x,
        target,
        label_smoothing=opts.get("smoothing", 0.0),
        lse_square_scale=opts.get("zloss", 0.0),
        softcap=opts.get("softcap"),
        reduction=reduction,
    )
    assert loss.dtype == torch.float32
    assert rel_err(loss.detach(), ref_loss) < 2e-6 * (10 if dtype == torch.bfloat16 else 1) + 1e-6
    loss.backward(grad_out)
    assert x.grad.dtype == dtype
    assert torch.isfinite(x.grad).all()
    assert rel_err(x.grad, ref_dx) < TOL[dtype]
    ignored = target == -100
    assert (x.grad[ignored] == 0).all()


@pytest.mark.parametrize("chunk,block", [(256, 128), (512, 512), (2048, 256)])
def test_chunk_layouts_agree(ce, chunk, block):
    """The multi-program row split (last arriver writes the row) equals the reference."""
    logits, target = make_inputs(16, 1531, torch.float32, ignore_index=7)
    ref_loss, ref_dx = reference(logits, target, ignore_index=7, smoothing=0.05, reduction="sum")
    grad = torch.full_like(logits, float("nan"))  # poison: every element must be written
    cfg = ce.CEConfig(chunk=chunk, block=block, num_warps=4)
    loss, lse = ce.ce_rows(
        logits, target, grad, torch.ones(1), ignore_index=7, label_smoothing=0.05, config=cfg
    )
    assert rel_err(loss.sum(), ref_loss) < 1e-6
    assert rel_err(grad, ref_dx) < 2e-5
    keep = target != 7
    ref_lse = torch.logsumexp(logits.double(), -1)
    assert rel_err(lse[keep], ref_lse[keep]) < 1e-6


@pytest.mark.usefixtures("ce_variant")
def test_inplace_consumes_logits_and_bumps_version(ce):
    logits, target = make_inputs(12, 1000, torch.bfloat16)
    _, ref_dx = reference(logits, target)
    x = logits.clone().requires_grad_(True)
    buf = x * 1.0  # a non-leaf buffer, as a model's lm_head output would be
    version = buf._version
    loss = ce.cross_entropy(buf, target)
    assert buf._version > version
    # The buffer now holds d(loss)/d(logits) already (grad_output 1 leaves it untouched).
    assert rel_err(buf.detach(), ref_dx) < 1e-2
    loss.backward()
    assert rel_err(x.grad, ref_dx) < 1e-2


def test_inplace_misuse_is_reported(ce):
    """A tensor saved by another op's backward must not be silently overwritten."""
    logits, target = make_inputs(8, 1000, torch.float32)
    x = logits.clone().requires_grad_(True)
    y = torch.exp(x)  # exp saves its output for backward
    loss = ce.cross_entropy(y, target)
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()


@pytest.mark.usefixtures("ce_variant")
def test_not_inplace_keeps_logits(ce):
    logits, target = make_inputs(12, 1531, torch.float32)
    ref_loss, ref_dx = reference(logits, target, smoothing=0.1)
    x = logits.clone().requires_grad_(True)
    loss = ce.cross_entropy(x, target, label_smoothing=0.1, inplace=False)
    assert torch.equal(x.detach(), logits)
    loss.backward()
    assert rel_err(loss.detach(), ref_loss) < 1e-6
    assert rel_err(x.grad, ref_dx) < 2e-5


@pytest.mark.usefixtures("ce_variant")
def test_num_items_divisor(ce):
    logits, target = make_inputs(16, 1000, torch.float32)
    ref_loss, ref_dx = reference(logits, target, num_items=37)
    for n in (37, torch.tensor(37)):
        x = logits.clone().requires_grad_(True)
        loss = ce.cross_entropy(x, target, num_items=n)
        loss.backward()
        assert rel_err(loss.detach(), ref_loss) < 1e-6
        assert rel_err(x.grad, ref_dx) < 2e-5


@pytest.mark.usefixtures("ce_variant")
@pytest.mark.parametrize("vocab", [1000, 1531])
def test_no_grad_leaves_logits_untouched(ce, vocab):
    """Under torch.no_grad() nothing is written, even into logits that require grad."""
    logits, target = make_inputs(10, vocab, torch.bfloat16)
    ref_loss, _ = reference(logits, target, zloss=1e-3)
    x = logits.clone().requires_grad_(True)
    with torch.no_grad():
        loss = ce.cross_entropy(x, target, lse_square_scale=1e-3)
    assert torch.equal(x.detach(), logits)
    assert rel_err(loss, ref_loss) < 1e-5


@pytest.mark.usefixtures("ce_variant")
def test_3d_logits_and_all_ignored(ce):
    logits, target = make_inputs(2 * 6, 1000, torch.float32)
    x = logits.view(2, 6, 1000).clone().requires_grad_(True)
    loss = ce.cross_entropy(x, target.view(2, 6), reduction="none")
    assert loss.shape == (2, 6)
    ref_loss, _ = reference(logits, target, reduction="none")
    assert rel_err(loss.detach().reshape(-1), ref_loss) < 1e-6
    # Every row ignored: the mean is 0/0 like torch's, and the gradient is exactly zero.
    y = logits.clone().requires_grad_(True)
    loss = ce.cross_entropy(y, torch.full((12,), -100))
    assert torch.isnan(loss)
    loss.backward()
    assert (y.grad == 0).all()


@pytest.mark.usefixtures("ce_variant")
def test_out_of_range_target_gives_nan(ce):
    logits, target = make_inputs(6, 1000, torch.float32, ignore_frac=0.0)
    target[3] = 1000
    loss = ce.cross_entropy(logits, target, reduction="none")
    assert torch.isnan(loss[3]) and torch.isfinite(loss[torch.arange(6) != 3]).all()


def test_bad_options_raise(ce):
    logits, target = make_inputs(4, 1000, torch.float32)
    with pytest.raises(ValueError, match="reduction"):
        ce.cross_entropy(logits, target, reduction="avg")
    with pytest.raises(ValueError, match="target shape"):
        ce.cross_entropy(logits, target[:3])
    with pytest.raises(ValueError, match="softcap"):
        ce.cross_entropy(logits, target, softcap=-1.0)


def test_torch_path_matches_kernel(ce, monkeypatch):
    """Without the interpreter (plain CPU) the torch path has the same contract."""
    logits, target = make_inputs(12, 1531, torch.float32)
    opts = dict(ignore_index=-100, label_smoothing=0.1, lse_square_scale=1e-3, softcap=12.0)
    g1 = torch.empty_like(logits)
    l1, s1 = ce.ce_rows(logits, target, g1, torch.tensor([0.5]), **opts)
    monkeypatch.setattr(ce, "use_triton", lambda t: False)
    g2 = torch.empty_like(logits)
    l2, s2 = ce.ce_rows(logits, target, g2, torch.tensor([0.5]), **opts)
    assert rel_err(l1, l2) < 1e-6 and rel_err(g1, g2) < 1e-6 and rel_err(s1, s2) < 1e-6


# 512/256 puts two chunk edges in each row, 256/128 five (with five times the programs, the
# costliest case of this file on the interpreter): the same kernel path, more edges.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "chunk,block", [(512, 256), sweep_param(256, 128, what="five chunk edges per row")]
)
def test_lean_targets_at_chunk_edges(ce, dtype, chunk, block):
    """Rows 1531 wide are not 16-byte aligned, so the lean kernel reads each from the aligned
    address below its start and its chunk edges move by that shift, row by row. Targets on
    every column next to a nominal chunk edge: the loss and the target column's gradient must
    come from the program that really holds the target."""
    vocab, n = 1531, 48
    logits, _ = make_inputs(n, vocab, dtype, ignore_frac=0.0)
    edges = torch.arange(chunk, vocab, chunk)
    target = (edges[torch.arange(n) % len(edges)] + torch.arange(n) % 16 - 8).clamp(0, vocab - 1)
    ref_loss, ref_dx = reference(logits, target, reduction="none")
    grad = torch.full_like(logits, float("nan"))
    cfg = ce.CEConfig(chunk=chunk, block=block, num_warps=4, lean=True, queue=True)
    loss, _ = ce.ce_rows(logits, target, grad, torch.ones(1), config=cfg)
    assert rel_err(loss, ref_loss) < 1e-6
    assert rel_err(grad, ref_dx) < TOL[dtype]


def test_scale_rows_strides_over_more_blocks_than_programs(ce):
    """The backward's in-place scale: a persistent grid (at most 8 programs per SM; the
    interpreter counts 4 SMs) strides over 1 << 16-element blocks, here 41 of them, with one
    factor, one per row (rows of factor 1 included), and a factor of exactly 1 (a no-op)."""
    x = torch.randn(40, 65536 + 3)
    for g in (torch.tensor(1.5), torch.rand(40) + 0.5, torch.ones(1)):
        if g.numel() == 40:
            g[::3] = 1.0
        y = x.clone()
        ce.scale_rows_(y, g)
        expect = x * (g[:, None] if g.numel() == 40 else g)
        assert torch.equal(y, expect)


def test_config_from_environment(ce, monkeypatch):
    """KERNELS_CE_CONFIG picks the launch config (here a lean queue variant) for cross_entropy
    without code changes; the kernel launched is the one it names, and the result is right."""
    monkeypatch.setenv("KERNELS_CE_CONFIG", "chunk=512, block=256, num_warps=4, lean, queue, lag=2")
    logits, target = make_inputs(12, 1531, torch.float32)
    ref_loss, ref_dx = reference(logits, target, smoothing=0.1)
    x = logits.clone().requires_grad_(True)
    with TritonLaunches(ce) as launches:
        loss = ce.cross_entropy(x, target, label_smoothing=0.1)
    launches.assert_launched("_ce_lean_kernel", CHUNK=512, QUEUE=True, LAG=2, PAIR=False)
    assert not launches.of("_ce_fwd_kernel")
    loss.backward()
    assert rel_err(loss.detach(), ref_loss) < 1e-6
    assert rel_err(x.grad, ref_dx) < 2e-5


@pytest.mark.parametrize(
    "spec,match",
    [
        ("chunk=512,block=256,num_warps=4,speed=9", "unknown field 'speed'"),
        ("chunk=512,block=256,num_warps=four", "not an integer"),
        ("chunk=512,lean", "give block, num_warps"),
        ("chunk=512,block=384,num_warps=4", "multiple of block"),
        ("chunk=512,block=256,num_warps=4,lean,queue,lag=0", "lag must be at least 1"),
    ],
)
def test_config_from_environment_rejects_bad_specs(ce, monkeypatch, spec, match):
    monkeypatch.setenv("KERNELS_CE_CONFIG", spec)
    logits, target = make_inputs(4, 1000, torch.float32)
    with pytest.raises(ValueError, match=match) as info:
        ce.cross_entropy(logits, target)
    assert str(info.value).startswith("KERNELS_CE_CONFIG=") and "\n" not in str(info.value)


# The GPU's shipped default, run by the interpreter: the same kernel, chunk, block and warps (the
# interpreter runs its programs one after another, so the lean kernel takes its queue schedule
# where a GPU spins, and maxnreg does not apply). 50257: rows not 16-byte aligned in fp32 or bf16,
# split over seven chunks, whose edges move with each row's alignment shift.
GPU_DEFAULT_CASES = [
    (torch.bfloat16, 50257, {}, "mean"),
    (torch.float32, 50257, {"smoothing": 0.1, "zloss": 1e-3, "softcap": 20.0}, "none"),
    (torch.bfloat16, 32000, {"smoothing": 0.1}, "sum"),
    (torch.float32, 1000, {}, "mean"),
]


@pytest.mark.parametrize(
    "dtype,vocab,opts,reduction",
    GPU_DEFAULT_CASES,
    ids=[f"{str(d)[6:]}-{v}-{'-'.join(o) or 'plain'}-{r}" for d, v, o, r in GPU_DEFAULT_CASES],
)
def test_gpu_default_config_on_the_interpreter(ce, monkeypatch, dtype, vocab, opts, reduction):
    """cross_entropy with the config a CUDA device gets, forward and backward (the gradient in
    place, over the logits), against float64: the loss of every row and every element of the
    gradient (ignored rows exactly zero), targets on the columns around the chunk edges and on
    the last column."""
    monkeypatch.delenv("KERNELS_CE_CONFIG", raising=False)
    cfg = ce.default_config(vocab, torch.device("cuda"))
    assert (cfg.lean, cfg.spin, cfg.queue, cfg.maxnreg) == (True, True, False, 40)
    monkeypatch.setattr(ce, "default_config", lambda v, device: cfg)
    n = 12
    logits, target = make_inputs(n, vocab, dtype, ignore_frac=0.2)
    edges = [c + d for c in range(cfg.chunk, vocab, cfg.chunk) for d in (-1, 0)] + [vocab - 1]
    kept = (target != -100).nonzero()[:, 0]
    for row, col in zip(kept, edges, strict=False):
        target[row] = col
    grad_out = torch.rand(n) + 0.5 if reduction == "none" else torch.tensor(1.3)
    ref_loss, ref_dx = reference(logits, target, reduction=reduction, grad_out=grad_out, **opts)
    x = logits.clone().requires_grad_(True)
    with TritonLaunches(ce) as launches:
        loss = ce.cross_entropy(
            x,
            target,
            label_smoothing=opts.get("smoothing", 0.0),
            lse_square_scale=opts.get("zloss", 0.0),
            softcap=opts.get("softcap"),
            reduction=reduction,
        )
    launches.assert_launched("_ce_lean_kernel", CHUNK=cfg.chunk, num_warps=cfg.num_warps)
    loss.backward(grad_out)
    assert rel_err(loss.detach(), ref_loss) < (1e-6 if dtype == torch.float32 else 1e-5)
    assert rel_err(x.grad, ref_dx) < TOL[dtype]
    # every element, not only the norm: a column written by the wrong program or left unwritten
    # stands out against the largest gradient of its row
    err = (x.grad.double() - ref_dx).abs().amax(1)
    assert (err <= TOL[dtype] * ref_dx.abs().amax(1) + 1e-7).all()
    assert (x.grad[target == -100] == 0).all()


def test_scratch_gives_each_launch_fresh_counters(ce):
    """The fused linear CE's per-call `Scratch`: the slots are shared by its launches, but the
    counters never are, and all are zero when taken (a launch whose counters carry a previous
    launch's counts would read stale partials, or wait forever on the interpreter's queue)."""
    scratch = ce.Scratch(launches=3)
    taken = []
    for n in (10, 10, 4):  # the last chunk of tokens is shorter
        stats, counts = scratch.take(n * 4, n + 1, torch.device("cpu"))
        assert stats.numel() == n * 4 and counts.numel() == n + 1 and (counts == 0).all()
        counts += 7  # what a launch leaves behind
        taken.append((stats, counts))
    assert len({s.data_ptr() for s, _ in taken}) == 1
    ends = sorted((c.data_ptr(), c.data_ptr() + c.numel() * c.element_size()) for _, c in taken)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:], strict=False))
    # more launches than planned: new zeros, never a used counter
    _, extra = scratch.take(40, 11, torch.device("cpu"))
    assert (extra == 0).all()


PERSISTENT = {
    # the queue, programs taking tiles from the ticket counter until it runs past the last
    "queue-ticket": dict(queue=True, ticket=True, persist=2),
    # tiles pid, pid + grid, ...: one program on the interpreter (see _lean_rows)
    "queue-static": dict(queue=True, ticket=False, persist=2),
    "pair-ticket": dict(queue=True, pair=True, ticket=True, persist=3),
    # a spin config: several chunks per row, so the interpreter takes the queue schedule
    "spin-ticket": dict(spin=True, ticket=True, persist=2),
}


@pytest.mark.parametrize("fields", list(PERSISTENT.values()), ids=list(PERSISTENT))
def test_lean_persistent_grid(ce, fields):
    """CEConfig(persist=k): k programs per SM (the interpreter counts 4 SMs) loop over the
    tiles instead of one program per tile. Every row's loss and every gradient element (the
    gradient buffer poisoned with NaN) against float64, with ignored rows; launched with the
    grid the config asks for."""
    vocab, n = 1531, 24
    cfg = ce.CEConfig(chunk=512, block=256, num_warps=4, lean=True, **fields)
    logits, target = make_inputs(n, vocab, torch.float32)
    ref_loss, ref_dx = reference(logits, target, smoothing=0.1, reduction="none")
    grad = torch.full_like(logits, float("nan"))
    with TritonLaunches(ce) as launches:
        loss, _ = ce.ce_rows(logits, target, grad, torch.ones(1), label_smoothing=0.1, config=cfg)
    (launch,) = launches.of("_ce_lean_kernel")
    assert launch.options["PERSIST"] and launch.options["QUEUE"]
    chunks = 3  # ceil((1531 + 3) / 512): unaligned fp32 rows read from 3 columns earlier
    tiles = (n + cfg.lag) * chunks * (1 if cfg.pair else 2)
    assert launch.grid == ((min(tiles, cfg.persist * 4) if cfg.ticket else 1),)
    assert rel_err(loss, ref_loss) < 1e-6
    assert rel_err(grad, ref_dx) < 2e-5
    assert (grad[target == -100] == 0).all()


@pytest.mark.parametrize("device_kind", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("vocab", [2, 3, 5])
def test_default_config_tiny_vocab(ce, monkeypatch, device_kind, dtype, vocab):
    """A binary or 3-class head (nn.CrossEntropyLoss over 2 classes): the default config, the
    interpreter's and a GPU's, still gives the lean kernel whole 16-byte vectors to read (a
    block of 2 or 4 bf16 columns held none: the kernel could not be built)."""
    monkeypatch.delenv("KERNELS_CE_CONFIG", raising=False)
    cfg = ce.default_config(vocab, torch.device(device_kind))
    monkeypatch.setattr(ce, "default_config", lambda v, device: cfg)
    logits, target = make_inputs(10, vocab, dtype)
    ref_loss, ref_dx = reference(logits, target)
    x = logits.clone().requires_grad_(True)
    with TritonLaunches(ce) as launches:
        loss = ce.cross_entropy(x, target)
    launches.assert_launched("_ce_lean_kernel")
    loss.backward()
    assert rel_err(loss.detach(), ref_loss) < (1e-6 if dtype == torch.float32 else 1e-5)
    assert rel_err(x.grad, ref_dx) < TOL[dtype]


def test_backward_fills_no_gradients_for_the_extras(ce, kt):
    """The loss functions return three never-differentiable extras (empty unless asked for);
    autograd would hand their backward zero-filled gradients on every call (three allocations
    and dispatches of host time) unless told not to materialise them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    fl = importlib.import_module(f"{kt.__name__}.fused_linear_cross_entropy")

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    logits, target = make_inputs(8, 1000, torch.float32)
    x = logits.clone().requires_grad_(True)
    w = torch.randn(1000, 16, requires_grad=True)
    h = torch.randn(8, 16, requires_grad=True)
    for loss in (ce.cross_entropy(x, target), fl.fused_linear_cross_entropy(h, w, target)):
        with Ops() as ops:
            loss.backward()
        assert not [op for op in ops.seen if "zeros" in op], ops.seen
