"""RMSNorm forward against Inductor's at the host-bound shapes: which of the differences
between our kernel and Inductor's shape-specialised one costs the time (GPU).

Per op inside a CUDA graph of 32 calls on one input (as bench_graph_chain), bf16, LLAMA
casting with a weight. Variants of our forward kernel, each at several launch geometries:
  base       our kernel's code (row width a run-time value, column mask, int64 row offsets,
             rstd stored)
  even       row width a compile-time constant equal to the block: no column mask; no row
             mask when the rows divide evenly
  even-nostd even, and rstd not stored (what a forward without a backward needs)
  even-i32   even, int32 offsets
  even-evict even, x loaded evict_first and the weight evict_last
and the compiled module (Inductor, default mode). Also prints Inductor's kernel source and the
launch config it ran, at two shapes. (The output committed under
docs/benchmarks/compile-h200-2026-12-03-s9/ came from a version that printed 0 as Inductor's
error instead of measuring it.)

    python scripts/probes/probe_norm_fwd_even_gpu.py
"""

import gc
import sys
import warnings
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_norm_fwd_wide_gpu import per_op_us  # noqa: E402


@triton.jit
def _fwd(X, W, Y, RSTD, M, N, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
         EVEN_N: tl.constexpr, EVEN_M: tl.constexpr, STORE_RSTD: tl.constexpr,
         I32: tl.constexpr, EVICT: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    if I32:
        offs = rows[:, None] * BLOCK_N + cols[None, :]
    else:
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    if EVEN_N:
        n = BLOCK_N
    else:
        n = N
    if EVEN_M and EVEN_N:
        if EVICT:
            x = tl.load(X + offs, eviction_policy="evict_first").to(tl.float32)
            w = tl.load(W + cols, eviction_policy="evict_last").to(tl.float32)
        else:
            x = tl.load(X + offs).to(tl.float32)
            w = tl.load(W + cols).to(tl.float32)
    else:
        rmask = rows < M
        cmask = cols < n
        x = tl.load(X + offs, mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n + eps)
    xhat = (x * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
    y = (xhat * w[None, :]).to(Y.dtype.element_ty)
    if EVEN_M and EVEN_N:
        tl.store(Y + offs, y)
        if STORE_RSTD:
            tl.store(RSTD + rows, rstd)
    else:
        tl.store(Y + offs, y, mask=(rows < M)[:, None] & (cols < n)[None, :])
        if STORE_RSTD:
            tl.store(RSTD + rows, rstd, mask=rows < M)


VARIANTS = {
    "base": dict(EVEN_N=False, EVEN_M=False, STORE_RSTD=True, I32=False, EVICT=False),
    "even": dict(EVEN_N=True, EVEN_M=True, STORE_RSTD=True, I32=False, EVICT=False),
    "even-nostd": dict(EVEN_N=True, EVEN_M=True, STORE_RSTD=False, I32=False, EVICT=False),
    "even-i32": dict(EVEN_N=True, EVEN_M=True, STORE_RSTD=True, I32=True, EVICT=False),
    "even-evict": dict(EVEN_N=True, EVEN_M=True, STORE_RSTD=True, I32=False, EVICT=True),
}


def variant(flags, rows, warps):
    def fn(x, w):
        m, n = x.shape
        y = torch.empty_like(x)
        rstd = torch.empty(m, device=x.device, dtype=torch.float32)
        _fwd[(triton.cdiv(m, rows),)](x, w, y, rstd, m, n, 1e-6, BLOCK_M=rows,
                                      BLOCK_N=n, num_warps=warps, **flags)  # fmt: skip
        return y

    return fn


def geometries(n):
    if n <= 256:
        return [(r, w) for r in (8, 16, 32, 64) for w in (1, 2, 4, 8) if r * n >= 32 * w]
    if n <= 1024:
        return [(r, w) for r in (1, 2, 4, 8) for w in (2, 4, 8)]
    if n <= 4096:
        return [(r, w) for r in (1, 2) for w in (4, 8, 16)]
    return [(1, w) for w in (4, 8, 16, 32)]


def inductor_launch_configs():
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    out = []
    warnings.simplefilter("ignore", FutureWarning)  # isinstance on deprecated module aliases
    for obj in gc.get_objects():
        try:  # weak proxies among gc's objects raise on isinstance
            if isinstance(obj, CachingAutotuner) and obj.launchers:
                cfgs = [str(launcher.config) for launcher in obj.launchers]
                out.append(f"{obj.fn.__name__}: {cfgs}")
        except ReferenceError:
            continue
    return out


def main():
    from torch._inductor.utils import run_and_get_code
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    shapes = [
        (1024, 128), (4096, 128), (1024, 1024), (4096, 1024), (1024, 4096), (4096, 4096),
        (1024, 8192), (4096, 8192), (1024, 16384), (4096, 16384),
    ]  # fmt: skip
    rows_out = []
    for m, n in shapes:
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        mod = LlamaRMSNorm(n, eps=1e-6).to("cuda", torch.bfloat16)
        with torch.no_grad():
            mod.weight.normal_(1.0, 0.1)
        w = mod.weight.detach()
        with torch.no_grad():
            ref = mod(x)
            compiled = torch.compile(mod)
            if (m, n) in ((1024, 1024), (4096, 128)):
                _, code = run_and_get_code(compiled, x)
                src = code[0]
                start = src.find("@triton_heuristics")
                print(f"===== Inductor, {m}x{n} =====")
                print(src[start : src.find("''', device_str", start)])
                print("launch:", inductor_launch_configs()[-3:])
            err = (compiled(x).float() - ref.float()).abs().max().item()
            best = {"inductor": (per_op_us(compiled, [x]), "", err)}
            for name, flags in VARIANTS.items():
                for r, wp in geometries(n):
                    fn = variant(flags, r, wp)
                    fx = lambda x, fn=fn, w=w: fn(x, w)  # noqa: E731
                    err = (fx(x).float() - ref.float()).abs().max().item()
                    us = per_op_us(fx, [x])
                    if name not in best or us < best[name][0]:
                        best[name] = (us, f"{r} rows, {wp} warps", err)
        for name, (us, geo, err) in best.items():
            rows_out.append(f"| {m}x{n} | {name} | {us:.2f} | {geo} | {err:.3g} |")
            print(rows_out[-1], flush=True)
    print("\n| shape | impl | µs/op (best geometry) | geometry | max abs err vs HF eager |")
    print("|---|---|---|---|---|")
    print("\n".join(rows_out))


if __name__ == "__main__":
    main()
