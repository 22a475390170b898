"""Inter-process locks with a deadline and a named holder.

A lock is an flock on `locks/<name>.lock`, so the OS frees it when its holder dies. The holder
writes who it is (pid, host, since when) into the file, so a process that has to wait can say
whom it waits for, and gives up with `LockTimeout` naming that holder once its deadline passes:
a holder that is stopped (SIGSTOP) or stuck delays others by at most the deadline.

Every write lock also holds the cache's `gc` lock shared, and `kernels prune` takes `gc`
exclusively: prune never runs while a load is between downloading an object and indexing it.

A cache this process cannot write (read-only mount, another user's cache) needs no lock: the
lock file cannot be created, so `acquire` takes nothing, and any write after it fails on its own.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from .fsutil import make_dirs

try:
    import fcntl
except ImportError:  # Windows: filelock's msvcrt locks, without holder names
    fcntl = None  # type: ignore[assignment]

_READ_ONLY = (errno.EACCES, errno.EPERM, errno.EROFS)
# How long a waiter stays quiet before it says whom it waits for.
NOTICE_AFTER = 1.0


class LockTimeout(Exception):
    """The lock stayed held past the deadline; `holder` describes who held it."""

    def __init__(self, name: str, holder: str, waited: float):
        super().__init__(f"waited {waited:.0f} s for the cache lock {name!r}, held by {holder}")
        self.name = name
        self.holder = holder
        self.waited = waited


def describe_holder(raw: bytes) -> str:
    """Readable words for the holder record in a lock file."""
    try:
        data = json.loads(raw)
        pid, host, since = int(data["pid"]), str(data["host"]), float(data["since"])
    except (ValueError, KeyError, TypeError):
        return "another process (it did not say which)"
    text = f"pid {pid} on {host}, for {max(0.0, time.time() - since):.0f} s"
    if host == _hostname():
        state = _process_state(pid)
        if state == "T":
            text += " (stopped: it was sent SIGSTOP or is being debugged)"
        elif state == "Z":
            text += " (a zombie)"
    return text


def _hostname() -> str:
    import socket  # only where a lock is taken or waited for: warm loads take none

    return socket.gethostname()


def _process_state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[0] if ")" in stat else None


class FileLock:
    """One named lock. `timeout` None waits forever; `on_wait(holder)` is called once when the
    wait has lasted NOTICE_AFTER seconds. Not reentrant; one holder per object."""

    def __init__(
        self,
        path: Path,
        *,
        shared: bool = False,
        timeout: float | None = None,
        on_wait: Callable[[str], None] | None = None,
        gc: FileLock | None = None,
    ):
        self.path = path
        self.shared = shared
        self.timeout = timeout
        self.on_wait = on_wait
        self.gc = gc
        self._fd: int | None = None
        self._portable = None
        self._held = False

    def _open(self) -> int | None:
        try:
            make_dirs(self.path.parent)
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            if exc.errno not in _READ_ONLY:
                raise
        try:  # flock needs no write access: an existing lock file still locks
            return os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            if exc.errno in _READ_ONLY or exc.errno == errno.ENOENT:
                return None  # nobody can take it, so nobody writes: nothing to wait for
            raise

    def acquire(self, deadline: float | None = None) -> None:
        if deadline is None and self.timeout is not None:
            deadline = time.monotonic() + self.timeout
        if self.gc is not None:
            self.gc.acquire(deadline)
        try:
            self._acquire(deadline)
        except BaseException:
            if self.gc is not None:
                self.gc.release()
            raise

    def _acquire(self, deadline: float | None) -> None:
        fd = self._open()
        if fd is None:
            self._held = True
            return
        if fcntl is None:
            os.close(fd)
            self._acquire_portable(deadline)
            return
        op = (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
        start = time.monotonic()
        told = False
        delay = 0.005
        while True:
            try:
                fcntl.flock(fd, op)
                break
            except BlockingIOError:
                pass
            except BaseException:
                os.close(fd)
                raise
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                holder = self._holder(fd)
                os.close(fd)
                raise LockTimeout(self.path.stem, holder, now - start)
            if not told and self.on_wait is not None and now - start >= NOTICE_AFTER:
                told = True
                self.on_wait(self._holder(fd))
            time.sleep(delay if deadline is None else max(0.0, min(delay, deadline - now)))
            delay = min(delay * 2, 0.1)
        self._fd = fd
        self._held = True
        if not self.shared:
            record = {"pid": os.getpid(), "host": _hostname(), "since": time.time()}
            with contextlib.suppress(OSError):  # a read-only fd: the lock still holds
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(record).encode(), 0)

    def _acquire_portable(self, deadline: float | None) -> None:
        import filelock

        wait = -1 if deadline is None else max(0.0, deadline - time.monotonic())
        lock = filelock.FileLock(str(self.path) + ".win", timeout=wait)
        try:
            lock.acquire()
        except filelock.Timeout:
            raise LockTimeout(self.path.stem, "another process", wait) from None
        self._portable = lock
        self._held = True

    @staticmethod
    def _holder(fd: int) -> str:
        try:
            return describe_holder(os.pread(fd, 4096, 0))
        except OSError:
            return "another process"

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        fd, self._fd = self._fd, None
        if fd is not None:
            if not self.shared:  # a later waiter must not name a holder that has left
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
            os.close(fd)  # closing the only descriptor drops the flock
        portable, self._portable = self._portable, None
        if portable is not None:
            portable.release()
        if self.gc is not None:
            self.gc.release()

    def __enter__(self) -> FileLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
