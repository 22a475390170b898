"""RMSNorm forward against Inductor's: our kernel's geometries and a two-pass looped kernel, per
op inside a CUDA graph of 32 calls, on one input (L2-warm) and on 32 inputs (cold) (GPU).

bench_graph_chain found Inductor's compiled LlamaRMSNorm forward ahead of ours at 8 of 10
host-bound shapes (by 0.1-2.5 µs per op). Ours holds whole rows in one program's registers;
Inductor's kernel is specialised to the shape. This times, in LLAMA casting mode with a weight,
bf16: ours as picked; ours at 1, 2 or 4 rows per program and 2-32 warps; for rows wider than
4096 a looped kernel (each row in chunks, read twice, the second read an L2 hit: several rows in
flight per SM) at a few chunk sizes and warps; and the compiled module. The output committed in
docs/benchmarks/compile-h200-2026-12-02-s8/ also has two "rms_norm.py {'LOOP': ...}" rows: the
same looped kernel offered to rms_norm.py's tuner on a tree since reverted.

    python scripts/probes/probe_norm_fwd_wide_gpu.py
"""

import statistics
import sys
from pathlib import Path

import torch
import triton  # noqa: F401
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_harness import load_training_kernels  # noqa: E402


@triton.jit
def _looped_fwd(X, W, Y, RSTD, N, stride, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    xr, yr = X + row * stride, Y + row * stride
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c in tl.range(0, N, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        x = tl.load(xr + cols, mask=cols < N, other=0.0, eviction_policy="evict_last")
        x = x.to(tl.float32)
        acc += x * x
    rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
    for c in tl.range(0, N, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        m = cols < N
        x = tl.load(xr + cols, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
        w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
        xhat = (x * rstd).to(X.dtype.element_ty).to(tl.float32)
        tl.store(yr + cols, (xhat * w).to(Y.dtype.element_ty), mask=m)
    tl.store(RSTD + row, rstd)


def looped(block, warps):
    def fn(x, w):
        m, n = x.shape
        y = torch.empty_like(x)
        rstd = torch.empty(m, device=x.device, dtype=torch.float32)
        _looped_fwd[(m,)](x, w, y, rstd, n, n, 1e-6, BLOCK=block, num_warps=warps)
        return y

    return fn


def per_op_us(fn, xs, ops=32, replays=10, rounds=5):
    """Device µs per call in a CUDA graph of `ops` calls, call i on xs[i % len(xs)]."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x in xs[:3]:
            fn(x)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(ops):
            fn(xs[i % len(xs)])
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        e0.record()
        for _ in range(replays):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        out.append(e0.elapsed_time(e1) * 1e3 / (ops * replays))
    return statistics.median(out)


def round_times(impls: dict, x, rounds: int, ops: int = 32, replays: int = 20) -> dict:
    """name -> per-op µs of each round: every implementation timed on x once per round (one
    per_op_us graph of `ops` calls, `replays` replays), the order reversed every other round."""
    times = {k: [] for k in impls}
    for r in range(rounds):
        for k in list(impls) if r % 2 == 0 else list(impls)[::-1]:
            times[k].append(per_op_us(impls[k], [x], ops=ops, replays=replays, rounds=1))
    return times


def main():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    kt = load_training_kernels()
    rms = sys.modules[kt.__name__ + ".rms_norm"]
    torch.manual_seed(0)
    shapes = [
        (1024, 1024), (4096, 1024), (1024, 4096), (4096, 4096),
        (1024, 8192), (4096, 8192), (1024, 16384), (4096, 16384),
    ]  # fmt: skip
    print(
        "| shape | impl | µs/op, one input (L2-warm) | µs/op, 32 inputs (cold) | max abs err vs ours |"
    )
    print("|---|---|---|---|---|")
    for m, n in shapes:
        xs = [torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(32)]
        x = xs[0]
        mod = LlamaRMSNorm(n, eps=1e-6).to("cuda", torch.bfloat16)
        with torch.no_grad():
            mod.weight.normal_(1.0, 0.1)
        w = mod.weight.detach()
        ref = rms.forward(x, w, 1e-6, False)[0]
        compiled = torch.compile(mod)
        impls = {
            "inductor": compiled,
            "ours": lambda x, w=w: rms.forward(x, w, 1e-6, False)[0],
        }
        geometries = [(1, w) for w in (4, 8, 16, 32)]
        if n <= 4096:  # short rows: several rows per program too
            geometries += [(rows, w) for rows in (2, 4) for w in (2, 4, 8) if rows * n <= 8192]
        for rows, warps in geometries:
            cfg = {"BLOCK_M": rows, "num_warps": warps}
            impls[f"whole row, {rows} rows, {warps} warps"] = lambda x, c=cfg, w=w: rms.forward(
                x, w, 1e-6, False, cfg=c
            )[0]
        for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8)) if n > 4096 else ():
            fn = looped(block, warps)
            impls[f"looped {block}, {warps} warps"] = lambda x, fn=fn, w=w: fn(x, w)
        with torch.no_grad():
            for name, fn in impls.items():
                try:
                    err = (fn(x).float() - ref.float()).abs().max().item()
                    warm, cold = per_op_us(fn, [x]), per_op_us(fn, xs)
                    print(f"| {m}x{n} | {name} | {warm:.2f} | {cold:.2f} | {err:.3g} |")
                except Exception as exc:
                    print(
                        f"| {m}x{n} | {name} | failed: {type(exc).__name__} {str(exc)[:80]} | | |"
                    )
        sys.stdout.flush()


if __name__ == "__main__":
    main()
