"""How many instructions does the shipped RoPE kernel cost per program with fp32 arithmetic
against 16-bit arithmetic? Compiles `_rope_kernel` for sm_90 (no GPU needed: Triton's bundled
ptxas and nvdisasm) at the Llama shape (32 q heads, 8 k heads, head_dim 128, bf16, one token per
program, 4 warps) with UPCAST on and off, and prints one table of SASS instruction counts.

    python scripts/probes/probe_rope_sass.py
"""

import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/: the bench harness
from bench_harness import load_training_kernels  # noqa: E402

rope = sys.modules[load_training_kernels().__name__ + ".rope"]
KERNEL = rope._rope_kernel
NVDISASM = Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm"
POINTERS = ("Q", "K", "QO", "KO", "COS", "SIN")


def sass(upcast: bool, repeated: bool) -> list[str]:
    constants = dict(HQ=32, HK=8, HALF=64, BLOCK_HQ=32, BLOCK_HK=8, BLOCK_D=64, BLOCK_T=1,
                     BACKWARD=False, EVEN_T=True, REPEATED=repeated, FLAGGED=False,
                     UPCAST=upcast)  # fmt: skip
    names = KERNEL.arg_names
    signature = {}
    for n in names:
        if n in constants:
            signature[n] = "constexpr"
        elif n in POINTERS:
            signature[n] = "*bf16"
        elif n == "REPEATS":
            signature[n] = "*bf16"  # unused unless FLAGGED; cos is passed in its place
        else:
            signature[n] = "i32"
    # As the JIT specialises them at these shapes: pointers and strides divisible by 16.
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n not in constants}
    constexprs = {(names.index(n),): v for n, v in constants.items()}
    src = ASTSource(KERNEL, signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        run = subprocess.run(
            [str(NVDISASM), "-c", f.name], capture_output=True, text=True, check=True
        )
        text = run.stdout
    return re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text, re.M)


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
