"""RoPE for q and k (transformers' apply_rotary_pos_emb contract) on the Triton interpreter."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from _training_refs import DTYPES, assert_close, check_rope, leaf64, rope64

# (B, T, Hq, Hk, D, cos batch): GQA, MHA, one token, head_dim whose half is not a power of two.
CASES = [
    (2, 7, 4, 2, 16, "B"),
    (1, 1, 3, 1, 8, "B"),
    (2, 5, 8, 8, 128, "1"),
    (3, 4, 6, 2, 80, "B"),
]


def make_inputs(b, t, hq, hk, d, cos_batch, dtype, layout):
    if layout == "transposed":  # what transformers passes: [B, H, T, D] views of [B, T, H, D]
        q = torch.randn(b, t, hq, d, dtype=dtype).transpose(1, 2)
        k = torch.randn(b, t, hk, d, dtype=dtype).transpose(1, 2)
    else:
        q = torch.randn(b, hq, t, d, dtype=dtype)
        k = torch.randn(b, hk, t, d, dtype=dtype)
    angles = torch.randn(b if cos_batch == "B" else 1, t, d // 2) * 3
    emb = torch.cat((angles, angles), dim=-1)
    return q.requires_grad_(), k.requires_grad_(), emb.cos().to(dtype), emb.sin().to(dtype)


check = check_rope


@pytest.mark.parametrize("checked", [False, True], ids=["small", "halves checked"])
@pytest.mark.parametrize("layout", ["transposed", "contiguous"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_forward_and_grads(kt, case, dtype, layout, checked, request):
    """Also with the halves check that real shapes get: the second halves are then skipped."""
    if checked:
        request.getfixturevalue("rope_mod")
    q, k, cos, sin = make_inputs(*case, dtype, layout)
    qo, ko = kt.apply_rotary_pos_emb(q, k, cos, sin)
    assert qo.stride() == q.stride() and ko.stride() == k.stride()  # laid out like eager's
    check(q, k, cos, sin, qo, ko, 1, dtype)


@pytest.mark.parametrize("which", ["k", "q and k"])
def test_head_dim_without_a_unit_stride(kt, which):
    """A q or k whose head_dim is not the innermost dimension (time is: [B, H, D, T] memory
    transposed) is rotated, not refused; the outputs are laid out with unit head_dim stride."""
    b, hq, hk, t, d = 2, 4, 2, 16, 8
    q = torch.randn(b, hq, t, d)
    k = torch.randn(b, hk, d, t).transpose(-1, -2)  # stride along head_dim: t
    if which == "q and k":
        q = torch.randn(b, hq, d, t).transpose(-1, -2)
    q, k = q.requires_grad_(), k.requires_grad_()
    angles = torch.randn(b, t, d // 2) * 3
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    assert kt.rope.triton_supported(q, k, cos, sin, 1)  # the Triton path, not the fallback
    qo, ko = kt.apply_rotary_pos_emb(q, k, cos, sin)
    assert qo.stride(-1) == 1 and ko.stride(-1) == 1
    check(q, k, cos, sin, qo, ko, 1, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unsqueeze_dim_2_bthd(kt, dtype):
    """q/k as [B, T, H, D] with unsqueeze_dim=2."""
    q = torch.randn(2, 6, 4, 32, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 6, 2, 32, dtype=dtype, requires_grad=True)
    cos, sin = torch.randn(2, 6, 32, dtype=dtype), torch.randn(2, 6, 32, dtype=dtype)
    qo, ko = kt.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    check(q, k, cos, sin, qo, ko, 2, dtype)


def test_arbitrary_cos_sin_halves(kt):
    """No cat(freqs, freqs) layout is assumed: distinct halves of cos/sin are honoured."""
    q = torch.randn(1, 3, 5, 16, requires_grad=True)
    k = torch.randn(1, 1, 5, 16, requires_grad=True)
    cos, sin = torch.randn(1, 5, 16), torch.randn(1, 5, 16)
    qo, ko = kt.apply_rotary_pos_emb(q, k, cos, sin)
    check(q, k, cos, sin, qo, ko, 1, torch.float32)


def test_unsupported_layout_falls_back_to_torch(kt):
    """3-D q/k are outside the kernel's contract; the torch formula still answers correctly."""
    q = torch.randn(5, 3, 16, requires_grad=True)
    k = torch.randn(5, 3, 16, requires_grad=True)
    cos, sin = torch.randn(5, 16), torch.randn(5, 16)
    qo, ko = kt.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    check(q, k, cos, sin, qo, ko, 1, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_matches_transformers_function(kt, dtype):
    """The rotary_pos_emb layer bound onto a module matches transformers' function in its dtype."""
    from transformers.models.qwen3 import modeling_qwen3

    hf = modeling_qwen3.apply_rotary_pos_emb
    holder = torch.nn.Module()
    holder.forward = types.MethodType(kt.layers.rotary_pos_emb.forward, holder)
    q, k, cos, sin = make_inputs(2, 9, 4, 2, 64, "B", dtype, "transposed")
    qo, ko = holder(q, k, cos, sin)
    qr, kr = hf(q, k, cos, sin)
    # Eager rounds q*cos, rotate_half(q)*sin and their sum; we round once or twice: a few
    # roundings apart.
    eps = torch.finfo(dtype).eps
    for out, ref in ((qo, qr), (ko, kr)):
        torch.testing.assert_close(out, ref, rtol=2 * eps, atol=2 * eps * ref.abs().max().item())


# (Hq, Hk, D): small heads take up to 8 tokens per program (BLOCK_T 4 and 8), Llama-size
# heads one or two; every candidate of each is launched below.
GEOMETRY_HEADS = [(4, 2, 16), (32, 8, 128)]


@pytest.mark.parametrize("heads", GEOMETRY_HEADS, ids=str)
def test_every_launch_candidate(kt, heads):
    """The GPU picks among these geometries by timing; each one must be right, forward and
    backward, for q and for k, to fp32 rounding (the launch is recorded: the geometry ran)."""
    from tests.gpu.launches import TritonLaunches

    mod = sys.modules[kt.__name__ + ".rope"]
    hq, hk, d = heads
    q, k, cos, sin = make_inputs(2, 9, hq, hk, d, "B", torch.float32, "transposed")
    q64, k64 = leaf64(q), leaf64(k)
    qr, kr = rope64(q64, k64, cos.double(), sin.double())
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    dq64, dk64 = torch.autograd.grad((qr, kr), (q64, k64), (gq.double(), gk.double()))
    candidates = mod.rope_candidates(hq, hk, d)
    for cfg in candidates:
        with TritonLaunches(mod) as launches:
            qo, ko = mod.rotate(q.detach(), k.detach(), cos, sin, 1, False, cfg)
            dq, dk = mod.rotate(gq, gk, cos, sin, 1, True, cfg)
        for backward in (False, True):
            launches.assert_launched(
                "_rope_kernel",
                BLOCK_T=cfg["BLOCK_T"],
                num_warps=cfg["num_warps"],
                BACKWARD=backward,
            )
        for name, out, ref in (("q", qo, qr), ("k", ko, kr), ("dq", dq, dq64), ("dk", dk, dk64)):
            assert_close(out, ref, torch.float32, f"{name} {cfg}")
    if heads == (4, 2, 16):
        assert {c["BLOCK_T"] for c in candidates} == {4, 8}  # the geometries meant above


@pytest.fixture
def rope_mod(kt, monkeypatch):
    """rope.py with the halves check on at any size (by default small calls skip it)."""
    mod = sys.modules[kt.__name__ + ".rope"]
    monkeypatch.setattr(mod, "MIN_CHECKED_ELEMENTS", 0)
    return mod


def fresh(t):
    return t.detach().clone().requires_grad_()


def rotate_with_distinct_halves(kt, rope_mod, q, k, cos, sin):
    """Rotates fresh copies of q and k after cos/sin changed: the check must answer False again
    and the result must match the float64 formula."""
    q2, k2 = fresh(q), fresh(k)
    qo, ko = kt.apply_rotary_pos_emb(q2, k2, cos, sin)
    assert rope_mod.halves_repeat(cos, sin) is False
    check(q2, k2, cos, sin, qo, ko, 1, torch.float32)


def test_checked_halves_are_cached_and_rechecked_after_a_write(kt, rope_mod):
    """The second halves are skipped only while cos/sin still repeat: a write is seen."""
    for written in ("sin", "cos"):  # each on its own pair: a write to either is seen
        q, k, cos, sin = make_inputs(2, 7, 4, 2, 16, "B", torch.float32, "transposed")
        qo, ko = kt.apply_rotary_pos_emb(q, k, cos, sin)
        check(q, k, cos, sin, qo, ko, 1, torch.float32)
        kept = rope_mod._CHECKS[(id(cos), id(sin))]
        assert rope_mod.halves_repeat(cos, sin) is True
        assert rope_mod._CHECKS[(id(cos), id(sin))] is kept
        t = sin if written == "sin" else cos
        t[1, 3, 8:] = torch.randn(8)  # its halves no longer equal, written in place
        rotate_with_distinct_halves(kt, rope_mod, q, k, cos, sin)


def test_a_kept_answer_follows_the_memory_behind_the_tensor(kt, rope_mod):
    """`.data =` keeps the object and its version counter but not its contents."""
    q, k, cos, sin = make_inputs(2, 7, 4, 2, 16, "B", torch.float32, "transposed")
    kt.apply_rotary_pos_emb(q, k, cos, sin)
    assert rope_mod.halves_repeat(cos, sin) is True
    cos.data = torch.randn_like(cos)  # halves differ now
    rotate_with_distinct_halves(kt, rope_mod, q, k, cos, sin)


def test_cos_without_a_unit_stride_is_checked_once(kt, rope_mod):
    q, k, cos, sin = make_inputs(2, 7, 4, 2, 16, "B", torch.float32, "transposed")
    cos = cos.transpose(1, 2).contiguous().transpose(1, 2)  # stride(-1) 7
    assert cos.stride(-1) != 1
    kt.apply_rotary_pos_emb(fresh(q), fresh(k), cos, sin)
    kept = rope_mod._CHECKS[(id(cos), id(sin))]
    for _ in range(2):
        kt.apply_rotary_pos_emb(fresh(q), fresh(k), cos, sin)
    assert rope_mod._CHECKS[(id(cos), id(sin))] is kept


@pytest.mark.parametrize("backward", [False, True])
def test_every_halves_answer_rotates_right(rope_mod, backward):
    """Known on the host (True/False), still on the device (a flag), or not checked (None)."""
    q, k, cos, sin = make_inputs(2, 5, 4, 2, 24, "B", torch.float32, "transposed")
    distinct = cos.clone(), sin.clone()
    distinct[0][..., 12:] += 0.5
    distinct[1][..., 12:] -= 0.5
    flag = torch.ones(1, dtype=torch.int32)
    cases = [((cos, sin), a) for a in (True, False, None, flag, 1 - flag)]
    cases += [(distinct, a) for a in (False, None, 1 - flag)]
    for (c, s), answer in cases:
        q64, k64 = leaf64(q), leaf64(k)
        qr, kr = rope64(q64, k64, c.double(), s.double())
        if backward:  # the gradient of the rotation, for upstream gradients q and k
            qr, kr = torch.autograd.grad((qr, kr), (q64, k64), (q.double(), k.double()))
        qo, ko = rope_mod.rotate(q.detach(), k.detach(), c, s, 1, backward, repeats=answer)
        assert_close(qo, qr, torch.float32, f"q, answer {answer}")
        assert_close(ko, kr, torch.float32, f"k, answer {answer}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_halves_check_compares_bits(rope_mod, dtype):
    """Every row of both tensors is compared, bit for bit (-0.0 is not 0.0; the same NaN is)."""
    a = torch.randn(3, 70, 40, dtype=dtype)  # 210 rows: several programs; a half of 40
    cos, sin = torch.cat((a, a), -1), torch.cat((a.flip(0), a.flip(0)), -1)
    assert rope_mod._check_halves(cos, sin).item() == 1
    cos[0, 0, 3] = cos[0, 0, 43] = float("nan")
    assert rope_mod._check_halves(cos, sin).item() == 1
    for t, row, value in ((cos, (2, 69), 0.5), (sin, (1, 35), 0.25)):
        changed = t.clone()
        changed[row][79] = value
        pair = (changed, sin) if t is cos else (cos, changed)
        assert rope_mod._check_halves(*pair).item() == 0
    zeros = torch.zeros(1, 4, 8, dtype=dtype)
    zeros[0, 2, 5] = -0.0
    assert rope_mod._check_halves(zeros, torch.zeros_like(zeros)).item() == 0


def test_checks_are_dropped_with_their_tensors_and_skipped_where_unsafe(kt, rope_mod, monkeypatch):
    q, k, cos, sin = make_inputs(1, 5, 2, 2, 16, "1", torch.float32, "transposed")
    kt.apply_rotary_pos_emb(q, k, cos, sin)
    key = (id(cos), id(sin))
    assert key in rope_mod._CHECKS
    del cos, sin
    assert key not in rope_mod._CHECKS
    with torch.inference_mode():  # no version counter to notice a later write
        cos, sin = make_inputs(1, 5, 2, 2, 16, "1", torch.float32, "transposed")[2:]
        assert rope_mod.halves_repeat(cos, sin) is None
    monkeypatch.setattr(rope_mod, "MIN_CHECKED_ELEMENTS", cos.numel() + 1)
    assert rope_mod.halves_repeat(cos.clone(), sin.clone()) is None


def test_backward_reuses_the_forward_check_after_the_caller_drops_cos_sin(
    kt, rope_mod, monkeypatch
):
    """transformers drops position_embeddings after the forward; autograd keeps cos/sin alive
    (same objects), so every layer's backward reuses the forward's answer instead of re-checking."""
    q, k, cos, sin = make_inputs(2, 7, 4, 2, 16, "B", torch.float32, "transposed")
    calls = []
    real = rope_mod._check_halves
    monkeypatch.setattr(rope_mod, "_check_halves", lambda c, s: calls.append(1) or real(c, s))
    outs = [kt.apply_rotary_pos_emb(q, k, cos, sin) for _layer in range(3)]
    assert len(calls) == 1
    key = (id(cos), id(sin))
    del cos, sin
    torch.autograd.backward(
        [o for pair in outs for o in pair], [torch.ones_like(o) for pair in outs for o in pair]
    )
    assert len(calls) == 1 and key not in rope_mod._CHECKS  # kept through backward, then dropped
    assert q.grad is not None and k.grad is not None


# Liger's test shape that took minutes to compile (73 q and 213 k heads, head_dim 92), at a
# few tokens: wider than one MAX_TILE head tile, so `_rope_heads_kernel` takes it.
WIDE = (2, 3, 73, 213, 92)


@pytest.mark.parametrize("cos_batch", ["B", "1"])
@pytest.mark.parametrize("layout", ["transposed", "contiguous"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_many_heads_take_the_tiled_kernel(kt, dtype, layout, cos_batch):
    rope_mod = sys.modules[kt.__name__ + ".rope"]
    b, t, hq, hk, d = WIDE
    assert rope_mod.head_tiles(hq, hk, d) == rope_mod.MAX_TILE // 64
    q, k, cos, sin = make_inputs(b, t, hq, hk, d, cos_batch, dtype, layout)
    plan = rope_mod._rotate_plan(q, k, cos, sin, 1, False, (None, None))
    assert plan.kernel is rope_mod._rope_heads_kernel
    qo, ko = kt.apply_rotary_pos_emb(q, k, cos, sin)
    check(q, k, cos, sin, qo, ko, 1, dtype)


@pytest.mark.parametrize("backward", [False, True])
def test_tiled_kernel_honours_every_halves_answer(rope_mod, backward):
    """The tiled kernel reads the second halves of cos/sin as `_rope_kernel` does: skipped
    (True), read (False, None) or decided by the device flag."""
    q, k, cos, sin = make_inputs(1, 3, 40, 33, 8, "B", torch.float32, "transposed")
    distinct = cos.clone(), sin.clone()
    distinct[0][..., 4:] += 0.5
    distinct[1][..., 4:] -= 0.5
    flag = torch.ones(1, dtype=torch.int32)
    cases = [((cos, sin), a) for a in (True, False, None, flag, 1 - flag)]
    cases += [(distinct, a) for a in (False, None, 1 - flag)]
    small = 16  # heads x 4 > 16: tiles of 4 heads, 10 and 9 tiles
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rope_mod, "MAX_TILE", small)
        for (c, s), answer in cases:
            q64, k64 = leaf64(q), leaf64(k)
            qr, kr = rope64(q64, k64, c.double(), s.double())
            if backward:
                qr, kr = torch.autograd.grad((qr, kr), (q64, k64), (q.double(), k.double()))
            plan = rope_mod._RotatePlan(q, k, c, s, 1, backward, (None, None))
            assert plan.kernel is rope_mod._rope_heads_kernel
            assert plan.constexprs["BLOCK_H"] == 4
            qo, ko = plan(q.detach(), k.detach(), c, s, answer, (None, None))
            assert_close(qo, qr, torch.float32, f"q, answer {answer}")
            assert_close(ko, kr, torch.float32, f"k, answer {answer}")
    rope_mod.rope_candidates.cache_clear()  # computed under the patched MAX_TILE


def test_model_shapes_keep_the_one_tile_kernel(rope_mod):
    """Every measured model's and sweep shape's heads fit one tile: its kernel and tuned configs
    are unchanged. (q heads, k heads, head_dim): Qwen3-0.6B, Llama-3-8B, Qwen3-30B-A3B,
    Gemma-2-2B, Gemma-3-1B, Phi-3-mini, the RoPE sweep's MHA, head_dim 64 and 64-head shapes."""
    shapes = ((16, 8, 128), (32, 8, 128), (32, 4, 128), (8, 4, 256), (4, 1, 256), (32, 32, 96),
              (32, 32, 128), (16, 16, 64), (64, 8, 128))  # fmt: skip
    for shape in shapes:
        assert rope_mod.head_tiles(*shape) is None, shape
        assert len(rope_mod.rope_candidates(*shape)) == 6, shape
    assert rope_mod.rope_candidates(*WIDE[2:]) == [
        {"BLOCK_T": 1, "num_warps": 4},
        {"BLOCK_T": 1, "num_warps": 8},
    ]
    # Ragged tiles (41 of 64 rows, half head_dim 20): no candidate over RAGGED_VALUES per thread
    ragged = rope_mod.rope_candidates(41, 41, 40)
    assert {"BLOCK_T": 1, "num_warps": 1} not in ragged and len(ragged) == 5


@pytest.mark.parametrize("layout", ["transposed", "contiguous"])
@pytest.mark.parametrize("backward", [False, True])
def test_op_torch_path_rotates_right(rope_mod, monkeypatch, backward, layout):
    """The custom op (what torch.compile calls) on the torch formula, where Triton does not run:
    the rotation and its transpose, outputs laid out as the fake registration says."""
    q, k, cos, sin = make_inputs(2, 5, 4, 2, 24, "B", torch.float32, layout)
    distinct = cos.clone(), sin.clone()
    distinct[0][..., 12:] += 0.5
    distinct[1][..., 12:] -= 0.5
    monkeypatch.setattr(rope_mod, "use_triton", lambda t: False)
    for c, s in ((cos, sin), distinct):
        q64, k64 = leaf64(q), leaf64(k)
        qr, kr = rope64(q64, k64, c.double(), s.double())
        if backward:
            qr, kr = torch.autograd.grad((qr, kr), (q64, k64), (q.double(), k.double()))
        qo, ko = rope_mod.rope(q.detach(), k.detach(), c, s, 1, backward)
        assert qo.stride() == rope_mod._out_like(q).stride()
        assert_close(qo, qr, torch.float32, "q")
        assert_close(ko, kr, torch.float32, "k")
