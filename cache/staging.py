"""tmp/: room for writes in progress, one folder per live process.

Objects and trees are assembled here and renamed into place only when complete. A process that is
killed leaves its folder behind. Each folder `tmp/<name>/` is owned through an flock on
`tmp/<name>.lock`, which the OS releases when the owner dies, so `clean()` removes a dead owner's
leftovers at once and never touches a live writer's, without guessing from file ages. A process
that exits normally removes its own folder. Where flock does not exist, folders are removed by age.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import threading
import time
from pathlib import Path

from .fsutil import make_dirs

try:
    import fcntl
except ImportError:  # Windows: no flock; age decides
    fcntl = None  # type: ignore[assignment]

_lock = threading.Lock()
# Folders this process owns: staging root -> (folder, lock fd, owner pid).
_owned: dict[str, tuple[Path, int, int]] = {}


class Staging:
    """The staging root of one cache (`<cache>/v1/tmp`)."""

    def __init__(self, root: Path):
        self.root = root

    def folder(self) -> Path:
        """This process's folder under the root, created (and locked) on first use."""
        key = os.path.abspath(self.root)
        with _lock:
            owned = _owned.get(key)
            if owned is not None and owned[2] == os.getpid() and owned[0].is_dir():
                return owned[0]
            if owned is not None and owned[2] == os.getpid():
                _release(owned)  # someone removed it: start a new one
            folder, fd = self._claim()
            _owned[key] = (folder, fd, os.getpid())
            return folder

    def _claim(self) -> tuple[Path, int]:
        import secrets  # only a process that writes claims a folder; a warm load does not

        make_dirs(self.root)
        while True:
            name = f"{os.getpid()}-{secrets.token_hex(6)}"
            lock = self.root / f"{name}.lock"
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                continue
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            # A cleaner may have taken the new, not yet locked file for a dead owner's and
            # unlinked it: then this lock guards nothing; take another name.
            try:
                ours = os.stat(lock).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                ours = False
            if ours:
                folder = self.root / name
                folder.mkdir(mode=0o755)
                return folder, fd
            os.close(fd)

    def clean(self, older_than: float = 3600.0) -> int:
        """Remove what dead processes left (at once) and loose entries older than `older_than`
        seconds; returns how many entries were removed."""
        if not self.root.is_dir():
            return 0
        cutoff = time.time() - older_than
        removed = 0
        with _lock:
            mine = {owned[0] for owned in _owned.values() if owned[2] == os.getpid()}
        for item in list(self.root.iterdir()):
            if item.name.endswith(".lock") and fcntl is not None:
                removed += _remove_if_owner_gone(item)
                continue
            if item in mine or (fcntl is not None and item.with_name(f"{item.name}.lock").exists()):
                continue  # owned: its lock decides
            with contextlib.suppress(OSError):
                if item.lstat().st_mtime < cutoff:
                    _remove(item)
                    removed += 1
        return removed


def _remove_if_owner_gone(lock: Path) -> int:
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return 0
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return 0  # its owner is alive
        # Folder first, lock last: nobody ever sees an owned folder without its lock.
        _remove(lock.with_name(lock.name[: -len(".lock")]))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)
        return 1
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _release(owned: tuple[Path, int, int]) -> None:
    folder, fd, _pid = owned
    _remove(folder)
    with contextlib.suppress(OSError):
        os.unlink(folder.with_name(f"{folder.name}.lock"))
    with contextlib.suppress(OSError):
        os.close(fd)


@atexit.register
def _release_all() -> None:
    """A normal exit leaves nothing in tmp/ (a forked child never removes its parent's folder)."""
    with _lock:
        for key, owned in list(_owned.items()):
            if owned[2] == os.getpid():
                _release(owned)
                del _owned[key]
