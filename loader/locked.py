"""Locked kernels: write kernels.lock, install exactly what it says, load from it.

A locked load resolves nothing (the commit is pinned) and never imports bytes whose sha256
differs from the lock. With the variant cached it makes no request at all.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import ModuleType

from kernels.cache import ResolutionRecord

from . import settings
from .api import Installed, _cache, _deps, _ensure_installed, _run, _system
from .errors import IntegrityError, LockfileError
from .fetch import fetch_object, get_listing
from .importer import RepoInfo, import_tree
from .lockfile import (
    LOCK_NAME,
    LockEntry,
    Lockfile,
    Requested,
    find_lockfile,
    read_dependencies,
    read_lock,
)
from .resolve import resolve
from .select import check_python_depends
from .spec import KernelSpec, make_spec
from .trust import TrustArg, ensure_trusted


def lock_entry(
    repo_id: str, requested: Requested, *, trust_remote_code: TrustArg = False, progress=None
) -> LockEntry:
    """Resolve `requested` now and record the sha256 of every file of every variant.

    LFS files are known by sha256 from the listing; small (git) files are fetched into the store
    once to hash them, which also makes a later `kernels sync` of this machine free.
    """
    cache = _cache()
    spec = make_spec(repo_id, version=requested.version, revision=requested.revision)
    resolution = resolve(
        cache,
        spec,
        offline=settings.offline(),
        ttl=0.0 if not settings.offline() else settings.resolve_ttl(),
    )
    ensure_trusted(cache, repo_id, trust_remote_code, offline=settings.offline())
    listing = get_listing(cache, repo_id, resolution.commit, offline=settings.offline())
    if not listing.variants:
        raise LockfileError(f"{repo_id}@{resolution.commit[:12]} has no build variants to lock")
    variants = {}
    for variant, files in listing.variants.items():
        variants[variant] = {
            f.path: f.lfs_sha256
            or fetch_object(cache, repo_id, resolution.commit, variant, f, progress)
            for f in files
        }
    return LockEntry(repo_id, requested, resolution.commit, variants)


def lock_project(
    project_dir: Path, *, trust_remote_code: TrustArg = False, progress=None
) -> tuple[Lockfile, Path]:
    """Read pyproject.toml's [tool.kernels.dependencies] and write PROJECT/kernels.lock."""
    from .lockfile import write_lock

    deps = read_dependencies(project_dir / "pyproject.toml")
    lock = Lockfile(
        [
            lock_entry(r, q, trust_remote_code=trust_remote_code, progress=progress)
            for r, q in sorted(deps.items())
        ]
    )
    path = project_dir / LOCK_NAME
    write_lock(lock, path)
    lock.path = path
    return lock, path


def _check_against_lock(entry: LockEntry, found: Installed) -> None:
    if not entry.variants:
        return  # a reference-format lock pins the commit only
    expected = entry.variants.get(found.variant)
    if expected is None:
        raise IntegrityError(
            f"{entry.repo_id}@{entry.commit[:12]}: variant {found.variant} is not in the lock",
            hint="run `kernels lock` again to record every variant",
        )
    actual = {e.path: e.sha256 for e in found.manifest.files}
    if actual != expected:
        changed = sorted(set(actual.items()) ^ set(expected.items()))
        raise IntegrityError(
            f"{entry.repo_id}@{entry.commit[:12]}/{found.variant}: files differ from the lock "
            f"({', '.join(sorted({p for p, _ in changed})[:3])})",
            hint="the bytes are not the ones that were locked; run `kernels verify` and `kernels lock`",
        )


def _spec_for(entry: LockEntry) -> KernelSpec:
    return make_spec(entry.repo_id, revision=entry.commit)


def _record_lock_resolution(entry: LockEntry) -> None:
    """After a sync, `version=N` (or the locked revision) resolves to the locked commit - the lock
    says so - until the record's TTL runs out, so plain get_kernel calls need no request either."""
    ref = make_spec(
        entry.repo_id, version=entry.requested.version, revision=entry.requested.revision
    ).ref
    if ref is None or ref == entry.commit:
        return
    try:
        _cache().records.put(ResolutionRecord(entry.repo_id, ref, entry.commit, time.time()))
    except OSError:
        pass  # a read-only cache: locked loads still work


def install_locked(
    entry: LockEntry,
    *,
    backend: str | None = None,
    trust_remote_code: TrustArg = False,
    all_variants: bool = False,
    progress=None,
) -> list[Installed]:
    """Install the entry's variant for this machine (or every locked variant) and verify it."""
    installed = _install_locked(entry, backend, trust_remote_code, all_variants, progress)
    _record_lock_resolution(entry)
    return installed


def _install_locked(entry: LockEntry, backend, trust_remote_code, all_variants, progress):
    if not all_variants:
        found = _ensure_installed(
            _spec_for(entry),
            backend=backend,
            trust_remote_code=trust_remote_code,
            progress=progress,
        )
        _check_against_lock(entry, found)
        return [found]
    from .fetch import install_variant

    cache = _cache()
    ensure_trusted(cache, entry.repo_id, trust_remote_code, offline=settings.offline())
    listing = get_listing(cache, entry.repo_id, entry.commit, offline=settings.offline())
    out = []
    for variant, files in sorted(listing.variants.items()):
        manifest, tree = install_variant(
            cache, entry.repo_id, entry.commit, variant, files, progress=progress
        )
        from .metadata import Metadata
        from .resolve import Resolution

        found = Installed(
            Resolution(entry.repo_id, entry.commit, entry.commit, "pinned"),
            variant,
            manifest,
            tree,
            Metadata.read(tree / "metadata.json"),
            [],
        )
        _check_against_lock(entry, found)
        out.append(found)
    return out


def _import_locked(entry: LockEntry, found: Installed, backend, trust_remote_code) -> ModuleType:
    _check_against_lock(entry, found)
    check_python_depends(found.metadata)
    return import_tree(
        found.tree,
        found.metadata,
        found.manifest.digest,
        variant=found.variant,
        repo_info=RepoInfo(entry.repo_id, entry.commit),
        deps=_deps(found.metadata, backend, trust_remote_code),
    ).module


def get_locked_kernel(
    repo_id: str,
    *,
    lockfile: Path | str | None = None,
    trust_remote_code: TrustArg = False,
    user_agent: str | dict | None = None,
    backend: str | None = None,
) -> ModuleType:
    """Load the locked commit of `repo_id`, downloading it if needed; bytes must match the lock."""
    entry = read_lock(find_lockfile(lockfile)).find(repo_id)
    found = _ensure_installed(
        _spec_for(entry), backend=backend, trust_remote_code=trust_remote_code
    )
    return _import_locked(entry, found, backend, trust_remote_code)


def load_kernel(
    repo_id: str, *, lockfile: Path | str | None = None, backend: str | None = None
) -> ModuleType:
    """Load the locked commit of `repo_id` from the cache only (never downloads)."""
    entry = read_lock(find_lockfile(lockfile)).find(repo_id)
    found = _run(_cache(), _spec_for(entry), _system(backend), False, network=False, offline=True)
    return _import_locked(entry, found, backend, False)
