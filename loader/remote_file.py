"""What the cache keeps of the Hub's answers: one listed file (`RemoteFile`) and the rule for a
commit id (`is_commit_id`).

A warm load reads both from the cache's records; they live apart from hub.py so that such a load
never imports the module that talks to the Hub. hub.py re-exports them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_COMMIT = re.compile(r"[0-9a-f]{40}")


def is_commit_id(value: object) -> bool:
    """True for a full commit id as the Hub writes it: 40 lowercase hex digits. Every commit a
    server names goes through this before it reaches the cache or a path."""
    return isinstance(value, str) and _COMMIT.fullmatch(value) is not None


@dataclass(frozen=True)
class RemoteFile:
    """One file of a remote listing, with the digests the Hub vouches for."""

    path: str
    size: int
    git_sha1: str | None  # git blob id of the file (or of its LFS pointer)
    lfs_sha256: str | None  # sha256 of the content, for LFS / Xet files

    def to_json(self) -> dict:
        return {"path": self.path, "size": self.size, "git": self.git_sha1, "lfs": self.lfs_sha256}

    @classmethod
    def from_json(cls, data: dict) -> RemoteFile:
        return cls(str(data["path"]), int(data["size"]), data.get("git"), data.get("lfs"))
