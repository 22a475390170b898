"""First calls of RMSNorm at the wide-row shapes whose forward has the most candidates (masked,
EVEN and looped), each shape in a fresh process with an empty Triton cache: compile and tuning
of the forward (and the backward, with a gradient) included (GPU).

    python scripts/probes/probe_norm_first_call_gpu.py [--shapes 4096x8192,1024x16384]
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import sys, time, torch
sys.path.insert(0, sys.argv[1])
from bench_harness import load_training_kernels
kt = load_training_kernels()
m, n, grad = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
w = torch.ones(n, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
torch.cuda.synchronize()
t = time.perf_counter()
y = kt.rms_norm(x, w, 1e-6)
if grad:
    y.backward(torch.ones_like(y))
torch.cuda.synchronize()
print(f"{time.perf_counter() - t:.2f}")
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="4096x8192,1024x8192,4096x16384,1024x1024")
    args = p.parse_args()
    scripts = str(Path(__file__).resolve().parents[1])
    print("| shape | call | first call s (fresh process, empty Triton cache) | process s |")
    print("|---|---|---|---|")
    for shape in args.shapes.split(","):
        m, n = shape.split("x")
        for grad, what in (("0", "forward, no grad"), ("1", "forward + backward")):
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, TRITON_CACHE_DIR=cache)
                t = time.perf_counter()
                run = subprocess.run([sys.executable, "-c", CHILD, scripts, m, n, grad], env=env,
                                     capture_output=True, text=True, timeout=300)  # fmt: skip
                wall = time.perf_counter() - t
            first = run.stdout.strip().splitlines()[-1] if run.returncode == 0 else "failed"
            print(f"| {shape} | {what} | {first} | {wall:.1f} |", flush=True)
            if run.returncode:
                print(run.stderr[-2000:], file=sys.stderr)


if __name__ == "__main__":
    main()
