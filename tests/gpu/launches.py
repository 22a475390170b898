"""Which Triton kernels a test launched, and with which launch geometry.

Value checks alone cannot tell the Triton kernels from the torch fallback: both compute the same
formulas, so a bug that routes tensors to the fallback passes them. `TritonLaunches` records the
launches themselves:

- every ``kernel[grid](...)`` of the named ``@triton.jit`` kernels of the given modules goes
  through the kernel object's ``run`` (a ``fast_launch`` wrapper's direct launches are switched
  off while recording, so they take that path too); wrapping it records the kernel's name, the grid and the
  keyword launch options (constexprs such as BLOCK_M, and num_warps). This works for compiled
  kernels and for the CPU interpreter alike;
- on a GPU, Triton's launch-enter hook also counts the launches the driver made, by kernel name,
  so a call that reached ``run`` but never the device would show (`device_counts`).

Plain module, not a conftest: tests/kernels (interpreter) and tests/gpu (CUDA) both import it,
and importing it imports nothing of triton until a recorder is entered.
"""

from __future__ import annotations

import types
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple


class Launch(NamedTuple):
    """One host-side launch: the kernel's function name, its grid and keyword launch options."""

    kernel: str
    grid: Any
    options: dict[str, Any]
    pointers: tuple[int, ...] = ()  # data_ptr() of the tensor arguments, in order


def _jit_kernels(module: types.ModuleType) -> dict[str, Any]:
    """The module's @triton.jit objects (compiled JITFunction or the interpreter's stand-in)."""
    from triton.runtime.jit import JITFunction

    kinds: tuple[type, ...] = (JITFunction,)
    try:
        from triton.runtime.interpreter import InterpretedFunction

        kinds += (InterpretedFunction,)
    except ImportError:  # a triton without the interpreter module
        pass
    found = {}
    for name, obj in vars(module).items():
        inner = getattr(obj, "__dict__", {}).get("fn")  # a fast_launch wrapper's JITFunction
        if isinstance(obj, kinds) or isinstance(inner, kinds):
            found[name] = obj
    return found


def _add_launch_hook(hook: Callable[[Any], None]) -> Callable[[], None]:
    """Install `hook` as a Triton launch-enter hook; returns the function that removes it.

    triton >= 3.5 keeps a chain of hooks (knobs.runtime.launch_enter_hook.add/remove); 3.3-3.4
    one callable in knobs.runtime.launch_enter_hook; older ones CompiledKernel.launch_enter_hook.
    """
    try:
        from triton import knobs

        holder, attr = knobs.runtime, "launch_enter_hook"
        slot = getattr(holder, attr)
    except (ImportError, AttributeError):
        from triton.compiler import CompiledKernel

        holder, attr = CompiledKernel, "launch_enter_hook"
        slot = getattr(holder, attr, None)
    if hasattr(slot, "add") and hasattr(slot, "remove"):
        slot.add(hook)
        return lambda: slot.remove(hook)
    previous = slot

    def chained(metadata):
        if previous is not None:
            previous(metadata)
        hook(metadata)

    setattr(holder, attr, chained)
    return lambda: setattr(holder, attr, previous)


def _kernel_name(metadata: Any) -> str:
    """The kernel name from a hook's launch metadata (a LazyDict: dict subclass or .get())."""
    data = (
        metadata.get()
        if callable(getattr(metadata, "get", None)) and not isinstance(metadata, dict)
        else metadata
    )
    return str(data["name"])


class TritonLaunches:
    """Context manager recording the launches of the @triton.jit kernels of `modules`.

    ``launches`` lists every host-side launch in order; ``device_counts`` counts, by kernel name,
    the launches the GPU driver made (stays empty on the interpreter, which has no driver).
    """

    def __init__(self, *modules: types.ModuleType, device: bool = False) -> None:
        self.modules = modules
        self.device = device
        self.launches: list[Launch] = []
        self.device_counts: Counter[str] = Counter()
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> TritonLaunches:
        for module in self.modules:
            for name, kernel in _jit_kernels(module).items():
                self._wrap(name, kernel)
        if self.device:
            self._undo.append(_add_launch_hook(self._on_device_launch))
        return self

    def __exit__(self, *exc: object) -> None:
        while self._undo:
            self._undo.pop()()

    def _wrap(self, name: str, kernel: Any) -> None:
        if "compiled" in getattr(kernel, "__dict__", {}):  # fast_launch: record via Triton's path
            wrapper, kernel = kernel, kernel.fn
            enabled = wrapper.enabled
            wrapper.enabled = False
            self._undo.append(lambda: setattr(wrapper, "enabled", enabled))
        original = kernel.run  # bound method of the class; the wrapper shadows it per instance

        def run(*args, grid, warmup=False, **kwargs):
            if not warmup:
                options = {k: v for k, v in kwargs.items() if isinstance(v, (bool, int, str))}
                pointers = tuple(a.data_ptr() for a in args if hasattr(a, "data_ptr"))
                self.launches.append(Launch(name, grid, options, pointers))
            return original(*args, grid=grid, warmup=warmup, **kwargs)

        kernel.run = run
        self._undo.append(lambda: vars(kernel).pop("run", None))

    def _on_device_launch(self, metadata: Any) -> None:
        self.device_counts[_kernel_name(metadata)] += 1

    # -- questions ------------------------------------------------------------------------------

    def of(self, kernel: str) -> list[Launch]:
        """The launches of `kernel`, in order."""
        return [launch for launch in self.launches if launch.kernel == kernel]

    def counts(self) -> Counter[str]:
        """Host-side launches by kernel name."""
        return Counter(launch.kernel for launch in self.launches)

    def assert_launched(self, kernel: str, **options: Any) -> list[Launch]:
        """At least one launch of `kernel`, and every option given equal on some launch of it."""
        seen = self.of(kernel)
        assert seen, f"{kernel} never launched; launches: {dict(self.counts())}"
        if options:
            matching = [s for s in seen if all(s.options.get(k) == v for k, v in options.items())]
            assert matching, (
                f"{kernel} not launched with {options}; saw {[s.options for s in seen]}"
            )
            return matching
        return seen

    def assert_device_matches(self, kernels: Iterable[str] | None = None) -> None:
        """Every host-side launch (of `kernels`, default all) reached the GPU driver, and only those."""
        host = self.counts()
        names = set(kernels) if kernels is not None else set(host)
        for name in names:
            assert host[name] > 0, f"{name} never launched on the host side"
            assert self.device_counts[name] == host[name], (
                f"{name}: {host[name]} launches through run(), {self.device_counts[name]} on the GPU"
            )
