"""Fixtures of the security suite: marker kernels, a folder other users can enter, and a second
user (`nobody`, by dropping privileges in a forked child) for the attacks that need one.

A marker kernel appends a line to a file when it is imported, so "did the attacker's code run?"
is a file on disk. Tests that need a second user skip when this process is not root.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kernels import notices

from tests.kernel_repos import metadata

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
NOBODY = 65534
needs_root = pytest.mark.skipif(not IS_ROOT, reason="needs root, to act as the user `nobody`")


def marker_files(name: str, marker: Path, *, value: int = 1, meta: dict | None = None) -> dict:
    """A pure-Python kernel variant whose import appends 'ran' to `marker`."""
    base = "build/torch-universal"
    return {
        f"{base}/metadata.json": metadata(name, **(meta or {})),
        f"{base}/__init__.py": f"open({str(marker)!r}, 'a').write('ran\\n')\nVALUE = {value}\n",
    }


def as_nobody(action: Callable[[], None], *, groups: tuple[int, ...] = ()) -> None:
    """Run `action` in a forked child that has become `nobody` (with supplementary `groups`);
    raise if it failed."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.setgroups(list(groups))
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            action()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the action as `nobody` failed (see stderr)"


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A fresh folder under /tmp that other users can enter (pytest's tmp folders are private)."""
    path = Path(tempfile.mkdtemp(prefix="kernels-sec-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        for p in [path, *path.rglob("*")]:
            with contextlib.suppress(OSError):
                if not p.is_symlink():
                    p.chmod(p.stat().st_mode | stat.S_IWUSR | stat.S_IXUSR)
        shutil.rmtree(path, ignore_errors=True)


def open_up(folder: Path, bits: int = 0o002) -> None:
    """Make `folder` and everything under it writable by others (`bits`), as a shared cache is."""
    for p in [folder, *folder.rglob("*")]:
        if p.is_dir() and not p.is_symlink():
            p.chmod(p.stat().st_mode | bits)


@pytest.fixture(autouse=True)
def _fresh_notices() -> Iterator[None]:
    notices.reset()
    yield
    notices.reset()
