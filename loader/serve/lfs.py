"""git-lfs pointer files: parse them, write them, and find their objects in a git dir.

A pointer is the small text blob git-lfs commits in place of a large file; the bytes live in
`<gitdir>/lfs/objects/<aa>/<bb>/<sha256>` (where `git lfs fetch --all` and `git lfs push` put them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

POINTER_VERSION = "https://git-lfs.github.com/spec/v1"
# git-lfs refuses to treat anything this large or larger as a pointer.
MAX_POINTER_SIZE = 1024
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class LfsPointer:
    """What a pointer blob says: the object's sha256, its size, and the pointer's own size."""

    oid: str
    size: int
    pointer_size: int


def parse_pointer(data: bytes) -> LfsPointer | None:
    """The pointer `data` encodes, or None when `data` is an ordinary file."""
    if len(data) >= MAX_POINTER_SIZE or not data.startswith(b"version "):
        return None
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        return None
    lines = text.split("\n")
    if lines[-1] != "" or lines[0] != f"version {POINTER_VERSION}":
        return None
    fields = {}
    for line in lines[1:-1]:
        key, sep, value = line.partition(" ")
        if not sep or not key:
            return None
        fields[key] = value
    oid = fields.get("oid", "")
    size = fields.get("size", "")
    if not oid.startswith("sha256:") or not _SHA256.fullmatch(oid[7:]) or not size.isdigit():
        return None
    return LfsPointer(oid=oid[7:], size=int(size), pointer_size=len(data))


def format_pointer(oid: str, size: int) -> bytes:
    """The canonical pointer text for an object with sha256 `oid` and `size` bytes."""
    return f"version {POINTER_VERSION}\noid sha256:{oid}\nsize {size}\n".encode("ascii")


def object_path(gitdir: Path, oid: str) -> Path:
    """Where git-lfs keeps the object `oid` inside `gitdir`."""
    return gitdir / "lfs" / "objects" / oid[0:2] / oid[2:4] / oid


def is_sha256(text: str) -> bool:
    """True for a lowercase 64-hex sha256 digest."""
    return bool(_SHA256.fullmatch(text))
