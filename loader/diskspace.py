"""Free space: refuse a write a disk cannot hold before it starts, and name a disk that fills up
anyway (from elsewhere) as the typed InsufficientSpace, never an untyped OSError.

Used by downloads (the cache's disk) and `kernels mirror build` (its staging folder and DEST).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from .errors import InsufficientSpace

# ENOSPC: the disk is full; EDQUOT: the user's quota on it is.
DISK_FULL = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})
# How a child process (git, run with LC_ALL=C) reports them on stderr.
_DISK_FULL_TEXTS = tuple(os.strerror(code) for code in sorted(DISK_FULL))


def require_free_space(folder: Path, needed: int, what: str, *, hint: str | None = None) -> None:
    """InsufficientSpace when `needed` bytes do not fit in the free space of the disk holding
    `folder` (or its nearest existing parent). Unknown free space passes: the writes themselves
    then fail on a full disk, which `is_disk_full` recognises."""
    if needed <= 0:
        return
    try:
        free = shutil.disk_usage(_nearest_existing(folder)).free
    except OSError:
        return
    if needed > free:
        raise InsufficientSpace(
            f"{what} needs {needed} bytes; the disk of {folder} has {free} free", hint=hint
        )


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc` says a disk (or the user's quota on it) is full: an OSError with ENOSPC or
    EDQUOT, or an error carrying a child process's C-locale message for one."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.errno in DISK_FULL
    text = str(exc)
    return any(full in text for full in _DISK_FULL_TEXTS)


def _nearest_existing(folder: Path) -> Path:
    folder = Path(os.path.abspath(folder))
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    return folder
