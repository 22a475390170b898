"""RMSNorm (Llama/Qwen3 and Gemma numerics) on the Triton interpreter against float64 references."""

from __future__ import annotations

import itertools
import sys
import types

import pytest
import torch
from _training_refs import DTYPES, assert_close, leaf64, rms_norm64

from tests.gpu.launches import TritonLaunches
from tests.sweep import sweep_param

# (shape, how x is laid out): awkward widths, one row, a long row, q/k-norm 4-D, non-contiguous.
CASES = [
    ((7, 77), "contiguous"),
    ((37, 1000), "contiguous"),
    ((1, 64), "contiguous"),
    ((3, 5000), "contiguous"),
    ((2, 3, 4, 128), "contiguous"),
    ((9, 96), "row-strided"),
    ((2, 5, 3, 32), "transposed"),
]


def make_x(shape, layout, dtype):
    if layout == "row-strided":  # a column slice: rows 2*N apart
        base = torch.randn(shape[0], 2 * shape[-1], dtype=dtype)
        x = base[:, : shape[-1]]
    elif layout == "transposed":  # [B, H, T, D] view of a [B, T, H, D] tensor
        b, t, h, d = shape
        x = torch.randn(b, h, t, d, dtype=dtype).transpose(1, 2)
    else:
        x = torch.randn(shape, dtype=dtype)
    return x.requires_grad_()


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,layout", CASES, ids=[f"{s}-{lay}" for s, lay in CASES])
def test_forward_and_grads(kt, shape, layout, dtype, gemma):
    x = make_x(shape, layout, dtype)
    w = (torch.randn(shape[-1], dtype=dtype) * 0.5 + (0.0 if gemma else 1.0)).requires_grad_()
    y = kt.rms_norm(x, w, 1e-6, gemma=gemma)
    assert y.dtype == dtype and y.shape == x.shape
    dy = torch.randn_like(y)
    y.backward(dy)

    x64, w64 = leaf64(x), leaf64(w)
    y64 = rms_norm64(x64, w64, 1e-6, gemma)
    y64.backward(dy.double())
    assert_close(y, y64, dtype, "y")
    assert_close(x.grad, x64.grad, dtype, "dx")
    assert_close(w.grad, w64.grad, dtype, "dw")


def test_fp32_weight_with_half_input_promotes_like_hf(kt):
    """Llama numerics: bf16 x with an fp32 weight gives an fp32 output, as HF's module does."""
    x = torch.randn(6, 200, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(200, dtype=torch.float32, requires_grad=True)
    y = kt.rms_norm(x, w, 1e-5)
    assert y.dtype == torch.float32
    y.backward(torch.ones_like(y))
    x64, w64 = leaf64(x), leaf64(w)
    y64 = rms_norm64(x64, w64, 1e-5)
    y64.backward(torch.ones_like(y64))
    assert_close(y, y64, torch.bfloat16, "y")
    assert_close(x.grad, x64.grad, torch.bfloat16, "dx")
    assert_close(w.grad, w64.grad, torch.bfloat16, "dw")
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32


def test_frozen_weight_gets_no_grad(kt):
    x = torch.randn(5, 48, requires_grad=True)
    w = torch.randn(48)
    kt.rms_norm(x, w, 1e-6).sum().backward()
    x64 = leaf64(x)
    rms_norm64(x64, w.double(), 1e-6).sum().backward()
    assert w.grad is None
    assert_close(x.grad, x64.grad, torch.float32, "dx")


def test_torch_path_without_interpreter(kt, monkeypatch):
    """CPU tensors take plain torch ops when the interpreter is off; same results."""
    x = torch.randn(4, 3, 40, requires_grad=True)
    w = torch.randn(40, requires_grad=True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    y = kt.rms_norm(x, w, 1e-6)
    y.backward(torch.ones_like(y))
    x64, w64 = leaf64(x), leaf64(w)
    y64 = rms_norm64(x64, w64, 1e-6)
    y64.backward(torch.ones_like(y64))
    assert_close(y, y64, torch.float32, "y")
    assert_close(x.grad, x64.grad, torch.float32, "dx")
    assert_close(w.grad, w64.grad, torch.float32, "dw")


def _tiny_config(cls, **extra):
    return cls(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_hidden_layers=1, vocab_size=32, rms_norm_eps=1e-6, **extra,
    )  # fmt: skip


def _hf_norms():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    return {
        "Qwen3RMSNorm": (Qwen3RMSNorm, "RMSNorm"),
        "LlamaRMSNorm": (LlamaRMSNorm, "RMSNorm"),
        "GemmaRMSNorm": (GemmaRMSNorm, "GemmaRMSNorm"),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["Qwen3RMSNorm", "LlamaRMSNorm", "GemmaRMSNorm"])
def test_layer_bound_on_hf_module(kt, name, dtype):
    """The layer's forward bound onto the HF module matches the module's own forward in its dtype."""
    cls, layer = _hf_norms()[name]
    ref = cls(120, eps=1e-6).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(120) * 0.3 + (0.0 if "Gemma" in name else 1.0))
    mod = cls(120, eps=1e-6).to(dtype)
    mod.load_state_dict(ref.state_dict())
    mod.forward = types.MethodType(getattr(kt.layers, layer).forward, mod)

    x = torch.randn(3, 11, 120, dtype=dtype)
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y = ref(xr), mod(xo)
    assert y.dtype == y_ref.dtype
    # Same numerics in the module's dtype: at most one rounding step apart.
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(y, y_ref, rtol=eps, atol=eps * y_ref.abs().max().item())
    dy = torch.randn_like(y)
    y.backward(dy)
    x64 = leaf64(xo)
    w64 = ref.weight.detach().double().requires_grad_()
    y64 = rms_norm64(x64, w64, 1e-6, gemma="Gemma" in name)
    y64.backward(dy.double())
    assert_close(xo.grad, x64.grad, dtype, "dx")
    assert_close(mod.weight.grad, w64.grad, dtype, "dw")


def test_qwen3_attention_q_norm_over_head_dim(kt):
    """Qwen3's q_norm normalizes [B, T, H, D] over D; the bound layer does the same."""
    from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    attn = Qwen3Attention(_tiny_config(Qwen3Config), layer_idx=0)
    x = torch.randn(2, 5, 4, 16)
    ref = attn.q_norm(x)
    attn.q_norm.forward = types.MethodType(kt.layers.RMSNorm.forward, attn.q_norm)
    torch.testing.assert_close(attn.q_norm(x), ref, rtol=1e-5, atol=1e-6)


# Backward shapes on the interpreter's 4 "SMs": 45 x 1000, several rows per iteration and a
# partial last block; 5 x 9000 and 5 x 5000, the hidden-16384 and -8192 lists (RELOAD and
# STAGES geometries; one row per iteration, padded to 16384 or 8192 columns) with rows split
# 2/2/1 over three programs: several iterations per program and a short last one; 70 x 128,
# q/k norms. KERNELS_SWEEP=1 adds 13 x 9000 and 10 x 5000 (4/4/4/1 and 3/3/3/1).
WIDE_MORE_ROWS = [
    sweep_param((13, 9000), what="more rows of the hidden-16384 list"),
    sweep_param((10, 5000), what="more rows of the hidden-8192 list"),
]
BWD_SHAPES = [(45, 1000), (5, 9000), (5, 5000), (70, 128), *WIDE_MORE_ROWS]


@pytest.mark.parametrize("shape", BWD_SHAPES, ids=str)
def test_every_backward_candidate(kt, shape):
    """The GPU picks among these geometries by timing; each one must be correct (prefetch too)."""
    mod = sys.modules[kt.__name__ + ".rms_norm"]
    x = torch.randn(shape, dtype=torch.bfloat16)
    w = torch.randn(shape[-1], dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    _, rstd, _ = mod.forward(x, w, 1e-6, False)
    x64, w64 = leaf64(x.requires_grad_()), leaf64(w.requires_grad_())
    rms_norm64(x64, w64, 1e-6).backward(dy.double())
    for cfg in mod.bwd_candidates(*shape):
        with TritonLaunches(mod) as launches:
            dx, dw = mod.backward(dy, x.detach(), w.detach(), rstd, False, True, cfg)
        launches.assert_launched("_rms_norm_bwd_kernel", **_bwd_options(cfg))
        assert_close(dx, x64.grad, torch.bfloat16, f"dx {cfg}")
        assert_close(dw, w64.grad, torch.bfloat16, f"dw {cfg}")
    y64 = rms_norm64(x64.detach(), w64.detach(), 1e-6)
    for cfg in mod.fwd_candidates(*shape):
        with TritonLaunches(mod) as launches:
            y = mod.forward(x.detach(), w.detach(), 1e-6, False, cfg)[0]
        launches.assert_launched(mod.fwd_kernel(cfg).fn.__name__, **cfg)
        assert_close(y, y64, torch.bfloat16, f"y {cfg}")


@pytest.mark.parametrize(
    "case", ["llama", "gemma", "none-offset", "no-weight", "save-output", "sum-gradient"]
)
def test_reload_and_stages_give_the_same_gradients_in_every_mode(kt, case):
    """RELOAD re-reads a block's rows (and with 2, w) for dx and dW; STAGES pipelines the loop;
    PREFETCH loads the next block first (a reload reads the current block, loaded a loop ago).
    None changes one operation of the arithmetic: bit for bit the gradients of RELOAD 0 (the
    arithmetic the float64 tests check), in each mode and with each input the kernel has.
    11 x 300: two programs of 6 rows, each one partial block of 8."""
    mod = sys.modules[kt.__name__ + ".rms_norm"]
    m, n = 11, 300
    numer = {"gemma": (1.0, mod.GEMMA), "none-offset": (0.5, mod.NONE)}.get(case, (0.0, mod.LLAMA))
    x = torch.randn(m, n, dtype=torch.bfloat16)
    w = None if case == "no-weight" else torch.rand(n, dtype=torch.bfloat16) + 0.5
    dy = torch.randn_like(x)
    ds = torch.randn_like(x) if case == "sum-gradient" else None
    y, rstd, _ = mod.forward(x, w, 1e-6, numer)
    saved, from_y = (y, True) if case == "save-output" else (x, False)

    def grads(**options):
        cfg = mod._geometry(512, 16, 4096, 4, **options)
        with TritonLaunches(mod) as launches:
            dx, dw = mod.backward(dy, saved, w, rstd, numer, w is not None, cfg, from_y, ds=ds)
        launches.assert_launched("_rms_norm_bwd_kernel", **_bwd_options(cfg))
        return dx, dw

    base = grads()
    for reload, stages, prefetch in itertools.product((0, 1, 2), (1, 2), (False, True)):
        dx, dw = grads(reload=reload, stages=stages, prefetch=prefetch)
        assert torch.equal(dx, base[0]) and torch.equal(dw, base[1]), (reload, stages, prefetch)


def _bwd_options(cfg: dict) -> dict:
    """The launch options a backward config must reach the kernel with (per_sm sets the grid)."""
    return {k: v for k, v in cfg.items() if k != "per_sm"}


SAVE_OUTPUT_CASES = [
    ((37, 1000), "contiguous"),
    ((2, 3, 4, 128), "contiguous"),
    ((9, 96), "row-strided"),
]


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape,layout", SAVE_OUTPUT_CASES, ids=[f"{s}-{lay}" for s, lay in SAVE_OUTPUT_CASES]
)
def test_save_output_mode_grads(kt, shape, layout, dtype, gemma):
    """save_output=True keeps y, not x, and recovers x̂ = y / w: the same gradients."""
    x = make_x(shape, layout, dtype)
    # Effective weights (1 + w for Gemma) of either sign, bounded away from zero: a zero entry
    # is the documented limit of this mode (next test).
    sign = torch.randint(0, 2, (shape[-1],)) * 2 - 1
    w_eff = (torch.rand(shape[-1]) + 0.5) * sign
    w = (w_eff - 1.0 if gemma else w_eff).to(dtype).requires_grad_()
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = kt.rms_norm(x, w, 1e-6, gemma=gemma, save_output=True)
    assert any(t is y for t in saved) and not any(t is x for t in saved)
    dy = torch.randn_like(y)
    y.backward(dy)
    x64, w64 = leaf64(x), leaf64(w)
    y64 = rms_norm64(x64, w64, 1e-6, gemma)
    y64.backward(dy.double())
    assert x.grad.dtype == dtype
    assert_close(y, y64, dtype, "y")
    assert_close(x.grad, x64.grad, dtype, "dx")
    assert_close(w.grad, w64.grad, dtype, "dw")


def test_save_output_mode_zero_weight_is_nan_not_wrong(kt):
    """A zero weight entry loses x̂ in that column: its gradients must be NaN, never a number."""
    x = torch.randn(5, 64, requires_grad=True)
    w = torch.rand(64) + 0.5
    w[7] = 0.0
    w.requires_grad_()
    kt.rms_norm(x, w, 1e-6, save_output=True).backward(torch.randn(5, 64))
    assert torch.isnan(w.grad[7]) and torch.isnan(x.grad[:, 7]).all()
    assert torch.isfinite(w.grad[torch.arange(64) != 7]).all()


@pytest.mark.parametrize("shape", [(45, 1000), (5, 9000), WIDE_MORE_ROWS[0]], ids=str)
def test_save_output_every_backward_candidate(kt, shape):
    mod = sys.modules[kt.__name__ + ".rms_norm"]
    x = torch.randn(shape, dtype=torch.bfloat16)
    w = torch.rand(shape[-1], dtype=torch.bfloat16) + 0.5
    dy = torch.randn_like(x)
    y, rstd, _ = mod.forward(x, w, 1e-6, False)
    x64, w64 = leaf64(x.requires_grad_()), leaf64(w.requires_grad_())
    rms_norm64(x64, w64, 1e-6).backward(dy.double())
    for cfg in mod.bwd_candidates(*shape):
        with TritonLaunches(mod) as launches:
            dx, dw = mod.backward(dy, y, w.detach(), rstd, False, True, cfg, from_y=True)
        launches.assert_launched("_rms_norm_bwd_kernel", FROM_Y=True, **_bwd_options(cfg))
        assert_close(dx, x64.grad, torch.bfloat16, f"dx {cfg}")
        assert_close(dw, w64.grad, torch.bfloat16, f"dw {cfg}")


def test_memory_efficient_layer_on_qwen3_norm(kt):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    ref = Qwen3RMSNorm(96, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(torch.rand(96) + 0.5)
    mod = Qwen3RMSNorm(96, eps=1e-6)
    mod.load_state_dict(ref.state_dict())
    mod.forward = types.MethodType(kt.layers.MemoryEfficientRMSNorm.forward, mod)
    x = torch.randn(2, 9, 96)
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y = ref(xr), mod(xo)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    dy = torch.randn_like(y)
    y_ref.backward(dy)
    y.backward(dy)
    torch.testing.assert_close(xo.grad, xr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mod.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("offset, mode", [(0.0, "LLAMA"), (1.0, "GEMMA"), (0.5, "LLAMA")])
def test_forward_adds_the_offset_only_when_there_is_one(kt, offset, mode):
    """A zero offset compiles the forward without its add (HAS_OFFSET off: the weight then stays
    exactly 16-bit and the multiply packed, see probe_norm_fwd_sass.py); any other offset is
    added. Both give float64's y, fp32 in and out."""
    mod = sys.modules[kt.__name__ + ".rms_norm"]
    x, w = torch.randn(6, 96), torch.randn(96)
    with TritonLaunches(mod) as launches:
        y = mod.forward(x, w, 1e-6, (offset, getattr(mod, mode)))[0]
    launches.assert_launched("_rms_norm_fwd_kernel", HAS_OFFSET=offset != 0.0)
    rstd = torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert_close(y, x.double() * rstd * (w.double() + offset), torch.float32, f"offset {offset}")


@pytest.mark.parametrize("fused", [False, True], ids=["rms_norm", "fused_add_rms_norm"])
def test_a_forward_no_gradient_follows_keeps_no_rstd_and_no_autograd_node(kt, fused):
    """Under no_grad, or on inputs that need no gradient, the forward launches without STATS
    (no rstd store, none allocated) and records no autograd node; its values are the training
    forward's, bit for bit. With a gradient to come, STATS is on."""
    mod = sys.modules[kt.__name__ + ".rms_norm"]
    x, r, w = torch.randn(6, 96), torch.randn(6, 96), torch.randn(96).requires_grad_()

    def call():
        return kt.fused_add_rms_norm(x, r, w, 1e-6)[0] if fused else kt.rms_norm(x, w, 1e-6)

    def stats_flags(fn):
        with TritonLaunches(mod) as launches:
            y = fn()
        return y, {launch.options["STATS"] for launch in launches.of("_rms_norm_fwd_kernel")}

    y_train, flags = stats_flags(call)
    assert flags == {True} and y_train.grad_fn is not None
    with torch.no_grad():
        y, flags = stats_flags(call)
    assert flags == {False} and y.grad_fn is None
    assert torch.equal(y, y_train.detach())
    w.requires_grad_(False)  # grad mode on, nothing needs a gradient
    y, flags = stats_flags(call)
    assert flags == {False} and y.grad_fn is None and torch.equal(y, y_train.detach())


@pytest.mark.parametrize("fused", [False, True], ids=["rms_norm_fwd", "add_rms_norm_fwd"])
def test_an_op_run_without_stats_refuses_a_backward(kt, fused):
    """The ops' stats=False forward keeps nothing for a backward: asking for one is an error
    that names the fix, not a gradient computed from an empty rstd."""
    mod = sys.modules[kt.__name__ + (".add_rms_norm" if fused else ".rms_norm")]
    x, r = torch.randn(4, 32, requires_grad=True), torch.randn(4, 32)
    w = torch.randn(32, requires_grad=True)
    if fused:
        y, _s, rstd = mod.add_rms_norm_fwd(x, r, w, 1e-6, False, 0.0, mod.LLAMA, False)
    else:
        y, rstd = mod.rms_norm_fwd(x, w, 1e-6, False, False, 0.0, mod.LLAMA, False)
    assert rstd.shape == (0,)
    with pytest.raises(RuntimeError, match="stats=True"):
        y.sum().backward()


@pytest.mark.parametrize("mode", ["LLAMA", "GEMMA", "NONE"])
def test_even_forward_equals_the_masked_one_where_it_tiles(kt, mode):
    """Where a geometry tiles [m, n] exactly (n a power of two, BLOCK_M dividing m) the tuner
    also gets it EVEN (no masks): bit for bit the masked kernel's y, rstd and residual sum, in
    every casting mode. Shapes it does not tile get no EVEN candidate."""
    mod = sys.modules[kt.__name__ + ".rms_norm"]
    numerics = (1.0 if mode == "GEMMA" else 0.0, getattr(mod, mode))
    x, r = torch.randn(64, 128, dtype=torch.bfloat16), torch.randn(64, 128, dtype=torch.bfloat16)
    w = torch.randn(128, dtype=torch.bfloat16)
    even = [c for c in mod.fwd_candidates(64, 128) if c.get("EVEN")]
    assert even, "no EVEN candidate where every geometry tiles"
    for cfg in even:
        masked = {k: v for k, v in cfg.items() if k != "EVEN"}
        with TritonLaunches(mod) as launches:
            got = mod.forward(x, w, 1e-6, numerics, cfg, residual=r)
        launches.assert_launched("_rms_norm_fwd_kernel", EVEN=True)
        want = mod.forward(x, w, 1e-6, numerics, masked, residual=r)
        for name, a, b in zip(("y", "rstd", "s"), got, want, strict=True):
            assert torch.equal(a, b), f"{name} {cfg}"
    assert not [c for c in mod.fwd_candidates(64, 96) if c.get("EVEN")]  # n not a power of two
    odd = mod.fwd_candidates(63, 128)  # only one-row geometries tile 63 rows
    assert all(c["BLOCK_M"] == 1 for c in odd if c.get("EVEN"))


def test_the_forward_candidates_measured_on_the_h200(kt):
    """The lists follow the sixteenth session's chain measurements: rows of exactly 8192
    columns get only the looped geometries (any row count), wider rows the whole-row ones too,
    and rows of 128 columns 16 rows x 8 warps among theirs; a list holds no geometry twice."""
    mod = sys.modules[kt.__name__ + ".rms_norm"]
    for m in (1, 1024, 4096, 5000):
        assert all(c.get("LOOP") for c in mod.fwd_candidates(m, 8192)), m
    for n in (16384, 5120):  # wider, and a width rounded up to 8192 (not measured): both kinds
        listed = mod.fwd_candidates(4096, n)
        assert any(c.get("LOOP") for c in listed) and not all(c.get("LOOP") for c in listed), n
    assert {"BLOCK_M": 16, "num_warps": 8} in mod.fwd_candidates(4096, 128)
    for m, n in ((4096, 128), (4, 128), (3, 256), (4096, 8192), (7, 4096)):
        listed = mod.fwd_candidates(m, n)
        assert all(c not in listed[:i] for i, c in enumerate(listed)), (m, n)


def test_an_even_pick_is_not_reused_for_rows_it_does_not_tile(kt, monkeypatch):
    """Picks are shared by row counts of one bit length; an EVEN pick made for 64 rows must not
    run unmasked over 96 (it would read and write past the rows)."""
    mod = sys.modules[kt.__name__ + ".rms_norm"]
    picks: dict = {}

    def pick(key, candidates, launch, cold=None):  # the GPU tuner's cache, picking EVEN
        best = max(candidates, key=lambda c: (bool(c.get("EVEN")), c["BLOCK_M"]))
        return picks.setdefault(key, best)

    monkeypatch.setattr(mod, "pick_config", pick)
    w = torch.randn(128)
    for m in (64, 96):
        x = torch.randn(m, 128)
        with TritonLaunches(mod) as launches:
            y = mod.forward(x, w, 1e-6, False)[0]
        (launch,) = launches.of("_rms_norm_fwd_kernel")
        block_m = launch.options["BLOCK_M"]
        assert m % block_m == 0 and launch.options["EVEN"], (m, launch.options)
        assert block_m == {64: 64, 96: 32}[m]  # 64 would run rows 96-127 unmasked
        rstd = torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
        assert_close(y, x.double() * rstd * w.double(), torch.float32, f"{m} rows")


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("case", ["llama", "gemma", "none-offset", "no-weight"])
@pytest.mark.parametrize("shape, loop", [((6, 5000), 2048), ((4, 4096), 1024)], ids=str)
def test_looped_forward_computes_what_the_whole_row_one_does(kt, case, residual, shape, loop):
    """The two-pass looped forward (chunks; the last one partial at 5000 columns, unmasked at
    4096) gives the whole-row kernel's s bit for bit, and its rstd and y up to the order of the
    row sums: rstd within fp32 rounding, y differing in at most 1 % of the bf16 outputs, by one
    bf16 step. A mode or rounding wired wrong differs in far more."""
    mod = sys.modules[kt.__name__ + ".rms_norm"]
    numerics = {"llama": (0.0, mod.LLAMA), "gemma": (1.0, mod.GEMMA), "none-offset": (0.5, mod.NONE),
                "no-weight": (0.0, mod.LLAMA)}[case]  # fmt: skip
    x, r = torch.randn(shape, dtype=torch.bfloat16), torch.randn(shape, dtype=torch.bfloat16)
    w = None if case == "no-weight" else torch.randn(shape[-1], dtype=torch.bfloat16)
    looped = {"BLOCK_M": 1, "num_warps": 4, "LOOP": loop, "EVEN": shape[-1] % loop == 0}
    whole = {"BLOCK_M": 1, "num_warps": 4}
    with TritonLaunches(mod) as launches:
        y, rstd, s = mod.forward(x, w, 1e-6, numerics, looped, residual=r if residual else None)
    launches.assert_launched("_rms_norm_fwd_looped_kernel", LOOP=loop)
    y0, rstd0, s0 = mod.forward(x, w, 1e-6, numerics, whole, residual=r if residual else None)
    if residual:
        assert torch.equal(s, s0)
    torch.testing.assert_close(rstd, rstd0, rtol=2e-6, atol=0)
    differ = y != y0
    assert differ.float().mean() <= 0.01, f"{int(differ.sum())} of {y.numel()} outputs differ"
    step = y0.float().abs().clamp_min(1e-30) * 2**-7  # one bf16 step at each value
    assert ((y.float() - y0.float()).abs() <= step * 1.01).all()
