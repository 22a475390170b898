"""Stage 4: choose the build variant to import, and check it can run here.

The rules and the preference order live in variants.py; this stage walks the accepted variants
best first and checks what only the variant's files can tell: the GPU architectures in its
metadata.json, its native libraries' ELF headers (CPU arch, GLIBC) and the minimum `kernels`
version. A variant that fails a check is added to the trace as rejected and the next one is
tried. The Python dependencies (python_deps.py: an allow-list, then installed) are checked for
the chosen variant, and a build made from a dirty git tree loads with a warning.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

from ._version import __version__
from .errors import NoCompatibleVariant
from .metadata import Metadata
from .native_abi import check_native_files
from .variants import SystemInfo, VariantAccepted, VariantRejected, check_archs, detect_system

NATIVE_SUFFIXES = (".so", ".pyd", ".dylib")


def check_metadata(metadata: Metadata, system: SystemInfo, *, check_arch: bool) -> str | None:
    """Why the variant with this metadata cannot run here, or None."""
    if metadata.kernels_minver and _newer_than_this(metadata.kernels_minver):
        return f"needs kernels >= {metadata.kernels_minver}, this is kernels {__version__}"
    if check_arch:
        return check_archs(metadata.backend, system)
    return None


def _newer_than_this(minver: str) -> bool:
    # packaging.version compiles a large regex on import: paid only by kernels that declare
    # kernels-minver, not by every warm load.
    from packaging.version import Version

    return Version(minver) > Version(__version__)


def check_native(tree: Path) -> str | None:
    """Why the variant's native libraries cannot load here (ELF probe), or None."""
    libs = [p for p in sorted(tree.rglob("*")) if p.is_file() and p.name.endswith(NATIVE_SUFFIXES)]
    problems = check_native_files(libs) if libs else []
    return "; ".join(problems) if problems else None


@functools.lru_cache(maxsize=1)
def _detected_backend() -> str:
    return detect_system().backend


def check_python_depends(metadata: Metadata, *, backend: str | None = None) -> None:
    """Raise UnsupportedDependency (a ValueError) for a declared Python dependency outside the
    allow-list, MissingDependency (an ImportError) for an allowed one that is not installed.
    `backend` is the selected backend kind (default: this machine's)."""
    if not metadata.python_depends:
        return  # the common case: no import of the allow-list
    from .python_deps import check_installed

    check_installed(metadata, backend or _detected_backend())


def warn_if_dirty(metadata: Metadata, variant: str) -> None:
    """A UserWarning when the build was made from a git tree with uncommitted changes: its
    recorded commit does not identify the sources, so the build may not be reproducible."""
    provenance = metadata.provenance
    if provenance is None or not provenance.dirty:
        return
    warnings.warn(
        f"Kernel '{metadata.name}' variant '{variant}' was built from a dirty git tree "
        f"({', '.join(provenance.dirty_sources())} had uncommitted changes); its recorded git "
        "revision does not fully identify the sources it was built from, so the build may not "
        "be reproducible",
        UserWarning,
        stacklevel=4,
    )


def no_variant_error(what: str, system: SystemInfo, trace: list) -> NoCompatibleVariant:
    if not trace:
        return NoCompatibleVariant(f"{what} has no build variants (nothing under build/)")
    return NoCompatibleVariant(
        f"no build variant of {what} fits this machine ({system.describe()}):", trace=trace
    )


def reject(trace: list, variant: str, reason: str) -> list:
    """The trace with `variant` moved from accepted to rejected for `reason`; the next accepted
    variant becomes the preferred one."""
    accepted = [e.variant for e in trace if isinstance(e, VariantAccepted) and e.variant != variant]
    rejected = [e for e in trace if isinstance(e, VariantRejected)]
    marked = [VariantAccepted(name, preferred=(i == 0)) for i, name in enumerate(accepted)]
    return marked + rejected + [VariantRejected(variant, reason)]
