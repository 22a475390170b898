"""What the compiled RoPE rows of bench_graph_chain spend their fwd+bwd on (GPU).

In bench_graph_chain, forward + backward of RoPE at q 16x32x512x128 took 202-207 µs per op for the
two compiled rows (ours inside torch.compile, HF's rope compiled) against 89 µs for ours and
Liger's without compile, though the compiled forward and backward graphs each hold one rope op.
q and k are transposed views of leaves there, as transformers passes them, and they are the
compiled function's inputs. This profiles three fwd+bwd calls of each row and prints the GPU
kernels by total time.

    python scripts/probes/probe_rope_compiled_boundary_gpu.py
"""

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_cases_elementwise  # noqa: E402
from bench_harness import allow_many_compiles  # noqa: E402

allow_many_compiles()
bench_cases_elementwise.set_compiled_ours(True)
case = bench_cases_elementwise.rope_case(16, 32, 8, 512, 128)
for impl in case.impls:
    if impl.name not in ("ours", "ours torch.compile", "torch.compile"):
        continue
    _, fwd_bwd = impl.make()
    for _ in range(3):
        fwd_bwd()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fwd_bwd()
        torch.cuda.synchronize()
    print(f"== {impl.name}: per call, GPU kernels and copies")
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]:
        if e.device_time_total > 0:
            print(f"  {e.device_time_total / 3:8.1f} µs  x{e.count // 3}  {e.key[:100]}")
