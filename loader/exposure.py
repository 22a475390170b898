"""The refusal of files and folders that other users can write (guard.py says why).

Apart from guard.py, which opens the cache from the settings, so that settings.py can refuse an
exposed config file without importing guard (an import circle).
"""

from __future__ import annotations

from pathlib import Path

from kernels.cache import Exposure
from kernels.cache.safety import check_path

from .errors import UnsafePermissions


def unsafe(exposure: Exposure, what: str) -> UnsafePermissions:
    """The error for `what`, exposed through `exposure`, with the command that fixes it."""
    return UnsafePermissions(
        f"refusing {what}: {exposure.path} is {exposure.why}, so another user could change "
        "which code runs",
        hint=exposure.remedy or f"run `{exposure.fix()}`, or use a path only you can write",
    )


def refuse_exposed(path: Path, what: str) -> None:
    """Raise UnsafePermissions when `path` or a folder above it is writable by other users."""
    exposure = check_path(path)
    if exposure is not None:
        raise unsafe(exposure, f"{what} {path}")
