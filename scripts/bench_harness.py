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

A case with a `Budget` (ops whose one call takes tens or hundreds of milliseconds) sizes the
repetitions from each implementation's second call so that its timings take about
`per_impl_s`, and stops an implementation that runs past `limit_s` (its first call included):
its row says "timeout" and the others go on.
"""

from __future__ import annotations

import gc
import importlib.util
import io
import itertools
import json
import math
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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


@dataclass(frozen=True)
class Budget:
    """Time allowed per implementation of a case: about `per_impl_s` of timed calls, and no
    more than `limit_s` in all (first call and memory probe included)."""

    per_impl_s: float
    limit_s: float


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
    budget: Budget | None = None  # run_case's default for this case


# The repetitions without a budget: device-timed calls per closure per round, and wall-timed
# calls per closure (do_bench's own warm-up and estimate add about 6 more).
DEVICE_REPS = 30
WALL_CALLS = 20


def scaled_reps(call_s: float, rounds: int, budget: Budget | None) -> tuple[int, int]:
    """(device reps per closure per round, wall-timed calls per closure) for an implementation
    whose fwd+bwd takes `call_s`: the defaults, or fewer so that its timings take about
    `budget.per_impl_s` (never below 3 and 5: a median of fewer says little)."""
    if budget is None:
        return DEVICE_REPS, WALL_CALLS
    # calls(scale) = rounds*2*(DEVICE_REPS*scale + 1) + 2*(WALL_CALLS*scale + 6), fwd counted
    # as a fwd+bwd (the sizing call before each device timing, do_bench's own ~6 calls fixed)
    fixed = rounds * 2 + 2 * 6
    per_scale = rounds * 2 * DEVICE_REPS + 2 * WALL_CALLS
    scale = (budget.per_impl_s / max(call_s, 1e-9) - fixed) / per_scale
    scale = min(1.0, max(0.0, scale))
    return max(3, round(DEVICE_REPS * scale)), max(5, round(WALL_CALLS * scale))


class Timeout(BaseException):
    """An implementation ran past its budget's limit (a BaseException: the `except Exception`
    of a peer's own code, such as a config search skipping a failed candidate, lets it by)."""


@contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise Timeout in this (main) thread once `seconds` have passed, at the next Python line
    it runs (a CUDA call in flight finishes first); no limit for None."""
    if seconds is None:
        yield
        return

    def expire(signum, frame):  # noqa: ARG001
        raise Timeout(f"timeout: over {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


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


def _wall_ms(fn: Callable[[], object], calls: int = WALL_CALLS) -> float:
    """do_bench's median wall time over at least ~`calls` timed calls: do_bench repeats a call
    rep / (its own estimate) times, so rep=50 ms alone timed one call of a 40 ms op."""
    from triton.testing import do_bench

    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once_ms = (time.perf_counter() - t) * 1e3
    rep = max(50.0, calls * once_ms) if calls >= WALL_CALLS else calls * once_ms
    return do_bench(fn, warmup=10, rep=rep, return_mode="median")


def allow_many_compiles() -> None:
    """Raise Dynamo's recompile limits: every case compiles its own module, and past the default
    limits Dynamo would fall back to eager and time that instead."""
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.accumulated_cache_size_limit = 4096


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


def _drain() -> None:
    """After an implementation was stopped: let the GPU finish what it queued, drop its memory."""
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()


def run_case(
    case: Case, ceil: Ceilings, rounds: int = 3, budget: Budget | None = None
) -> list[dict]:
    """Every implementation of `case`, device times as medians over `rounds` in which the
    implementations take turns, so a drift of the GPU during the case favours none of them.
    All implementations' inputs are held at once for that (their sum must fit the GPU).
    With a `budget`, fewer repetitions for slow implementations and a time limit for each."""
    budget = budget or case.budget
    rows, live = [], []
    spent: dict[int, float] = {}  # id(row) -> seconds this implementation has taken so far
    reps: dict[int, tuple[int, int]] = {}
    limit = None if budget is None else budget.limit_s
    for impl in case.impls:
        row: dict = {"op": case.op, "shape": case.shape, "impl": impl.name}
        began = time.perf_counter()
        try:
            with time_limit(limit):
                fwd, fwd_bwd = impl.make()
                torch.cuda.synchronize()
                start = time.perf_counter()
                fwd_bwd()  # compile / autotune first
                torch.cuda.synchronize()
                # a first call at a new shape: Triton's builds and the launch-geometry timing
                row["first_call_s"] = time.perf_counter() - start
                second = time.perf_counter()
                fwd_bwd()  # a warm call sizes the repetitions (no build in it)
                torch.cuda.synchronize()
                reps[id(row)] = scaled_reps(time.perf_counter() - second, rounds, budget)
            live.append((row, fwd, fwd_bwd))
        except Timeout as exc:
            row["error"] = str(exc)
            fwd = fwd_bwd = None
            _drain()
        except Exception as exc:  # a peer that cannot run this case is reported, not fatal
            row["error"] = _error(exc)
        spent[id(row)] = time.perf_counter() - began
        rows.append(row)
    times: dict[int, dict[str, list[float]]] = {id(r): {"fwd": [], "fwd_bwd": []} for r, *_ in live}

    def left(row: dict) -> float | None:
        return None if limit is None else max(1e-3, limit - spent[id(row)])

    for _ in range(rounds):
        for row, fwd, fwd_bwd in list(live):
            start = time.perf_counter()
            try:
                with time_limit(left(row)):
                    times[id(row)]["fwd"].append(_device_ms(fwd, reps[id(row)][0]))
                    times[id(row)]["fwd_bwd"].append(_device_ms(fwd_bwd, reps[id(row)][0]))
            except Timeout as exc:
                row["error"] = str(exc)
                live.remove((row, fwd, fwd_bwd))
                _drain()
            except Exception as exc:  # noqa: BLE001 - reported in the row like a failed make()
                row["error"] = _error(exc)
                live.remove((row, fwd, fwd_bwd))
            spent[id(row)] += time.perf_counter() - start
    for row, fwd, fwd_bwd in live:
        try:
            with time_limit(left(row)):
                row["fwd_ms"] = statistics.median(times[id(row)]["fwd"])
                row["fwd_bwd_ms"] = statistics.median(times[id(row)]["fwd_bwd"])
                row["fwd_bwd_ms_rounds"] = times[id(row)]["fwd_bwd"]
                row["fwd_wall_ms"] = _wall_ms(fwd, reps[id(row)][1])
                row["fwd_bwd_wall_ms"] = _wall_ms(fwd_bwd, reps[id(row)][1])
                row["extra_mib"] = _extra_peak_mib(fwd_bwd)
                if budget is not None:
                    row["reps"] = list(reps[id(row)])
            if case.bytes_fwd:
                row["fwd_gbps"] = case.bytes_fwd / row["fwd_ms"] / 1e6
            if case.bytes_fwd_bwd:
                row["fwd_bwd_gbps"] = case.bytes_fwd_bwd / row["fwd_bwd_ms"] / 1e6
            if case.flops_fwd_bwd:
                row["tflops"] = case.flops_fwd_bwd / row["fwd_bwd_ms"] / 1e9
        except Timeout as exc:
            row["error"] = str(exc)
            _drain()
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
                what = r["error"] if r["error"].startswith("timeout") else f"error: {r['error']}"
                lines.append(f"| {op} | {shape} | {r['impl']} | {what} |||||||||||")
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
