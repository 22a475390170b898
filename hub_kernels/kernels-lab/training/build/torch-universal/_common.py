"""Helpers shared by the ops: the custom-op namespace, the Triton-or-torch dispatch, row views."""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import operator
import os
import re
import statistics
import warnings

import torch
from torch.nn.modules import module as _module

from ._triton import AVAILABLE as HAVE_TRITON
from ._triton import missing, triton

# The loader imports this folder under a content-derived package name; deriving the torch.library
# namespace from it keeps two builds loaded side by side from registering the same op twice.
NAMESPACE = re.sub(r"\W", "_", __name__.split(".")[0]).strip("_") or "kernels_training"


def op_name(name: str) -> str:
    """Fully qualified torch.library name of this build's op `name`."""
    return f"{NAMESPACE}::{name}"


def has_hooks(module: torch.nn.Module) -> bool:
    """Whether calling `module` would run any hook around its forward (its own or global ones):
    then a fused path that skips the call must not be taken."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or _module._global_forward_hooks
        or _module._global_forward_pre_hooks
        or _module._global_backward_hooks
        or _module._global_backward_pre_hooks
    )


def interpreting() -> bool:
    """True when Triton's CPU interpreter is switched on for this process."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(t: torch.Tensor) -> bool:
    """Run the Triton kernels for CUDA tensors, and for CPU tensors under TRITON_INTERPRET=1;
    without Triton installed those raise `_triton.missing()` (the torch formulas need none)."""
    if t.is_cuda or (t.device.type == "cpu" and interpreting()):
        if not HAVE_TRITON:
            raise missing(
                "CUDA tensors" if t.is_cuda else "Triton's interpreter (TRITON_INTERPRET=1)"
            )
        return True
    return False


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (a small fixed number on the CPU interpreter)."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host-side grid sizes. Plain Python: ``triton.cdiv`` is a constexpr
    function whose call unwraps its arguments, several times the cost on every launch."""
    return -(-a // b)


def as_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """View `x` as [rows, n] with unit stride along n (copies only when no such view exists)."""
    rows = x.reshape(-1, n)
    if n > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    return rows


def rows_stride(x: torch.Tensor, n: int) -> int | None:
    """The row stride of `as_rows(x, n)` when that is a view of x starting at x's first element
    (then x itself can be handed to a kernel that takes rows n elements wide), else None (a copy).
    A function of x's shape and strides alone, so a plan keyed by them may keep the answer."""
    rows = as_rows(x, n)
    if rows.numel() and rows.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        return rows.stride(0)
    return None


def contiguous_strides(shape) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape`. Plans allocate with
    ``torch.empty_strided(shape, strides, ...)``: a third of ``torch.empty``'s host time."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def flat(x: torch.Tensor) -> torch.Tensor:
    """`x` as a contiguous 1-D tensor (a view when x is already contiguous)."""
    return x.contiguous().view(-1)


# --- Kernel launches without Triton's per-call argument binding ------------------------------
#
# `kernel[grid](*args, **constexprs)` costs ~15 µs of host time on an H200 machine's CPU, most of
# it Triton binding and specialising the arguments anew on every call; the compiled kernel's own
# launcher takes ~6 µs. A training step at small batch is bound by that host time (and a
# backward runs on the autograd engine's thread, where it is slower still), so `fast_launch`
# remembers the compiled kernel per specialisation and calls its launcher directly.
#
# The key holds everything Triton specialises on, computed the same way or stricter: per tensor
# its dtype and whether its address is 16-byte aligned; per int whether it is 1, a multiple of
# 16, and which integer type it needs; the type of any other scalar; the keyword arguments
# (constexprs and launch options); the current device. A key seen before therefore maps to the
# kernel Triton itself would pick. Anything else (the CPU interpreter, a Triton whose launch
# signature is not the one read here, launch hooks, a grid function, a non-constexpr keyword)
# takes Triton's own path.

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_ARG_TYPES = (int, bool, float, type(None))
_data_ptr, _dtype = operator.methodcaller("data_ptr"), operator.attrgetter("dtype")
_16, _1 = itertools.repeat(16), itertools.repeat(1)


def _picker(indices: list[int]):
    """A function returning the arguments at `indices` as a tuple (itemgetter, always a tuple)."""
    if not indices:
        return lambda args: ()
    if len(indices) == 1:
        i = indices[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*indices)


def _layout(types: tuple) -> tuple:
    """(tensors of args, ints of args) pickers for one sequence of argument types."""
    tensors, ints = [], []
    for i, t in enumerate(types):
        if issubclass(t, torch.Tensor):
            tensors.append(i)
        elif t is int:
            ints.append(i)
        elif t not in _ARG_TYPES:
            raise TypeError(t)  # an argument kind the key does not cover: Triton's path
    return _picker(tensors), _picker(ints)


def _int_kind(v: int) -> int:
    return 0 if _I32_MIN <= v <= _I32_MAX else 1 if -(2**63) <= v < 2**63 else 2


def spec_key(args: tuple, layouts: dict) -> tuple:
    """What Triton specialises `args` on, or more: the argument types; per tensor its dtype and
    16-byte alignment; per int whether it is a multiple of 16 and whether it is 1, and the
    integer type each int needs. Built from C-level maps: this runs on every launch."""
    types = tuple(map(type, args))
    pick = layouts.get(types)
    if pick is None:
        pick = layouts[types] = _layout(types)
    tensors, ints = pick[0](args), pick[1](args)
    if ints and (min(ints) < _I32_MIN or max(ints) > _I32_MAX):
        widths = tuple(map(_int_kind, ints))
    else:
        widths = None
    return (
        types,
        tuple(map(_dtype, tensors)),
        tuple(map(operator.not_, map(operator.mod, map(_data_ptr, tensors), _16))),
        tuple(map(operator.not_, map(operator.mod, ints, _16))),
        tuple(map(operator.eq, ints, _1)),
        widths,
    )


# The current device and its raw stream, read as Triton's own launcher reads them. Private torch
# functions of CUDA (and ROCm) builds; without them every launch takes Triton's path.
_CUDA_LAUNCH_API = hasattr(torch._C, "_cuda_getDevice") and hasattr(
    torch._C, "_cuda_getCurrentRawStream"
)


def _launch_signature_known() -> bool:
    """Whether this Triton launches as ``run(g0, g1, g2, stream, function, packed_metadata,
    launch_metadata, enter_hook, exit_hook, *every_argument)`` (read from 3.4 to 3.9)."""
    try:
        major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    except ValueError:
        return False
    return (3, 4) <= (major, minor) <= (3, 9)


class FastLaunch:
    """A @triton.jit kernel launched as ``kernel[grid](*args, **constexprs_and_options)``, through
    the compiled kernel's launcher once Triton has compiled it for the same specialisation."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.compiled: dict[tuple, tuple | None] = {}
        self.layouts: dict[tuple, tuple] = {}
        self.enabled = _CUDA_LAUNCH_API and _launch_signature_known() and not interpreting()
        self._params: list[inspect.Parameter] | None = None

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def __getattr__(self, name):  # the JITFunction's own attributes (fn, src, ...)
        return getattr(self.fn, name)

    def _plan(self, args: tuple, kwargs: dict, kernel) -> tuple | None:
        """(kernel, the trailing arguments after `args`) or None when the launch cannot be
        replayed from the key alone (a keyword that is a runtime argument)."""
        if any(getattr(p, "is_constexpr", False) for p in self.fn.params[: len(args)]):
            return None  # a constexpr passed by position: its value is not in the key
        if self._params is None:
            self._params = list(inspect.signature(self.fn.fn).parameters.values())
        tail = []
        for param in self._params[len(args) :]:
            value = kwargs.get(param.name, param.default)
            if value is inspect.Parameter.empty or not isinstance(value, (*_ARG_TYPES, str)):
                return None
            tail.append(value)
        if hasattr(kernel, "result"):
            kernel = kernel.result()
        if not all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata")):
            return None  # a compiled-kernel object of another shape: Triton's path from now on
        return kernel, tuple(tail)

    def launch(self, grid, args: tuple, kwargs: dict):
        if not self.enabled or not isinstance(grid, tuple):
            return self.fn[grid](*args, **kwargs)
        runtime = triton.knobs.runtime
        enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
        try:
            device = torch._C._cuda_getDevice()  # what Triton launches on: the current device
            key = (device, spec_key(args, self.layouts), tuple(kwargs.items()))
            plan = self.compiled.get(key, False)
        except TypeError:  # an argument kind the key does not cover, or an unhashable keyword
            return self.fn[grid](*args, **kwargs)
        if plan is False:  # first launch with this specialisation: Triton compiles and launches
            kernel = self.fn[grid](*args, **kwargs)
            self.compiled[key] = self._plan(args, kwargs, kernel)
            return kernel
        if plan is None or _hooked(enter) or _hooked(leave):
            return self.fn[grid](*args, **kwargs)
        kernel, tail = plan
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = torch._C._cuda_getCurrentRawStream(device)
        try:
            kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None,
                       enter, leave, *args, *tail)  # fmt: skip
        except TypeError:
            # The launcher refused the arguments before launching (a Triton whose launch
            # signature differs from the one read here): Triton's path, for good.
            self.enabled = False
            return self.fn[grid](*args, **kwargs)
        return kernel

    def bound(self, grid: tuple, kwargs: dict) -> BoundLaunch:
        """This kernel's launch with `grid` and the keywords fixed (see BoundLaunch)."""
        return BoundLaunch(self, grid, kwargs)


class BoundLaunch:
    """``kernel[grid](*args, **kwargs)`` with the grid and the keywords fixed, for an op's plan.

    Called as ``bound(*args)``. The plan that holds it fixes every scalar argument too (its key
    holds the shapes, strides and options they derive from, and the call passes the plan's own
    values), so what Triton specialises on can change only with the tensors' dtypes and 16-byte
    alignment and the current device: those are checked per call, and a call that matches the
    first aligned one goes straight to the compiled kernel's launcher, without building the
    FastLaunch key. Any other call goes through FastLaunch (which may still replay).
    """

    __slots__ = ("fast", "grid", "kwargs", "g", "tensors", "ready")

    def __init__(self, fast: FastLaunch, grid: tuple, kwargs: dict) -> None:
        self.fast, self.grid, self.kwargs = fast, grid, kwargs
        self.g = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        self.tensors: tuple = ()  # (position, dtype) of each tensor argument
        self.ready: tuple | None = None  # (device, kernel, tail) once replayable

    def __call__(self, *args):
        ready = self.ready
        if ready is not None:
            # The launcher takes a pointer argument given as an int as it is; given a tensor it
            # calls data_ptr() and asks the driver about the address (cuPointerGetAttribute),
            # for each tensor on every launch. The addresses are read here anyway for the
            # alignment check. A tensor off the device the kernel was kept for (host memory, or
            # another GPU: the driver's answer would refuse or map it) takes Triton's path.
            flat = list(args)
            device = ready[0]
            for i, dtype in self.tensors:
                t = args[i]
                ptr = t.data_ptr()
                # dtypes are singletons; get_device() is -1 for host memory
                if ptr & 15 or t.dtype is not dtype or t.get_device() != device:
                    return self._through_fast_launch(args)
                flat[i] = ptr
            runtime = triton.knobs.runtime
            enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
            # _hooked(enter) or _hooked(leave), without two calls per launch
            hooked = (enter is not None and getattr(enter, "calls", True)) or (
                leave is not None and getattr(leave, "calls", True)
            )
            # What Triton launches on is the current device.
            if torch._C._cuda_getDevice() == device and not hooked:
                kernel, tail = ready[1], ready[2]
                g = self.g
                stream = torch._C._cuda_getCurrentRawStream(device)
                try:
                    # No hook is set: None spares the launcher calling two empty hook chains.
                    kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata,
                               None, None, None, *flat, *tail)  # fmt: skip
                except TypeError:  # see FastLaunch.launch: Triton's path, for good
                    self.ready = None
                    self.fast.enabled = False
                    return self.fast.fn[self.grid](*args, **self.kwargs)
                return kernel
        return self._through_fast_launch(args)

    def _through_fast_launch(self, args: tuple):
        """FastLaunch's own path; the first time all tensors are 16-byte aligned, keep what it
        compiled (or found) for them, for the calls to come."""
        fast = self.fast
        kernel = fast.launch(self.grid, args, self.kwargs)
        if self.ready is None and fast.enabled:
            tensors = tuple((i, a.dtype) for i, a in enumerate(args) if isinstance(a, torch.Tensor))
            if all(args[i].data_ptr() % 16 == 0 for i, _ in tensors):
                device = torch._C._cuda_getDevice()
                try:
                    key = (device, spec_key(args, fast.layouts), tuple(self.kwargs.items()))
                except TypeError:  # an argument kind FastLaunch does not replay
                    return kernel
                plan = fast.compiled.get(key)
                if plan:
                    self.tensors = tensors
                    self.ready = (device, plan[0], plan[1])
        return kernel


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is set (None in older Tritons, an empty chain in newer)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def fast_launch(fn) -> FastLaunch:
    """Decorator over @triton.jit for kernels the host launches (see FastLaunch)."""
    return FastLaunch(fn)


# --- Per-call plans ---------------------------------------------------------------------------
#
# An op's host work between autograd and the launch is a function of what its plan key holds
# (shapes, strides, dtypes, device, options): the config, the grid, the row strides, the
# allocation shapes, the scalar arguments. The op works them out on the first call with a key and
# keeps them, so later calls make one dict lookup, the allocations and the launch.


class PlanCache(dict):
    """Plans by key; emptied when it holds `limit` of them, so a process that sees ever new
    shapes (or a NaN option, never equal to itself) does not grow it without bound."""

    def __init__(self, limit: int = 1024) -> None:
        super().__init__()
        self.limit = limit

    def keep(self, key, plan) -> None:
        if len(self) >= self.limit:
            self.clear()
        self[key] = plan


def config_is_final(key: tuple, candidates: list) -> bool:
    """Whether `pick_config(key, candidates, ...)` answers the same from now on (timed and kept,
    one candidate, or the interpreter's untimed default): a plan may then keep its answer. Not
    while a CUDA graph is captured, nor for the in-place default taken before any timing."""
    return key in _CHOICES or len(candidates) == 1 or interpreting()


_CHOICES: dict[tuple, dict] = {}
TUNING_ROUNDS = 5
# A timed span holds back-to-back launches of one candidate, as many as make up this much GPU
# time (at most MAX_BURST): CUDA events resolve about 0.5 µs, a few ticks of a 2 µs kernel, so
# single launches of short kernels tie or order by chance; the graphs and steps that run them
# run them back to back, too.
BURST_MS = 0.02
MAX_BURST = 16


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will record an op on `tensors`: grad mode on and one of them needs it
    (unlike ctx.needs_input_grad, which stays True under torch.no_grad())."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def cached_config(key: tuple) -> dict | None:
    """The config `pick_config` chose for `key` in this process, or None before it has."""
    return _CHOICES.get(key)


def pick_config(
    key: tuple, candidates: list[dict], launch, cold: torch.device | None = None
) -> dict:
    """The fastest of `candidates` for `key`, timed once per process on the GPU (short kernels
    in spans of back-to-back launches, see BURST_MS).

    `launch(cfg)` runs the kernel once with that config (it may write the real outputs; the
    caller launches again with the winner). With `cold`, each timed launch follows a flush of
    that device's L2, so inputs small enough to stay cached between back-to-back launches do not
    favour the geometry that is best only on cached data. The first candidate is used without
    timing on the CPU interpreter and while a CUDA graph is being captured.
    """
    choice = _CHOICES.get(key)  # first: the path every call after the first takes
    if choice is not None:
        return choice
    if len(candidates) == 1 or interpreting() or torch.cuda.is_current_stream_capturing():
        return candidates[0]
    launch(candidates[0])  # the default must work; its errors are the caller's
    usable = [candidates[0]]
    for cfg in candidates[1:]:  # compile and warm the others; one Triton rejects is skipped
        try:
            launch(cfg)
        except Exception as exc:  # noqa: BLE001 - a compile failure only removes a candidate
            warnings.warn(f"kernel config {cfg} skipped: {type(exc).__name__}: {exc}", stacklevel=2)
            continue
        usable.append(cfg)
    candidates = usable
    flush, burst = None, 1
    if cold is not None:  # one launch per flush: no burst
        l2 = torch.cuda.get_device_properties(cold).L2_cache_size
        flush = torch.empty(2 * l2, dtype=torch.int8, device=cold)
    else:  # sized by one round of single launches
        fastest = max(min(_span_ms(candidates, launch, None, 1, 1)), 1e-4)
        burst = min(MAX_BURST, math.ceil(BURST_MS / fastest))
    times = _span_ms(candidates, launch, flush, TUNING_ROUNDS, burst)
    choice = candidates[times.index(min(times))]
    _CHOICES[key] = choice
    return choice


def _span_ms(candidates: list[dict], launch, flush, rounds: int, burst: int) -> list[float]:
    """Each candidate's median ms per launch over `rounds` timed spans of `burst` back-to-back
    launches (each after a flush of the L2 with `flush`), replayed from a CUDA graph where the
    launches can be captured. Candidates take turns, one span each per round: a drift of the
    GPU's speed or one slow span does not decide the choice."""
    graphs = _burst_graphs(candidates, launch, burst) if burst > 1 else None
    events: list[list] = [[] for _ in candidates]
    for _ in range(rounds):
        for i, (cfg, spans) in enumerate(zip(candidates, events, strict=True)):
            # Keeps the GPU busy while this span is queued, so no host gap is timed: about
            # 0.5 ms, and 60 µs more per launch of a long burst (a Python launch takes 10-40).
            torch.cuda._sleep(max(1_000_000, 120_000 * burst))
            if flush is not None:
                flush.zero_()
            start, end = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            start.record()
            if graphs is not None:
                graphs[i].replay()
            else:
                for _ in range(burst):
                    launch(cfg)
            end.record()
            spans.append((start, end))
    torch.cuda.synchronize()
    return [statistics.median(s.elapsed_time(e) for s, e in spans) / burst for spans in events]


def _burst_graphs(candidates: list[dict], launch, burst: int) -> list | None:
    """Each candidate's `burst` launches captured in one CUDA graph, or None where a launch
    cannot be captured. Replayed, the launches follow each other as in a compiled step's
    graph: launched from a stream, a short kernel's time is mostly the gap between launches,
    and the tuner picked 5 % off the best at 1024 x 128 that way (H200, twelfth session)."""
    side, current = torch.cuda.Stream(), torch.cuda.current_stream()
    side.wait_stream(current)
    graphs = []
    try:
        with torch.cuda.stream(side):
            for cfg in candidates:
                graph = torch.cuda.CUDAGraph()
                # capture_begin, not torch.cuda.graph(): that runs gc.collect() per capture.
                graph.capture_begin()
                try:
                    for _ in range(burst):
                        launch(cfg)
                finally:
                    graph.capture_end()
                graphs.append(graph)
    except RuntimeError:  # a launch that syncs or allocates outside the graph's pool
        graphs = None
    current.wait_stream(side)
    return graphs


# A private hook of the autograd engine (in every torch this build allows; docs/compatibility.md).
_KEEP_GRAPH = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


def graph_is_freed() -> bool:
    """Whether the running backward frees its graph (no ``retain_graph=True``): only then is a
    saved activation read for the last time, and may its buffer take a gradient. False where
    this torch cannot tell: nothing is then overwritten, and a second backward still works."""
    return _KEEP_GRAPH is not None and not _KEEP_GRAPH()
