"""kernels.cache: the content-addressed store behind the loader.

It knows nothing of the Hub or of torch: it stores objects by sha256, manifests, materialised
variant trees, resolution and trust records, and takes file locks. The on-disk format is
versioned (the `v1/` bucket) and documented in docs/cache.md.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from .fsutil import atomic_write_bytes, is_writable_dir, make_dirs
from .manifest import FileEntry, Manifest, ManifestError, check_relpath
from .objects import DigestMismatch, ObjectStore, ObjectWriter
from .records import (
    RecordStore,
    RepoIndex,
    ResolutionRecord,
    TrustRecord,
    VerdictRecord,
    VerdictStore,
)
from .safety import Exposure, check_path, check_tree
from .staging import Staging
from .trees import TreeCheck, TreeStore

if TYPE_CHECKING:
    from .locks import FileLock
    from .reports import PruneReport, Usage

FORMAT_VERSION = 1


def __getattr__(name: str):
    # Locks are imported where one is taken: a warm load takes none.
    if name in ("FileLock", "LockTimeout"):
        from . import locks

        return getattr(locks, name)
    # The maintenance reports, where `du` or `prune` makes one.
    if name in ("PruneReport", "Usage"):
        from . import reports

        return getattr(reports, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FORMAT_VERSION",
    "Cache",
    "DigestMismatch",
    "Exposure",
    "FileEntry",
    "FileLock",
    "LockTimeout",
    "Manifest",
    "ManifestError",
    "ObjectWriter",
    "PruneReport",
    "ResolutionRecord",
    "TreeCheck",
    "TrustRecord",
    "Usage",
    "VerdictRecord",
    "check_relpath",
]

_CACHEDIR_TAG = (
    b"Signature: 8a477f597d28d172789f06886806bc55\n"
    b"# This folder is the cache of the `kernels` package; see its docs/cache.md.\n"
)


# Bucket folders whose writers decide what a load imports or trusts (see `exposure`).
# `kernel-status` decides which repo a load goes on to; `snapshots` which tree a caller of
# install_kernel is shown; `signatures` whether a signature policy lets a tree be imported.
_GUARDED = (
    "objects",
    "aliases",
    "trees",
    "stamps",
    "manifests",
    "index",
    "refs",
    "trust",
    "locks",
    "kernel-status",
    "snapshots",
    "signatures",
)


class Cache:
    """One cache root. Cheap to construct; folders are created on first write.

    `endpoint` scopes resolution, trust and variant records to one server (see records.py);
    None reads them all (tools). `lock_timeout` bounds every lock wait (None: no bound) and
    `on_lock_wait(holder)` hears once about a wait that lasts."""

    def __init__(
        self,
        root: Path | str,
        *,
        endpoint: str | None = None,
        lock_timeout: float | None = None,
        on_lock_wait=None,
    ):
        self.root = Path(root)
        self.endpoint = endpoint
        self.lock_timeout = lock_timeout
        self.on_lock_wait = on_lock_wait
        self.base = self.root / f"v{FORMAT_VERSION}"
        self.staging = Staging(self.base / "tmp")
        self.objects = ObjectStore(self.base / "objects", self.staging)
        self.trees = TreeStore(
            self.base / "trees", self.base / "stamps", self.staging, self.objects
        )
        self.records = RecordStore(self.base / "refs", self.base / "trust", endpoint)
        self.index = RepoIndex(self.base / "index", self.base / "manifests", endpoint)
        # Maintenance sees every endpoint's variants: one endpoint's prune keeps the others'.
        self.all_index = RepoIndex(self.base / "index", self.base / "manifests")
        self.tmp = self.staging.root
        self.locks = self.base / "locks"
        # Written by the loader (opaque to this package), through make_dirs and atomic writes,
        # and covered by `exposure` like every other bucket.
        self.status = self.base / "kernel-status"
        self.snapshots = self.base / "snapshots"
        self.signatures = VerdictStore(self.base / "signatures", endpoint)

    # -- setup -----------------------------------------------------------------------------
    def ensure(self) -> None:
        """Create the layout (idempotent). Raises OSError when the root cannot be written."""
        make_dirs(self.base)
        tag = self.root / "CACHEDIR.TAG"
        if not tag.exists():
            atomic_write_bytes(tag, _CACHEDIR_TAG)
        marker = self.base / "FORMAT"
        if not marker.exists():
            atomic_write_bytes(marker, f"{FORMAT_VERSION}\n".encode())

    @property
    def writable(self) -> bool:
        return is_writable_dir(self.base) if self.base.exists() else is_writable_dir(self.root)

    def exposure(self) -> Exposure | None:
        """Who else could write this cache: the first folder (from `/` down to the root, then
        the root and its buckets) that a user other than this one and root may write, or None.
        A cache with an exposure proves nothing by its stamps, records or index (safety.py)."""
        found = check_path(self.root, sticky_here=True)  # the entries below are checked
        if found is None:
            base = str(self.base)
            found = check_tree([base, *(os.path.join(base, b) for b in _GUARDED)])
        return found

    def lock(self, name: str, timeout: float | None = None) -> FileLock:
        """The inter-process write lock `name` (flock: the OS frees it when its holder dies).
        It holds the `gc` lock shared, so `prune` cannot run under it; its wait ends at
        `timeout` (default: the cache's lock_timeout) with LockTimeout naming the holder."""
        from .fsutil import safe_key
        from .locks import FileLock

        return FileLock(
            self.locks / f"{safe_key(name)}.lock",
            timeout=self.lock_timeout if timeout is None else timeout,
            on_wait=self.on_lock_wait,
            gc=FileLock(self.locks / "gc.lock", shared=True),
        )

    def gc_lock(self) -> FileLock:
        """The lock `prune` holds: exclusive, so it waits for every write lock to be released."""
        from .locks import FileLock

        return FileLock(
            self.locks / "gc.lock", timeout=self.lock_timeout, on_wait=self.on_lock_wait
        )

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
        from .reports import Usage

        usage = Usage()
        for digest in self.objects.iter_digests():
            usage.objects += 1
            with contextlib.suppress(OSError):
                usage.object_bytes += self.objects.path(digest).stat().st_size
        usage.trees = sum(1 for _ in self.trees.iter_digests())
        repos = set()
        for repo, _commit, _variant, _tree in self.all_index.entries():
            usage.variants += 1
            repos.add(repo)
        usage.repos = len(repos)
        return usage

    def prune(self, *, keep_trees: set[str] = frozenset(), dry_run: bool = False) -> PruneReport:
        """Drop trees no index entry references (plus `keep_trees`), then unreferenced objects.

        Runs under the exclusive `gc` lock: a load between downloading objects and indexing
        its variant holds a write lock (and so `gc` shared), and prune waits for it."""
        if dry_run:
            return self._prune(keep_trees, dry_run)
        with self.gc_lock():
            return self._prune(keep_trees, dry_run)

    def _prune(self, keep_trees: set[str], dry_run: bool) -> PruneReport:
        from .reports import PruneReport

        report = PruneReport(dry_run=dry_run)
        live_trees = {tree for *_rest, tree in self.all_index.entries()} | set(keep_trees)
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
        for repo, commit, variant, digest in self.all_index.entries():
            manifest = self.index.get_manifest(digest)
            if manifest is None:
                out.append((repo, commit, variant, TreeCheck(ok=False, bad=("<manifest>",))))
                continue
            if not self.trees.exists(digest):
                out.append((repo, commit, variant, TreeCheck(ok=False, bad=("<tree missing>",))))
                continue
            out.append((repo, commit, variant, self.trees.check(manifest, full=full)))
        return out
