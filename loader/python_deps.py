"""The Python dependencies a kernel may declare (metadata.json `python-depends`), and their check.

A kernel's code runs in the user's interpreter, so the packages it imports are part of what the
user trusts. As the reference does, only an allow-list of kernel dependencies is accepted: any
other name is refused (UnsupportedDependency, a ValueError) before the variant is downloaded or
imported, and an allowed one that is not installed raises MissingDependency (an ImportError)
naming the pip package. The list matches the reference's `python_depends.json` (0.17.2): a
general set, plus packages that only a backend's builds may use.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from .errors import MissingDependency, UnsupportedDependency
from .metadata import Metadata


@dataclass(frozen=True)
class AllowedDependency:
    """A dependency name a kernel may declare: the pip package that provides it and the module
    that proves it is installed (None for packages that install no Python module)."""

    pip: str
    module: str | None


GENERAL: dict[str, AllowedDependency] = {
    "einops": AllowedDependency("einops", "einops"),
    "helion": AllowedDependency("helion", "helion"),
    "tvm-ffi": AllowedDependency("apache-tvm-ffi", "tvm_ffi"),
}

# Keys are this package's backend kinds (variants.BACKENDS).
BY_BACKEND: dict[str, dict[str, AllowedDependency]] = {
    "cuda": {"nvidia-cutlass-dsl": AllowedDependency("nvidia-cutlass-dsl", "cutlass")},
    "neuron": {"nki": AllowedDependency("nki", "nki")},
    "xpu": {"onednn": AllowedDependency("onednn-devel", None)},
}


def allowed(dependency: str, backend: str) -> AllowedDependency | None:
    """The allow-list entry for `dependency` on `backend`, or None when it is not allowed."""
    return GENERAL.get(dependency) or BY_BACKEND.get(backend, {}).get(dependency)


def check_allowed(metadata: Metadata, backend: str) -> None:
    """Raise UnsupportedDependency for the first declared dependency outside the allow-list.

    Needs only metadata.json, so it runs before the rest of the variant is downloaded.
    """
    for dep in metadata.python_depends:
        if allowed(dep, backend) is None:
            raise UnsupportedDependency(
                f"Kernel module `{metadata.name.python_name}` uses unsupported kernel "
                f"dependency: {dep}"
            )


def check_installed(metadata: Metadata, backend: str) -> None:
    """check_allowed, then raise MissingDependency for an allowed dependency not installed."""
    check_allowed(metadata, backend)
    for dep in metadata.python_depends:
        entry = allowed(dep, backend)
        assert entry is not None  # check_allowed passed
        if entry.module is not None and importlib.util.find_spec(entry.module) is None:
            raise MissingDependency(
                f"Kernel module `{metadata.name.python_name}` requires Python dependency "
                f"`{entry.pip}`. Please install with: pip install {entry.pip}",
                hint=f"pip install {entry.pip}",
            )
