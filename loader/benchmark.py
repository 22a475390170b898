"""`Benchmark`: the base class of a kernel repo's benchmark scripts (`benchmarks/benchmark*.py`).

The reference exports it so that kernel repos can ship benchmarks that its `kernels benchmark`
command discovers and times. A subclass defines `setup()` to build its inputs as attributes,
`benchmark_<name>()` methods to time, and optional `verify_<name>()` methods that return the
expected tensor for `self.out`. The runner sets `kernel` (the loaded kernel module) and `device`
before calling `setup()`. This package exports the class so such scripts import unchanged; it
has no benchmark runner of its own (docs/compatibility.md).
"""

from __future__ import annotations

from typing import Any


class Benchmark:
    """Base class for kernel benchmarks.

    Attributes a runner reads or sets:
      seed:   an int to seed the RNGs before `setup()`, or None for no seeding.
      device: the device the runner benchmarks on ("cpu" until a runner sets it).
      kernel: the loaded kernel module, set by the runner.
      out:    the output a `verify_<name>()` result is compared with, set by `setup()` or the
              benchmarked method.
    """

    seed: int | None = None
    device: str = "cpu"

    def __init__(self) -> None:
        self.kernel: Any = None
        self.out: Any = None

    def setup(self) -> None:
        """Build the inputs as attributes. The default does nothing."""
