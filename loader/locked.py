"""Locked kernels: write kernels.lock, install exactly what it says, load from it.

A locked load resolves nothing (the commit is pinned) and never imports bytes whose sha256
differs from the lock. With the variant cached it makes no request at all.

A lock with file digests proves the bytes by itself: a variant whose every file is in the cache
with the sha256 the lock pins is served whichever endpoint downloaded it (`cached_by_lock`), with
no resolution or listing of the current endpoint; but only when the cache's index records that
very tree as that variant of the locked repo and commit, at some endpoint (digests say which
bytes, not whose: another repo's files are never served under the locked name). When the tree
was recorded only at other endpoints, a notice names them. Trust is not in the lock: it is still
decided at the current endpoint, or by the user (`_trust_cached`). A commit-only lock (the
reference's formats) proves nothing about bytes and gets none of this.

A lock pins the named repo's commit, so a kernel-status.toml redirect, which names a branch of
another repo, is never followed by a locked load (`_redirect_rule`).
"""

from __future__ import annotations

import time
from pathlib import Path
from types import ModuleType

from kernels.cache import Cache, FileEntry, Manifest, ManifestError, ResolutionRecord

from . import settings, status
from .api import Installed, _cache, _deps, _ensure_installed, _run, _system, _verify_installed
from .errors import IntegrityError, LockfileError, UntrustedPublisher
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
from .metadata import Metadata
from .notices import notice_once
from .resolve import Resolution, resolve
from .select import check_metadata, check_native, check_python_depends, reject
from .spec import KernelSpec, make_spec
from .trust import TrustArg, ensure_trusted
from .variants import SystemInfo, VariantAccepted, select_variants


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
    redirect = status.lookup(
        cache, repo_id, resolution.commit, network=None if settings.offline() else True
    )
    if redirect is not None:
        raise LockfileError(
            f"{repo_id}@{resolution.commit[:12]} redirects to '{redirect.destination}' "
            f"(revision {redirect.revision}) in its {status.FILENAME}: a lock of it would pin "
            "files its publisher has moved away from",
            hint=f"lock the destination: name '{redirect.destination}' in pyproject.toml "
            "instead, then run `kernels lock`",
        )
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


def _redirect_rule(entry: LockEntry):
    """`on_redirect` for api._run: a lock pins `entry.repo_id`'s commit, and a redirect names a
    branch of another repo, whatever it holds now; so it is never followed. With file digests
    the repo's own locked files are loaded (a notice says it moved); a commit-only lock cannot
    tell which bytes are right, so it is refused (LockfileError)."""

    def on_redirect(repo_id: str, commit: str, redirect) -> bool:
        moved = (
            f"{repo_id}@{commit[:12]} redirects to '{redirect.destination}' (revision "
            f"{redirect.revision}) in its {status.FILENAME}"
        )
        if entry.variants:
            notice_once(
                f"lock-redirect:{repo_id}@{commit}",
                f"kernels: {moved}; kernels.lock pins the files of {repo_id} at that commit, "
                "which are loaded (lock the destination to move)",
            )
            return False
        raise LockfileError(
            f"{moved}; the lock pins a commit of {repo_id}, and following the redirect would "
            f"run whatever {redirect.destination}@{redirect.revision} holds now",
            hint=f"lock the destination: name '{redirect.destination}' in pyproject.toml, then "
            "run `kernels lock`",
        )

    return on_redirect


def _lock_manifest(cache: Cache, files: dict[str, str]) -> Manifest | None:
    """The manifest of a locked variant, its sizes read from the objects the lock's sha256s
    name; None when one of them is not in the store."""
    entries = []
    for path, sha256 in files.items():
        try:
            size = cache.objects.path(sha256).stat().st_size
        except OSError:
            return None
        entries.append(FileEntry(path, sha256, size))
    try:
        return Manifest(tuple(entries))
    except ManifestError:
        return None


def _cached_variant(cache: Cache, entry: LockEntry, variant: str, *, repair: bool):
    """(manifest, tree) of `variant` when its tree is cached, the index records that tree as
    `variant` of the locked repo and commit at some endpoint, and every file matches the sha256
    the lock pins (stamps, a re-hash where one moved); else None (a damaged tree is evicted when
    `repair`). The lock's digests say which bytes; the record says they are this repo's at this
    commit, so a lock cannot lend a repo's name to another repo's files. One record read."""
    assert entry.variants is not None
    manifest = _lock_manifest(cache, entry.variants[variant])
    if manifest is None or not cache.trees.exists(manifest.digest):
        return None
    sources = cache.index.tree_endpoints(entry.repo_id, entry.commit, variant, manifest.digest)
    if not sources:
        return None
    what = f"{entry.repo_id}@{entry.commit[:12]}/{variant}"
    if not _verify_installed(cache, manifest, what, repair=repair):
        return None
    if cache.endpoint not in sources:
        notice_once(
            f"lock-elsewhere:{what}:{manifest.digest}",
            f"kernels: {what}: the files kernels.lock pins were listed by "
            f"{', '.join(sources)}, not by {cache.endpoint} (the current endpoint); they match "
            "the lock's sha256s and are loaded from the cache",
        )
    return manifest, cache.trees.path(manifest.digest)


def cached_by_lock(
    cache: Cache, entry: LockEntry, system: SystemInfo, *, cache_only: bool
) -> Installed | None:
    """The best variant for `system` among those the lock pins, served from the cache whatever
    the endpoint when every file matches the lock's sha256; None when the lock has no digests,
    or (unless `cache_only`) when the preferred variant is not cached, so that the network path
    installs it."""
    if not entry.variants:
        return None
    trace = select_variants(entry.variants, system)
    skipped: list[str] = []
    for item in list(trace):
        if not isinstance(item, VariantAccepted):
            continue
        variant = str(item.variant)
        found = _cached_variant(cache, entry, variant, repair=cache.writable and not cache_only)
        if found is None:
            if not cache_only:
                return None
            skipped.append(variant)
            continue
        manifest, tree = found
        metadata = Metadata.read(tree / "metadata.json")
        reason = check_metadata(metadata, system, check_arch=True) or check_native(tree)
        if reason:
            trace = reject(trace, variant, reason)
            continue
        if skipped:
            notice_once(
                f"lock-variant:{entry.repo_id}@{entry.commit}",
                f"kernels: using cached variant {variant} of {entry.repo_id}@{entry.commit[:12]}; "
                f"the preferred {skipped[0]} is not cached",
            )
        resolution = Resolution(entry.repo_id, entry.commit, entry.commit, "pinned")
        return Installed(resolution, variant, manifest, tree, metadata, trace)
    return None


def _trust_cached(cache: Cache, entry: LockEntry, trust_remote_code: TrustArg, *, offline: bool):
    """Trust for a kernel served by its lock's digests. The lock pins bytes, not whom to trust:
    the decision is the current endpoint's (its record, or asked now when online) or the user's
    (trust_remote_code, the allowlist), never that of the endpoint the bytes came from."""
    try:
        ensure_trusted(cache, entry.repo_id, trust_remote_code, offline=True)
        return
    except UntrustedPublisher as exc:
        if offline:
            raise _untrusted_here(cache, entry, exc) from None
    ensure_trusted(cache, entry.repo_id, trust_remote_code, offline=False)


def _lock_sources(cache: Cache, entry: LockEntry) -> list[str]:
    """The endpoints that listed the trees the lock pins (for messages)."""
    found: set[str] = set()
    for variant, files in (entry.variants or {}).items():
        manifest = _lock_manifest(cache, files)
        if manifest is not None:
            found.update(
                cache.index.tree_endpoints(entry.repo_id, entry.commit, variant, manifest.digest)
            )
    return sorted(found)


def _untrusted_here(cache: Cache, entry: LockEntry, exc: UntrustedPublisher) -> UntrustedPublisher:
    org = entry.repo_id.split("/", 1)[0]
    sources = _lock_sources(cache, entry)
    came = f" (downloaded from {', '.join(sources)})" if sources else ""
    trusted_at = [e for e in cache.records.trusted_at(org) if e != cache.endpoint]
    where = f"set HF_ENDPOINT={trusted_at[0]}, which trusts it, or " if trusted_at else ""
    return UntrustedPublisher(
        f"{exc.message}; the cached files of {entry.repo_id}@{entry.commit[:12]}{came} match "
        "kernels.lock, but a lock pins bytes, not whom to trust",
        hint=f"{where}add '{org}' to KERNELS_TRUSTED_PUBLISHERS (or trusted_publishers in the "
        "kernels config file), or pass trust_remote_code=True (--trust-remote-code)",
    )


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
    cache = _cache()
    offline = settings.offline()
    if not all_variants:
        found = cached_by_lock(cache, entry, _system(backend), cache_only=offline)
        if found is not None:
            _trust_cached(cache, entry, trust_remote_code, offline=offline)
            return [found]
        found = _ensure_installed(
            _spec_for(entry),
            backend=backend,
            trust_remote_code=trust_remote_code,
            progress=progress,
            on_redirect=_redirect_rule(entry),
        )
        _check_against_lock(entry, found)
        return [found]
    out = [_locked_installed(entry, v, *f) for v, f in _cached_variants(cache, entry, offline)]
    if entry.variants and len(out) == len(entry.variants):
        _trust_cached(cache, entry, trust_remote_code, offline=offline)
        return out
    from .fetch import install_variant

    ensure_trusted(cache, entry.repo_id, trust_remote_code, offline=offline)
    redirect = status.lookup(cache, entry.repo_id, entry.commit, network=None if offline else True)
    if redirect is not None:
        _redirect_rule(entry)(entry.repo_id, entry.commit, redirect)
    listing = get_listing(cache, entry.repo_id, entry.commit, offline=offline)
    out = []
    for variant, files in sorted(listing.variants.items()):
        manifest, tree = install_variant(
            cache, entry.repo_id, entry.commit, variant, files, progress=progress
        )
        found = _locked_installed(entry, variant, manifest, tree)
        _check_against_lock(entry, found)
        out.append(found)
    return out


def _cached_variants(cache: Cache, entry: LockEntry, offline: bool):
    """(variant, (manifest, tree)) for every locked variant served by the lock's digests."""
    for variant in sorted(entry.variants or {}):
        found = _cached_variant(cache, entry, variant, repair=cache.writable and not offline)
        if found is not None:
            yield variant, found


def _locked_installed(entry: LockEntry, variant: str, manifest: Manifest, tree: Path) -> Installed:
    return Installed(
        Resolution(entry.repo_id, entry.commit, entry.commit, "pinned"),
        variant,
        manifest,
        tree,
        Metadata.read(tree / "metadata.json"),
        [],
    )


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
    cache = _cache()
    offline = settings.offline()
    found = cached_by_lock(cache, entry, _system(backend), cache_only=offline)
    if found is not None:
        _trust_cached(cache, entry, trust_remote_code, offline=offline)
    else:
        found = _ensure_installed(
            _spec_for(entry),
            backend=backend,
            trust_remote_code=trust_remote_code,
            on_redirect=_redirect_rule(entry),
        )
    return _import_locked(entry, found, backend, trust_remote_code)


def load_kernel(
    repo_id: str, *, lockfile: Path | str | None = None, backend: str | None = None
) -> ModuleType:
    """Load the locked commit of `repo_id` from the cache only (never downloads)."""
    entry = read_lock(find_lockfile(lockfile)).find(repo_id)
    cache, system = _cache(), _system(backend)
    found = cached_by_lock(cache, entry, system, cache_only=True)
    if found is not None:
        _trust_cached(cache, entry, False, offline=True)
    else:
        found = _run(
            cache,
            _spec_for(entry),
            system,
            False,
            network=False,
            offline=True,
            on_redirect=_redirect_rule(entry),
        )
    return _import_locked(entry, found, backend, False)
