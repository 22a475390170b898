"""Benchmark cases for the memory-bound training kernels: RMSNorm (also fused with the residual
add), LayerNorm, RoPE, SwiGLU/GeGLU, SiLU.

Peers per case: eager (the transformers / torch module's own forward), torch.compile of that same
eager code, Liger 0.8.5 where it has the op, and ours (the layer from
hub_kernels/kernels-lab/training bound onto the same module). Inputs are bf16 (``set_dtype``
picks another) and random; the backward is timed through torch.autograd.grad so no gradient
accumulation is counted.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from bench_harness import Case, Impl, load_training_kernels

DT = torch.bfloat16
B2 = 2  # bytes per element of DT


def set_dtype(dtype: torch.dtype) -> None:
    """Make the cases built from now on use `dtype` (bf16 unless set; bench_kernels --dtype)."""
    global DT, B2
    DT, B2 = dtype, dtype.itemsize


# bench_kernels --cudagraphs: every case also gets "<impl> reduce-overhead" rows for torch's own
# implementations and ours, each the op inside torch.compile(mode="reduce-overhead"): CUDA graphs
# replay the launches without the host work around them, for host-bound shapes.
CUDAGRAPHS = False
CUDAGRAPH_SUFFIX = " reduce-overhead"


def set_cudagraphs(on: bool) -> None:
    """Add the reduce-overhead rows to the cases built from now on."""
    global CUDAGRAPHS
    CUDAGRAPHS = on


# bench_graph_chain: ours inside torch.compile (default mode) too, as a compiled model runs it.
COMPILED_OURS = False
COMPILED_OURS_NAME = "ours torch.compile"


def set_compiled_ours(on: bool) -> None:
    """Add the "ours torch.compile" row to the cases built from now on."""
    global COMPILED_OURS
    COMPILED_OURS = on


def _liger():
    """liger_kernel's modules, or the ImportError text (reported per case, not fatal)."""
    try:
        import liger_kernel.transformers as lt
        from liger_kernel.ops.geglu import LigerGELUMulFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        from liger_kernel.transformers.fused_add_rms_norm import LigerFusedAddRMSNorm
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except ImportError as exc:
        return f"liger-kernel missing: {exc}"
    return types.SimpleNamespace(
        RMSNorm=lt.LigerRMSNorm,
        FusedAddRMSNorm=LigerFusedAddRMSNorm,
        LayerNorm=lt.LigerLayerNorm,
        rope=liger_rotary_pos_emb,
        silu_mul=LigerSiLUMulFunction.apply,
        gelu_mul=LigerGELUMulFunction.apply,
    )


def _closures(fn: Callable[[], object], leaves: list[torch.Tensor], graphs: bool = False):
    """fwd() under no_grad, and fwd_bwd() = forward + autograd.grad w.r.t. `leaves`. With
    `graphs` (fn compiled with CUDA graphs), each call starts a new graph step, as a training
    loop does once per step: a replay may reuse the previous call's output memory."""
    grads: dict[str, object] = {}

    def fwd():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            return fn()

    def fwd_bwd():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        out = fn()
        outs = out if isinstance(out, tuple) else (out,)
        if "g" not in grads:  # one upstream gradient per output, laid out like the output
            grads["g"] = tuple(torch.randn_like(o) for o in outs)
        return torch.autograd.grad(outs, leaves, grads["g"])

    return fwd, fwd_bwd


def _compiled(fn):
    return torch.compile(fn, dynamic=False)


def _impls(make_eager, make_ours, make_liger=None, extra: dict | None = None) -> list[Impl]:
    """eager, torch.compile(eager), Liger, ours; each make_* returns (callable, leaves)."""

    def wrap(builder, compile_it=False, graphs=False):
        def make():
            fn, leaves = builder()
            if graphs:
                fn = torch.compile(fn, mode="reduce-overhead", dynamic=False)
            return _closures(_compiled(fn) if compile_it else fn, leaves, graphs)

        return make

    impls = [Impl("eager", wrap(make_eager)), Impl("torch.compile", wrap(make_eager, True))]
    for name, builder in (extra or {}).items():
        impls.append(Impl(name, wrap(builder)))
    if make_liger is not None:
        impls.append(Impl("liger", wrap(make_liger)))
    impls.append(Impl("ours", wrap(make_ours)))
    if COMPILED_OURS:
        impls.append(Impl(COMPILED_OURS_NAME, wrap(make_ours, True)))
    if CUDAGRAPHS:  # torch's implementations (fused by Inductor) and ours, under CUDA graphs
        for name, builder in (("eager", make_eager), *(extra or {}).items(), ("ours", make_ours)):
            impls.append(Impl(name + CUDAGRAPH_SUFFIX, wrap(builder, graphs=True)))
    return impls


def _randn(*shape, requires_grad=True):
    return torch.randn(*shape, device="cuda", dtype=DT, requires_grad=requires_grad)


# --- RMSNorm -----------------------------------------------------------------------------------


def _llama_rms_norm(n: int):
    """A bf16 LlamaRMSNorm on the GPU with a weight around 1 (not exactly 1)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    mod = LlamaRMSNorm(n, eps=1e-6).to("cuda", DT)
    with torch.no_grad():
        mod.weight.normal_(1.0, 0.1)
    return mod


def rms_norm_case(m: int, n: int, target_ms: float | None = None, label: str = "") -> Case:
    kt, liger = load_training_kernels(), _liger()

    def eager():
        mod, x = _llama_rms_norm(n), _randn(m, n)
        return (lambda: mod(x)), [x, mod.weight]

    def ours():
        mod, x = _llama_rms_norm(n), _randn(m, n)
        mod.forward = types.MethodType(kt.layers.RMSNorm.forward, mod)
        return (lambda: mod(x)), [x, mod.weight]

    def functional():
        w, x = _randn(n), _randn(m, n)
        return (lambda: F.rms_norm(x, (n,), w, 1e-6)), [x, w]

    def liger_impl():
        if isinstance(liger, str):
            raise RuntimeError(liger)
        mod, x = liger.RMSNorm(n, eps=1e-6).to("cuda", DT), _randn(m, n)
        return (lambda: mod(x)), [x, mod.weight]

    elems = m * n
    return Case(
        op="RMSNorm",
        shape=f"x {m}x{n}{label}",
        impls=_impls(eager, ours, liger_impl, {"F.rms_norm": functional}),
        bytes_fwd=2 * B2 * elems,
        bytes_fwd_bwd=5 * B2 * elems,
        target_ms=target_ms,
    )


def add_rms_norm_case(m: int, n: int) -> Case:
    """The decoder layer's `residual + hidden` followed by its RMSNorm; returns (normed, sum)."""
    kt, liger = load_training_kernels(), _liger()

    def eager():
        mod, x, r = _llama_rms_norm(n), _randn(m, n), _randn(m, n)

        def fn():
            s = r + x
            return mod(s), s

        return fn, [x, r, mod.weight]

    def ours():
        mod, x, r = _llama_rms_norm(n), _randn(m, n), _randn(m, n)
        mod.forward = types.MethodType(kt.layers.FusedAddRMSNorm.forward, mod)
        return (lambda: mod(x, r)), [x, r, mod.weight]

    def liger_impl():
        if isinstance(liger, str):
            raise RuntimeError(liger)
        mod = liger.FusedAddRMSNorm(n, eps=1e-6).to("cuda", DT)
        with torch.no_grad():  # a weight drawn like the other peers'
            mod.weight.copy_(_llama_rms_norm(n).weight)
        x, r = _randn(m, n), _randn(m, n)
        return (lambda: mod(x, r)), [x, r, mod.weight]

    elems = m * n
    return Case(
        op="AddRMSNorm",
        shape=f"x, residual {m}x{n}",
        impls=_impls(eager, ours, liger_impl),
        bytes_fwd=4 * B2 * elems,  # read x and the residual, write the sum and the norm
        bytes_fwd_bwd=8 * B2 * elems,  # + read dy, ds and the sum, write one shared gradient
    )


# --- LayerNorm ---------------------------------------------------------------------------------


def layer_norm_case(m: int, n: int) -> Case:
    kt, liger = load_training_kernels(), _liger()

    def module():
        mod = torch.nn.LayerNorm(n).to("cuda", DT)
        with torch.no_grad():
            mod.weight.normal_(1.0, 0.1)
            mod.bias.normal_()
        return mod

    def eager():
        mod, x = module(), _randn(m, n)
        return (lambda: mod(x)), [x, mod.weight, mod.bias]

    def ours():
        mod, x = module(), _randn(m, n)
        mod.forward = types.MethodType(kt.layers.LayerNorm.forward, mod)
        return (lambda: mod(x)), [x, mod.weight, mod.bias]

    def liger_impl():
        if isinstance(liger, str):
            raise RuntimeError(liger)
        mod, x = liger.LayerNorm(n).to("cuda", DT), _randn(m, n)
        return (lambda: mod(x)), [x, mod.weight, mod.bias]

    elems = m * n
    return Case(
        op="LayerNorm",
        shape=f"x {m}x{n}",
        impls=_impls(eager, ours, liger_impl),
        bytes_fwd=2 * B2 * elems,
        bytes_fwd_bwd=5 * B2 * elems,
    )


# --- RoPE --------------------------------------------------------------------------------------


def rope_case(b: int, hq: int, hk: int, t: int, d: int, target_ms: float | None = None) -> Case:
    from transformers.models.llama import modeling_llama

    kt, liger = load_training_kernels(), _liger()
    hf_rope = modeling_llama.apply_rotary_pos_emb

    def inputs():
        # transformers passes q/k as [B, H, T, D] views of the projections' [B, T, H, D] output.
        q = _randn(b, t, hq, d).transpose(1, 2)
        k = _randn(b, t, hk, d).transpose(1, 2)
        angles = torch.rand(b, t, d // 2, device="cuda") * 100
        emb = torch.cat((angles, angles), dim=-1)
        return q, k, emb.cos().to(DT), emb.sin().to(DT)

    def eager():
        q, k, cos, sin = inputs()
        return (lambda: hf_rope(q, k, cos, sin)), [q, k]

    def ours():
        q, k, cos, sin = inputs()
        holder = torch.nn.Module()
        holder.forward = types.MethodType(kt.layers.rotary_pos_emb.forward, holder)
        return (lambda: holder(q, k, cos, sin)), [q, k]

    def liger_impl():
        if isinstance(liger, str):
            raise RuntimeError(liger)
        q, k, cos, sin = inputs()
        return (lambda: liger.rope(q, k, cos, sin)), [q, k]

    qk = b * t * (hq + hk) * d
    cos_sin = 2 * b * t * d
    return Case(
        op="RoPE",
        shape=f"q {b}x{hq}x{t}x{d}, k {b}x{hk}x{t}x{d}",
        impls=_impls(eager, ours, liger_impl),
        bytes_fwd=B2 * (2 * qk + cos_sin),
        bytes_fwd_bwd=2 * B2 * (2 * qk + cos_sin),
        target_ms=target_ms,
    )


# --- gated activations and SiLU ------------------------------------------------------------------


def glu_case(m: int, n: int, act: str, target_ms: float | None = None) -> Case:
    """act(a) * b as the HF MLP writes it: act_fn(gate_proj(x)) * up_proj(x).

    "ours" is the product as the MLP layers run it: its backward writes d(a), d(b) over a and b
    (the projections' outputs, read by nothing else), as Liger's always does; "ours out of
    place" is the functional `silu_mul` / `gelu_mul` default, which leaves a and b intact.
    """
    kt, liger = load_training_kernels(), _liger()
    if act == "silu":
        from transformers.activations import SiLUActivation

        hf_act, ours_fn, op = SiLUActivation(), kt.silu_mul, "SwiGLU silu(a)*b"
    else:
        from transformers.activations import GELUTanh

        hf_act, op = GELUTanh(), "GeGLU gelu_tanh(a)*b"

        def ours_fn(a, b, in_place=False):
            return kt.gelu_mul(a, b, "tanh", in_place=in_place)

    def eager():
        a, b = _randn(m, n), _randn(m, n)
        return (lambda: hf_act(a) * b), [a, b]

    def ours():
        a, b = _randn(m, n), _randn(m, n)
        return (lambda: ours_fn(a, b, in_place=True)), [a, b]

    def ours_out_of_place():
        a, b = _randn(m, n), _randn(m, n)
        return (lambda: ours_fn(a, b)), [a, b]

    def liger_impl():
        if isinstance(liger, str):
            raise RuntimeError(liger)
        fn = liger.silu_mul if act == "silu" else liger.gelu_mul
        a, b = _randn(m, n), _randn(m, n)
        return (lambda: fn(a, b)), [a, b]

    elems = m * n
    return Case(
        op=op,
        shape=f"a,b {m}x{n}",
        impls=_impls(eager, ours, liger_impl, {"ours out of place": ours_out_of_place}),
        bytes_fwd=3 * B2 * elems,
        bytes_fwd_bwd=8 * B2 * elems,
        target_ms=target_ms,
    )


def silu_case(m: int, n: int) -> Case:
    from transformers.activations import SiLUActivation

    kt = load_training_kernels()

    def eager():
        act, x = SiLUActivation(), _randn(m, n)
        return (lambda: act(x)), [x]

    def ours():
        act, x = SiLUActivation(), _randn(m, n)
        act.forward = types.MethodType(kt.layers.SiLU.forward, act)
        return (lambda: act(x)), [x]

    elems = m * n
    return Case(
        op="SiLU",
        shape=f"x {m}x{n}",
        impls=_impls(eager, ours),
        bytes_fwd=2 * B2 * elems,
        bytes_fwd_bwd=5 * B2 * elems,
    )


def cases(small: bool) -> list[Case]:
    """The anchors (issue targets) and small, launch-bound shapes; `small` keeps only the latter."""
    out = [
        rms_norm_case(2048, 4096),
        add_rms_norm_case(2048, 4096),
        rope_case(1, 32, 8, 2048, 128),
        glu_case(2048, 4096, "silu"),
        layer_norm_case(2048, 4096),
    ]
    if small:
        return out
    return out + [
        rms_norm_case(16384, 4096, target_ms=0.20),
        rms_norm_case(262144, 128, label=" (Qwen3 q_norm)"),
        add_rms_norm_case(16384, 4096),
        rope_case(8, 32, 8, 2048, 128, target_ms=0.20),
        rope_case(8, 16, 8, 2048, 128),
        glu_case(16384, 14336, "silu", target_ms=0.92),
        glu_case(16384, 3072, "silu"),
        glu_case(16384, 14336, "gelu_tanh"),
        silu_case(16384, 14336),
        layer_norm_case(16384, 4096),
    ]
