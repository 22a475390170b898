"""The public loading functions, with the reference `kernels` signatures.

Each call runs the pipeline spec -> resolve -> fetch -> select -> import. A warm load is served
from the cache alone (zero requests): a fresh resolution record (or a pinned commit, or offline),
the cached listing of that commit, and an installed variant whose files match their stamps. Only
when something is missing does a call take the repo's inter-process lock and talk to the Hub, so
N processes starting together make the requests of one. The same request again in the same
process returns the already imported module without touching the disk.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from kernels.cache import Cache, FileEntry, Manifest
from kernels.cache.fsutil import make_dirs

from . import settings, status
from .errors import (
    HubUnavailable,
    IntegrityError,
    InvalidMetadata,
    KernelNotFound,
    KernelStatusError,
    NoCompatibleVariant,
    OfflineCacheMiss,
    RevisionNotFound,
    UntrustedPublisher,
)
from .fetch import Listing, cache_lock, get_listing, install_variant
from .guard import open_cache
from .importer import LoadedKernel, RepoInfo, get_loaded_kernels, import_tree
from .importer import get_kernel_dep as get_kernel_dep
from .metadata import Metadata
from .notices import notice_once
from .resolve import Resolution, resolve
from .select import (
    check_metadata,
    check_native,
    check_python_depends,
    no_variant_error,
    reject,
)
from .spec import KernelSpec, make_spec
from .trust import (
    TrustArg,
    dependency_trust,
    ensure_trusted,
    redirect_trust,
    untrusted_redirect,
)
from .variants import SystemInfo, VariantAccepted, detect_system, select_variants

__all__ = [
    "get_kernel",
    "get_local_kernel",
    "has_kernel",
    "install_kernel",
    "get_kernel_variants",
    "get_loaded_kernels",
    "get_kernel_dep",
]


class _NeedNetwork(Exception):
    """The cache alone cannot answer; retry with the Hub (under the repo lock)."""


_redirects_warned: set[tuple[str, str]] = set()  # (repo, commit): warn once per process


@dataclass(frozen=True)
class Installed:
    resolution: Resolution
    variant: str
    manifest: Manifest
    tree: Path
    metadata: Metadata
    trace: list


def _check_allowed(metadata: Metadata, backend: str) -> None:
    """The dependency allow-list; imported only for kernels that declare Python dependencies."""
    from .python_deps import check_allowed

    check_allowed(metadata, backend)


@functools.lru_cache(maxsize=8)
def _system(backend: str | None) -> SystemInfo:
    return detect_system(backend)


def _cache() -> Cache:
    return open_cache()


def _local_override(repo_id: str) -> Path | None:
    """local_kernels.override_for, without importing it when LOCAL_KERNELS is unset."""
    if not os.environ.get("LOCAL_KERNELS"):
        return None
    from . import local_kernels

    return local_kernels.override_for(repo_id)


# -- the pipeline --------------------------------------------------------------------------


def _verify_installed(cache: Cache, manifest: Manifest, what: str, *, repair: bool) -> bool:
    """True if the tree matches its manifest. A corrupt tree is evicted (when `repair`)."""
    check = cache.trees.check(manifest)
    if check.ok:
        if check.rehashed:
            cache.trees.refresh_stamps(manifest)
        return True
    notice_once(
        f"corrupt:{manifest.digest}",
        f"kernels: {what}: cached files changed on disk ({', '.join(check.bad[:3])}); "
        + ("fetching clean copies" if repair else "refusing to import them"),
    )
    if repair:
        cache.evict(manifest, check.bad)
    return False


def _run(
    cache: Cache,
    spec: KernelSpec,
    system: SystemInfo | Callable[[], SystemInfo],
    trust_remote_code: TrustArg,
    *,
    network: bool,
    offline: bool,
    check_arch: bool = True,
    validate_deps: bool = False,
    progress=None,
    hops: int = 0,
    on_redirect=None,
) -> Installed:
    """One pass of resolve/fetch/select. Without `network`, raise _NeedNetwork where the cache
    cannot answer (or OfflineCacheMiss when `offline`). A repo whose kernel-status.toml
    redirects is replaced by its destination (`hops` counts the redirects followed), unless
    `on_redirect(repo_id, commit, redirect)` returns False (load the repo's own files) or
    raises (a locked load: locked.py). `system` may be a function, called only once a variant
    is chosen."""
    assert spec.repo_id is not None
    repo_id = spec.repo_id
    ttl = settings.resolve_ttl()
    if not network and not offline and not spec.pinned:
        record = cache.records.get(repo_id, spec.ref)
        if record is None or record.age() >= ttl:
            raise _NeedNetwork
    resolution = resolve(cache, spec, offline=offline or not network, ttl=ttl)
    commit = resolution.commit
    what = f"{repo_id}@{spec.ref if spec.ref == commit else f'{spec.ref} ({commit[:12]})'}"
    if network or offline:
        try:
            ensure_trusted(cache, repo_id, trust_remote_code, offline=offline)
        except UntrustedPublisher:
            # Offline with no decision on record and nothing of this commit installed: the
            # kernel is simply not cached (e.g. a pull was interrupted), which is what to say.
            publisher = repo_id.split("/", 1)[0]
            if not offline or cache.records.get_trust(publisher) is not None:
                raise
            if cache.index.installed_variants(repo_id, commit):
                raise
            from .offline import cache_miss

            detail = "this kernel is not cached"
            if spec.ref != commit:
                detail = f"{commit[:12]}, the commit it names, is not cached"
            raise cache_miss(cache, repo_id, spec.ref, detail, commit=commit) from None
    else:
        try:
            ensure_trusted(cache, repo_id, trust_remote_code, offline=True)
        except Exception:
            raise _NeedNetwork from None
    try:
        redirect = status.lookup(cache, repo_id, commit, network=None if offline else network)
    except status.NeedNetwork:
        raise _NeedNetwork from None
    if (
        redirect is not None
        and on_redirect is not None
        and not on_redirect(repo_id, commit, redirect)
    ):
        redirect = None
    if redirect is not None:
        if hops >= status.MAX_HOPS:
            raise KernelStatusError(f"{what}: more than {status.MAX_HOPS} kernel-status redirects")
        if (repo_id, commit) not in _redirects_warned:
            _redirects_warned.add((repo_id, commit))
            warnings.warn(
                f"'{repo_id}' redirected to '{redirect.destination}'", UserWarning, stacklevel=4
            )
        target = make_spec(redirect.destination, revision=redirect.revision)
        try:
            return _run(
                cache,
                target,
                system,
                # The caller trusted the repo they named, not wherever its status file points.
                redirect_trust(trust_remote_code),
                network=network,
                offline=offline,
                check_arch=check_arch,
                validate_deps=validate_deps,
                progress=progress,
                hops=hops + 1,
            )
        except UntrustedPublisher as exc:
            raise untrusted_redirect(exc, repo_id, redirect.destination) from None
    try:
        listing = get_listing(cache, repo_id, commit, offline=offline or not network)
    except OfflineCacheMiss:
        if offline:
            raise
        raise _NeedNetwork from None
    if callable(system):
        system = system()
    trace = select_variants(listing.variants, system)
    accepted = [e.variant for e in trace if isinstance(e, VariantAccepted)]
    skipped_uncached = []
    for variant in accepted:
        found = cache.installed(repo_id, commit, variant)
        if found is not None and not _verify_installed(
            cache, found[0], f"{what}/{variant}", repair=network and cache.writable
        ):
            if not network:
                if offline:
                    raise IntegrityError(
                        f"{what}/{variant}: cached files do not match their digests",
                        hint=f"run `kernels pull {repo_id}@{spec.ref}` while online to repair",
                    )
                raise _NeedNetwork
            found = None
        if found is None:
            if not network:
                if offline:
                    skipped_uncached.append(variant)
                    continue
                raise _NeedNetwork
            found = _install(
                cache,
                repo_id,
                commit,
                variant,
                listing,
                system,
                check_arch,
                validate_deps,
                progress,
            )
            if isinstance(found, str):
                trace = reject(trace, variant, found)
                continue
        manifest, tree = found
        metadata = Metadata.read(tree / "metadata.json")
        if validate_deps and metadata.python_depends:
            _check_allowed(metadata, system.backend)
        reason = check_metadata(metadata, system, check_arch=check_arch) or check_native(tree)
        if reason:
            # Falling back to a lesser variant is a decision the user should see once.
            notice_once(f"skip:{what}/{variant}", f"kernels: {what}: skipping {variant}: {reason}")
            trace = reject(trace, variant, reason)
            continue
        if skipped_uncached:
            notice_once(
                f"offline-variant:{what}",
                f"kernels: offline: using cached variant {variant} of {what}; the preferred "
                f"{skipped_uncached[0]} is not cached",
            )
        return Installed(resolution, variant, manifest, tree, metadata, trace)
    if skipped_uncached:
        from .offline import cache_miss

        raise cache_miss(
            cache,
            repo_id,
            spec.ref,
            f"no compatible variant is cached (wanted {skipped_uncached[0]})",
            commit=commit,
        )
    raise no_variant_error(what, system, trace)


def _install(
    cache, repo_id, commit, variant, listing: Listing, system, check_arch, validate_deps, progress
):
    """Install one variant; returns (manifest, tree), or a rejection reason string.

    With `validate_deps`, a dependency outside the allow-list raises UnsupportedDependency once
    metadata.json is in, before the rest of the variant is downloaded (as the reference does).
    """
    files = listing.variants[variant]
    if not any(f.path == "metadata.json" for f in files):
        return "no metadata.json in this variant"

    def precheck(data: bytes) -> None:
        metadata = Metadata.from_bytes(
            data, where=f"{repo_id}@{commit[:12]}/{variant}/metadata.json"
        )
        if validate_deps and metadata.python_depends:
            _check_allowed(metadata, system.backend)
        reason = check_metadata(metadata, system, check_arch=check_arch)
        if reason:
            raise _Rejected(reason)

    try:
        return install_variant(
            cache, repo_id, commit, variant, files, precheck=precheck, progress=progress
        )
    except _Rejected as exc:
        return str(exc)


class _Rejected(Exception):
    pass


def _ensure_installed(
    spec: KernelSpec,
    *,
    backend: str | None,
    trust_remote_code: TrustArg,
    check_arch: bool = True,
    validate_deps: bool = False,
    progress=None,
    on_redirect=None,
) -> Installed:
    cache = _cache()
    if backend is not None:
        _system(backend)  # a backend this machine lacks is refused before any request
    # Described where a variant is chosen: an answer before that (no such repo or revision, an
    # untrusted publisher) comes without importing torch, 2 of a CLI command's 3 s on a CPU.
    system = functools.partial(_system, backend)
    offline = settings.offline()
    kwargs = dict(
        check_arch=check_arch,
        validate_deps=validate_deps,
        progress=progress,
        on_redirect=on_redirect,
    )
    try:
        return _run(
            cache, spec, system, trust_remote_code, network=False, offline=offline, **kwargs
        )
    except _NeedNetwork:
        pass
    with cache_lock(cache, f"repo:{spec.repo_id}"):
        # Another process may have done the work while we waited: check the cache again.
        try:
            return _run(
                cache, spec, system, trust_remote_code, network=False, offline=False, **kwargs
            )
        except _NeedNetwork:
            pass
        first_resolution = cache.records.get(spec.repo_id, spec.ref) is None
        try:
            found = _run(
                cache, spec, system, trust_remote_code, network=True, offline=False, **kwargs
            )
            if spec.version is not None and first_resolution and found.resolution.networked:
                # Only when this cache first resolves the version with the Hub: warm loads and
                # TTL re-checks keep their request counts (zero and one).
                from .versions import warn_if_outdated  # cold path only: kept off import

                warn_if_outdated(spec.repo_id, spec.version)
            return found
        except HubUnavailable as exc:
            try:
                found = _run(
                    cache, spec, system, trust_remote_code, network=False, offline=True, **kwargs
                )
            except (OfflineCacheMiss, IntegrityError, UntrustedPublisher):
                # The cache cannot stand in; the failure to report is the Hub's, never a trust
                # decision nobody was able to ask for.
                raise exc from None
            notice_once(
                f"unreachable:{spec.repo_id}",
                f"kernels: the Hub is unreachable ({exc.message}); loading {spec} from the cache",
            )
            return found


def _deps(metadata: Metadata, backend, trust_remote_code) -> dict[str, ModuleType]:
    return {
        dep.repo_id: get_kernel(
            dep.repo_id,
            version=dep.version,
            backend=backend,
            trust_remote_code=dependency_trust(trust_remote_code),
        )
        for dep in metadata.kernel_depends
    }


# -- in-process memo -----------------------------------------------------------------------

_memo_lock = threading.Lock()
_memo: dict[tuple, tuple[LoadedKernel, float]] = {}


def _memo_key(spec: KernelSpec, backend, trust_remote_code, check_arch) -> tuple:
    trust = (
        tuple(trust_remote_code)
        if isinstance(trust_remote_code, (list, tuple))
        else trust_remote_code
    )
    return (
        spec.repo_id,
        spec.ref,
        backend,
        trust,
        check_arch,
        str(settings.cache_root()),
        settings.endpoint(),  # what one server served is not another's answer
    )


def _memo_get(key: tuple, pinned: bool) -> ModuleType | None:
    with _memo_lock:
        hit = _memo.get(key)
    if hit is None:
        return None
    loaded, at = hit
    if pinned or settings.offline() or time.monotonic() - at < settings.resolve_ttl():
        return loaded.module
    return None


# -- public API ----------------------------------------------------------------------------


def get_kernel(
    repo_id: str,
    *,
    revision: str | None = None,
    version: int | None = None,
    backend: str | None = None,
    user_agent: str | dict | None = None,
    trust_remote_code: TrustArg = False,
    check_arch: bool = True,
) -> ModuleType:
    """Load a kernel from the Hub (or the cache) and return its module.

    Exactly one of `version` (the branch 'v<N>') and `revision` (a branch, tag or commit) is
    required. A repo id mapped by LOCAL_KERNELS loads from that folder instead. The kernel's
    Python dependencies must be on the allow-list (checked before the variant is downloaded) and
    installed. Raises the typed errors of kernels.errors.
    """
    spec = make_spec(repo_id, revision=revision, version=version)
    local = _local_override(repo_id)
    if local is not None:
        return get_local_kernel(local, backend=backend)
    key = _memo_key(spec, backend, trust_remote_code, check_arch)
    module = _memo_get(key, spec.pinned)
    if module is not None:
        return module
    found = _ensure_installed(
        spec,
        backend=backend,
        trust_remote_code=trust_remote_code,
        check_arch=check_arch,
        validate_deps=True,
    )
    check_python_depends(found.metadata, backend=_backend(backend))
    loaded = import_tree(
        found.tree,
        found.metadata,
        found.manifest.digest,
        variant=found.variant,
        repo_info=RepoInfo(found.resolution.repo_id, found.resolution.commit),
        deps=_deps(found.metadata, backend, trust_remote_code),
    )
    with _memo_lock:
        _memo[key] = (loaded, time.monotonic())
    return loaded.module


def install_kernel(
    repo_id: str,
    *,
    revision: str | None = None,
    version: int | None = None,
    backend: str | None = None,
    local_files_only: bool = False,
    user_agent: str | dict | None = None,
    trust_remote_code: TrustArg = False,
    validate_dependencies: bool = False,
    progress=None,
) -> Path:
    """Download and verify the variant that fits this machine; return its folder. No import.

    The folder has the reference's layout, `<snapshot>/build/<variant>`, so that
    `path.parent.parent` is a repo root that `get_local_kernel` and `LocalLayerRepository`
    accept: `<cache>/v1/snapshots/<endpoint key>/<org>--<name>/<commit>/build/<variant>` is a
    link to the verified tree in the cache (the tree itself where links cannot be made), checked
    to lead there before it is returned. With
    `validate_dependencies`, the kernel's Python dependencies are checked against the allow-list
    before the variant is downloaded, and for being installed.
    """
    spec = make_spec(repo_id, revision=revision, version=version)
    cache = _cache()
    if local_files_only:
        found = _run(
            cache,
            spec,
            _system(backend),
            trust_remote_code,
            network=False,
            offline=True,
            validate_deps=validate_dependencies,
        )
    else:
        found = _ensure_installed(
            spec,
            backend=backend,
            trust_remote_code=trust_remote_code,
            validate_deps=validate_dependencies,
            progress=progress,
        )
    if validate_dependencies:
        check_python_depends(found.metadata, backend=_backend(backend))
    return snapshot_link(
        cache, found.resolution.repo_id, found.resolution.commit, found.variant, found.tree
    )


def _backend(backend: str | None) -> str:
    return _system(backend).backend


def snapshot_link(cache: Cache, repo_id: str, commit: str, variant: str, tree: Path) -> Path:
    """`<cache>/v1/snapshots/<endpoint key>/<org>--<name>/<commit>/build/<variant>`, a relative
    symlink to the verified `tree`; `tree` itself when the link cannot be made (read-only cache,
    no symlinks).

    Keyed by endpoint like every record: a path handed out at one endpoint never shows another
    endpoint's files for the same commit. Before it is returned, the link must resolve to `tree`
    (the tree this endpoint's record names for that commit and variant) and no folder on its way
    may be writable by another user (UnsafePermissions); else IntegrityError. A pruned tree
    leaves a dangling link that the next install_kernel repoints.
    """
    from kernels.cache.records import endpoint_key

    build = (
        cache.snapshots
        / endpoint_key(cache.endpoint or "")
        / repo_id.replace("/", "--")
        / commit
        / "build"
    )
    link = build / variant
    # Before anything is written there: make_dirs and the link would follow a planted link.
    _refuse_exposed_snapshot(build, "the snapshot folder")
    try:
        target = os.path.relpath(tree, build)
        if not (link.is_symlink() and os.readlink(link) == target):
            make_dirs(build)  # 0755 whatever the umask: the cache's permission check covers it
            staged = build / f".tmp-{variant}-{os.getpid()}-{threading.get_ident()}"
            staged.unlink(missing_ok=True)
            os.symlink(target, staged, target_is_directory=True)
            os.replace(staged, link)  # atomic: a reader sees the old link or the new one
    except (OSError, NotImplementedError, ValueError):
        return tree
    _check_snapshot(link, tree)
    return link


def _refuse_exposed_snapshot(path: Path, what: str) -> None:
    """UnsafePermissions when a user other than this one and root could change `path` or a
    folder on its way (a missing one is judged by the nearest folder that exists)."""
    from kernels.cache.safety import check_path

    from .exposure import unsafe

    exposure = check_path(path)
    if exposure is not None:
        raise unsafe(exposure, f"{what} {path}")


def _check_snapshot(link: Path, tree: Path) -> None:
    """The link, every folder above it and every folder it leads through are writable only by
    this user and root, and it resolves to `tree`: what the caller reads is what was verified."""
    # The link's folders, then (it is a link) its target's.
    _refuse_exposed_snapshot(link, "the snapshot link")
    if os.path.realpath(link) != os.path.realpath(tree):
        raise IntegrityError(
            f"the snapshot link {link} leads to {os.path.realpath(link)}, not to the verified "
            f"tree {tree}",
            hint=f"remove {link.parent.parent} and call install_kernel again",
        )


def install_with_details(
    spec: KernelSpec,
    *,
    backend: str | None = None,
    trust_remote_code: TrustArg = False,
    progress=None,
) -> Installed:
    """install_kernel for the CLI: returns the resolution, variant, manifest and trace too."""
    return _ensure_installed(
        spec, backend=backend, trust_remote_code=trust_remote_code, progress=progress
    )


def has_kernel(
    repo_id: str,
    *,
    revision: str | None = None,
    version: int | None = None,
    backend: str | None = None,
    trust_remote_code: TrustArg = False,
    check_arch: bool = True,
) -> bool:
    """True if the kernel exists and has a variant that can run here (downloads it).

    A repo id mapped by LOCAL_KERNELS is answered from that folder.
    """
    spec = make_spec(repo_id, revision=revision, version=version)
    local = _local_override(repo_id)
    if local is not None:
        try:
            _local_variant(local, _system(backend))
        except (KernelNotFound, NoCompatibleVariant, InvalidMetadata):
            return False
        return True
    try:
        _ensure_installed(
            spec, backend=backend, trust_remote_code=trust_remote_code, check_arch=check_arch
        )
    except (KernelNotFound, RevisionNotFound, NoCompatibleVariant):
        return False
    return True


def get_kernel_variants(
    repo_id: str,
    *,
    revision: str | None = None,
    version: int | None = None,
    backend: str | None = None,
) -> list:
    """The accept/reject trace of every variant of the kernel on this machine (no download)."""
    spec = make_spec(repo_id, revision=revision, version=version)
    cache = _cache()
    offline = settings.offline()
    resolution = resolve(cache, spec, offline=offline, ttl=settings.resolve_ttl())
    listing = get_listing(cache, repo_id, resolution.commit, offline=offline)
    return select_variants(listing.variants, _system(backend))


# -- local kernels -------------------------------------------------------------------------


def _local_variant_dirs(repo_path: Path) -> tuple[dict[str, Path], bool]:
    """Variant folders of a local kernel path: the repo root, its build/, or one variant."""
    if (repo_path / "metadata.json").is_file():
        return {repo_path.name: repo_path}, True
    build = repo_path / "build" if (repo_path / "build").is_dir() else repo_path
    return {p.name: p for p in sorted(build.iterdir()) if p.is_dir()}, False


def _local_manifest(folder: Path) -> Manifest:
    from kernels.cache.fsutil import sha256_file

    entries = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if "__pycache__" in rel.split("/") or rel.endswith(".pyc") or not path.is_file():
            continue
        entries.append(FileEntry(rel, sha256_file(path), path.stat().st_size))
    return Manifest(tuple(entries))


def _local_variant(given: Path | str, system: SystemInfo) -> tuple[Path, Metadata, str]:
    """(folder, metadata, variant name) of the best variant of a local kernel for `system`.
    Its code runs, so the folder is held to the cache's rule: UnsafePermissions when another
    user could write it, a folder above it or a file below it (local_kernels.py)."""
    from .local_kernels import check_imported, checked_folder

    repo_path = checked_folder(given)
    if not repo_path.is_dir():
        raise KernelNotFound(
            f"Could not find kernel in {repo_path}", hint="pass the path of a kernel repo"
        )
    variants, single = _local_variant_dirs(repo_path)
    if single:
        trace = [VariantAccepted(next(iter(variants)), preferred=True)]
    else:
        trace = select_variants(variants, system)
    for entry in trace:
        if not isinstance(entry, VariantAccepted):
            continue
        folder = variants[entry.variant]
        # Before a byte of it is read: a variant may lead into a folder others control (a
        # FIFO there as metadata.json hung the load; its .so files are parsed below).
        check_imported(folder)
        try:
            metadata = Metadata.read(folder / "metadata.json")
        except InvalidMetadata:
            if single:
                raise
            trace = reject(trace, entry.variant, "missing or invalid metadata.json")
            continue
        reason = check_metadata(metadata, system, check_arch=True) or check_native(folder)
        if reason:
            if single:
                raise no_variant_error(str(repo_path), system, reject(trace, entry.variant, reason))
            trace = reject(trace, entry.variant, reason)
            continue
        return folder, metadata, str(entry.variant)
    raise no_variant_error(str(repo_path), system, trace)


def get_local_kernel(
    repo_path: Path | str,
    *,
    backend: str | None = None,
    trust_remote_code: TrustArg = False,
    user_agent: str | dict | None = None,
) -> ModuleType:
    """Import a kernel from a local folder: the repo root, its build/, or one variant folder
    (so also `install_kernel(...).parent.parent`)."""
    system = _system(backend)
    folder, metadata, variant = _local_variant(repo_path, system)
    check_python_depends(metadata, backend=system.backend)
    manifest = _local_manifest(folder)
    loaded = import_tree(
        folder,
        metadata,
        manifest.digest,
        variant=variant,
        deps=_deps(metadata, backend, trust_remote_code),
    )
    return loaded.module
