"""Fused linear + cross-entropy on the Triton CPU interpreter against a float64 reference."""

from __future__ import annotations

import importlib
import socket

import pytest
import torch
from _training_refs import rel_err
from cross_entropy_variants import ce_variant  # noqa: F401 - a fixture
from torch.utils._python_dispatch import TorchDispatchMode


@pytest.fixture(scope="module")
def fl(kt):
    return importlib.import_module(f"{kt.__name__}.fused_linear_cross_entropy")


def reference(
    hidden,
    weight,
    bias,
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
    """float64 loss and gradients (hidden, weight, bias) through autograd on full logits."""
    h = hidden.detach().double().requires_grad_(True)
    w = weight.detach().double().requires_grad_(True)
    b = None if bias is None else bias.detach().double().requires_grad_(True)
    x = h @ w.T + (0 if b is None else b)
    z = softcap * torch.tanh(x / softcap) if softcap else x
    logp = torch.log_softmax(z, dim=-1)
    lse = torch.logsumexp(z, dim=-1)
    valid = target != ignore_index
    t = torch.where(valid, target, 0)
    per_row = (1 - smoothing) * -logp.gather(-1, t[..., None])[..., 0]
    per_row = per_row + smoothing * -logp.mean(-1) + zloss * lse**2
    per_row = torch.where(valid, per_row, 0.0)
    if reduction == "none":
        loss = per_row
    elif reduction == "sum":
        loss = per_row.sum()
    else:
        loss = per_row.sum() / (valid.sum().double() if num_items is None else float(num_items))
    g = torch.ones_like(loss) if grad_out is None else grad_out.double()
    grads = torch.autograd.grad(loss, [h, w] + ([] if b is None else [b]), g)
    return loss.detach(), grads


def make_inputs(n, hdim, vocab, dtype, bias=False, ignore_index=-100):
    hidden = torch.randn(n, hdim).to(dtype)
    weight = (torch.randn(vocab, hdim) * hdim**-0.5 * 3).to(dtype)
    b = (torch.randn(vocab) * 0.5).to(dtype) if bias else None
    target = torch.randint(0, vocab, (n,))
    drop = torch.rand(n) < 0.25
    drop[0], drop[1] = True, False
    target[drop] = ignore_index
    return hidden, weight, b, target


TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}

CASES = [
    # (dtype, vocab, bias, options, reduction)
    (torch.float32, 1000, False, {}, "mean"),
    (torch.bfloat16, 1531, True, {}, "mean"),
    (torch.float32, 1531, True, {"smoothing": 0.1, "zloss": 1e-3}, "sum"),
    (torch.bfloat16, 1000, False, {"softcap": 12.0, "smoothing": 0.1}, "mean"),
    (torch.float32, 1000, True, {"softcap": 12.0, "zloss": 1e-2}, "none"),
    (torch.bfloat16, 1531, False, {"smoothing": 0.2}, "none"),
]


@pytest.mark.usefixtures("ce_variant")
@pytest.mark.parametrize(
    "dtype,vocab,bias,opts,reduction",
    CASES,
    ids=[
        f"{str(d)[6:]}-{v}-{'bias' if b else 'nobias'}-{'-'.join(o) or 'plain'}-{r}"
        for d, v, b, o, r in CASES
    ],
)
def test_loss_and_grads(fl, dtype, vocab, bias, opts, reduction):
    n = 24
    hidden, weight, b, target = make_inputs(n, 32, vocab, dtype, bias=bias)
    grad_out = torch.rand(n) + 0.5 if reduction == "none" else torch.tensor(0.7)
    ref_loss, ref_grads = reference(
        hidden, weight, b, target, reduction=reduction, grad_out=grad_out, **opts
    )
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    bb = None if b is None else b.clone().requires_grad_(True)
    loss = fl.fused_linear_cross_entropy(
        h,
        w,
        target,
        bb,
        label_smoothing=opts.get("smoothing", 0.0),
        lse_square_scale=opts.get("zloss", 0.0),
        softcap=opts.get("softcap"),
        reduction=reduction,
        chunk_rows=10,  # 3 chunks, the last one partial
    )
    assert loss.dtype == torch.float32
    assert rel_err(loss.detach(), ref_loss) < (1e-6 if dtype == torch.float32 else 1e-2)
    loss.backward(grad_out)
    got = [h.grad, w.grad] + ([] if bb is None else [bb.grad])
    names = ["hidden", "weight", "bias"][: len(got)]
    for name, g, r in zip(names, got, ref_grads, strict=True):
        assert g.dtype == dtype, name
        assert rel_err(g, r) < TOL[dtype], name


@pytest.mark.usefixtures("ce_variant")
def test_tied_weights_add_up(fl):
    """lm_head tied to the input embedding: both uses' gradients land in the one parameter."""
    vocab, hdim, n = 1000, 32, 24
    emb = (torch.randn(vocab, hdim) * 0.3).requires_grad_(True)
    ids = torch.randint(0, vocab, (n,))
    target = torch.roll(ids, -1)
    target[-3:] = -100
    loss = fl.fused_linear_cross_entropy(torch.tanh(emb[ids]), emb, target, chunk_rows=10)
    loss.backward()
    e64 = emb.detach().double().requires_grad_(True)
    logits = torch.tanh(e64[ids]) @ e64.T
    ref = torch.nn.functional.cross_entropy(logits, target)
    (ref_grad,) = torch.autograd.grad(ref, e64)
    assert rel_err(loss.detach(), ref.detach()) < 1e-6
    assert rel_err(emb.grad, ref_grad) < 2e-5


@pytest.mark.usefixtures("ce_variant")
def test_num_items_and_3d_hidden(fl):
    hidden, weight, _, target = make_inputs(2 * 10, 32, 1000, torch.float32)
    ref_loss, (ref_dh, ref_dw) = reference(hidden, weight, None, target, num_items=31)
    h = hidden.view(2, 10, 32).clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    loss = fl.fused_linear_cross_entropy(h, w, target.view(2, 10), num_items=torch.tensor(31))
    loss.backward()
    assert rel_err(loss.detach(), ref_loss) < 1e-6
    assert rel_err(h.grad.view(20, 32), ref_dh) < 2e-5 and rel_err(w.grad, ref_dw) < 2e-5


@pytest.mark.usefixtures("ce_variant")
def test_only_weight_needs_grad_and_no_grad(fl):
    hidden, weight, _, target = make_inputs(20, 32, 1531, torch.float32)
    ref_loss, (_, ref_dw) = reference(hidden, weight, None, target, smoothing=0.1)
    w = weight.clone().requires_grad_(True)
    loss = fl.fused_linear_cross_entropy(hidden, w, target, label_smoothing=0.1, chunk_rows=7)
    loss.backward()
    assert rel_err(w.grad, ref_dw) < 2e-5
    w2 = weight.clone().requires_grad_(True)
    with torch.no_grad():
        loss2 = fl.fused_linear_cross_entropy(hidden, w2, target, label_smoothing=0.1)
    assert loss2.grad_fn is None and w2.grad is None
    assert rel_err(loss2, ref_loss) < 1e-6 and rel_err(loss.detach(), ref_loss) < 1e-6


def test_autocast_casts_once_and_grads_reach_fp32_params(fl):
    hidden, weight, _, target = make_inputs(20, 32, 1000, torch.float32)
    w = weight.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fl.fused_linear_cross_entropy(hidden, w, target)
    loss.backward()
    ref_loss, (_, ref_dw) = reference(
        hidden.bfloat16().float(), weight.bfloat16().float(), None, target
    )
    assert w.grad.dtype == torch.float32
    assert rel_err(loss.detach(), ref_loss) < 1e-2 and rel_err(w.grad, ref_dw) < 2e-2


def test_bad_inputs_raise(fl):
    hidden, weight, _, target = make_inputs(8, 32, 1000, torch.float32)
    with pytest.raises(ValueError, match="share a dtype"):
        fl.fused_linear_cross_entropy(hidden, weight.double(), target)
    with pytest.raises(ValueError, match="weight must be"):
        fl.fused_linear_cross_entropy(hidden, weight[:, :16], target)
    with pytest.raises(ValueError, match="target shape"):
        fl.fused_linear_cross_entropy(hidden, weight, target[:5])


@pytest.mark.parametrize(
    "n,vocab,itemsize,budget,expect",
    [
        (16384, 128256, 2, 504 * 2**20, 2048),  # 8 chunks, a 501 MiB buffer
        (16384, 151936, 2, 504 * 2**20, 1024),  # 2048 rows would need 594 MiB
        # 512 fills half the budget (1008 rows): the largest multiple of 64 instead
        (8192, 262144, 2, 504 * 2**20, 960),
        (8192, 131072, 2, 504 * 2**20, 1984),  # 1024 of 2016
        (8192, 151936, 2, 504 * 2**20, 1024),  # 1024 of 1739 (59 %): the power of two
        (1000, 50000, 2, 504 * 2**20, 1000),  # everything fits in one chunk
        (300, 1000, 4, 44_000, 8),  # 11 rows fit: 8
        (5, 1000, 4, 1_000, 1),  # not even one row fits: one row at a time
    ],
)
def test_default_chunk_rows(fl, n, vocab, itemsize, budget, expect):
    rows = fl.default_chunk_rows(n, vocab, itemsize, budget)
    assert rows == expect
    assert rows * vocab * itemsize <= budget or rows == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sharded_dtensor_weight_is_gathered_and_grad_flows_back(fl):
    """An FSDP2-style Shard(0) DTensor weight (one-rank gloo group on the CPU)."""
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    if not dist.is_available():
        pytest.skip("torch.distributed is not built")
    started = not dist.is_initialized()
    if started:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
        )
    try:
        mesh = init_device_mesh("cpu", (1,))
        hidden, weight, _, target = make_inputs(16, 32, 1000, torch.float32)
        ref_loss, (ref_dh, ref_dw) = reference(hidden, weight, None, target)
        w = torch.nn.Parameter(distribute_tensor(weight.clone(), mesh, [Shard(0)]))
        h = hidden.clone().requires_grad_(True)
        loss = fl.fused_linear_cross_entropy(h, w, target)
        loss.backward()
        assert isinstance(w.grad, DTensor) and w.grad.placements == (Shard(0),)
        assert rel_err(loss.detach(), ref_loss) < 1e-6
        assert rel_err(w.grad.full_tensor(), ref_dw) < 2e-5 and rel_err(h.grad, ref_dh) < 2e-5
    finally:
        if started:
            dist.destroy_process_group()


@pytest.mark.parametrize("want_lse", [False, True], ids=["plain", "z-loss-returned"])
def test_chunks_write_loss_in_place(fl, monkeypatch, want_lse):
    """Every chunk's loss (and log-sum-exp, when the options keep it) is written by the kernel
    straight into slices of one per-call buffer: no per-chunk loss buffers and no copies. The
    returned per-token loss is that buffer."""
    seen = []
    real = fl.ce_rows

    def recording(*args, **kwargs):
        seen.append(kwargs["out"])
        return real(*args, **kwargs)

    monkeypatch.setattr(fl, "ce_rows", recording)
    hidden, weight, _, target = make_inputs(40, 16, 1000, torch.float32)
    out = fl.fused_linear_cross_entropy(
        hidden, weight, target, reduction="none", chunk_rows=10, lse_square_scale=1e-3,
        return_z_loss=want_lse,
    )  # fmt: skip
    loss = out.loss if want_lse else out
    ref_loss, _ = reference(hidden, weight, None, target, reduction="none", zloss=1e-3)
    assert rel_err(loss, ref_loss) < 1e-6
    assert len(seen) == 4
    loss_slices = [o[0] for o in seen]
    lse_slices = [o[1] for o in seen]
    assert all(
        s.untyped_storage().data_ptr() == loss.untyped_storage().data_ptr() for s in loss_slices
    )
    assert [s.storage_offset() for s in loss_slices] == [0, 10, 20, 30]
    # one log-sum-exp buffer too: per call (kept for the z-loss) or reused across chunks
    assert len({s.untyped_storage().data_ptr() for s in lse_slices}) == 1


class MatmulShapes(TorchDispatchMode):
    """Records the dimensions of every mm / addmm operand run under it."""

    def __init__(self):
        super().__init__()
        self.dims: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.out,
                    torch.ops.aten.addmm.default, torch.ops.aten.addmm_.default):  # fmt: skip
            for a in args:
                if isinstance(a, torch.Tensor) and a.dim() == 2:
                    self.dims.update(a.shape)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("vocab", [1000, 1024])
def test_chunk_rows_start_aligned_for_any_vocabulary(fl, monkeypatch, vocab):
    """The chunk's logits rows start 64-element aligned whatever V is (an odd V made cuBLAS's
    matmuls on the chunk 5x slower on the GPU), as one reused buffer, and the result is right."""
    strides = []
    real = fl.ce_rows

    def recording(logits, *args, **kwargs):
        strides.append((logits.stride(), logits.shape, logits.untyped_storage().data_ptr()))
        return real(logits, *args, **kwargs)

    monkeypatch.setattr(fl, "ce_rows", recording)
    hidden, weight, _, target = make_inputs(30, 16, vocab, torch.float32)
    hl, wl = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with MatmulShapes() as seen:
        fl.fused_linear_cross_entropy(hl, wl, target, chunk_rows=10).backward()
    # every vocabulary-sized matmul dimension is the aligned bulk or the < 64 remainder
    if vocab % 64:
        assert vocab not in seen.dims and {vocab // 64 * 64, vocab % 64} <= seen.dims
    else:
        assert vocab in seen.dims
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    torch.nn.functional.cross_entropy(h64 @ w64.t(), target).backward()
    assert rel_err(hl.grad, h64.grad) < 1e-5 and rel_err(wl.grad, w64.grad) < 1e-5
    assert [s[0] for s in strides] == [(-(-vocab // 64) * 64, 1)] * 3
    assert [s[1] for s in strides] == [(10, vocab)] * 3
    assert len({s[2] for s in strides}) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.timeout(300)  # a launch given used counters would wait forever
def test_gpu_default_config_on_the_interpreter(fl, monkeypatch, dtype):
    """The config a CUDA device gets (the lean kernel over 8192-column chunks), run by the
    interpreter inside the chunk loop: rows of 50257 (not 16-byte aligned), three chunks of
    tokens sharing one `Scratch` (each launch must get fresh counters), ignored rows; the loss
    and every gradient (hidden, weight, bias) against float64."""
    ce = importlib.import_module(fl.__name__.rsplit(".", 1)[0] + ".cross_entropy")
    monkeypatch.delenv("KERNELS_CE_CONFIG", raising=False)
    cfg = ce.default_config(50257, torch.device("cuda"))
    assert cfg.lean and cfg.spin and cfg.chunk == 8192
    monkeypatch.setattr(ce, "default_config", lambda v, device: cfg)
    scratches = []
    real = fl.ce_rows

    def recording(*args, **kwargs):
        scratches.append(kwargs["scratch"])
        return real(*args, **kwargs)

    monkeypatch.setattr(fl, "ce_rows", recording)
    hidden, weight, b, target = make_inputs(20, 16, 50257, dtype, bias=True)
    ref_loss, ref_grads = reference(hidden, weight, b, target, smoothing=0.1)
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, b)]
    loss = fl.fused_linear_cross_entropy(*leaves[:2], target, leaves[2], label_smoothing=0.1,
                                         chunk_rows=7)  # fmt: skip
    (loss * 0.8).backward()
    assert len(scratches) == 3 and len({id(s) for s in scratches}) == 1
    assert rel_err(loss.detach(), ref_loss) < (1e-6 if dtype == torch.float32 else 1e-2)
    for name, leaf, ref in zip(["hidden", "weight", "bias"], leaves, ref_grads, strict=True):
        assert leaf.grad.dtype == dtype, name
        assert rel_err(leaf.grad, 0.8 * ref) < TOL[dtype], name
