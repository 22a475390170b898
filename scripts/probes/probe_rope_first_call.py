"""What a RoPE call's first forward + backward compiles on an H200, and how long each kernel takes
to build, measured on any machine: Triton's compiler for sm_90 with its bundled ptxas, no GPU.

    python scripts/probes/probe_rope_first_call.py                    # the shapes below
    python scripts/probes/probe_rope_first_call.py --one-tile 2,8     # the pre-fix kernel: the
                                                                      # wide shapes' one-tile
                                                                      # build at 2 and 8 warps

A first call on a GPU compiles one kernel per launch configuration it launches: the configs the
tuner times (`rope_candidates`) for the first kind of halves answer it times, plus one kernel
per further (direction, answer) pair with the chosen config. This replays that sequence from
the shipped plan code (`_RotatePlan`: its kernel and launch keywords, on CPU tensors of the
shape), compiles each distinct specialisation once for sm_90 in a fresh cache and prints, per
shape, the kernel, the number of builds and their summed and largest build times. Ints are
specialised as Triton's JIT specialises them (1 is a constant; multiples of 16 are marked).

The sequence assumed for a first forward + backward on a GPU: cos/sin of at least
MIN_CHECKED_ELEMENTS are checked, so the forward sees the device flag (untimed: the default
config) and the backward the host answer True (timed; the next forward builds its winner);
smaller ones are not checked, so the forward times the candidates (answer None) and the backward
builds the winner. One build per timed candidate is the worst case: a candidate that fails to
compile is skipped.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="probe-rope-cache-"))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/: the bench harness
from bench_harness import load_training_kernels  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
POINTERS = ("Q", "K", "QO", "KO", "COS", "SIN", "REPEATS")

# (batch, tokens, q heads, k heads, head_dim, q/k dtype): Liger's test_rope.py shapes (its cos
# and sin are fp32 whatever q's dtype), and the model anchors of docs/benchmarks (bf16 cos).
SHAPES = [
    (1, 128, 32, 32, 64, torch.float32),
    (2, 128, 32, 8, 64, torch.bfloat16),
    (3, 423, 73, 213, 92, torch.float16),
    (3, 423, 73, 155, 92, torch.float32),
    (1, 8192, 32, 8, 128, torch.bfloat16),
    (9, 7, 41, 41, 40, torch.float16),
    (8, 2048, 32, 8, 128, torch.bfloat16),
    (8, 2048, 16, 8, 128, torch.bfloat16),
]


def first_call_launches(rope, b, t, hq, hk, d, dtype, cos_dtype) -> list[tuple]:
    """(kernel, launch keywords, pointer dtypes, int scalars) of each launch configuration a
    first forward + backward makes (see the module docstring), in order, duplicates removed."""
    q = torch.empty(b, t, hq, d, dtype=dtype).transpose(1, 2)
    k = torch.empty(b, t, hk, d, dtype=dtype).transpose(1, 2)
    cos = torch.empty(b, t, d, dtype=cos_dtype)
    checked = cos.numel() >= rope.MIN_CHECKED_ELEMENTS
    fwd = rope._RotatePlan(q, k, cos, cos, 1, False, (None, None))
    bwd = rope._RotatePlan(q, k, cos, cos, 1, True, (None, None))
    cands = fwd.candidates
    if checked:  # forward: flag, default untimed; backward: True, timed; next forward: winner
        steps = [(fwd, "flag", cands[:1]), (bwd, True, cands), (fwd, True, cands[:1])]
    else:  # forward: None (False), timed; backward: the winner
        steps = [(fwd, False, cands), (bwd, False, cands[:1])]
    ptrs = {"Q": dtype, "K": dtype, "QO": dtype, "KO": dtype, "COS": cos_dtype, "SIN": cos_dtype}
    out, seen = [], set()
    for plan, kind, configs in steps:
        for cfg in configs:
            kw = plan._kwargs(cfg, kind)
            key = (plan.kernel.fn.__name__, tuple(sorted(kw.items())))
            if key not in seen:
                seen.add(key)
                out.append((plan.kernel, kw, dict(ptrs, REPEATS=torch.int32), plan.scalars))
    return out


def build(kernel, kwargs: dict, pointers: dict, scalars: tuple) -> float:
    """Seconds to compile `kernel` with these launch keywords for sm_90."""
    jit = kernel.fn if hasattr(kernel, "fn") and hasattr(kernel.fn, "arg_names") else kernel
    names = jit.arg_names
    options = {k: v for k, v in kwargs.items() if k == "num_warps"}
    constants = {k: v for k, v in kwargs.items() if k != "num_warps"}
    ints = iter(scalars)
    signature, attrs, constexprs = {}, {}, {}
    for i, name in enumerate(names):
        if name in constants:
            signature[name] = "constexpr"
            constexprs[(i,)] = constants[name]
        elif name in POINTERS:
            signature[name] = "*" + ("i32" if pointers[name] == torch.int32 else
                                     TRITON_TYPES[pointers[name]])  # fmt: skip
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            value = next(ints)
            if value == 1:  # the JIT makes an int equal to 1 a constant
                signature[name] = "constexpr"
                constexprs[(i,)] = 1
            else:
                signature[name] = "i32"
                if value % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(jit, signature, constexprs=constexprs, attrs=attrs)
    start = time.perf_counter()
    triton.compile(src, target=TARGET, options=options)
    return time.perf_counter() - start


def one_tile(rope, warps: list[int]) -> None:
    """The pre-fix build of the wide Liger shape: `_rope_kernel` with every head in one tile."""
    b, t, hq, hk, d, dtype = SHAPES[2]
    q = torch.empty(b, t, hq, d, dtype=dtype).transpose(1, 2)
    k = torch.empty(b, t, hk, d, dtype=dtype).transpose(1, 2)
    cos = torch.empty(b, t, d, dtype=torch.float32)
    plan = rope._RotatePlan(q, k, cos, cos, 1, False, (None, None))
    half = d // 2
    constants = {"HQ": hq, "HK": hk, "HALF": half, "BLOCK_HQ": rope.next_pow2(hq),
                 "BLOCK_HK": rope.next_pow2(hk), "BLOCK_D": rope.next_pow2(half),
                 "BACKWARD": False, "UPCAST": False, "BLOCK_T": 1, "EVEN_T": True,
                 "REPEATED": False, "FLAGGED": True}  # fmt: skip
    ptrs = {"Q": dtype, "K": dtype, "QO": dtype, "KO": dtype, "COS": torch.float32,
            "SIN": torch.float32, "REPEATS": torch.int32}  # fmt: skip
    for w in warps:
        seconds = build(rope._rope_kernel, {**constants, "num_warps": w}, ptrs, plan.scalars[:18])
        print(
            f"| one tile {hq}x{hk} heads, head_dim {d}, {w} warps | {seconds:.1f} s |", flush=True
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--one-tile", default="", help="warps, e.g. 2,8: time the pre-fix build")
    args = p.parse_args()
    rope = sys.modules[load_training_kernels().__name__ + ".rope"]
    print(f"triton {triton.__version__}, target sm_90, compiled on this CPU ({os.cpu_count()} "
          f"CPUs); MAX_TILE {rope.MAX_TILE}\n")  # fmt: skip
    if args.one_tile:
        print("| build | seconds |\n|---|---|")
        one_tile(rope, [int(w) for w in args.one_tile.split(",")])
        return 0
    print("| shape (B, T, Hq, Hk, D, dtype) | kernel | builds in a first fwd+bwd | "
          "summed build s | largest build s |")  # fmt: skip
    print("|---|---|---|---|---|")
    build(*first_call_launches(rope, 1, 4, 4, 2, 16, torch.float32, torch.float32)[0])  # warm
    for b, t, hq, hk, d, dtype in SHAPES:
        cos_dtype = torch.float32 if (b, t) != (8, 2048) else dtype
        launches = first_call_launches(rope, b, t, hq, hk, d, dtype, cos_dtype)
        times = [build(*launch) for launch in launches]
        kernel = launches[0][0].fn.__name__
        print(f"| {b}, {t}, {hq}, {hk}, {d}, {str(dtype)[6:]} | {kernel} | {len(times)} | "
              f"{sum(times):.1f} | {max(times):.1f} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
