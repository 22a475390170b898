"""SASS opcodes of a @triton.jit kernel compiled for sm_90 without a GPU (Triton's bundled ptxas
and nvdisasm), for the probes that count instructions. Run with TRITON_INTERPRET unset."""

import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

NVDISASM = Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm"


def sass_opcodes(kernel, types: dict, constants: dict, warps: int) -> list[str]:
    """The opcodes of `kernel` with `constants` fixed; `types` gives each other argument's
    Triton type ("*bf16", "fp32", ...; "i32" when absent). Pointers and integers are marked
    divisible by 16, as the JIT specialises them at 16-aligned shapes. Constexprs not in
    `constants` take their defaults."""
    names = kernel.arg_names
    # A constexpr left out takes its declared default (else it would compile as an i32 argument).
    defaults = {p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}
    constants = {**defaults, **constants}
    signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
    attrs = {
        (names.index(n),): [["tt.divisibility", 16]]
        for n in names
        if signature[n] == "i32" or signature[n].startswith("*")
    }
    constexprs = {(names.index(n),): v for n, v in constants.items()}
    src = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run(
            [str(NVDISASM), "-c", f.name], capture_output=True, text=True, check=True
        ).stdout
    return re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text, re.M)
