"""Shared timing harness for scripts/bench_kernels.py (GPU only).

A `Case` is one op at one shape with several implementations ("eager", "torch.compile", "liger",
"ours", ...). Each implementation is a `make()` that builds fresh inputs and returns two closures:
`fwd()` and `fwd_bwd()`. The harness times both with `triton.testing.do_bench` (median), measures
the extra peak memory of one fwd+bwd above what the inputs and outputs hold, and reports GB/s or
TFLOP/s against the ceilings measured in the same run.
"""

from __future__ import annotations

import gc
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

Closures = tuple[Callable[[], object], Callable[[], object]]


@dataclass
class Impl:
    name: str
    make: Callable[[], Closures]  # builds inputs; returns (fwd, fwd_bwd)


@dataclass
class Case:
    op: str
    shape: str
    impls: list[Impl]
    bytes_fwd: int = 0  # minimal bytes moved by the forward (read once + write once)
    bytes_fwd_bwd: int = 0  # minimal bytes moved by forward + backward
    flops_fwd_bwd: int = 0  # for matmul-bound ops (FLCE): 6*N*H*V
    target_ms: float | None = None  # the issue's target for fwd+bwd, if any
    notes: list[str] = field(default_factory=list)


@dataclass
class Ceilings:
    copy_gbps: float
    matmul_tflops: float


def measure_ceilings() -> Ceilings:
    from triton.testing import do_bench

    n = 1 << 30  # 2 GiB of bf16 -> copy moves 4 GiB
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    copy_gbps = 2 * src.numel() * src.element_size() / ms / 1e6
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=25, rep=100, return_mode="median")
    tflops = 2 * 8192**3 / ms / 1e9
    del a, b
    torch.cuda.empty_cache()
    return Ceilings(copy_gbps=copy_gbps, matmul_tflops=tflops)


def _time(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def _extra_peak_mib(make: Callable[[], Closures]) -> float:
    """Peak memory of one fwd+bwd above the memory held once it returns (inputs, grads, outputs)."""
    gc.collect()
    torch.cuda.empty_cache()
    fwd, fwd_bwd = make()
    fwd_bwd()  # warm (compile, autotune) outside the measured window
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    peak = torch.cuda.max_memory_allocated()
    del fwd, fwd_bwd
    return (peak - max(base, after)) / 2**20


def run_case(case: Case, ceil: Ceilings) -> list[dict]:
    rows = []
    for impl in case.impls:
        row: dict = {"op": case.op, "shape": case.shape, "impl": impl.name}
        try:
            fwd, fwd_bwd = impl.make()
            fwd_bwd()  # compile / autotune first
            row["fwd_ms"] = _time(fwd)
            row["fwd_bwd_ms"] = _time(fwd_bwd)
            del fwd, fwd_bwd
            row["extra_mib"] = _extra_peak_mib(impl.make)
            if case.bytes_fwd:
                row["fwd_gbps"] = case.bytes_fwd / row["fwd_ms"] / 1e6
            if case.bytes_fwd_bwd:
                row["fwd_bwd_gbps"] = case.bytes_fwd_bwd / row["fwd_bwd_ms"] / 1e6
            if case.flops_fwd_bwd:
                row["tflops"] = case.flops_fwd_bwd / row["fwd_bwd_ms"] / 1e9
        except Exception as exc:  # a peer that cannot run this case is reported, not fatal
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        rows.append(row)
        gc.collect()
        torch.cuda.empty_cache()
    floor_ms = 0.0
    if case.bytes_fwd_bwd:
        floor_ms = case.bytes_fwd_bwd / (ceil.copy_gbps * 1e6)
    if case.flops_fwd_bwd:
        floor_ms = max(floor_ms, case.flops_fwd_bwd / (ceil.matmul_tflops * 1e9))
    for row in rows:
        row["floor_ms"] = floor_ms
        row["target_ms"] = case.target_ms
    return rows


def format_table(rows: list[dict], ceil: Ceilings) -> str:
    def fmt(v, spec):
        return "" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)

    head = "| op | shape | impl | fwd ms | fwd GB/s | fwd+bwd ms | fwd+bwd GB/s or TFLOP/s | extra MiB | floor ms | target ms | best? |"
    lines = [
        f"Ceilings measured in this run: copy {ceil.copy_gbps:.0f} GB/s, bf16 matmul {ceil.matmul_tflops:.0f} TFLOP/s",
        "",
        head,
        "|" + "|".join(["---"] * 11) + "|",
    ]
    by_case: dict[tuple, list[dict]] = {}
    for r in rows:
        by_case.setdefault((r["op"], r["shape"]), []).append(r)
    for (op, shape), group in by_case.items():
        ok = [r for r in group if "error" not in r]
        best = min((r["fwd_bwd_ms"] for r in ok), default=None)
        for r in group:
            if "error" in r:
                lines.append(f"| {op} | {shape} | {r['impl']} | error: {r['error']} ||||||||")
                continue
            rate = r.get("tflops")
            rate_s = f"{rate:.0f} TF/s" if rate else fmt(r.get("fwd_bwd_gbps"), ".0f")
            lines.append(
                f"| {op} | {shape} | {r['impl']} | {r['fwd_ms']:.3f} | {fmt(r.get('fwd_gbps'), '.0f')} "
                f"| {r['fwd_bwd_ms']:.3f} | {rate_s} | {r['extra_mib']:.0f} | {fmt(r['floor_ms'], '.3f')} "
                f"| {fmt(r['target_ms'], '.2f')} | {'best' if r['fwd_bwd_ms'] == best else ''} |"
            )
    return "\n".join(lines)


def dump(rows: list[dict], ceil: Ceilings, path: str) -> None:
    with open(path, "w") as fh:
        json.dump({"ceilings": ceil.__dict__, "rows": rows}, fh, indent=1)
