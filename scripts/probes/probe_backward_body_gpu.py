"""Where our backward's host time goes on the autograd engine's device thread: a diagnosis.

    python scripts/probes/probe_backward_body_gpu.py

Wraps the backward of our RMSNorm and gated-activation autograd.Functions with a timer (and, in a
second pass, cProfile enabled inside the backward, so the engine's own thread is profiled), then
runs forward+backward with the engine's device threads on and off. Also times a Triton launch
through `kernel[grid](...)` against the compiled kernel's launcher called directly.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from bench_harness import host_us, load_training_kernels  # noqa: E402
from triton import knobs  # noqa: E402

DT = torch.bfloat16
BODY: list[float] = []
PROF = cProfile.Profile()
PROFILING = [False]


def wrap(fn_cls):
    orig = fn_cls.backward

    def backward(ctx, *grads):
        if PROFILING[0]:
            PROF.enable()
        t = time.perf_counter()
        out = orig(ctx, *grads)
        BODY.append(time.perf_counter() - t)
        if PROFILING[0]:
            PROF.disable()
        return out

    fn_cls.backward = staticmethod(backward)


def host_and_body_us(fn, calls=400):
    """(host us per call, median us of the wrapped backward bodies of the timed calls)."""
    BODY.clear()
    host = host_us(fn, calls, warmup=20)
    return host, statistics.median(BODY[20:]) * 1e6


@triton.jit
def _k14(X, Y, W, R, M, N, s1, s2, s3, s4, eps, off, BLOCK: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(X + pid * s1 + cols, mask=cols < N, other=0.0)
    tl.store(Y + pid * s2 + cols, x, mask=cols < N)


def launch_costs():
    x = torch.randn(64, 128, device="cuda", dtype=DT)
    y, w, r = torch.empty_like(x), torch.ones(128, device="cuda"), torch.empty(64, device="cuda")
    args = (x, y, w, r, 64, 128, 128, 128, 128, 128, 1e-6, 0.0)
    ck = _k14[(64,)](*args, BLOCK=128, MODE=0)
    full = args + (128, 0)
    get_stream = torch._C._cuda_getCurrentRawStream

    def direct():
        ck.run(64, 1, 1, get_stream(0), ck.function, ck.packed_metadata, None,
               knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *full)  # fmt: skip

    y.zero_()
    direct()
    torch.cuda.synchronize()
    ok = torch.equal(y, x)
    out = {}
    for name, fn in (("kernel[grid](...)", lambda: _k14[(64,)](*args, BLOCK=128, MODE=0)),
                     ("compiled.run(...) direct", direct),
                     ("torch.empty_like", lambda: torch.empty_like(x))):  # fmt: skip
        out[name] = host_us(fn, 3000)
    out["direct launch correct"] = ok
    return out


def main():
    kt = load_training_kernels()
    mods = {name: mod for name, mod in sys.modules.items() if name.startswith(kt.__name__)}
    for mod in mods.values():
        for attr in ("_RMSNormFunction", "_GLUFunction"):
            if hasattr(mod, attr):
                wrap(getattr(mod, attr))
    x = torch.randn(4096, 1024, device="cuda", dtype=DT, requires_grad=True)
    w = torch.randn(1024, device="cuda", dtype=DT, requires_grad=True)
    g = torch.randn(4096, 1024, device="cuda", dtype=DT)
    a = torch.randn(4096, 3072, device="cuda", dtype=DT, requires_grad=True)
    c = torch.randn(4096, 3072, device="cuda", dtype=DT, requires_grad=True)
    ga = torch.randn(4096, 3072, device="cuda", dtype=DT)
    cases = {
        "rms_norm 4096x1024": lambda: torch.autograd.grad(kt.rms_norm(x, w, 1e-6), (x, w), g),
        "silu_mul 4096x3072": lambda: torch.autograd.grad(kt.silu_mul(a, c), (a, c), ga),
    }
    print(
        "| case | host us/call threads | body us threads | host us/call 1 thread | body us 1 thread |"
    )
    for name, fb in cases.items():
        cells = []
        for threads in (True, False):
            torch.autograd.set_multithreading_enabled(threads)
            cells += host_and_body_us(fb)
        torch.autograd.set_multithreading_enabled(True)
        print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in cells) + " |")
    for name, fb in cases.items():
        for threads in (True, False):
            torch.autograd.set_multithreading_enabled(threads)
            PROF.__init__()
            PROFILING[0] = True
            for _ in range(300):
                fb()
            PROFILING[0] = False
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(PROF, stream=s).sort_stats("tottime").print_stats(14)
            print(f"== backward body profile: {name}, engine threads {threads}\n{s.getvalue()}")
        torch.autograd.set_multithreading_enabled(True)
    print("== launch costs, host us")
    for k, v in launch_costs().items():
        print(f"{k:28s} {v}")


if __name__ == "__main__":
    main()
