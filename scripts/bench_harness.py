"""Shared timing harness for scripts/bench_kernels.py (GPU only).

A `Case` is one op at one shape with several implementations ("eager", "torch.compile", "liger",
"ours", ...). Each implementation is a `make()` that builds fresh inputs and returns two closures:
`fwd()` and `fwd_bwd()`. The harness measures the extra peak memory of one fwd+bwd above what the
inputs and outputs hold, and reports GB/s or TFLOP/s against the ceilings measured in the same run.

Two timings per closure, both medians with the L2 flushed before each call:
- device time (`fwd_ms`, `fwd_bwd_ms`): a sleep kernel queued ahead of each call lets the host
  issue all of the call's work before the GPU reaches it, so host overhead (Python, autograd,
  dispatch) is hidden, as it is in a training step whose host runs ahead of the GPU. The
  implementations take turns over a few rounds (30 calls each) and the median round counts, so
  a drift of the GPU's speed during a case does not favour whichever ran first;
- wall time (`fwd_wall_ms`, `fwd_bwd_wall_ms`): `triton.testing.do_bench` as is (median, L2
  flushed before each call, nothing queued ahead; at least ~20 timed calls, rep 50 ms or more),
  so a call whose host work outlasts its GPU work is timed at its host's pace, as a user at
  small batch sees it.

Each case's table rows say which implementation is best in device and in wall time, and whether
ours is within 3 % of the best peer in both and uses no more memory than Liger (`verdict`).
"""

from __future__ import annotations

import gc
import importlib.util
import io
import itertools
import json
import math
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

Closures = tuple[Callable[[], object], Callable[[], object]]

TRAINING_VARIANT = (
    Path(__file__).resolve().parents[1] / "hub_kernels/kernels-lab/training/build/torch-universal"
)
_loaded: dict[str, ModuleType] = {}
_counter = itertools.count()


def load_training_kernels(path: Path = TRAINING_VARIANT) -> ModuleType:
    """Import the training kernel variant folder as a package (once per process and path)."""
    key = str(path)
    if key not in _loaded:
        name = f"_kernels_training_bench{next(_counter)}"
        spec = importlib.util.spec_from_file_location(
            name, path / "__init__.py", submodule_search_locations=[str(path)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        _loaded[key] = module
    return _loaded[key]


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


def _copy_gbps() -> float:
    from triton.testing import do_bench

    src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)  # 2 GiB; a copy moves 4 GiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    return 2 * src.numel() * src.element_size() / ms / 1e6


def _matmul_tflops() -> float:
    from triton.testing import do_bench

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=25, rep=100, return_mode="median")
    return 2 * 8192**3 / ms / 1e9


def measure_ceilings() -> Ceilings:
    """Device copy bandwidth (bytes read + written) and bf16 8192^3 matmul rate, measured now."""
    copy_gbps = _copy_gbps()
    tflops = _matmul_tflops()
    torch.cuda.empty_cache()
    return Ceilings(copy_gbps=copy_gbps, matmul_tflops=tflops)


def _wall_ms(fn: Callable[[], object]) -> float:
    """do_bench's median wall time over at least ~20 timed calls: do_bench repeats a call
    rep / (its own estimate) times, so rep=50 ms alone timed one call of a 40 ms op."""
    from triton.testing import do_bench

    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once_ms = (time.perf_counter() - t) * 1e3
    return do_bench(fn, warmup=10, rep=max(50.0, 20 * once_ms), return_mode="median")


def host_us(fn: Callable[[], object], calls: int = 300, warmup: int = 1) -> float:
    """Host microseconds per call of fn(): `calls` calls back to back, one sync before and after
    (the GPU keeps up with small work, so this is the CPU's time to issue it)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return host


def variant_at(rev: str, into: Path) -> Path:
    """The training variant folder as committed at git revision `rev`, extracted under `into`
    (to load it beside this tree's with `load_training_kernels`)."""
    root = TRAINING_VARIANT.parents[4]
    rel = TRAINING_VARIANT.relative_to(root).as_posix()
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", rev, rel], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / rel


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    """Host microseconds per call of fn() (CPU tensors or host-only work: no device sync), with
    the garbage collector held off so that one collection does not land in one version's run."""
    gc.collect()
    gc.disable()
    try:
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t) / calls * 1e6
    finally:
        gc.enable()


_cycles_per_ms: list[float] = []


def _sleep_cycles_per_ms() -> float:
    if not _cycles_per_ms:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # warm
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        torch.cuda.synchronize()
        _cycles_per_ms.append(20_000_000 / start.elapsed_time(end))
    return _cycles_per_ms[0]


def _device_ms(fn: Callable[[], object], reps: int = 30) -> float:
    """Median GPU time of fn() with its host work hidden behind a queued sleep kernel."""
    cache = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()  # host time of one call sizes the sleep
    host_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    cycles = int(_sleep_cycles_per_ms() * min(50.0, 2.0 * host_ms + 0.05))
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(reps)
    ]
    for start, end in events:
        cache.zero_()
        torch.cuda._sleep(cycles)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def _extra_peak_mib(fwd_bwd: Callable[[], object]) -> float:
    """Peak memory of one (already warm) fwd+bwd above what is held before and after it."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = fwd_bwd()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    peak = torch.cuda.max_memory_allocated()
    del result
    return (peak - max(base, after)) / 2**20


def _error(exc: Exception) -> str:
    """A row's error cell: the exception's type and the first line of its message."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


def run_case(case: Case, ceil: Ceilings, rounds: int = 3) -> list[dict]:
    """Every implementation of `case`, device times as medians over `rounds` in which the
    implementations take turns, so a drift of the GPU during the case favours none of them.
    All implementations' inputs are held at once for that (their sum must fit the GPU)."""
    rows, live = [], []
    for impl in case.impls:
        row: dict = {"op": case.op, "shape": case.shape, "impl": impl.name}
        try:
            fwd, fwd_bwd = impl.make()
            torch.cuda.synchronize()
            start = time.perf_counter()
            fwd_bwd()  # compile / autotune first
            torch.cuda.synchronize()
            # a first call at a new shape: Triton's builds and the launch-geometry timing
            row["first_call_s"] = time.perf_counter() - start
            live.append((row, fwd, fwd_bwd))
        except Exception as exc:  # a peer that cannot run this case is reported, not fatal
            row["error"] = _error(exc)
        rows.append(row)
    times: dict[int, dict[str, list[float]]] = {id(r): {"fwd": [], "fwd_bwd": []} for r, *_ in live}
    for _ in range(rounds):
        for row, fwd, fwd_bwd in list(live):
            try:
                times[id(row)]["fwd"].append(_device_ms(fwd))
                times[id(row)]["fwd_bwd"].append(_device_ms(fwd_bwd))
            except Exception as exc:  # noqa: BLE001 - reported in the row like a failed make()
                row["error"] = _error(exc)
                live.remove((row, fwd, fwd_bwd))
    for row, _fwd, fwd_bwd in live:
        try:
            row["fwd_ms"] = statistics.median(times[id(row)]["fwd"])
            row["fwd_bwd_ms"] = statistics.median(times[id(row)]["fwd_bwd"])
            row["fwd_bwd_ms_rounds"] = times[id(row)]["fwd_bwd"]
            row["fwd_wall_ms"] = _wall_ms(fwd)
            row["fwd_bwd_wall_ms"] = _wall_ms(fwd_bwd)
            row["extra_mib"] = _extra_peak_mib(fwd_bwd)
            if case.bytes_fwd:
                row["fwd_gbps"] = case.bytes_fwd / row["fwd_ms"] / 1e6
            if case.bytes_fwd_bwd:
                row["fwd_bwd_gbps"] = case.bytes_fwd_bwd / row["fwd_bwd_ms"] / 1e6
            if case.flops_fwd_bwd:
                row["tflops"] = case.flops_fwd_bwd / row["fwd_bwd_ms"] / 1e9
        except Exception as exc:  # noqa: BLE001
            row["error"] = _error(exc)
    live.clear()
    fwd = _fwd = fwd_bwd = None  # the loop names would keep the last closures alive
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


def fmt(v, spec: str) -> str:
    """A table cell: `v` formatted, or empty where the row has no such value."""
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def rate_cell(row: dict) -> str:
    """fwd+bwd TFLOP/s for matmul-bound cases, else GB/s."""
    rate = row.get("tflops")
    return f"{rate:.0f} TF/s" if rate else fmt(row.get("fwd_bwd_gbps"), ".0f")


TIE = 1.03  # within 3 % of the best peer counts as a tie


GRAPHED = " reduce-overhead"  # bench_cases_elementwise's suffix for rows under CUDA graphs


def verdict(group: list[dict], ours: dict) -> str:
    """One of our rows ("ours", or a variant named "ours ...") against the best peer of its case
    (our variants are not peers): "ok", or what is behind (device / wall time by more than 3 %,
    or more extra memory than Liger). A row under CUDA graphs is compared with the peers
    under CUDA graphs, any other row with the peers without."""
    graphed = ours["impl"].endswith(GRAPHED)
    peers = [
        r
        for r in group
        if not r["impl"].startswith("ours")
        and "error" not in r
        and r["impl"].endswith(GRAPHED) == graphed
    ]
    if "error" in ours or not peers:
        return ""
    behind = []
    for key, what in (("fwd_bwd_ms", "device"), ("fwd_bwd_wall_ms", "wall")):
        best = min(peers, key=lambda r: r.get(key, math.inf))
        if key in ours and key in best and ours[key] > TIE * best[key]:
            behind.append(f"{what} {ours[key] / best[key]:.2f}x {best['impl']}")
    liger = next((r for r in peers if r["impl"] == "liger"), None)
    if liger is not None and ours["extra_mib"] > liger["extra_mib"] + 1.0:
        behind.append(f"mem {ours['extra_mib']:.0f} > liger {liger['extra_mib']:.0f} MiB")
    return "; ".join(behind) or "ok"


def format_table(rows: list[dict], ceil: Ceilings) -> str:
    head = (
        "| op | shape | impl | fwd ms | fwd wall ms | fwd GB/s | fwd+bwd ms | fwd+bwd wall ms "
        "| fwd+bwd GB/s or TFLOP/s | extra MiB | floor ms | target ms | best (device/wall) "
        "| ours vs best peer |"
    )
    lines = [
        f"Ceilings measured in this run: copy {ceil.copy_gbps:.0f} GB/s, bf16 matmul {ceil.matmul_tflops:.0f} TFLOP/s. "
        "'ms' columns are device times (host work hidden behind a queued sleep kernel); 'wall ms' "
        "is the plain do_bench time (L2 flushed, nothing queued ahead, host work included). "
        "The last column: ok = within 3 % of the best peer in both times and no more memory "
        "than Liger.",
        "",
        head,
        "|" + "|".join(["---"] * 14) + "|",
    ]
    by_case: dict[tuple, list[dict]] = {}
    for r in rows:
        by_case.setdefault((r["op"], r["shape"]), []).append(r)
    for (op, shape), group in by_case.items():
        ok = [r for r in group if "error" not in r]
        best = min((r["fwd_bwd_ms"] for r in ok), default=None)
        best_wall = min((r.get("fwd_bwd_wall_ms", math.inf) for r in ok), default=None)
        for r in group:
            if "error" in r:
                lines.append(f"| {op} | {shape} | {r['impl']} | error: {r['error']} |||||||||||")
                continue
            marks = "/".join(
                m
                for m, hit in (
                    ("device", r["fwd_bwd_ms"] == best),
                    ("wall", r.get("fwd_bwd_wall_ms") == best_wall),
                )
                if hit
            )
            lines.append(
                f"| {op} | {shape} | {r['impl']} | {r['fwd_ms']:.3f} "
                f"| {fmt(r.get('fwd_wall_ms'), '.3f')} | {fmt(r.get('fwd_gbps'), '.0f')} "
                f"| {r['fwd_bwd_ms']:.3f} | {fmt(r.get('fwd_bwd_wall_ms'), '.3f')} "
                f"| {rate_cell(r)} | {r['extra_mib']:.0f} | {fmt(r['floor_ms'], '.3f')} "
                f"| {fmt(r['target_ms'], '.2f')} | {marks} "
                f"| {verdict(group, r) if r['impl'].startswith('ours') else ''} |"
            )
    return "\n".join(lines)


def dump(rows: list[dict], ceil: Ceilings, path: str) -> None:
    with open(path, "w") as fh:
        json.dump({"ceilings": ceil.__dict__, "rows": rows}, fh, indent=1)
