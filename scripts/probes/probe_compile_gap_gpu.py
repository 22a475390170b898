"""Where the time of a compiled bound model goes, against the same model eager (GPU; issue 30).

bench_compile.py measured Qwen3-0.6B at 1 x 2048 with the training kernels bound: eager 91 ms a
step, torch.compile of the bound model 126 ms (one graph, no break). This probe builds the same
model (bench_compile.build, seed 0), runs --warm steps of each setup in one process, then
profiles --steps steps and prints, per setup: the median step wall time, the GPU kernel time per
step, the number of kernel launches per step, and the kernels that take the most GPU time. A
gap in kernel time names the extra work; a gap in wall time only is the host.

--setups may repeat (ours,ours-compile,ours,ours-compile): a setup measured later in the process
runs on a GPU that has been busy longer, so an alternating order shows whether a gap follows the
setup or its turn. Each row records the SM clock, power and temperature (nvidia-smi) right after
its profile; per kernel name, the difference between the first two setups is printed, once from
each of their turns.

    python scripts/probes/probe_compile_gap_gpu.py [--run qwen3-1x2048] [--setups ours,ours-compile]
                                                   [--top 12]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _steps(model, opt, batches, torch) -> list[float]:
    times = []
    for ids in batches:
        torch.cuda.synchronize()
        t = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times


def gpu_state() -> str:
    """SM clock, power, temperature and active clock-event reasons of GPU 0, or why not."""
    fields = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=20).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        out = f"nvidia-smi: {exc}"
    return out or "nvidia-smi: no answer"


def measure(setup: str, run, args) -> dict:
    import torch
    from bench_compile import build
    from torch.profiler import ProfilerActivity, profile

    model, _ = build("ours" if setup != "compile" else "compile", run, "cuda", smoke=False)
    # ours-compile-nofuse: without the kernels' residual-add fusion pass (read per compile)
    os.environ["KERNELS_COMPILE_FUSION"] = "0" if setup == "ours-compile-nofuse" else "1"
    compiled = setup in ("ours-compile", "ours-compile-nofuse", "compile")
    step_model = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator().manual_seed(1234)
    n = args.warm + args.steps
    ids = torch.randint(0, model.config.vocab_size, (n, run.batch, run.seq), generator=gen)
    batches = [b.cuda() for b in ids]
    _steps(step_model, opt, batches[: args.warm], torch)
    walls = _steps(step_model, opt, batches[args.warm : args.warm + 3], torch)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _steps(step_model, opt, batches[args.warm : args.warm + args.steps], torch)
    state = gpu_state()
    per_kernel: dict[str, float] = defaultdict(float)
    launches = 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name] += event.device_time / 1e3  # ms
            launches += 1
    total = sum(per_kernel.values())
    del model, step_model, opt
    torch.cuda.empty_cache()
    return {
        "setup": setup,
        "wall_ms": statistics.median(walls) * 1e3,
        "gpu_ms": total / args.steps,
        "launches": launches / args.steps,
        "top": sorted(per_kernel.items(), key=lambda kv: -kv[1])[: args.top],
        "per_kernel": dict(per_kernel),
        "gpu": state,
    }


def diff(a: dict, b: dict, steps: int, top: int) -> list[str]:
    """Per kernel name, ms per step in b minus a, the largest differences first."""
    names = set(a["per_kernel"]) | set(b["per_kernel"])
    rows = [(b["per_kernel"].get(k, 0.0) - a["per_kernel"].get(k, 0.0), k) for k in names]
    rows.sort(key=lambda r: -abs(r[0]))
    return [f"  {d / steps:+8.2f}  {a['per_kernel'].get(k, 0.0) / steps:8.2f} -> "
            f"{b['per_kernel'].get(k, 0.0) / steps:8.2f}  {k[:120]}" for d, k in rows[:top]]  # fmt: skip


def main() -> int:
    import torch
    from bench_compile import RUNS, VARIANT

    os.environ["LOCAL_KERNELS"] = f"kernels-lab/training={VARIANT}"  # offline, this checkout

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", default="qwen3-1x2048", choices=sorted(RUNS))
    p.add_argument("--setups", default="ours,ours-compile")
    p.add_argument("--warm", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for s in args.setups.split(","):
        t = time.perf_counter()
        rows.append(measure(s, RUNS[args.run], args))
        # Printed as each setup ends: a run stopped by a time limit still shows what it measured.
        r = rows[-1]
        print(f"measured {s}: wall {r['wall_ms']:.1f} ms, GPU {r['gpu_ms']:.1f} ms / step "
              f"({time.perf_counter() - t:.0f} s)", flush=True)  # fmt: skip
    print(f"{args.run}, {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print(
        "| turn | setup | step wall ms | GPU kernel ms / step | launches / step | "
        "after the profile: SM MHz, W, C, clock events |"
    )
    print("|---|---|---|---|---|---|")
    for i, r in enumerate(rows, 1):
        print(f"| {i} | {r['setup']} | {r['wall_ms']:.1f} | {r['gpu_ms']:.1f} | "
              f"{r['launches']:.0f} | {r['gpu']} |")  # fmt: skip
    names = list(dict.fromkeys(r["setup"] for r in rows))
    if len(names) >= 2:
        firsts = [r for r in rows if r["setup"] == names[0]]
        seconds = [r for r in rows if r["setup"] == names[1]]
        for a, b in zip(firsts, seconds, strict=False):
            turns = f"turns {rows.index(a) + 1} and {rows.index(b) + 1}"
            print(f"\nkernel ms per step, {names[1]} minus {names[0]} ({turns}):")
            print("\n".join(diff(a, b, args.steps, args.top)))
    for r in rows:
        print(f"\ntop kernels, {r['setup']} (ms per step):")
        for name, ms in r["top"]:
            print(f"  {ms / args.steps:8.2f}  {name[:150]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
