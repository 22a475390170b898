"""SASS of the RMSNorm forward kernel (sm_90, no GPU needed: Triton's bundled ptxas and
nvdisasm), bf16 LLAMA casting with a weight, with and without HAS_OFFSET: instruction counts and
the fp32 -> bf16 conversions (F2F.BF16.F32) that a run-time offset add costs.

Without the offset the weight stays exactly a bf16 value, so x̂ (rounded to bf16) times w is
compiled to packed bf16 multiplies; with `+ offset` it stays fp32 with a conversion per element.

    python scripts/probes/probe_norm_fwd_sass.py [--json]

Run it with TRITON_INTERPRET unset (the interpreter replaces the kernels' compiled form).
"""

import collections
import json
import sys
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_harness import load_training_kernels  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass import sass_opcodes  # noqa: E402

# (BLOCK_M, BLOCK_N, num_warps): geometries the tuner picks at the sweeps' shapes
GEOMETRIES = [(16, 128, 4), (2, 1024, 4), (1, 4096, 8), (1, 8192, 4)]


def opcodes(block_m: int, block_n: int, warps: int, has_offset: bool) -> list[str]:
    """The SASS opcodes of the forward kernel at this geometry (bf16 in and out, a weight)."""
    rms = sys.modules[load_training_kernels().__name__ + ".rms_norm"]
    constants = dict(BLOCK_M=block_m, BLOCK_N=block_n, MODE=rms.LLAMA, RESIDUAL=False,
                     HAS_W=True, HAS_OFFSET=has_offset)  # fmt: skip
    types = {"X": "*bf16", "R": "*bf16", "W": "*bf16", "Y": "*bf16", "S": "*bf16",
             "RSTD": "*fp32", "eps": "fp32", "offset": "fp32"}  # fmt: skip
    return sass_opcodes(rms._rms_norm_fwd_kernel.fn, types, constants, warps)


def main() -> None:
    rows = []
    for block_m, block_n, warps in GEOMETRIES:
        for has_offset in (False, True):
            ops = opcodes(block_m, block_n, warps, has_offset)
            count = collections.Counter(ops)
            rows.append(
                {"geometry": f"{block_m}r {block_n} {warps}w", "has_offset": has_offset,
                 "instructions": len(ops), "F2F.BF16.F32": count["F2F.BF16.F32"],
                 "packed bf16 mul/fma": count["HMUL2.BF16_V2"] + count["HFMA2.MMA.BF16_V2"]
                 + count["HFMA2.BF16_V2"]}
            )  # fmt: skip
    if "--json" in sys.argv:
        print(json.dumps(rows))
        return
    print(f"triton {triton.__version__}, sm_90, RMSNorm forward, bf16, LLAMA casting, a weight\n")
    print("| geometry | HAS_OFFSET | SASS instructions | F2F.BF16.F32 | packed bf16 mul/fma |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['geometry']} | {r['has_offset']} | {r['instructions']} | "
              f"{r['F2F.BF16.F32']} | {r['packed bf16 mul/fma']} |")  # fmt: skip


if __name__ == "__main__":
    main()
