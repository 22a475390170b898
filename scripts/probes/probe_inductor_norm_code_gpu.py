"""Inductor's own code for a compiled LlamaRMSNorm forward (bf16, no grad) at the host-bound
shapes where ours trails it in CUDA graphs (GPU): the generated source, one file per shape under
--out. The Triton kernel in it shows how Inductor specialises the shape (constant sizes, no
masks where it tiles, the loop and eviction hints of wide rows).

    python scripts/probes/probe_inductor_norm_code_gpu.py --out DIR [--shapes 4096x8192,...]
"""

import argparse
import sys
from pathlib import Path

import torch
from torch._inductor.utils import run_and_get_code

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_cases_elementwise as cases  # noqa: E402
from bench_harness import allow_many_compiles  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="4096x8192,1024x1024,4096x128,1024x128")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    allow_many_compiles()
    for shape in args.shapes.split(","):
        m, n = (int(v) for v in shape.split("x"))
        mod, x = cases._llama_rms_norm(n), cases._randn(m, n, requires_grad=False)
        compiled = torch.compile(mod)
        with torch.no_grad():
            _, code = run_and_get_code(compiled, x)
            for _ in range(3):
                compiled(x)
        torch.cuda.synchronize()
        (out / f"{shape}.txt").write_text("\n\n# ----\n\n".join(code))
        print(f"{shape}: {len(code)} generated module(s) written", flush=True)


if __name__ == "__main__":
    main()
