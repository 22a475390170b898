"""Who else can write a path: the check that decides whether the cache may be trusted.

The cache holds what a load imports (trees), what says which bytes belong to which commit (index,
manifests) and the recorded trust decisions. Stamps and records prove nothing against somebody
who can rewrite them, so the loader trusts a cache only when nobody but its user and root can
write it, the rule ssh applies to keys: every folder from `/` down to the cache root is owned by
the user or root and is not group- or world-writable (a sticky folder such as /tmp may be, since
others cannot rename or delete entries in it), and so is every bucket folder inside the cache.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


class Exposure:
    """`path` can be written by a user other than this one and root; `why` says how.
    (A plain class: this module is imported on every load, and a dataclass costs more.)"""

    __slots__ = ("path", "why", "remedy")

    def __init__(self, path: Path, why: str, remedy: str | None = None):
        self.path = path
        self.why = why
        self.remedy = remedy  # a one-line hint, where a chmod or chown is not the fix

    def __repr__(self) -> str:
        return f"Exposure({str(self.path)!r}, {self.why!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Exposure) and (self.path, self.why) == (other.path, other.why)

    def fix(self) -> str:
        if self.why.startswith("a link to"):
            return f"rm {self.path}"
        if self.why.startswith("owned"):
            return f"chown -R {os.geteuid()} {self.path} (or use a folder of your own)"
        return f"chmod -R go-w {self.path}"


def trusted_owners() -> frozenset[int]:
    """The users whose files this process may trust: itself and root."""
    return frozenset({os.geteuid(), 0})


def exposure_of(
    path: Path | str, st: os.stat_result, *, sticky_ok: bool = False
) -> Exposure | None:
    """Why the file or folder `path` (with stat `st`) is writable by others, or None."""
    if os.name == "nt":  # no POSIX owners; ACLs are out of scope
        return None
    if st.st_uid not in trusted_owners():
        return Exposure(Path(path), f"owned by uid {st.st_uid}")
    if st.st_mode & _OTHERS_WRITE:
        if sticky_ok and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX:
            return None
        who = "world" if st.st_mode & stat.S_IWOTH else "group"
        return Exposure(Path(path), f"{who}-writable (mode {stat.S_IMODE(st.st_mode):o})")
    return None


def _with_parents(path: str) -> list[str]:
    out = [path]
    while (parent := os.path.dirname(out[-1])) != out[-1]:
        out.append(parent)
    return out


def check_path(
    path: Path | str, *, parents: bool = True, sticky_here: bool = False
) -> Exposure | None:
    """The first exposure of `path` or (when `parents`) of a folder above it; None when only
    this user and root can change it. A missing `path` is judged by its nearest existing folder,
    since whoever can write that folder can create it. Folders above `path` may be sticky (like
    /tmp: others cannot rename or delete what this user put there); `path` itself only with
    `sticky_here`, for a folder whose entries are all checked in turn (a cache root: a tmpfs
    mount is 1777), never for one where anybody's new file would be believed. A symlink on the
    way is judged by its own folders and by its target's; a link whose target is missing by the
    nearest existing folder of its target, and that one may not be writable by others even when
    sticky: nothing of the user's is there yet, so whoever creates the target first decides
    what the link leads to.

    Plain strings and os calls: this runs on every load that reaches the disk."""
    given = os.path.abspath(path)
    found, linked = _check_chain(_with_parents(given) if parents else [given], sticky_here)
    if found is None and linked:  # a symlink on the way: its target's folders decide too
        real = os.path.realpath(given)
        found, _ = _check_chain(_with_parents(real) if parents else [real], sticky_here)
        if found is None and not os.path.lexists(real):
            found = _dangling(given, real)
    return found


def _dangling(given: str, real: str) -> Exposure | None:
    """The exposure of `given`, a path through a link whose target `real` is missing, when
    another user could create that target (its nearest existing folder is writable by others,
    sticky or not); None otherwise."""
    if os.name == "nt":
        return None
    folder = os.path.dirname(real)
    while True:
        try:
            st = os.lstat(folder)
            break
        except OSError:
            if os.path.dirname(folder) == folder:
                return None
            folder = os.path.dirname(folder)
    exposure = exposure_of(folder, st)
    if exposure is None:
        return None  # only this user and root can create it there
    return Exposure(
        Path(given),
        f"a link to {real}, which does not exist, in {folder}, {exposure.why}: whoever "
        "creates it first decides what the link leads to",
        f"create {real} yourself before loading, or remove the link (`rm {given}`)",
    )


def _check_chain(chain: list[str], sticky_here: bool) -> tuple[Exposure | None, bool]:
    """(the first exposure in `chain`, whether a symlink was met); chain[0] is the path."""
    linked = False
    for index, item in enumerate(chain):
        try:
            st = os.lstat(item)
        except (FileNotFoundError, NotADirectoryError):  # missing (or below a file): no such path
            continue
        except OSError:
            return Exposure(Path(item), "not readable"), linked
        if stat.S_ISLNK(st.st_mode):
            linked = True  # a link's own mode means nothing; its folder is the next item
            continue
        exposure = exposure_of(item, st, sticky_ok=sticky_here or index > 0)
        if exposure is not None:
            return exposure, linked
    return None, linked


def check_tree(paths: list[Path] | list[str]) -> Exposure | None:
    """The first of `paths` (each a folder or file inside a checked root) others can write."""
    for item in paths:
        try:
            st = os.lstat(item)
        except FileNotFoundError:
            continue
        except OSError:
            return Exposure(Path(item), "not readable")
        exposure = exposure_of(item, st)
        if exposure is not None:
            return exposure
    return None
