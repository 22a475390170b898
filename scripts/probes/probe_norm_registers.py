"""Registers, spills and shared memory of every shipped norm-backward geometry, compiled for an
H200 (sm_90) on any machine: Triton's bundled ptxas, cuobjdump and nvdisasm, no GPU.

    python scripts/probes/probe_norm_registers.py            # hidden 4096, 8192 and 16384
    python scripts/probes/probe_norm_registers.py 16384 5120 # other widths

For each width, the RMSNorm backward (bf16, llama mode, with dW, no residual) and the LayerNorm
backward (bf16, weight and bias) at each geometry ``bwd_candidates`` lists, as the JIT
specialises them at 16-aligned shapes. Columns: registers per thread, spill stores and loads
(STL / LDL instructions: the fp32 values that did not fit), the stack, the dynamic shared memory
(the STAGES buffers and the reductions' scratch; an H200 SM has 227 KiB) and the asynchronous
copies (LDGSTS: the loads STAGES moved into shared memory). A static view: it says which
geometries spill, not how fast any runs (scripts/probes/probe_norms_glu_gpu.py times them).
"""

from __future__ import annotations

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

BIN = Path(triton.__file__).parent / "backends/nvidia/bin"
TARGET = GPUTarget("cuda", 90, 32)
ROWS = 16384  # sets BLOCK_M's clamp only: the lists depend on the row count's power of two
FLOATS = ("offset", "eps")
UNALIGNED = ("M", "rows_per_program")  # row counts: not taken to be multiples of 16


def compile_stats(kernel, pointers: dict[str, str], constants: dict, warps: int) -> dict:
    """Compile `kernel` (the @triton.jit function) for sm_90 and read its resource usage."""
    names = kernel.arg_names
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in FLOATS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name not in UNALIGNED:
                attrs[(i,)] = [["tt.divisibility", 16]]
    constexprs = {(names.index(n),): v for n, v in constants.items()}
    src = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=TARGET, options={"num_warps": warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(BIN / "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
        sass = subprocess.run([str(BIN / "nvdisasm"), "-c", f.name],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
    return {
        "regs": int(re.search(r"REG:(\d+)", usage).group(1)),
        "stack": int(re.search(r"STACK:(\d+)", usage).group(1)),
        "stl": len(re.findall(r"\bSTL\b", sass)),
        "ldl": len(re.findall(r"\bLDL\b", sass)),
        "smem_kib": compiled.metadata.shared / 1024,
        "async": len(re.findall(r"\bLDGSTS\b", sass)),
    }


def geometry_constants(cfg: dict) -> dict:
    return {k: cfg[k] for k in ("BLOCK_M", "PREFETCH", "ACC_2D", "RELOAD", "STAGES")}


def rms_stats(rn, n: int, cfg: dict) -> dict:
    constants = dict(BLOCK_N=rn.next_pow2(n), MODE=rn.LLAMA, COMPUTE_DW=True, FROM_Y=False,
                     HAS_DS=False, HAS_W=True, **geometry_constants(cfg))  # fmt: skip
    pointers = dict(DY="*bf16", X="*bf16", W="*bf16", RSTD="*fp32", DX="*bf16",
                    DW_PART="*fp32", DS="*bf16")  # fmt: skip
    return compile_stats(rn._rms_norm_bwd_kernel.fn, pointers, constants, cfg["num_warps"])


def ln_stats(ln, n: int, cfg: dict) -> dict:
    constants = dict(BLOCK_N=ln.next_pow2(n), HAS_W=True, COMPUTE_DW=True, COMPUTE_DB=True,
                     **geometry_constants(cfg))  # fmt: skip
    pointers = dict(DY="*bf16", X="*bf16", W="*bf16", MEAN="*fp32", RSTD="*fp32", DX="*bf16",
                    DW_PART="*fp32", DB_PART="*fp32")  # fmt: skip
    return compile_stats(ln._layer_norm_bwd_kernel.fn, pointers, constants, cfg["num_warps"])


def main() -> None:
    widths = [int(a) for a in sys.argv[1:]] or [4096, 8192, 16384]
    kt = load_training_kernels()
    rn = sys.modules[f"{kt.__name__}.rms_norm"]
    ln = sys.modules[f"{kt.__name__}.layer_norm"]
    print(f"# probe_norm_registers (triton {triton.__version__}, sm_90, bf16, with dW)\n")
    print("| op | hidden | # | BLOCK_M | warps | prefetch | reload | stages | regs | "
          "spill st/ld | stack B | smem KiB | async copies |")  # fmt: skip
    print("|" + "---|" * 13)
    for n in widths:
        for op, stats in (("RMSNorm", rms_stats), ("LayerNorm", ln_stats)):
            for i, cfg in enumerate(rn.bwd_candidates(ROWS, n)):
                s = stats(rn if op == "RMSNorm" else ln, n, cfg)
                print(f"| {op} | {n} | {i} | {cfg['BLOCK_M']} | {cfg['num_warps']} | "
                      f"{cfg['PREFETCH']} | {cfg['RELOAD']} | {cfg['STAGES']} | {s['regs']} | "
                      f"{s['stl']}/{s['ldl']} | {s['stack']} | {s['smem_kib']:.0f} | "
                      f"{s['async']} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
