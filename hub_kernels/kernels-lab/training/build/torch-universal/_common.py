"""Helpers shared by the ops: the custom-op namespace, the Triton-or-torch dispatch, row views."""

from __future__ import annotations

import functools
import os
import re
import warnings

import torch

# The loader imports this folder under a content-derived package name; deriving the torch.library
# namespace from it keeps two builds loaded side by side from registering the same op twice.
NAMESPACE = re.sub(r"\W", "_", __name__.split(".")[0]).strip("_") or "kernels_training"


def op_name(name: str) -> str:
    """Fully qualified torch.library name of this build's op `name`."""
    return f"{NAMESPACE}::{name}"


def interpreting() -> bool:
    """True when Triton's CPU interpreter is switched on for this process."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(t: torch.Tensor) -> bool:
    """Run the Triton kernels for CUDA tensors, and for CPU tensors under TRITON_INTERPRET=1."""
    return t.is_cuda or (t.device.type == "cpu" and interpreting())


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


def as_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """View `x` as [rows, n] with unit stride along n (copies only when no such view exists)."""
    rows = x.reshape(-1, n)
    if n > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    return rows


def flat(x: torch.Tensor) -> torch.Tensor:
    """`x` as a contiguous 1-D tensor (a view when x is already contiguous)."""
    return x.contiguous().view(-1)


def _arg_key(a) -> object:
    """What Triton specializes a kernel argument on: a tensor's dtype and 16-byte alignment;
    an int's being 1, its divisibility by 16 and its width; other values as they are."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if type(a) is int:
        return (a == 1, a % 16 == 0, -(2**31) <= a < 2**31, a < 2**63)
    if type(a) is float:
        return float
    return a


class FastLaunch:
    """``kernel[grid](*args, **constexprs)`` with less host work per call on CUDA.

    The first call for an argument signature (see `_arg_key`) goes through Triton's own launch,
    which compiles and returns the compiled kernel; later calls with that signature hand the
    arguments straight to it, skipping Triton's per-call Python (binding, cache keys, hooks).
    In a training step the host issues hundreds of these launches and can fall behind the GPU,
    so this is GPU time. Under the CPU interpreter, with launch hooks set, or on a Triton
    whose compiled kernels lack the expected interface, every call takes Triton's path.
    """

    def __init__(self, fn):
        self.fn = fn
        self.__doc__ = getattr(fn, "__doc__", None)
        self._compiled: dict[tuple, tuple] = {}

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, **kwargs):
        if interpreting():
            return self.fn[grid](*args, **kwargs)
        device = torch._C._cuda_getDevice()  # Triton binds compiled kernels per device
        key = (device, tuple(_arg_key(a) for a in args), tuple(kwargs.items()))
        hit = self._compiled.get(key)
        knobs = _triton_knobs()
        if hit is None or knobs is None or knobs.runtime.launch_enter_hook is not None:
            compiled = self.fn[grid](*args, **kwargs)
            if hit is None:
                self._compiled[key] = self._fast_entry(compiled, len(args), kwargs)
            return compiled
        compiled, constexprs = hit
        if compiled is None:
            return self.fn[grid](*args, **kwargs)
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = torch._C._cuda_getCurrentRawStream(device)
        compiled.run(
            grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, None,
            None, knobs.runtime.launch_exit_hook, *args, *constexprs,
        )  # fmt: skip
        return compiled

    def _fast_entry(self, compiled, n_args: int, kwargs: dict) -> tuple:
        """(compiled kernel, constexpr values in parameter order), or (None, ()) when this call
        cannot be replayed as a plain argument list (keyword order differs from the
        parameters', or the compiled kernel lacks the interface)."""
        names = list(getattr(self.fn, "arg_names", ()))
        params = [k for k in kwargs if k in names]
        # Triton re-checks the globals a kernel reads on every call; ours read only constexpr
        # module constants, so the replay skips that check.
        if params != names[n_args:] or not all(
            hasattr(compiled, a) for a in ("run", "function", "packed_metadata")
        ):
            return (None, ())
        return (compiled, tuple(kwargs[k] for k in params))


def fast_launch(fn):
    """Decorator over ``@triton.jit``: see `FastLaunch`."""
    return FastLaunch(fn)


@functools.cache
def _triton_knobs():
    try:
        from triton import knobs
    except ImportError:  # an older Triton: no replay, every call takes Triton's path
        return None
    return knobs


_CHOICES: dict[tuple, dict] = {}


def pick_config(key: tuple, candidates: list[dict], launch) -> dict:
    """The fastest of `candidates` for `key`, timed once per process on the GPU.

    `launch(cfg)` runs the kernel once with that config (it may write the real outputs; the
    caller launches again with the winner). The first candidate is used without timing on the
    CPU interpreter and while a CUDA graph is being captured.
    """
    if len(candidates) == 1 or interpreting() or torch.cuda.is_current_stream_capturing():
        return candidates[0]
    choice = _CHOICES.get(key)
    if choice is None:
        launch(candidates[0])  # the default must work; its errors are the caller's
        usable = [candidates[0]]
        for cfg in candidates[
            1:
        ]:  # compile and warm the others; one this Triton rejects is skipped
            try:
                launch(cfg)
            except Exception as exc:  # noqa: BLE001 - a compile failure only removes a candidate
                warnings.warn(
                    f"kernel config {cfg} skipped: {type(exc).__name__}: {exc}", stacklevel=2
                )
                continue
            usable.append(cfg)
        candidates = usable
        events = []
        for cfg in candidates:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(2_000_000)  # keeps the GPU busy while the launches are queued
            start.record()
            for _ in range(3):
                launch(cfg)
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in events]
        choice = candidates[times.index(min(times))]
        _CHOICES[key] = choice
    return choice
