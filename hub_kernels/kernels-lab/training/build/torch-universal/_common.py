"""Helpers shared by the ops: the custom-op namespace, the Triton-or-torch dispatch, row views."""

from __future__ import annotations

import functools
import os
import re
import statistics
import warnings

import torch
from torch.nn.modules import module as _module

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


def flat(x: torch.Tensor) -> torch.Tensor:
    """`x` as a contiguous 1-D tensor (a view when x is already contiguous)."""
    return x.contiguous().view(-1)


_CHOICES: dict[tuple, dict] = {}
TUNING_ROUNDS = 5


def cached_config(key: tuple) -> dict | None:
    """The config `pick_config` chose for `key` in this process, or None before it has."""
    return _CHOICES.get(key)


def pick_config(
    key: tuple, candidates: list[dict], launch, cold: torch.device | None = None
) -> dict:
    """The fastest of `candidates` for `key`, timed once per process on the GPU.

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
    flush = None
    if cold is not None:
        l2 = torch.cuda.get_device_properties(cold).L2_cache_size
        flush = torch.empty(2 * l2, dtype=torch.int8, device=cold)
    # Candidates take turns, one launch each per round, and the median round counts: a
    # drift of the GPU's speed or one slow launch does not decide the choice.
    events: list[list] = [[] for _ in candidates]
    for _ in range(TUNING_ROUNDS):
        for cfg, spans in zip(candidates, events, strict=True):
            # Keeps the GPU busy while this launch is queued, so no host gap is timed.
            torch.cuda._sleep(1_000_000)
            if flush is not None:
                flush.zero_()
            start, end = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            start.record()
            launch(cfg)
            end.record()
            spans.append((start, end))
    torch.cuda.synchronize()
    times = [statistics.median(s.elapsed_time(e) for s, e in spans) for spans in events]
    choice = candidates[times.index(min(times))]
    _CHOICES[key] = choice
    return choice
