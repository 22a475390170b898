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
from dataclasses import dataclass
from pathlib import Path

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


@dataclass(frozen=True)
class Exposure:
    """`path` can be written by a user other than this one and root; `why` says how."""

    path: Path
    why: str

    def fix(self) -> str:
        if self.why.startswith("owned"):
            return f"chown -R {os.geteuid()} {self.path} (or use a folder of your own)"
        return f"chmod -R go-w {self.path}"


def trusted_owners() -> frozenset[int]:
    """The users whose files this process may trust: itself and root."""
    return frozenset({os.geteuid(), 0})


def exposure_of(path: Path, st: os.stat_result, *, sticky_ok: bool = False) -> Exposure | None:
    """Why the file or folder `path` (with stat `st`) is writable by others, or None."""
    if os.name == "nt":  # no POSIX owners; ACLs are out of scope
        return None
    if st.st_uid not in trusted_owners():
        return Exposure(path, f"owned by uid {st.st_uid}")
    if st.st_mode & _OTHERS_WRITE:
        if sticky_ok and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX:
            return None
        who = "world" if st.st_mode & stat.S_IWOTH else "group"
        return Exposure(path, f"{who}-writable (mode {stat.S_IMODE(st.st_mode):o})")
    return None


def check_path(path: Path, *, parents: bool = True, sticky_here: bool = False) -> Exposure | None:
    """The first exposure of `path` or (when `parents`) of a folder above it; None when only
    this user and root can change it. A missing `path` is judged by its nearest existing folder,
    since whoever can write that folder can create it. Folders above `path` may be sticky (like
    /tmp: others cannot rename or delete what this user put there); `path` itself only with
    `sticky_here`, for a folder whose entries are all checked in turn (a cache root: a tmpfs
    mount is 1777), never for one where anybody's new file would be believed."""
    given = Path(os.path.abspath(path))
    chain = [given, *given.parents] if parents else [given]
    real = Path(os.path.realpath(given))
    if real != given:  # a symlink on the way: whoever can change it or its target decides too
        chain += [real, *real.parents] if parents else [real]
    for item in chain:
        try:
            st = os.stat(item)
        except FileNotFoundError:
            continue
        except OSError:
            return Exposure(item, "not readable")
        exposure = exposure_of(item, st, sticky_ok=item not in (given, real) or sticky_here)
        if exposure is not None:
            return exposure
    return None


def check_tree(paths: list[Path]) -> Exposure | None:
    """The first of `paths` (each a folder or file inside a checked root) others can write."""
    for item in paths:
        try:
            st = os.lstat(item)
        except FileNotFoundError:
            continue
        except OSError:
            return Exposure(item, "not readable")
        exposure = exposure_of(item, st)
        if exposure is not None:
            return exposure
    return None
