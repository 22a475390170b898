"""What a variant tree holds: a `Manifest` of `FileEntry`s, and its content digest.

A manifest is the unit of trust: a tree is published only after every file's sha256 matched, and
a load imports only bytes that match it. Paths are relative, '/'-separated, and never escape the
tree (no '..', no absolute paths, no empty or '.' components, no NUL or backslash).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

_HEX64 = set("0123456789abcdef")


class ManifestError(ValueError):
    """A manifest or one of its paths is malformed."""


def check_relpath(path: str) -> str:
    """Return `path` if it is a safe relative path inside a tree, else raise ManifestError."""
    if not isinstance(path, str) or not path or len(path) > 1024:
        raise ManifestError(f"bad path {path!r}")
    if path.startswith("/") or "\\" in path or "\x00" in path or (len(path) > 1 and path[1] == ":"):
        raise ManifestError(f"path {path!r} is absolute or not portable")
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise ManifestError(f"path {path!r} escapes its folder or has empty parts")
    if len(parts) > 32:
        raise ManifestError(f"path {path!r} is nested too deep")
    return path


@dataclass(frozen=True, order=True)
class FileEntry:
    path: str
    sha256: str
    size: int
    mode: int = 0o444

    def __post_init__(self) -> None:
        check_relpath(self.path)
        if len(self.sha256) != 64 or not set(self.sha256) <= _HEX64:
            raise ManifestError(f"{self.path}: bad sha256 {self.sha256!r}")
        if not isinstance(self.size, int) or self.size < 0:
            raise ManifestError(f"{self.path}: bad size {self.size!r}")

    def to_json(self) -> dict:
        return {"path": self.path, "sha256": self.sha256, "size": self.size, "mode": self.mode}


@dataclass(frozen=True)
class Manifest:
    """The files of one variant tree, sorted by path; `digest` names the tree."""

    files: tuple[FileEntry, ...]

    def __post_init__(self) -> None:
        ordered = tuple(sorted(self.files))
        object.__setattr__(self, "files", ordered)
        seen: set[str] = set()
        dirs: set[str] = set()
        for entry in ordered:
            if entry.path in seen or entry.path in dirs:
                raise ManifestError(f"duplicate or clashing path {entry.path!r}")
            seen.add(entry.path)
            parts = entry.path.split("/")
            dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
        if seen & dirs:
            raise ManifestError(f"a path is both a file and a folder: {sorted(seen & dirs)[0]!r}")

    @property
    def digest(self) -> str:
        """sha256 over the canonical (path, sha256, size) lines: equal content, equal digest."""
        h = hashlib.sha256(b"kernels-tree-v1\n")
        for entry in self.files:
            h.update(f"{entry.path}\x00{entry.sha256}\x00{entry.size}\n".encode())
        return h.hexdigest()

    @property
    def total_size(self) -> int:
        return sum(entry.size for entry in self.files)

    def to_json(self) -> dict:
        return {"format": 1, "digest": self.digest, "files": [e.to_json() for e in self.files]}

    @classmethod
    def from_json(cls, data: object) -> Manifest:
        if not isinstance(data, dict) or data.get("format") != 1:
            raise ManifestError("not a version 1 manifest")
        try:
            files = tuple(
                FileEntry(f["path"], f["sha256"], int(f["size"]), int(f.get("mode", 0o444)))
                for f in data["files"]
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"bad manifest entry: {exc}") from None
        manifest = cls(files)
        if data.get("digest") not in (None, manifest.digest):
            raise ManifestError("manifest digest does not match its entries")
        return manifest

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), indent=1).encode("utf-8")
