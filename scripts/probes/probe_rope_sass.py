"""How many instructions does the shipped RoPE kernel cost per program with fp32 arithmetic
against 16-bit arithmetic? Compiles `_rope_kernel` for sm_90 (no GPU needed: Triton's bundled
ptxas and nvdisasm) at the Llama shape (32 q heads, 8 k heads, head_dim 128, bf16, one token per
program, 4 warps) with UPCAST on and off, and prints one table of SASS instruction counts.

    python scripts/probes/probe_rope_sass.py
"""

import collections
import sys
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/: the bench harness
from bench_harness import load_training_kernels  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass import sass_opcodes  # noqa: E402

rope = sys.modules[load_training_kernels().__name__ + ".rope"]
KERNEL = rope._rope_kernel
POINTERS = ("Q", "K", "QO", "KO", "COS", "SIN", "REPEATS")  # REPEATS: cos in its place


def sass(upcast: bool, repeated: bool) -> list[str]:
    constants = dict(HQ=32, HK=8, HALF=64, BLOCK_HQ=32, BLOCK_HK=8, BLOCK_D=64, BLOCK_T=1,
                     BACKWARD=False, EVEN_T=True, REPEATED=repeated, FLAGGED=False,
                     UPCAST=upcast)  # fmt: skip
    return sass_opcodes(KERNEL, {n: "*bf16" for n in POINTERS}, constants, warps=4)


print(
    f"triton {triton.__version__}, target sm_90, RoPE q 32 heads, k 8 heads, head_dim 128, bf16\n"
)
print("| arithmetic | cos/sin second halves | SASS instructions | top opcodes |")
print("|---|---|---|---|")
for repeated in (False, True):
    for upcast in (True, False):
        ops = sass(upcast, repeated)
        top = ", ".join(f"{op} {n}" for op, n in collections.Counter(ops).most_common(5))
        arith = "fp32 (upcast)" if upcast else "bf16 (shipped)"
        halves = "skipped" if repeated else "read"
        print(f"| {arith} | {halves} | {len(ops)} | {top} |")
