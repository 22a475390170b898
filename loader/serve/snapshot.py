"""Serve a snapshot export (`kernels export`) with the same interface as a git repo.

An export keeps the Hub's commit ids, which git could not reproduce, as plain folders:

    <repo>/kernels-export.json              {"format": 1, "refs": {"branches": {...}, "tags": {...}}}
    <repo>/commits/<commit>/<path>          the files of that commit (only what was exported)

Files are served as regular (non-LFS) blobs; their ids are the git blob sha1 of their bytes,
computed once per commit, so clients verify exactly as they do against the Hub.

An export is a folder someone copied in, so it is read as untrusted: symbolic links (and
anything but regular files and folders) are not served, `commits/` and `commits/<commit>` must
be real folders, and every file is opened without following a link and checked to be the file
that was listed. The server never reads outside the snapshot.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

from .git import HEX40, CommitInfo, Entry, Refs, Tree

EXPORT_MANIFEST = "kernels-export.json"


def is_snapshot(path: Path) -> bool:
    return (path / EXPORT_MANIFEST).is_file()


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _open_regular(path: Path, identity: tuple[int, int] | None = None):
    """`path` opened for reading if it is a regular file and not a link (and, given `identity`,
    still the (device, inode) that was listed); OSError otherwise."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a regular file")
        if identity is not None and (st.st_dev, st.st_ino) != identity:
            raise OSError(f"{path} changed since it was listed")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _git_blob_sha1(fh, size: int) -> str:
    h = hashlib.sha1(f"blob {size}\0".encode())
    while chunk := fh.read(1 << 20):
        h.update(chunk)
    return h.hexdigest()


class SnapshotRepo:
    """Read access to one exported repo folder (duck-typed like serve.git.GitRepo)."""

    def __init__(self, path: Path):
        self.path = path
        self.gitdir = path  # LFS objects are never looked up: an export has no pointers
        self.head_file = str(path / EXPORT_MANIFEST)
        self._lock = threading.Lock()
        self._trees: dict[str, Tree] = {}
        # blob id -> a file holding those bytes, with the (device, inode) it had when listed
        self._files: dict[str, tuple[Path, tuple[int, int]]] = {}
        self._refs: tuple[tuple, Refs] | None = None

    def refs(self) -> Refs:
        st = os.stat(self.head_file)
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if self._refs is not None and self._refs[0] == stamp:
            return self._refs[1]
        data = json.loads(Path(self.head_file).read_text("utf-8"))
        refs = data.get("refs", {})
        commits = {f"refs/heads/{k}": v for k, v in refs.get("branches", {}).items()}
        commits.update({f"refs/tags/{k}": v for k, v in refs.get("tags", {}).items()})
        commits = {
            k: v for k, v in commits.items() if HEX40.fullmatch(str(v)) and self.is_commit(v)
        }
        result = Refs(
            commits=commits, head="refs/heads/main" if "refs/heads/main" in commits else None
        )
        self._refs = (stamp, result)
        return result

    def resolve(self, rev: str) -> str | None:
        commits = self.refs().commits
        for name in (f"refs/heads/{rev}", f"refs/tags/{rev}"):
            if name in commits:
                return commits[name]
        if HEX40.fullmatch(rev):
            return rev.lower() if self.is_commit(rev.lower()) else None
        return commits.get(rev) if rev.startswith("refs/") else None

    def is_commit(self, sha: str) -> bool:
        return (
            bool(HEX40.fullmatch(sha))
            and _is_real_dir(self.path / "commits")
            and _is_real_dir(self.path / "commits" / sha)
        )

    def tree(self, commit: str) -> Tree:
        with self._lock:
            cached = self._trees.get(commit)
            if cached is not None:
                return cached
            base = self.path / "commits" / commit
            entries: dict[str, Entry] = {}
            children: dict[str, list[Entry]] = {}
            if not self.is_commit(commit):
                raise OSError(f"{base} is not a folder of this snapshot")
            for dirpath, dirnames, filenames in os.walk(base):
                # os.walk lists links to folders among dirnames (without entering them): drop them.
                dirnames[:] = sorted(d for d in dirnames if _is_real_dir(Path(dirpath) / d))
                rel_dir = Path(dirpath).relative_to(base).as_posix()
                rel_dir = "" if rel_dir == "." else rel_dir
                for name in dirnames:
                    path = f"{rel_dir}/{name}" if rel_dir else name
                    entry = Entry(path=path, kind="directory", oid="0" * 40, size=0, mode="040000")
                    entries[path] = entry
                    children.setdefault(rel_dir, []).append(entry)
                for name in sorted(filenames):
                    full = Path(dirpath) / name
                    path = f"{rel_dir}/{name}" if rel_dir else name
                    try:
                        fh = _open_regular(full)
                    except OSError:
                        continue  # a link, a fifo, a device: not part of the export
                    with fh:
                        st = os.fstat(fh.fileno())
                        oid = _git_blob_sha1(fh, st.st_size)
                    self._files[oid] = (full, (st.st_dev, st.st_ino))
                    entry = Entry(path=path, kind="file", oid=oid, size=st.st_size, mode="100644")
                    entries[path] = entry
                    children.setdefault(rel_dir, []).append(entry)
            tree = Tree(entries=entries, children=children, pointers={})
            self._trees[commit] = tree
            return tree

    def _open(self, oid: str):
        path, identity = self._files[oid]
        return _open_regular(path, identity)

    def read_blob(self, oid: str) -> bytes:
        with self._open(oid) as fh:
            return fh.read()

    def stream_blob(
        self, oid: str, start: int, length: int, write: Callable[[bytes], object]
    ) -> None:
        with self._open(oid) as fh:
            fh.seek(start)
            left = length
            while left > 0:
                chunk = fh.read(min(left, 1 << 16))
                if not chunk:
                    raise OSError(f"{self._files[oid][0]} ended early")
                write(chunk)
                left -= len(chunk)

    def log(self, commit: str) -> list[CommitInfo]:
        stamp = int((self.path / "commits" / commit).stat().st_mtime)
        return [
            CommitInfo(
                sha=commit, time=stamp, author="kernels export", title="export", message="export"
            )
        ]

    def last_commit(self, commit: str, path: str) -> CommitInfo | None:
        return self.log(commit)[0]
