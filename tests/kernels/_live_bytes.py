"""A tensor-registry probe of memory: the bytes of tensor storages allocated while it is on that
are still alive, and their peak, counted on the CPU as a CUDA allocator's peak statistics count.

Every aten op that runs under the probe (forward, autograd's backward, our ops' torch calls) is
seen by a TorchDispatchMode. An op's output that aliases one of its inputs (a view, an in-place
or ``out=`` op) adds a holder to the storage it aliases; any other output is a new storage. A
storage is freed when the last tensor holding it dies (a weakref finalizer per holder; torch
keeps a tensor's Python object alive as long as autograd or a view's base still holds it).
Storages that existed before the probe are not counted, nor are Triton's interpreter buffers
(numpy), which a GPU does not have.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding a wrapper subclass's memory (a DTensor's local tensor, a functional
    collective's result), or `t` itself."""
    while type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        t = getattr(t, t.__tensor_flatten__()[0][0])
    return t


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as probe: ...``; then ``probe.peak`` and ``probe.live`` in bytes."""

    def __init__(self) -> None:
        super().__init__()
        self._storages: dict[int, list[int]] = {}  # data_ptr -> [nbytes, live holders]
        self.live = 0
        self.peak = 0

    def _release(self, key: int) -> None:
        entry = self._storages.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self._storages[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        aliases = any(r.alias_info is not None for r in func._schema.returns)
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            t = plain(t)
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self._storages:
                self._storages[key][1] += 1
            elif aliases or storage.nbytes() == 0:
                continue  # a view of (or a write into) memory that was there before the probe
            else:
                self._storages[key] = [storage.nbytes(), 1]
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._release, key)
        return out


def extra_peak(fn) -> tuple[int, object]:
    """(bytes, fn's result): the peak of `fn()` above what it leaves alive (its result), as the
    benchmark's extra peak memory is measured on a GPU."""
    with LiveBytes() as probe:
        result = fn()
        after = probe.live
    return probe.peak - after, result


def saved_bytes(fn, x) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of fn(x) (a view saved
    keeps its whole base alive)."""
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return sum(storages.values())
