"""Where do our RMSNorm forward's extra 0.2-0.4 µs at 1024 x 1024 come from: the kernel's code,
its launch path, or how it was timed (GPU)?

One process, one input per shape, every implementation timed in alternating turns inside CUDA
graphs of 32 calls (median of the rounds), bf16, LLAMA casting, a weight, no grad:

  inductor          the compiled LlamaRMSNorm
  op RrWw           our op at that geometry (rms_norm.forward with cfg: plan, BoundLaunch)
  triton RrWw       the same kernel through Triton's own launcher (kernel.fn[grid]), outputs
                    allocated per call as the op does
  probe-base RrWw   probe_norm_fwd_even_gpu's copy of the forward (base: masks, int64 rows)
  probe-like RrWw   that copy as Inductor writes it: no masks, int32 offsets, weight
                    evict_last, no rstd store

    python scripts/probes/probe_norm_fwd_launch_path_gpu.py [--rounds 15]
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_norm_fwd_ab_gpu import llama_norm_case, norm_modules  # noqa: E402
from probe_norm_fwd_even_gpu import VARIANTS, variant  # noqa: E402
from probe_norm_fwd_wide_gpu import round_times  # noqa: E402

SHAPES = {(1024, 1024): [(1, 1), (2, 2), (2, 4)], (4096, 1024): [(2, 4), (4, 8)],
          (1024, 8192): [(1, 4), (1, 8)]}  # fmt: skip
INDUCTOR_LIKE = dict(EVEN_N=True, EVEN_M=True, STORE_RSTD=False, I32=True, EVICT=True)


def through_triton(rms, r: int, warps: int):
    kernel = rms._rms_norm_fwd_kernel.fn  # the @triton.jit function under FastLaunch

    def fn(x, w):
        m, n = x.shape
        y = torch.empty_like(x)
        rstd = torch.empty(m, device=x.device, dtype=torch.float32)
        kernel[(triton_cdiv(m, r),)](
            x, x, w, y, y, rstd, m, n, n, n, n, n, 1e-6, 0.0, BLOCK_M=r, BLOCK_N=n,
            MODE=rms.LLAMA, RESIDUAL=False, HAS_W=True, HAS_OFFSET=False, num_warps=warps,
        )  # fmt: skip
        return y

    return fn


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    rms, _ = norm_modules()
    torch.manual_seed(0)
    lines = []
    for (m, n), geoms in SHAPES.items():
        x, mod, w = llama_norm_case(m, n)
        with torch.no_grad():
            ref = rms.forward(x, w, 1e-6, False, cfg=rms.fwd_candidates(m, n)[0])[0]
            compiled = torch.compile(mod)
            compiled(x)
            impls = {"inductor": compiled}
            for r, wp in geoms:
                cfg = next(
                    (c for c in rms.fwd_candidates(m, n) if c["BLOCK_M"] == r and
                     c["num_warps"] == wp), None,
                )  # fmt: skip
                if cfg is not None:
                    impls[f"op {r}r{wp}w"] = lambda x, c=cfg, w=w: rms.forward(
                        x, w, 1e-6, False, cfg=c
                    )[0]
                for label, fn in (
                    ("triton", through_triton(rms, r, wp)),
                    ("probe-base", variant(VARIANTS["base"], r, wp)),
                    ("probe-like", variant(INDUCTOR_LIKE, r, wp)),
                ):
                    impls[f"{label} {r}r{wp}w"] = lambda x, f=fn, w=w: f(x, w)
            same = {k: torch.equal(f(x), ref) for k, f in impls.items() if k != "inductor"}
            times = round_times(impls, x, args.rounds)
        med = {k: statistics.median(v) for k, v in times.items()}
        ind = med["inductor"]
        for k, v in med.items():
            spread = f"{min(times[k]):.2f}-{max(times[k]):.2f}"
            eq = "" if k == "inductor" else same[k]
            lines.append(f"| {m}x{n} | {k} | {v:.2f} | {spread} | {v / ind:.3f}x | {eq} |")
            print(lines[-1], flush=True)
    print("\n| shape | impl | µs per op (median) | rounds' range | / Inductor | y == op's y |")
    print("|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
