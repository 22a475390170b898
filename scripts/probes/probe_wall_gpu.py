"""Where the wall time of the training kernels goes on the GPU host: a diagnosis, not a benchmark.

    python scripts/probes/probe_wall_gpu.py

For RMSNorm (4096x1024 and 1024x4096, the function and the layer bound on a LlamaRMSNorm as a
kernelized model calls it; 16384x4096, the anchor), fused add + RMSNorm, LayerNorm, RoPE (anchor),
silu_mul / gelu_mul (in place, as the MLP layers call them) and cross-entropy, bf16, prints:
- do_bench wall time of fwd+bwd (L2 flushed, nothing queued ahead) for F.rms_norm / ours, with
  the autograd engine's device threads on and off;
- host microseconds per call (a loop of calls, one sync at the end);
- the host cost of one Triton launch through `kernel[grid](...)` and through the compiled
  kernel's own runner (what a launcher that skips the binder would pay);
- cProfile's top functions for 300 fwd+bwd calls run on the main thread.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from bench_harness import host_us, load_training_kernels  # noqa: E402
from triton.testing import do_bench  # noqa: E402

DT = torch.bfloat16


def grad_fn(fwd, leaves, g):
    return lambda: torch.autograd.grad(fwd(), leaves, g)


@triton.jit
def _k14(X, Y, W, R, M, N, s1, s2, s3, s4, eps, off, BLOCK: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(X + pid * s1 + cols, mask=cols < N, other=0.0)
    tl.store(Y + pid * s2 + cols, x, mask=cols < N)


def rope_anchor_case(kt):
    """(fwd, leaves, gradients) of RoPE at the anchor: q 8x32x2048x128 and k with 8 heads, in
    transformers' [batch, heads, seq, head_dim] layout (a transposed view), bf16."""
    b, hq, hk, t, d = 8, 32, 8, 2048, 128
    q = torch.randn(b, t, hq, d, device="cuda", dtype=DT).transpose(1, 2).requires_grad_()
    k = torch.randn(b, t, hk, d, device="cuda", dtype=DT).transpose(1, 2).requires_grad_()
    emb = torch.randn(b, t, d // 2, device="cuda").repeat(1, 1, 2)
    cos, sin = emb.cos().to(DT), emb.sin().to(DT)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    return (lambda: kt.apply_rotary_pos_emb(q, k, cos, sin), [q, k], (gq, gk))


def launch_costs():
    x = torch.randn(64, 128, device="cuda", dtype=DT)
    y, w, r = torch.empty_like(x), torch.ones(128, device="cuda"), torch.empty(64, device="cuda")
    args = (x, y, w, r, 64, 128, 128, 128, 128, 128, 1e-6, 0.0)
    ck = _k14[(64,)](*args, BLOCK=128, MODE=0)
    out = {"jit kernel[grid](...)": host_us(lambda: _k14[(64,)](*args, BLOCK=128, MODE=0), 2000)}
    try:
        runner = ck[(64, 1, 1)]
        runner(*args)
        torch.cuda.synchronize()
        assert torch.equal(y, x)
        out["CompiledKernel[grid](...)"] = host_us(lambda: runner(*args), 2000)
    except Exception as exc:  # noqa: BLE001
        out["CompiledKernel[grid](...)"] = f"{type(exc).__name__}: {exc}"[:100]
    try:
        stream = torch.cuda.current_stream().cuda_stream
        md = ck.launch_metadata((64, 1, 1), stream, *args)
        from triton import knobs

        def raw():
            ck.run(64, 1, 1, stream, ck.function, ck.packed_metadata, md,
                   knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *args)  # fmt: skip

        raw()
        out["ck.run(...) raw"] = host_us(raw, 2000)
    except Exception as exc:  # noqa: BLE001
        out["ck.run(...) raw"] = f"{type(exc).__name__}: {exc}"[:100]
    out["torch empty_like"] = host_us(lambda: torch.empty_like(x), 2000)
    out["torch x.add(1)"] = host_us(lambda: x.add(1), 2000)
    return out


def profile(fn, calls=300, top=22):
    torch.autograd.set_multithreading_enabled(False)
    try:
        fn()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(calls):
            fn()
        pr.disable()
        torch.cuda.synchronize()
    finally:
        torch.autograd.set_multithreading_enabled(True)
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def more_cases(kt) -> dict:
    """The other ops' eager paths, as a kernelized model calls them (the layers' forwards bound
    on transformers modules; in place where the MLP layers pass it), with torch's op beside."""
    import types

    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    def leaf(*shape, dtype=DT):
        return torch.randn(*shape, device="cuda", dtype=dtype).requires_grad_()

    cases = {}
    m, n = 4096, 1024
    norm = LlamaRMSNorm(n, eps=1e-6).to("cuda", DT)
    x, r, g = leaf(m, n), leaf(m, n), torch.randn(m, n, device="cuda", dtype=DT)
    layer = types.MethodType(kt.layers.RMSNorm.forward, norm)
    cases[f"ours RMSNorm layer {m}x{n}"] = (lambda: layer(x), [x, norm.weight], (g,))
    add_layer = types.MethodType(kt.layers.FusedAddRMSNorm.forward, norm)
    cases[f"ours fused add+RMSNorm layer {m}x{n}"] = (
        lambda: add_layer(x, r),
        [x, r, norm.weight],
        (g, g),
    )
    ln = torch.nn.LayerNorm(n).to("cuda", DT)
    ln_layer = types.MethodType(kt.layers.LayerNorm.forward, ln)
    cases[f"ours LayerNorm layer {m}x{n}"] = (lambda: ln_layer(x), [x, ln.weight, ln.bias], (g,))
    cases[f"F.layer_norm {m}x{n}"] = (
        lambda: F.layer_norm(x, (n,), ln.weight, ln.bias, 1e-5),
        [x, ln.weight, ln.bias],
        (g,),
    )
    xa, wa = leaf(16384, 4096), leaf(4096)
    ga = (torch.randn(16384, 4096, device="cuda", dtype=DT),)
    cases["ours rms_norm 16384x4096 (anchor)"] = (lambda: kt.rms_norm(xa, wa, 1e-6), [xa, wa], ga)
    cases["F.rms_norm 16384x4096 (anchor)"] = (
        lambda: F.rms_norm(xa, (4096,), wa, 1e-6),
        [xa, wa],
        ga,
    )
    # In place, the backward writes the gradients over a and b: leaves here, so their values
    # drift from call to call; the work per call does not.
    a, b = leaf(4096, 3072), leaf(4096, 3072)
    gab = (torch.randn(4096, 3072, device="cuda", dtype=DT),)
    cases["ours silu_mul in_place 4096x3072"] = (
        lambda: kt.silu_mul(a, b, in_place=True),
        [a, b],
        gab,
    )
    cases["ours gelu_mul in_place 4096x3072"] = (
        lambda: kt.gelu_mul(a, b, "tanh", in_place=True),
        [a, b],
        gab,
    )
    logits, target = leaf(4096, 32000), torch.randint(0, 32000, (4096,), device="cuda")
    one = (torch.ones((), device="cuda"),)
    cases["ours cross_entropy 4096x32000"] = (
        lambda: kt.cross_entropy(logits, target),
        [logits],
        one,
    )
    cases["F.cross_entropy 4096x32000"] = (
        lambda: F.cross_entropy(logits.float(), target),
        [logits],
        one,
    )
    return cases


def main():
    kt = load_training_kernels()
    rows = []
    profiles = {}
    cases = {}
    # 65536x1024 and 262144x128: wall 2-4x device after the host-path plans (2026-12-01 sweeps)
    for m, n in ((4096, 1024), (1024, 4096), (65536, 1024), (262144, 128)):
        x = torch.randn(m, n, device="cuda", dtype=DT, requires_grad=True)
        w = torch.randn(n, device="cuda", dtype=DT).requires_grad_()
        g = (torch.randn(m, n, device="cuda", dtype=DT),)
        cases[f"F.rms_norm {m}x{n}"] = (
            lambda x=x, w=w, n=n: F.rms_norm(x, (n,), w, 1e-6),
            [x, w],
            g,
        )
        cases[f"ours rms_norm {m}x{n}"] = (lambda x=x, w=w: kt.rms_norm(x, w, 1e-6), [x, w], g)
    cases["ours rope anchor"] = rope_anchor_case(kt)
    a = torch.randn(4096, 3072, device="cuda", dtype=DT, requires_grad=True)
    c = torch.randn(4096, 3072, device="cuda", dtype=DT, requires_grad=True)
    ga = (torch.randn(4096, 3072, device="cuda", dtype=DT),)
    cases["ours silu_mul 4096x3072"] = (lambda: kt.silu_mul(a, c), [a, c], ga)
    cases["torch silu*mul 4096x3072"] = (lambda: F.silu(a) * c, [a, c], ga)
    cases.update(more_cases(kt))

    for name, (fwd, leaves, g) in cases.items():
        fb = grad_fn(fwd, leaves, g)
        fb()
        row = {"case": name}
        row["fwd wall"] = do_bench(lambda f=fwd: torch.no_grad()(f)(), warmup=10, rep=50)
        row["fwd+bwd wall"] = do_bench(fb, warmup=10, rep=50)
        torch.autograd.set_multithreading_enabled(False)
        row["fwd+bwd wall (1 thread)"] = do_bench(fb, warmup=10, rep=50)
        row["host ms fwd+bwd (1 thread)"] = host_us(fb) / 1e3
        torch.autograd.set_multithreading_enabled(True)
        row["host ms fwd"] = host_us(lambda f=fwd: torch.no_grad()(f)()) / 1e3
        row["host ms fwd+bwd"] = host_us(fb) / 1e3
        rows.append(row)
        if name.startswith("ours"):
            profiles[name] = profile(fb)

    print("== launch costs, host us per call")
    for k_, v in launch_costs().items():
        print(f"{k_:32s} {v if isinstance(v, str) else f'{v:.1f}'}")
    for name, text in profiles.items():
        print(f"== cProfile {name} (300 fwd+bwd, 1 thread)\n{text}")
    cols = list(rows[0])
    print("== times in ms (host columns: ms per call)")
    print("| " + " | ".join(cols) + " |")
    for r in rows:
        print("| " + " | ".join(r[c] if c == "case" else f"{r[c]:.3f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
