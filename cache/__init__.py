"""kernels.cache: the content-addressed store behind the loader.

It knows nothing of the Hub or of torch: it stores objects by sha256, manifests, materialised
variant trees, resolution and trust records, and takes file locks. The on-disk format is
versioned (the `v1/` bucket) and documented in docs/cache.md.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from .fsutil import atomic_write_bytes, is_writable_dir
from .manifest import FileEntry, Manifest, ManifestError, check_relpath
from .objects import DigestMismatch, ObjectStore, ObjectWriter
from .records import RecordStore, RepoIndex, ResolutionRecord, TrustRecord
from .staging import Staging
from .trees import TreeCheck, TreeStore

FORMAT_VERSION = 1

__all__ = [
    "FORMAT_VERSION",
    "Cache",
    "DigestMismatch",
    "FileEntry",
    "Manifest",
    "ManifestError",
    "ObjectWriter",
    "PruneReport",
    "ResolutionRecord",
    "TreeCheck",
    "TrustRecord",
    "Usage",
    "check_relpath",
]

_CACHEDIR_TAG = (
    b"Signature: 8a477f597d28d172789f06886806bc55\n"
    b"# This folder is the cache of the `kernels` package; see its docs/cache.md.\n"
)


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


class Cache:
    """One cache root. Cheap to construct; folders are created on first write."""

    def __init__(self, root: Path | str):
        self.root = Path(root)
        self.base = self.root / f"v{FORMAT_VERSION}"
        self.staging = Staging(self.base / "tmp")
        self.objects = ObjectStore(self.base / "objects", self.staging)
        self.trees = TreeStore(
            self.base / "trees", self.base / "stamps", self.staging, self.objects
        )
        self.records = RecordStore(self.base / "refs", self.base / "trust")
        self.index = RepoIndex(self.base / "index", self.base / "manifests")
        self.tmp = self.staging.root
        self.locks = self.base / "locks"

    # -- setup -----------------------------------------------------------------------------
    def ensure(self) -> None:
        """Create the layout (idempotent). Raises OSError when the root cannot be written."""
        self.base.mkdir(parents=True, exist_ok=True)
        tag = self.root / "CACHEDIR.TAG"
        if not tag.exists():
            atomic_write_bytes(tag, _CACHEDIR_TAG)
        marker = self.base / "FORMAT"
        if not marker.exists():
            atomic_write_bytes(marker, f"{FORMAT_VERSION}\n".encode())

    @property
    def writable(self) -> bool:
        return is_writable_dir(self.base) if self.base.exists() else is_writable_dir(self.root)

    def lock(self, name: str, timeout: float = -1):
        """An inter-process lock (flock: the OS frees it when its holder dies)."""
        from filelock import FileLock

        from .fsutil import safe_key

        self.locks.mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.locks / f"{safe_key(name)}.lock"), timeout=timeout)

    # -- variants ----------------------------------------------------------------------------
    def installed(self, repo: str, commit: str, variant: str) -> tuple[Manifest, Path] | None:
        """The manifest and tree folder of an installed variant, or None. Does not verify."""
        manifest = self.index.get_variant(repo, commit, variant)
        if manifest is None or not self.trees.exists(manifest.digest):
            return None
        return manifest, self.trees.path(manifest.digest)

    def install(self, repo: str, commit: str, variant: str, manifest: Manifest) -> Path:
        """Publish a variant whose objects are all present and verified; returns its tree."""
        missing = [e.path for e in manifest.files if not self.objects.has(e.sha256, e.size)]
        if missing:
            raise FileNotFoundError(f"objects missing for {', '.join(missing[:3])}")
        self.index.put_manifest(manifest)
        tree = self.trees.publish(manifest)
        self.index.put_variant(repo, commit, variant, manifest)
        return tree

    def evict(self, manifest: Manifest, bad_paths: tuple[str, ...]) -> None:
        """Forget a tree found corrupt, and the objects behind its bad files."""
        self.trees.remove(manifest.digest)
        by_path = {e.path: e for e in manifest.files}
        for path in bad_paths:
            entry = by_path.get(path)
            if entry is not None and not self.objects.verify(entry.sha256):
                self.objects.remove(entry.sha256)

    # -- maintenance -------------------------------------------------------------------------
    def clean_tmp(self, older_than: float = 3600.0) -> int:
        """Remove what crashed processes left in tmp/: a dead process's folder at once (its
        flock is gone), loose entries once older than `older_than` seconds. Returns the count."""
        return self.staging.clean(older_than)

    def usage(self) -> Usage:
        usage = Usage()
        for digest in self.objects.iter_digests():
            usage.objects += 1
            with contextlib.suppress(OSError):
                usage.object_bytes += self.objects.path(digest).stat().st_size
        usage.trees = sum(1 for _ in self.trees.iter_digests())
        repos = set()
        for repo, _commit, _variant, _tree in self.index.entries():
            usage.variants += 1
            repos.add(repo)
        usage.repos = len(repos)
        return usage

    def prune(self, *, keep_trees: set[str] = frozenset(), dry_run: bool = False) -> PruneReport:
        """Drop trees no index entry references (plus `keep_trees`), then unreferenced objects."""
        report = PruneReport(dry_run=dry_run)
        live_trees = {tree for *_rest, tree in self.index.entries()} | set(keep_trees)
        for digest in list(self.trees.iter_digests()):
            if digest not in live_trees:
                report.trees.append(digest)
                if not dry_run:
                    self.trees.remove(digest)
        live_objects: set[str] = set()
        for digest in live_trees:
            manifest = self.index.get_manifest(digest)
            if manifest is not None:
                live_objects.update(e.sha256 for e in manifest.files)
        for digest in list(self.objects.iter_digests()):
            if digest not in live_objects:
                path = self.objects.path(digest)
                with contextlib.suppress(OSError):
                    report.bytes += path.stat().st_size
                report.objects.append(digest)
                if not dry_run:
                    self.objects.remove(digest)
        return report

    def verify_all(self, *, full: bool = True) -> list[tuple[str, str, str, TreeCheck]]:
        """Check every installed variant; returns (repo, commit, variant, check) for each."""
        out = []
        for repo, commit, variant, digest in self.index.entries():
            manifest = self.index.get_manifest(digest)
            if manifest is None:
                out.append((repo, commit, variant, TreeCheck(ok=False, bad=("<manifest>",))))
                continue
            if not self.trees.exists(digest):
                out.append((repo, commit, variant, TreeCheck(ok=False, bad=("<tree missing>",))))
                continue
            out.append((repo, commit, variant, self.trees.check(manifest, full=full)))
        return out
