"""Training kernels (hub_kernels/kernels-lab/training) on a CUDA GPU at real shapes, plus convergence.

Every value check also records the Triton launches (tests/gpu/launches.py): the torch fallback
computes the same formulas, so only the launches show that the Triton path ran, with the launch
geometry the test meant, on the device. Tolerances per dtype against float64: fp32 1e-5, fp16
1e-3, bf16 1e-2 (relative, norm-wise). Run in its own pytest process (see conftest.py).
"""

from __future__ import annotations

import os
import sys
import types
import warnings
import zlib

import pytest
import torch

from tests.gpu.launches import TritonLaunches
from tests.gpu.variant import load_variant, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def kt():
    return load_variant("_kernels_training_gpu_test")


@pytest.fixture(autouse=True)
def _seed(request):
    seed = int(os.environ.get("KERNEL_TEST_SEED", zlib.crc32(request.node.nodeid.encode())))
    torch.manual_seed(seed)
    print(f"seed={seed}")


TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def check(out, ref, dtype, what):
    limit = TOLERANCE[dtype]
    err = rel_err(out, ref)
    assert err <= limit, f"{what}: relative error {err:.2e} > {limit:.0e}"


def leaf64(t):
    return t.detach().double().requires_grad_()


def submodule(kt, name: str):
    return sys.modules[f"{kt.__name__}.{name}"]


@pytest.fixture
def launches(kt):
    """Records the launches of every kernel of the package, host side and on the device."""
    modules = [m for n, m in sys.modules.items() if n.startswith(kt.__name__ + ".")]
    with TritonLaunches(*modules, device=True) as recorder:
        yield recorder


def ran_on_gpu(launches: TritonLaunches, *kernels: str) -> None:
    """Each of `kernels` launched, and every host-side launch reached the GPU driver."""
    for kernel in kernels:
        launches.assert_launched(kernel)
    launches.assert_device_matches()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(16384, 4096), (8, 2048, 16, 128), (4096, 1000)], ids=str)
def test_rms_norm_real_shapes(kt, shape, dtype, launches):
    x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    w = (torch.randn(shape[-1], device="cuda", dtype=dtype) * 0.1 + 1).requires_grad_()
    y = kt.rms_norm(x, w, 1e-6)
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    ran_on_gpu(launches, "_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel", "_column_sum_kernel")
    x64, w64 = leaf64(x), leaf64(w)
    y64 = w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.double())
    check(y, y64, dtype, "y")
    check(dx, dx64, dtype, "dx")
    check(dw, dw64, dtype, "dw")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rms_norm_real_shape(kt, dtype, launches):
    """The sum equals torch's add bit for bit (one rounding to nearest), the norm equals the
    separate RMSNorm of that sum to one rounding, the gradients match float64."""
    x = torch.randn(16384, 4096, device="cuda", dtype=dtype, requires_grad=True)
    r = torch.randn(16384, 4096, device="cuda", dtype=dtype, requires_grad=True)
    w = (torch.randn(4096, device="cuda", dtype=dtype) * 0.1 + 1).requires_grad_()
    y, s = kt.fused_add_rms_norm(x, r, w, 1e-6)
    with torch.no_grad():
        assert torch.equal(s, r + x)
        y_sep = kt.rms_norm(r + x, w, 1e-6)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(y, y_sep, rtol=eps, atol=eps * y_sep.abs().max().item())
    dy, ds = torch.randn_like(y), torch.randn_like(s)
    dx, dr, dw = torch.autograd.grad((y, s), (x, r, w), (dy, ds))
    launches.assert_launched("_rms_norm_fwd_kernel", RESIDUAL=True)
    launches.assert_launched("_rms_norm_bwd_kernel", HAS_DS=True)
    launches.assert_device_matches()
    x64, r64, w64 = leaf64(x), leaf64(r), leaf64(w)
    s64 = x64 + r64
    y64 = w64 * s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-6)
    dx64, dr64, dw64 = torch.autograd.grad((y64, s64), (x64, r64, w64), (dy.double(), ds.double()))
    for name, out, ref in (("y", y, y64), ("dx", dx, dx64), ("dr", dr, dr64), ("dw", dw, dw64)):
        check(out, ref, dtype, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemma_rms_norm_and_layer_norm(kt, dtype, launches):
    x = torch.randn(8192, 2048, device="cuda", dtype=dtype, requires_grad=True)
    w = (torch.randn(2048, device="cuda", dtype=dtype) * 0.1).requires_grad_()
    bias = torch.randn(2048, device="cuda", dtype=dtype, requires_grad=True)
    x64, w64, b64 = leaf64(x), leaf64(w), leaf64(bias)

    y = kt.rms_norm(x, w, 1e-6, gemma=True)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, w), dy)
    y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w64)
    refs = torch.autograd.grad(y64, (x64, w64), dy.double())
    for name, out, ref in zip(("y", "dx", "dw"), (y, *grads), (y64, *refs), strict=True):
        check(out, ref, dtype, f"gemma {name}")

    # Gemma numerics are the kernels' MODE constexpr (casting mode "gemma"); its offset 1.0 is a
    # runtime argument, not a launch option, so the (1 + w) values above are what check it.
    gemma_mode = submodule(kt, "rms_norm").GEMMA
    launches.assert_launched("_rms_norm_fwd_kernel", MODE=gemma_mode)
    launches.assert_launched("_rms_norm_bwd_kernel", MODE=gemma_mode)

    y = kt.layer_norm(x, w, bias, 1e-5)
    grads = torch.autograd.grad(y, (x, w, bias), dy)
    ran_on_gpu(launches, "_layer_norm_fwd_kernel", "_layer_norm_bwd_kernel")
    y64 = torch.nn.functional.layer_norm(x64, (2048,), w64, b64, 1e-5)
    refs = torch.autograd.grad(y64, (x64, w64, b64), dy.double())
    for name, out, ref in zip(("y", "dx", "dw", "db"), (y, *grads), (y64, *refs), strict=True):
        check(out, ref, dtype, f"layer_norm {name}")


def _rope64(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rot(x):
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1)

    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


@pytest.mark.parametrize("halves", ["repeated", "distinct"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_anchor_shape(kt, dtype, halves, launches):
    """transformers' cos/sin (halves repeated: the second halves are skipped) and any other."""
    b, t, hq, hk, d = 8, 2048, 32, 8, 128
    q = torch.randn(b, t, hq, d, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(b, t, hk, d, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
    angles = torch.rand(b, t, d // 2, device="cuda") * 100
    other = angles if halves == "repeated" else torch.rand_like(angles) * 100
    emb = torch.cat((angles, other), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    qo, ko = kt.apply_rotary_pos_emb(q, k, cos, sin)
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    dq, dk = torch.autograd.grad((qo, ko), (q, k), (gq, gk))
    launches.assert_launched("_rope_kernel", BACKWARD=False)
    launches.assert_launched("_rope_kernel", BACKWARD=True)
    ran_on_gpu(launches, "_halves_differ_kernel")
    q64, k64 = leaf64(q), leaf64(k)
    qr, kr = _rope64(q64, k64, cos.double(), sin.double())
    dq64, dk64 = torch.autograd.grad((qr, kr), (q64, k64), (gq.double(), gk.double()))
    for name, out, ref in (("q", qo, qr), ("k", ko, kr), ("dq", dq, dq64), ("dk", dk, dk64)):
        check(out, ref, dtype, name)
    # The check's answer reached the host without a wait; later calls skip the flag load.
    torch.cuda.synchronize()
    assert sys.modules[kt.__name__ + ".rope"].halves_repeat(cos, sin) is (halves == "repeated")


def _bwd_options(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k != "per_sm"}  # per_sm sets the grid only


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "shape", [(16384, 4096), (8 * 2048 * 16, 128), (2048, 8192), (2048, 16384)], ids=str
)
def test_rms_norm_every_candidate(kt, shape, dtype):
    """Each geometry the tuner may pick, launched as asked (recorded) and right to float64."""
    mod = submodule(kt, "rms_norm")
    x = torch.randn(shape, device="cuda", dtype=dtype)
    w = torch.randn(shape[-1], device="cuda", dtype=dtype) * 0.1 + 1
    dy = torch.randn_like(x)
    x64, w64 = leaf64(x), leaf64(w)
    y64 = w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.double())
    _, rstd, _ = mod.forward(x, w, 1e-6, False)
    for cfg in mod.fwd_candidates(*shape):
        with TritonLaunches(mod, device=True) as launches:
            y = mod.forward(x, w, 1e-6, False, cfg)[0]
        launches.assert_launched(mod.fwd_kernel(cfg).fn.__name__, **cfg)
        launches.assert_device_matches()
        check(y, y64, dtype, f"y {cfg}")
    for cfg in mod.bwd_candidates(*shape, row_bytes=2 * x.element_size()):
        with TritonLaunches(mod, device=True) as launches:
            dx, dw = mod.backward(dy, x, w, rstd, False, True, cfg)
        launches.assert_launched("_rms_norm_bwd_kernel", **_bwd_options(cfg))
        launches.assert_device_matches()
        check(dx, dx64, dtype, f"dx {cfg}")
        check(dw, dw64, dtype, f"dw {cfg}")


@pytest.mark.parametrize("heads", [(4, 2, 16), (32, 8, 128)], ids=str)
def test_rope_every_candidate(kt, heads):
    """Each geometry (small heads: 4 and 8 tokens per program), forward and backward, q and k,
    in fp32 to 1e-5, launched as asked."""
    mod = submodule(kt, "rope")
    hq, hk, d = heads
    b, t = 2, 2048
    q = torch.randn(b, t, hq, d, device="cuda").transpose(1, 2)
    k = torch.randn(b, t, hk, d, device="cuda").transpose(1, 2)
    angles = torch.rand(b, t, d // 2, device="cuda") * 100
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    q64, k64 = leaf64(q), leaf64(k)
    qr, kr = _rope64(q64, k64, cos.double(), sin.double())
    dq64, dk64 = torch.autograd.grad((qr, kr), (q64, k64), (gq.double(), gk.double()))
    for cfg in mod.rope_candidates(hq, hk, d):
        with TritonLaunches(mod, device=True) as launches:
            qo, ko = mod.rotate(q, k, cos, sin, 1, False, cfg)
            dq, dk = mod.rotate(gq, gk, cos, sin, 1, True, cfg)
        for backward in (False, True):
            launches.assert_launched("_rope_kernel", BACKWARD=backward, **cfg)
        launches.assert_device_matches()
        for name, out, ref in (("q", qo, qr), ("k", ko, kr), ("dq", dq, dq64), ("dk", dk, dk64)):
            check(out, ref, torch.float32, f"{name} {cfg}")


def test_tuning_launches_every_candidate(kt, monkeypatch):
    """On a key not tuned yet, pick_config times every candidate: each is launched on the GPU
    (its warm-up, one sizing launch, and its timed launches: a short kernel's are captured once
    into the CUDA graph its spans replay), then the winner once more."""
    common = submodule(kt, "_common")
    mod = submodule(kt, "rms_norm")
    monkeypatch.setattr(common, "_CHOICES", {})
    m, n = 6000, 256  # q/k-norm-like rows: 5 forward and 7 backward candidates
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with (
        warnings.catch_warnings(record=True) as caught,
        TritonLaunches(mod, device=True) as launches,
    ):
        warnings.simplefilter("always")
        y = kt.rms_norm(x, w, 1e-6)
        y.backward(torch.randn_like(y))
    launches.assert_device_matches()
    # A config this Triton refuses to compile is dropped with a warning (and not timed).
    refused = " ".join(str(w.message) for w in caught if "skipped" in str(w.message))
    for kernel, candidates, options in (
        ("_rms_norm_fwd_kernel", mod.fwd_candidates(m, n), lambda c: c),
        ("_rms_norm_bwd_kernel", mod.bwd_candidates(m, n), _bwd_options),
    ):
        assert len(candidates) > 1
        for cfg in candidates:
            if str(cfg) in refused:
                continue
            count = len(launches.assert_launched(kernel, **options(cfg)))
            assert count >= 3, f"{kernel} {cfg}: {count} launches"


def test_forward_tuning_times_into_alternating_outputs(kt, monkeypatch):
    """The forward's timing launches alternate between the call's outputs and a spare set, as
    a model's calls write new buffers (see rms_norm._spare_outputs); the call's own outputs get
    the winner's values, and the looped geometries are among those timed at 8192 columns."""
    common = submodule(kt, "_common")
    mod = submodule(kt, "rms_norm")
    monkeypatch.setattr(common, "_CHOICES", {})
    monkeypatch.setattr(mod, "_FORWARD_PLANS", common.PlanCache())  # no plan from an earlier test
    m, n = 1024, 8192
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.1 + 1
    with TritonLaunches(mod) as launches:
        y = kt.rms_norm(x, w, 1e-6)
    fwd = [launch for launch in launches.launches if launch.kernel.startswith("_rms_norm_fwd")]
    written = [launch.pointers[3] for launch in fwd]  # Y, the fourth tensor argument
    assert written[-1] == y.data_ptr()  # the winner's launch into the call's output
    assert len(set(written)) == 2, "timing wrote one output buffer"
    assert any("LOOP" in launch.options for launch in fwd)
    (pick,) = [v for k, v in common._CHOICES.items() if k[0] == "rms_fwd"]
    want = mod.forward(x, w, 1e-6, False, pick, stats=False)[0]
    assert torch.equal(y, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ["silu", "tanh", "none"])
def test_gated_activations_real_shape(kt, act, dtype, launches):
    m, n = 4096, 14336
    a = torch.randn(m, n, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(m, n, device="cuda", dtype=dtype, requires_grad=True)
    c = kt.silu_mul(a, b) if act == "silu" else kt.gelu_mul(a, b, act)
    dc = torch.randn_like(c)
    da, db = torch.autograd.grad(c, (a, b), dc)
    ran_on_gpu(launches, "_glu_fwd_kernel", "_glu_bwd_kernel")
    a64, b64 = leaf64(a), leaf64(b)
    f = torch.nn.functional
    h = f.silu(a64) if act == "silu" else f.gelu(a64, approximate=act)
    c64 = h * b64
    da64, db64 = torch.autograd.grad(c64, (a64, b64), dc.double())
    check(c, c64, dtype, "c")
    check(da, da64, dtype, "da")
    check(db, db64, dtype, "db")
    if act == "silu":
        y = kt.silu(a)
        (dx,) = torch.autograd.grad(y, (a,), dc)
        ran_on_gpu(launches, "_act_fwd_kernel", "_act_bwd_kernel")
        (dx64,) = torch.autograd.grad(f.silu(a64), (a64,), dc.double())
        check(y, f.silu(a64), dtype, "silu")
        check(dx, dx64, dtype, "dsilu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("act", ["silu", "tanh", "none"])
def test_gated_activations_round_where_eager_rounds(kt, act, dtype, launches):
    """The Triton GLU against eager's `act(a) * b` in the input dtype on the GPU. GELU (tanh):
    product and gradients equal element for element (torch's formula, the device's tanh).
    SiLU and GELU (erf): last-bit flips where the fp32 formulas differ (Triton's exp and erf
    against CUDA's): at most 0.84 % of an fp16 product, 0.15 % of d(a) on the H200. Before d(act)
    was rounded where eager rounds it, about 25 % of d(a) differed for every activation (and 1-1.5 %
    of the GELU (tanh) product), and Liger's GeGLU test (weight gradients at 1e-2) failed."""
    m, n = 4096, 14336
    a = (2 * torch.randn(m, n, device="cuda")).to(dtype).requires_grad_()
    b = torch.randn(m, n, device="cuda", dtype=dtype, requires_grad=True)
    dc = torch.randn(m, n, device="cuda", dtype=dtype)
    c = kt.silu_mul(a, b) if act == "silu" else kt.gelu_mul(a, b, act)
    da, db = torch.autograd.grad(c, (a, b), dc)
    ran_on_gpu(launches, "_glu_fwd_kernel", "_glu_bwd_kernel")
    a2, b2 = a.detach().requires_grad_(), b.detach().requires_grad_()
    f = torch.nn.functional
    c2 = (f.silu(a2) if act == "silu" else f.gelu(a2, approximate=act)) * b2
    da2, db2 = torch.autograd.grad(c2, (a2, b2), dc)
    differ = {k: (x != y).float().mean().item() for k, x, y in
              (("c", c, c2), ("da", da, da2), ("db", db, db2))}  # fmt: skip
    print(f"{act} {dtype}: fraction differing from eager {differ}")
    limit = 0.0 if act == "tanh" else 0.02
    assert all(v <= limit for v in differ.values()), differ


# --- convergence -------------------------------------------------------------------------------


def _tiny_model(kind: str, **sizes):
    if kind == "llama":
        from transformers import LlamaConfig as Config
        from transformers import LlamaForCausalLM as Model
    else:
        from transformers import Qwen3Config as Config
        from transformers import Qwen3ForCausalLM as Model
    cfg = Config(
        hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64, vocab_size=2048, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    )  # fmt: skip
    for name, value in sizes.items():  # smaller shapes for a dry run on the CPU interpreter
        setattr(cfg, name, value)
    cfg._attn_implementation = "sdpa"
    return Model(cfg)


def _kernelize(model, kt, kind: str, monkeypatch):
    """Bind our layers onto the model's modules, as kernelize would."""
    if kind == "llama":
        from transformers.models.llama import modeling_llama as modeling
    else:
        from transformers.models.qwen3 import modeling_qwen3 as modeling
    bound = {"norm": 0, "mlp": 0}
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            module.forward = types.MethodType(kt.layers.RMSNorm.forward, module)
            bound["norm"] += 1
        elif name.endswith("MLP"):
            module.forward = types.MethodType(kt.layers.SwiGLUMLP.forward, module)
            bound["mlp"] += 1
    rope = torch.nn.Module()
    rope.forward = types.MethodType(kt.layers.rotary_pos_emb.forward, rope)
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", rope)
    return bound


def _train(model, batches, steps=30):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    losses = []
    for step in range(steps):
        ids = batches[step % len(batches)]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_convergence_matches_eager(kt, kind, monkeypatch):
    torch.manual_seed(0)
    base = _tiny_model(kind).to("cuda", torch.bfloat16)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    gen = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, 2048, (8, 256), device="cuda", generator=gen) for _ in range(3)]

    ref_losses = _train(base, batches)
    ours = _tiny_model(kind).to("cuda", torch.bfloat16)
    ours.load_state_dict(state)
    bound = _kernelize(ours, kt, kind, monkeypatch)
    n_layers = ours.config.num_hidden_layers
    expected_norms = 2 * n_layers + 1 + (2 * n_layers if kind == "qwen3" else 0)
    assert bound == {"norm": expected_norms, "mlp": n_layers}
    with TritonLaunches(*_package_modules(kt), device=True) as launches:
        our_losses = _train(ours, batches)
    ran_on_gpu(launches, *TRAINING_KERNELS)

    print(f"{kind} eager: {[round(v, 4) for v in ref_losses]}")
    print(f"{kind} ours:  {[round(v, 4) for v in our_losses]}")
    assert ref_losses[-1] < ref_losses[0] - 1.0  # the run learns something
    for step, (r, o) in enumerate(zip(ref_losses, our_losses, strict=True)):
        assert abs(o - r) <= 1e-2 + 5e-2 * abs(r), f"step {step}: eager {r:.4f} vs ours {o:.4f}"


TRAINING_KERNELS = (
    "_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel", "_rope_kernel", "_glu_fwd_kernel",
    "_glu_bwd_kernel",
)  # fmt: skip


def _package_modules(kt):
    return [m for n, m in sys.modules.items() if n.startswith(kt.__name__ + ".")]


def first_step_gradients(kt, kind, monkeypatch, device="cuda", batch=(4, 256), **sizes):
    """One forward/backward of eager and of the kernelized model in fp32 from the same weights
    and batch: (eager loss, our loss, [(name, our grad, eager grad)], launches)."""
    torch.manual_seed(0)
    base = _tiny_model(kind, **sizes).to(device, torch.float32)
    ours = _tiny_model(kind, **sizes).to(device, torch.float32)
    ours.load_state_dict(base.state_dict())
    gen = torch.Generator(device=device).manual_seed(2)
    ids = torch.randint(0, base.config.vocab_size, batch, device=device, generator=gen)
    ref_loss = base(input_ids=ids, labels=ids).loss  # before _kernelize patches the rotary
    ref_loss.backward()
    _kernelize(ours, kt, kind, monkeypatch)
    with TritonLaunches(*_package_modules(kt), device=device == "cuda") as launches:
        loss = ours(input_ids=ids, labels=ids).loss
        loss.backward()
    grads = [
        (name, p.grad, p_ref.grad)
        for (name, p), p_ref in zip(ours.named_parameters(), base.parameters(), strict=True)
    ]
    return ref_loss, loss, grads, launches


FIRST_STEP_TOLERANCE = 2e-5  # fp32 gradients, norm-wise relative, after 4 layers


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_first_step_gradients_match_eager(kt, kind, monkeypatch):
    """fp32 (TF32 off): every parameter's gradient after one step equals eager's to fp32
    rounding. The bf16 loss curve above absorbs a dropped or scaled gradient of a layer (its
    tolerance covers bf16 drift); this catches it."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    ref_loss, loss, grads, launches = first_step_gradients(kt, kind, monkeypatch)
    ran_on_gpu(launches, *TRAINING_KERNELS)
    assert rel_err(loss, ref_loss) <= 1e-5
    errors = {name: rel_err(g, g_ref) for name, g, g_ref in grads}
    print({name: f"{e:.1e}" for name, e in errors.items()})
    worst = max(errors, key=errors.get)
    assert errors[worst] <= FIRST_STEP_TOLERANCE, f"{worst}: relative error {errors[worst]:.2e}"


@pytest.mark.parametrize("cold", [False, True])
def test_pick_config_times_the_usable_candidates_and_keeps_the_fastest(kt, cold):
    common = sys.modules[kt.__name__ + "._common"]
    x = torch.zeros(1 << 20, device="cuda")
    calls = []

    def launch(cfg):
        calls.append(cfg["n"])
        if cfg["n"] == 2:
            raise RuntimeError("this Triton rejects the config")
        torch.cuda._sleep(100_000 * cfg["n"])  # one launch whose GPU time grows with n

    key = ("pick_config test", cold, zlib.crc32(os.urandom(8)))
    with pytest.warns(UserWarning, match="skipped"):
        cfg = common.pick_config(
            key, [{"n": 3}, {"n": 1}, {"n": 2}], launch, x.device if cold else None
        )
    assert cfg == {"n": 1}
    # a warm-up, a sizing round unless cold (a 50 µs launch: spans of one), the timed rounds
    timed = common.TUNING_ROUNDS + (0 if cold else 1)
    assert calls.count(3) == 1 + timed and calls.count(1) == 1 + timed and calls.count(2) == 1
    assert common.pick_config(key, [{"n": 3}, {"n": 1}], launch) == {"n": 1}  # kept, not retimed
    assert len(calls) == 3 + 2 * timed


@pytest.mark.parametrize("capturable", [True, False])
def test_pick_config_times_short_kernels_in_back_to_back_spans(kt, capturable):
    """A launch far below BURST_MS is timed in spans of several back-to-back launches (single
    ones are a few ticks of the events' clock), the same number for every candidate: captured
    once into a CUDA graph that each span replays, or, where a launch cannot be captured (here:
    it raises while captured), launched again for every span."""
    common = sys.modules[kt.__name__ + "._common"]
    calls, captured = [], []

    def launch(cfg):
        capturing = torch.cuda.is_current_stream_capturing()
        if capturing and not capturable:
            raise RuntimeError("this launch cannot be captured")
        calls.append(cfg["n"])
        captured.append(capturing)
        torch.cuda._sleep(200 * cfg["n"])

    key = ("pick_config burst test", capturable, zlib.crc32(os.urandom(8)))
    assert common.pick_config(key, [{"n": 40}, {"n": 1}], launch) == {"n": 1}
    assert calls.count(40) == calls.count(1)
    spans = calls.count(1) - 2  # less the warm-up and sizing launches
    if capturable:  # every timed launch went into the graphs, once
        assert sum(captured) == 2 * spans and spans > 1
    else:
        assert not any(captured) and spans % common.TUNING_ROUNDS == 0
        assert spans // common.TUNING_ROUNDS > 1
