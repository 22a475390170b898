"""RMSNorm forward inside a CUDA graph of 32 calls: our kernel at its default geometry against
the geometry the tuner picks among the wide-row candidates, and Inductor's compiled module, in
alternating turns in one process (GPU). bf16, LLAMA casting, a weight, no grad.

bench_graph_chain runs differ by up to 5 % between processes at these sizes, so a change of
candidates is judged here, with every implementation timed in each round.

    python scripts/probes/probe_norm_fwd_ab_gpu.py
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_harness import load_training_kernels  # noqa: E402
from probe_norm_fwd_even_gpu import inductor_launch_configs  # noqa: E402
from probe_norm_fwd_wide_gpu import round_times  # noqa: E402

SHAPES = [
    (1024, 128), (4096, 128), (1024, 1024), (4096, 1024), (1024, 4096), (4096, 4096),
    (1024, 8192), (4096, 8192), (1024, 16384), (4096, 16384),
]  # fmt: skip


def norm_modules():
    """This tree's rms_norm and _common modules (the kernels imported as the benches do)."""
    kt = load_training_kernels()
    return sys.modules[kt.__name__ + ".rms_norm"], sys.modules[kt.__name__ + "._common"]


def llama_norm_case(m: int, n: int):
    """(x, module, weight): a bf16 [m, n] input and a LlamaRMSNorm of width n on the GPU, its
    weight drawn around 1 (and detached for our kernel)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    mod = LlamaRMSNorm(n, eps=1e-6).to("cuda", torch.bfloat16)
    with torch.no_grad():
        mod.weight.normal_(1.0, 0.1)
    return x, mod, mod.weight.detach()


def main(rounds: int = 9) -> None:
    rms, common = norm_modules()
    torch.manual_seed(0)
    lines = []
    for m, n in SHAPES:
        x, mod, w = llama_norm_case(m, n)
        default = rms.fwd_candidates(m, n)[0]
        with torch.no_grad():
            compiled = torch.compile(mod)
            if m == 4096 and n >= 8192:  # is Inductor's kernel persistent or looped here?
                from torch._inductor.utils import run_and_get_code

                src = run_and_get_code(compiled, x)[1][0]
                start = src.find("@triton.jit")
                print(f"===== Inductor, {m}x{n} =====")
                print(src[start : src.find("''', device_str", start)])
            compiled(x)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            rms.forward(x, w, 1e-6, False)  # the tuner's first call builds, times and picks
            torch.cuda.synchronize()
            print(f"{m}x{n}: ours' first call {time.perf_counter() - t0:.2f} s", flush=True)
            picked = {k: v for k, v in common._CHOICES.items() if k[0] == "rms_fwd"}
            pick = [v for k, v in picked.items() if k[1:3] == (m.bit_length(), n)][0]
            impls = {
                "inductor": compiled,
                f"ours default {default}": lambda x, c=default, w=w: rms.forward(
                    x, w, 1e-6, False, cfg=c
                )[0],
                f"ours tuned {pick}": lambda x, w=w: rms.forward(x, w, 1e-6, False)[0],
            }
            times = round_times(impls, x, rounds)
        if n >= 8192 and m == 4096:
            print(f"Inductor launch configs so far: {inductor_launch_configs()}", flush=True)
        base = statistics.median(times["inductor"])
        for name, ts in times.items():
            med = statistics.median(ts)
            lines.append(
                f"| {m}x{n} | {name} | {med:.2f} [{min(ts):.2f}-{max(ts):.2f}] | {med / base:.3f}x |"
            )
            print(lines[-1], flush=True)
    print("\n| shape | impl | µs/op, median [min-max] of rounds | vs inductor |")
    print("|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
