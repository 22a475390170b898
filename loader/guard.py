"""What the loader refuses to believe: files and folders that other users can write.

Loading a kernel runs its code, and three local things decide which code: the cache (which
bytes belong to which commit, and recorded trust decisions), the config file (trusted
publishers) and kernels.lock (which commit). Each is used only when no user but this one and
root can write it (kernels.cache.safety has the rule); otherwise the load stops with
UnsafePermissions and the command that fixes it. docs/security.md has the threat model.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kernels.cache import Cache

from . import settings
from .errors import CacheError
from .notices import notice_once

__all__ = ["check_cache_root", "lock_wait_notice", "open_cache"]
_CACHE_HINT = "set KERNELS_CACHE to a folder, or a path where one can be made"


def check_cache_root(root: Path) -> None:
    """CacheError when `root` is a file, or lies under one (no folder can be made there): said
    as such, never as a permission problem. One `stat` when the root is a folder."""
    for path in (root, *root.parents):
        try:
            mode = os.stat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):
            continue  # not there yet, or under a file: look further up
        except OSError:
            return  # unreadable: the permission check says why
        if stat.S_ISDIR(mode):
            return
        if path == root:
            raise CacheError(f"the cache {root} is a file, not a folder", hint=_CACHE_HINT)
        raise CacheError(
            f"the cache {root} is under {path}, which is a file, not a folder", hint=_CACHE_HINT
        )


def lock_wait_notice(holder: str) -> None:
    notice_once(f"lock-wait:{holder}", f"kernels: waiting for a cache lock held by {holder}")


def open_cache(*, check: bool = True, endpoint: str | None = None) -> Cache:
    """The cache of this process's settings, scoped to its Hub endpoint (or to `endpoint`, e.g.
    the bundled kernels' pseudo-endpoint), with lock deadlines. With `check`, refuse a cache
    other users can write (UnsafePermissions)."""
    root = settings.cache_root()
    check_cache_root(root)
    cache = Cache(
        root,
        endpoint=endpoint or settings.endpoint(),
        lock_timeout=settings.lock_timeout(),
        on_lock_wait=lock_wait_notice,
    )
    if check:
        exposure = cache.exposure()
        if exposure is not None:
            from .exposure import unsafe  # the error path only

            raise unsafe(exposure, f"the kernels cache {cache.root}")
    return cache
