"""What the maintenance operations report: `Usage` (du) and `PruneReport` (prune).

A module of their own so that opening a cache, which every load does, creates no dataclass it
does not use. kernels.cache re-exports both.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Usage:
    objects: int = 0
    object_bytes: int = 0
    trees: int = 0
    variants: int = 0
    repos: int = 0


@dataclass
class PruneReport:
    trees: list[str] = field(default_factory=list)
    objects: list[str] = field(default_factory=list)
    bytes: int = 0
    dry_run: bool = False
