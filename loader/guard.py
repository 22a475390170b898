"""What the loader refuses to believe: files and folders that other users can write.

Loading a kernel runs its code, and three local things decide which code: the cache (which
bytes belong to which commit, and recorded trust decisions), the config file (trusted
publishers) and kernels.lock (which commit). Each is used only when no user but this one and
root can write it (kernels.cache.safety has the rule); otherwise the load stops with
UnsafePermissions and the command that fixes it. docs/security.md has the threat model.
"""

from __future__ import annotations

from pathlib import Path

from kernels.cache import Cache, Exposure
from kernels.cache.safety import check_path

from . import settings
from .errors import UnsafePermissions
from .notices import notice_once


def unsafe(exposure: Exposure, what: str) -> UnsafePermissions:
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


def lock_wait_notice(holder: str) -> None:
    notice_once(f"lock-wait:{holder}", f"kernels: waiting for a cache lock held by {holder}")


def open_cache(*, check: bool = True) -> Cache:
    """The cache of this process's settings, scoped to its Hub endpoint, with lock deadlines.
    With `check`, refuse a cache other users can write (UnsafePermissions)."""
    cache = Cache(
        settings.cache_root(),
        endpoint=settings.endpoint(),
        lock_timeout=settings.lock_timeout(),
        on_lock_wait=lock_wait_notice,
    )
    if check:
        exposure = cache.exposure()
        if exposure is not None:
            raise unsafe(exposure, f"the kernels cache {cache.root}")
    return cache
