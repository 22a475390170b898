"""Why a Python backward costs more host time on the autograd engine's device thread: a diagnosis.

    python scripts/probes/probe_engine_thread_gpu.py

Times host microseconds per forward+backward for autograd.Functions whose backward does nothing,
one torch op, one or three Triton launches, with the engine's device threads on and off; and how
long the backward body itself takes in each case (perf_counter inside it). Prints Triton's launch
path source so a direct launcher can be written against the installed version.
"""

from __future__ import annotations

import inspect
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_harness import host_us  # noqa: E402

DT = torch.bfloat16
BODY: list[float] = []


@triton.jit
def _copy(X, Y, N, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + cols, tl.load(X + cols, mask=cols < N), mask=cols < N)


def launch(g, out):
    n = g.numel()
    _copy[(triton.cdiv(n, 4096),)](g, out, n, BLOCK=4096)


def make(kind):
    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            t = time.perf_counter()
            if kind == "noop":
                out = g
            elif kind == "torch op":
                out = g * 2
            elif kind == "1 triton":
                out = torch.empty_like(g)
                launch(g, out)
            elif kind == "3 triton":
                out = torch.empty_like(g)
                launch(g, out)
                launch(out, g.new_empty(g.shape))
                launch(out, g.new_empty(g.shape))
            else:
                raise ValueError(kind)
            BODY.append(time.perf_counter() - t)
            return out

    return F.apply


def main():
    print(f"python {sys.version.split()[0]} torch {torch.__version__} triton {triton.__version__}")
    print(f"sys.getswitchinterval() = {sys.getswitchinterval()}")
    x = torch.randn(1024, 1024, device="cuda", dtype=DT, requires_grad=True)
    g = torch.randn(1024, 1024, device="cuda", dtype=DT)
    rows = []
    for kind in ("C++ op (x*2)", "noop", "torch op", "1 triton", "3 triton"):
        f = (lambda t: t * 2) if kind.startswith("C++") else make(kind)
        fb = lambda f=f: torch.autograd.grad(f(x), (x,), (g,))  # noqa: E731
        row = [kind]
        for threads in (True, False):
            torch.autograd.set_multithreading_enabled(threads)
            BODY.clear()
            row.append(host_us(fb, 500, warmup=20))
            row.append(statistics.median(BODY) * 1e6 if BODY else float("nan"))
        torch.autograd.set_multithreading_enabled(True)
        # The same with a short sys.setswitchinterval: does the GIL hand-off wait for a timeout?
        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        BODY.clear()
        row.append(host_us(fb, 500, warmup=20))
        sys.setswitchinterval(old)
        rows.append(row)
    print("| backward | host us (engine threads) | body us | host us (1 thread) | body us "
          "| host us (threads, switchinterval 1us) |")  # fmt: skip
    for r in rows:
        print("| " + " | ".join(r[0:1] + [f"{v:.1f}" for v in r[1:]]) + " |")

    from triton.compiler import compiler
    from triton.runtime import jit

    print("== JITFunction.run")
    print(inspect.getsource(jit.JITFunction.run))
    print("== CompiledKernel.__getitem__ / launch_metadata")
    print(inspect.getsource(compiler.CompiledKernel.__getitem__))
    print(inspect.getsource(compiler.CompiledKernel.launch_metadata))
    from triton.backends.nvidia import driver

    print("== CudaLauncher")
    print(inspect.getsource(driver.CudaLauncher))


if __name__ == "__main__":
    main()
