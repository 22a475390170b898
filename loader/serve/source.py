"""Read a `mirror build` SRC as somebody else's folder: what may be copied, and a private copy of it.

The build runs with the builder's rights, and whatever it copies `kernels serve` hands to anyone.
SRC may be shared with users who can add entries to it, so:

* links (to files or folders) are never followed, at any level, and are refused when they stand
  where the build would read (an org folder, a repo folder, anything inside a kernel folder);
* only regular files and folders are opened: a FIFO, socket or device inside a kernel folder is
  refused without being opened (a FIFO named metadata.json used to hang the build);
* every name inside a kernel folder must be printable UTF-8 (no newline, ESC, CR, ...);
* a file that is not readable by everyone (mode o+r) is copied only when it and every folder from
  `/` down to it are owned by the builder or root and writable by nobody else: otherwise another
  user could have put it there, for example as a hard link to the builder's private key.

Folders are opened one level at a time with O_NOFOLLOW relative to their parent's descriptor, and
each file is checked on the descriptor its bytes are read from, so swapping an entry for a link
between the check and the read changes nothing. The bytes go to a private staging folder, so the
whole of SRC is read, and every refusal raised, before DEST is touched. Each file's size is
checked against the staging disk's free space before a byte of it is copied, and no more than
that size is copied (a sparse file costs its owner nothing, and can grow after the check).
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kernels.cache.safety import Exposure, check_path, exposure_of

from ..diskspace import is_disk_full, require_free_space
from ..errors import InsufficientSpace, KernelsError, MirrorSourceError
from .mirror import valid_name

SKIP_NAMES = frozenset({".git", "__pycache__"})
# getattr: flags POSIX has and Windows lacks (there the module imports, but builds are untested).
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW
# O_NONBLOCK: a FIFO swapped in after the lstat opens at once (then fstat refuses it), never waits.
_FILE_FLAGS = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
_CHUNK = 1 << 20
# A repo path has at most this many parts: the client refuses deeper ones (check_relpath), and
# the walk recurses once per folder, so a tree 1,500 deep was a RecursionError.
MAX_PARTS = 32

_LINK_HINT = (
    "replace the link by a copy of what it points to (or remove it); links are not followed"
)
_SPECIAL_HINT = "remove it: a mirror holds regular files and folders only"
_NAME_HINT = "rename it: names in a kernel folder must be printable UTF-8 (no newline or escape)"
STAGING_HINT = (
    "free space on that disk, or set TMPDIR to a folder on a larger one (the build copies SRC "
    "there first)"
)
_PRIVATE_HINT = (
    "if the file is meant to be published, `chmod o+r` it; otherwise remove it, or build from a "
    "folder only you can write"
)


@dataclass
class SourceRepo:
    """One kernel folder of SRC, read: `files` are (repo path, git mode, staged copy), sorted;
    `blobs` maps the git blob sha of each distinct content to its size."""

    repo_id: str
    files: list[tuple[str, str, Path]] = field(default_factory=list)
    blobs: dict[str, int] = field(default_factory=dict)

    def staged(self, repo_path: str) -> Path | None:
        for path, _mode, copy in self.files:
            if path == repo_path:
                return copy
        return None


def shown(text: str) -> str:
    """`text` with every unprintable character escaped, safe to print on a terminal."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def read_source(src: Path, staging: Path) -> list[SourceRepo]:
    """Every `src/<org>/<name>/` with a `build/` folder, its files copied under `staging`.

    MirrorSourceError (naming the entry) for a link, a special file, an unprintable name, or a
    private file in a place others control. `src` itself may be a link: the builder named it.
    """
    root_exposure = check_path(src)  # SRC itself and the folders above it, as for a cache root
    base = os.path.join(src, "")  # "SRC/": errors name entries the way the builder wrote SRC
    reader = _Reader(staging, base)
    repos = []
    root = os.open(src, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        for org, org_fd, org_exposure in _subfolders(root, base, root_exposure):
            try:
                for name, repo_fd, repo_exposure in _subfolders(
                    org_fd, f"{base}{org}/", org_exposure
                ):
                    try:
                        if _has_build(repo_fd, f"{base}{org}/{name}"):
                            repo = SourceRepo(f"{org}/{name}")
                            reader.read_tree(repo, repo_fd, "", repo_exposure)
                            repo.files.sort()
                            repos.append(repo)
                    finally:
                        os.close(repo_fd)
            finally:
                os.close(org_fd)
    finally:
        os.close(root)
    return repos


def _subfolders(
    parent: int, prefix: str, exposure: Exposure | None
) -> Iterator[tuple[str, int, Exposure | None]]:
    """(name, open descriptor, exposure) of each folder below `parent` whose name could be an
    org or repo name; a link there that leads to a folder is refused, anything else is ignored."""
    for name in _list(parent, prefix.rstrip("/")):
        if not valid_name(name):
            continue
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            try:
                leads_to_folder = stat.S_ISDIR(os.stat(name, dir_fd=parent).st_mode)
            except OSError:
                leads_to_folder = False  # a dangling link: nothing to build from
            if leads_to_folder:
                raise _link(prefix + name)
            continue
        if not stat.S_ISDIR(st.st_mode):
            continue
        fd = _open_dir(parent, name, prefix + name)
        yield name, fd, exposure or exposure_of(prefix + name, os.fstat(fd))


def _has_build(repo_fd: int, where: str) -> bool:
    try:
        st = os.stat("build", dir_fd=repo_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(st.st_mode):
        raise _link(f"{where}/build")
    return stat.S_ISDIR(st.st_mode)


def _open_dir(parent: int, name: str, where: str) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError as exc:
        raise _unreadable(where, exc) from None


def _list(fd: int, where: str) -> list[str]:
    try:
        return sorted(os.listdir(fd))
    except OSError as exc:
        raise _unreadable(where, exc) from None


def _unreadable(where: str, exc: OSError) -> MirrorSourceError:
    if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link: it was swapped in after the lstat
        return _link(where)
    if exc.errno == errno.ENOTDIR:
        return _changed(where)
    return MirrorSourceError(
        f"{shown(where)}: cannot read it ({exc.strerror})",
        hint="make it readable to you, or remove it from SRC",
    )


def _changed(where: str) -> MirrorSourceError:
    return MirrorSourceError(
        f"{shown(where)} changed while the mirror was being built",
        hint="build again once nobody is writing to SRC",
    )


class _Reader:
    """Copies checked files into `staging` under numbered names (so no SRC name reaches git)."""

    def __init__(self, staging: Path, base: str):
        self.staging = staging
        self.base = base  # "SRC/", to name entries in errors
        self.count = 0

    def read_tree(self, repo: SourceRepo, fd: int, prefix: str, exposure: Exposure | None) -> None:
        where = f"{self.base}{repo.repo_id}/{prefix}"
        if prefix.count("/") >= MAX_PARTS:
            raise MirrorSourceError(
                f"{shown(where.rstrip('/'))}: folders nested deeper than a repo path may go "
                f"({MAX_PARTS} parts)",
                hint="flatten the tree: clients refuse paths that deep",
            )
        for name in _list(fd, where.rstrip("/")):
            if not name.isprintable() or _not_utf8(name):
                raise MirrorSourceError(
                    f"{shown(where + name)}: a name with control characters (or not UTF-8) "
                    "cannot go into a mirror",
                    hint=_NAME_HINT,
                )
            if name in SKIP_NAMES or name.endswith(".pyc"):
                continue  # git metadata and bytecode are never part of a kernel: not even read
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise _link(where + name)
            if stat.S_ISDIR(st.st_mode):
                sub = _open_dir(fd, name, where + name)
                try:
                    inner = exposure or exposure_of(where + name, os.fstat(sub))
                    self.read_tree(repo, sub, f"{prefix}{name}/", inner)
                finally:
                    os.close(sub)
            elif stat.S_ISREG(st.st_mode):
                mode, copy, blob, size = self._copy(fd, name, where + name, st, exposure)
                repo.files.append((f"{prefix}{name}", mode, copy))
                repo.blobs[blob] = size
            else:
                raise _special(where + name)

    def _copy(
        self,
        fd: int,
        name: str,
        where: str,
        listed: os.stat_result,
        exposure: Exposure | None,
    ) -> tuple[str, Path, str, int]:
        """(git mode, staged copy, git blob sha, size) of the checked file `name` of `fd`."""
        try:
            src = os.open(name, _FILE_FLAGS, dir_fd=fd)
        except OSError as exc:
            raise _unreadable(where, exc) from None
        try:
            st = os.fstat(src)
            if (st.st_dev, st.st_ino) != (listed.st_dev, listed.st_ino):
                raise _changed(where)
            if not stat.S_ISREG(st.st_mode):
                raise _special(where)
            _check_private(where, st, exposure)
            # Free space now, which the copies staged so far already took: a running total.
            require_free_space(self.staging.parent, st.st_size, shown(where), hint=STAGING_HINT)
            self.count += 1
            copy = self.staging / str(self.count)
            blob = self._stage(src, copy, st.st_size, where)
        finally:
            os.close(src)
        mode = "100755" if st.st_mode & 0o111 else "100644"
        return mode, copy, blob, st.st_size

    def _stage(self, src: int, copy: Path, size: int, where: str) -> str:
        """Copy the `size` bytes of `src` to `copy`; return their git blob sha. A file that
        grew past `size` since it was checked changed; a disk that fills up anyway (from
        elsewhere) is InsufficientSpace."""
        blob = hashlib.sha1(b"blob %d\0" % size, usedforsecurity=False)
        left = size
        try:
            with open(copy, "wb") as out:
                while left and (chunk := os.read(src, min(_CHUNK, left))):
                    out.write(chunk)
                    blob.update(chunk)
                    left -= len(chunk)
        except OSError as exc:
            if isinstance(exc, KernelsError) or not is_disk_full(exc):
                raise
            raise InsufficientSpace(
                f"{shown(where)}: the disk of {self.staging.parent} filled up while it was "
                f"being copied ({exc.strerror})",
                hint=STAGING_HINT,
            ) from None
        if left or os.read(src, 1):  # shorter or longer than when it was checked
            raise _changed(where)
        return blob.hexdigest()


def _check_private(where: str, st: os.stat_result, exposure: Exposure | None) -> None:
    """Refuse a file not readable by everyone when another user controls it or a folder above."""
    if st.st_mode & stat.S_IROTH:
        return  # anybody on this machine could read it already: the mirror reveals nothing new
    own = exposure_of(where, st)
    found = own or exposure
    if found is None:
        return
    place = "it" if own is not None else str(found.path)
    raise MirrorSourceError(
        f"{shown(where)}: not readable by everyone (mode {stat.S_IMODE(st.st_mode):o}), and "
        f"{shown(place)} is {found.why}, so another user could have put it there",
        hint=_PRIVATE_HINT,
    )


def _not_utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes come back as lone surrogates
        return True
    return False


def _link(where: str) -> MirrorSourceError:
    return MirrorSourceError(f"{shown(where)} is a symbolic link", hint=_LINK_HINT)


def _special(where: str) -> MirrorSourceError:
    return MirrorSourceError(
        f"{shown(where)} is not a regular file or folder (a FIFO, socket or device)",
        hint=_SPECIAL_HINT,
    )
