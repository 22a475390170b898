"""Where GeGLU/SwiGLU fwd+bwd at 16384x14336 stands against torch.compile, and whether the
backward kernel has anything left (GPU).

    python scripts/probes/probe_glu_backward.py

Prints one table, bf16, all rows from this one run:
- ``fwd+bwd``: autograd forward + backward of act(a) * b, ours (also with the flat kernels at
  1024 elements x 4 warps) against torch.compile of the eager code, timed as bench_kernels times
  it (device time, host hidden, L2 flushed; implementations take turns over 5 rounds);
- ``kernel (profiler)``: the same calls, each GPU kernel's own duration from torch.profiler;
- ``fwd -> bwd kernels``: the forward and backward kernels launched back to back without
  autograd, the shipped ones against variants at Inductor's launch size, adding one by one
  what Inductor's generated kernels do differently (int32 offsets without masks, the tanh
  form, act(a) kept in fp32 instead of rounded to bf16 as eager rounds it);
- ``bwd kernel``: the backward kernel alone, the shipped one against variants of it (exp2 math,
  int32 offsets without masks, eviction hints, two tiles per program, a persistent grid).
"""

import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/: the bench harness
from bench_harness import _device_ms, load_training_kernels  # noqa: E402

M, N, ROUNDS = 16384, 14336, 5
_LOG2E = 1.4426950408889634
_K, _C = 0.7978845608028654, 0.044715
# Constants go on the right of tensors: in the CPU interpreter, constexpr * tensor passed
# straight to tl.sigmoid or tl.exp fails.
# exp2 forms: sigmoid(2u) = 1 / (1 + 2^-(a (G1 + G2 a^2))); 2 du/da = D1 + D2 a^2
G1, G2 = tl.constexpr(2 * _K * _LOG2E), tl.constexpr(2 * _K * _C * _LOG2E)
D1, D2 = tl.constexpr(2 * _K), tl.constexpr(6 * _K * _C)
NL2E = tl.constexpr(-_LOG2E)
KC, CC, K2 = tl.constexpr(_K), tl.constexpr(_C), tl.constexpr(2 * _K)


@triton.jit
def _variant_fwd(
    A, B, C, numel, ACT: tl.constexpr, NOMASK: tl.constexpr, TANH: tl.constexpr,
    ROUND: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """act(a) * b as the shipped forward computes it, with the same knobs as the backward."""
    if NOMASK:  # int32 offsets, whole tiles only (the probe's shape divides evenly)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = None
    else:
        offs = tl.cast(tl.program_id(0), tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
    a = tl.load(A + offs, mask=mask).to(tl.float32)
    b = tl.load(B + offs, mask=mask).to(tl.float32)
    if ACT == 0:
        h = a * tl.sigmoid(a)
    elif TANH:
        h = 0.5 * a * (1.0 + libdevice.tanh((a + a * a * a * CC) * KC))
    else:
        h = a * tl.sigmoid((a + a * a * a * CC) * K2)
    if ROUND:
        h = h.to(A.dtype.element_ty).to(tl.float32)
    tl.store(C + offs, (h * b).to(C.dtype.element_ty), mask=mask)


@triton.jit
def _tile(
    t, DC, A, B, DA, DB, numel, ACT: tl.constexpr, EXP2: tl.constexpr, NOMASK: tl.constexpr,
    EVICT: tl.constexpr, TANH: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Gradients of act(a) * b over tile t, as the shipped kernel computes them."""
    if NOMASK:  # int32 offsets, whole tiles only (the probe's shape divides evenly)
        offs = t * BLOCK + tl.arange(0, BLOCK)
        mask = None
    else:
        offs = tl.cast(t, tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
    if EVICT:
        dc = tl.load(DC + offs, mask=mask, eviction_policy="evict_first").to(tl.float32)
        a = tl.load(A + offs, mask=mask, eviction_policy="evict_first").to(tl.float32)
        b = tl.load(B + offs, mask=mask, eviction_policy="evict_first").to(tl.float32)
    else:
        dc = tl.load(DC + offs, mask=mask).to(tl.float32)
        a = tl.load(A + offs, mask=mask).to(tl.float32)
        b = tl.load(B + offs, mask=mask).to(tl.float32)
    if ACT == 0:
        if EXP2:
            s = 1.0 / (1.0 + tl.exp2(a * NL2E))
        else:
            s = tl.sigmoid(a)
        g = s * (1.0 + a * (1.0 - s))
    elif TANH:  # as Inductor writes gelu(tanh) and its derivative
        a2 = a * a
        th = libdevice.tanh((a + a2 * a * CC) * KC)
        s = 0.5 * (1.0 + th)
        g = s + 0.5 * a * (1.0 - th * th) * ((a2 * CC * 3.0 + 1.0) * KC)
    else:
        a2 = a * a
        if EXP2:
            s = 1.0 / (1.0 + tl.exp2(-(a * (a2 * G2 + G1))))
        else:
            s = tl.sigmoid((a + a2 * a * CC) * K2)
        g = s * (1.0 + a * (1.0 - s) * (a2 * D2 + D1))
    h = a * s
    if ROUND:  # act(a) rounded to the input dtype before the product, as eager computes it
        h = h.to(A.dtype.element_ty).to(tl.float32)
    db = (dc * h).to(DB.dtype.element_ty)
    da = (dc * b * g).to(DA.dtype.element_ty)
    if EVICT:
        tl.store(DB + offs, db, mask=mask, cache_modifier=".cs")
        tl.store(DA + offs, da, mask=mask, cache_modifier=".cs")
    else:
        tl.store(DB + offs, db, mask=mask)
        tl.store(DA + offs, da, mask=mask)


@triton.jit
def _variant_bwd(
    DC, A, B, DA, DB, numel, ACT: tl.constexpr, EXP2: tl.constexpr, NOMASK: tl.constexpr,
    EVICT: tl.constexpr, TANH: tl.constexpr, ROUND: tl.constexpr, TILES: tl.constexpr,
    PERSISTENT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The shipped backward with one knob per variant: TILES tiles per program, or a grid
    that strides over all tiles."""
    if PERSISTENT:
        for t in tl.range(tl.program_id(0), tl.cdiv(numel, BLOCK), tl.num_programs(0)):
            _tile(t, DC, A, B, DA, DB, numel, ACT, EXP2, NOMASK, EVICT, TANH, ROUND, BLOCK)
    else:
        for i in tl.static_range(TILES):
            t = tl.program_id(0) * TILES + i
            _tile(t, DC, A, B, DA, DB, numel, ACT, EXP2, NOMASK, EVICT, TANH, ROUND, BLOCK)


VARIANTS = {  # name: (knobs, BLOCK, num_warps, programs per SM for a persistent grid)
    "exp2 math": ({"EXP2": True}, 2048, 8, 0),
    "int32 offsets, no mask": ({"NOMASK": True}, 2048, 8, 0),
    "evict_first loads, .cs stores": ({"EVICT": True}, 2048, 8, 0),
    "2 tiles per program": ({"TILES": 2}, 2048, 8, 0),
    "persistent, 4 programs/SM": ({"PERSISTENT": True}, 2048, 8, 4),
    "1024 x 4 warps": ({}, 1024, 4, 0),
}


BWD_DEFAULTS = {
    "EXP2": False, "NOMASK": False, "EVICT": False, "TANH": False, "ROUND": True, "TILES": 1,
    "PERSISTENT": False,
}  # fmt: skip
PAIRS = {  # fwd -> bwd kernel pairs at 1024 elements x 4 warps (Inductor's launch here)
    "variant kernels, 1024 x 4 warps": {},
    "+ int32 offsets, no mask": {"NOMASK": True},
    "+ tanh form (GeGLU)": {"NOMASK": True, "TANH": True},
    "+ act(a) not rounded to bf16 (Inductor's numerics)": {
        "NOMASK": True, "TANH": True, "ROUND": False,
    },
}  # fmt: skip


def _pair(act, knobs: dict, a, b, c, dc, da, db):
    """Launch the variant forward, then the variant backward, as one timed call."""
    grid = (triton.cdiv(a.numel(), 1024),)
    fwd = {k: knobs.get(k, BWD_DEFAULTS[k]) for k in ("NOMASK", "TANH", "ROUND")}
    bwd = {**BWD_DEFAULTS, **knobs}

    def run():
        _variant_fwd[grid](a, b, c, a.numel(), ACT=act, BLOCK=1024, num_warps=4, **fwd)
        _variant_bwd[grid](dc, a, b, da, db, a.numel(), ACT=act, BLOCK=1024, num_warps=4, **bwd)

    return run


def _with_config(glu, config: dict, fn):
    """fn() with the flat GLU kernels launched at `config` instead of the shipped choice."""

    def run():
        shipped = glu.elementwise_config
        glu.elementwise_config = lambda numel: config
        try:
            return fn()
        finally:
            glu.elementwise_config = shipped

    return run


def _kernel_durations_us(fn) -> dict[str, float]:
    """Median duration of each GPU kernel of fn() over 20 calls, L2 flushed before each."""
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    found: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA" and "FillFunctor" not in e.name:
            found.setdefault(e.name, []).append(e.device_time_total)
    return {n: statistics.median(v) for n, v in found.items()}


def main() -> int:
    if not torch.cuda.is_available():
        print("probe_glu_backward: needs a CUDA GPU", file=sys.stderr)
        return 2
    kt = load_training_kernels()
    glu = sys.modules[kt.__name__ + ".swiglu"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    torch.manual_seed(0)
    a = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dc = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    da, db = torch.empty_like(a), torch.empty_like(b)
    numel = a.numel()
    rows = []  # (op, measure, impl, [us per round], note)
    for op, act in (("GeGLU", glu.GELU_TANH), ("SwiGLU", glu.SILU)):
        compiled = torch.compile(lambda x, y, act=act: glu._torch_act(x, act) * y, dynamic=False)
        ours = kt.silu_mul if act == glu.SILU else (lambda x, y: kt.gelu_mul(x, y, "tanh"))
        calls = {
            "torch.compile": lambda f=compiled: torch.autograd.grad(f(a, b), (a, b), dc),
            "ours": lambda f=ours: torch.autograd.grad(f(a, b), (a, b), dc),
            "ours, 1024 x 4 warps": _with_config(
                glu,
                {"BLOCK": 1024, "num_warps": 4},
                lambda f=ours: torch.autograd.grad(f(a, b), (a, b), dc),
            ),
        }
        ref = glu.glu_backward(dc, a.detach(), b.detach(), act)
        kernels = {"shipped": lambda act=act: glu.glu_backward(dc, a, b, act, out=(da, db))}
        notes = {"shipped": ""}
        for name, (knobs, block, warps, per_sm) in VARIANTS.items():
            grid = (
                (sms * per_sm,) if per_sm else (triton.cdiv(numel, block * knobs.get("TILES", 1)),)
            )
            args = {**BWD_DEFAULTS, **knobs}

            def launch(grid=grid, args=args, block=block, warps=warps, act=act):
                _variant_bwd[grid](
                    dc, a, b, da, db, numel, ACT=act, BLOCK=block, num_warps=warps, **args
                )

            kernels[name] = launch
            launch()
            same = torch.equal(da, ref[0]) and torch.equal(db, ref[1])
            notes[name] = "bit-equal to shipped" if same else "differs from shipped"
        c = torch.empty_like(dc)
        pairs = {
            "shipped kernels (2048 x 8 warps)": lambda act=act: (
                glu.glu_forward(a, b, act),
                glu.glu_backward(dc, a, b, act, out=(da, db)),
            )
        }
        for name, knobs in PAIRS.items():
            if act == glu.SILU and knobs.get("TANH"):
                continue
            pairs[name] = _pair(act, knobs, a, b, c, dc, da, db)
        for fn in [*calls.values(), *kernels.values(), *pairs.values()]:
            fn()
        times: dict[tuple, list[float]] = {}
        for _ in range(ROUNDS):
            for impl, fn in calls.items():
                times.setdefault(("fwd+bwd", impl), []).append(_device_ms(fn) * 1e3)
            for impl, fn in pairs.items():
                times.setdefault(("fwd -> bwd kernels", impl), []).append(_device_ms(fn) * 1e3)
            for impl, fn in kernels.items():
                times.setdefault(("bwd kernel", impl), []).append(_device_ms(fn) * 1e3)
        for (measure, impl), us in times.items():
            rows.append((op, measure, impl, us, notes.get(impl, "")))
        for impl in ("torch.compile", "ours"):
            for kernel, us in _kernel_durations_us(calls[impl]).items():
                rows.append((op, "kernel (profiler)", f"{impl}: {kernel[:48]}", [us], ""))
    env = f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}"
    print(f"{env}; bf16 a, b {M}x{N}; microseconds\n")
    print("| op | measure | impl | rounds | median | note |")
    print("|---|---|---|---|---|---|")
    for op, measure, impl, us, note in rows:
        rounds = " ".join(f"{u:.1f}" for u in us)
        print(f"| {op} | {measure} | {impl} | {rounds} | {statistics.median(us):.1f} | {note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
