"""Stage 3: list a commit's build variants and install one variant into the cache.

The listing of a commit is immutable, so it is fetched once and kept. Installing a variant
downloads only the files whose bytes the store lacks, checks each against the digest the Hub
vouches for (the LFS sha256, else the git blob sha1 of the bytes received), stores objects by
sha256 and publishes the variant tree atomically, under one lock per variant: N processes on a
host fetch each file once while the others wait.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kernels.cache import Cache, DigestMismatch, FileEntry, Manifest, ManifestError, check_relpath

from .errors import (
    CacheError,
    IntegrityError,
    InvalidSpec,
    KernelsError,
    LockWaitTimeout,
)
from .metadata import MAX_METADATA_BYTES
from .remote_file import RemoteFile, is_commit_id
from .spec import validate_repo_id

MAX_FILE_SIZE = 16 << 30
MAX_FILES_PER_VARIANT = 10_000
_HEX64 = re.compile(r"^[0-9a-f]{64}\Z")
_VARIANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}\Z")


def valid_install_key(repo_id: str, commit: str, variant: str) -> bool:
    """True when a cache entry's (repo, commit, variant) is one this client could have installed:
    a Hub repo id, a 40-lowercase-hex commit and a variant folder name. Anything else (a record
    written by a client that trusted a server's commit id) must not become a path or a line of
    output."""
    try:
        validate_repo_id(repo_id)
    except InvalidSpec:
        return False
    return is_commit_id(commit) and bool(_VARIANT.match(variant))


@dataclass(frozen=True)
class Listing:
    """The build/ tree of one commit: variant name -> files (paths relative to the variant)."""

    variants: dict[str, tuple[RemoteFile, ...]]

    def to_json(self) -> dict:
        return {
            "format": 1,
            "variants": {v: [f.to_json() for f in files] for v, files in self.variants.items()},
        }

    @classmethod
    def from_json(cls, data: dict) -> Listing:
        return cls(
            {v: tuple(RemoteFile.from_json(f) for f in fs) for v, fs in data["variants"].items()}
        )


def _validate_listing(repo_id: str, commit: str, files: list[RemoteFile]) -> Listing:
    """Group files by variant; refuse any entry that could escape its folder or lie about itself."""
    variants: dict[str, list[RemoteFile]] = {}

    def bad(why: str) -> IntegrityError:
        return IntegrityError(
            f"{repo_id}@{commit[:12]}: the server's listing is unsafe: {why}",
            hint="refusing to use this listing; report it to the mirror or repo owner",
        )

    for f in files:
        try:
            check_relpath(f.path)
        except ManifestError as exc:
            raise bad(str(exc)) from None
        parts = f.path.split("/")
        if len(parts) < 3 or parts[0] != "build":
            continue  # only build/<variant>/<file> is ever installed
        variant, rel = parts[1], "/".join(parts[2:])
        if not _VARIANT.match(variant):
            raise bad(f"variant folder name {variant!r}")
        if any(p.startswith("__pycache__") or p.endswith(".pyc") for p in parts):
            continue  # bytecode is never installed
        if not isinstance(f.size, int) or f.size < 0 or f.size > MAX_FILE_SIZE:
            raise bad(f"{f.path} has size {f.size!r}")
        if rel == "metadata.json" and f.size > MAX_METADATA_BYTES:
            # Refused from the listing's word, before a byte of it is downloaded or read.
            raise bad(f"{f.path} is {f.size} bytes; metadata is at most {MAX_METADATA_BYTES}")
        if f.lfs_sha256 is not None and not _HEX64.match(f.lfs_sha256):
            raise bad(f"{f.path} has a malformed sha256")
        if f.lfs_sha256 is None and not is_commit_id(f.git_sha1):
            raise bad(f"{f.path} has no usable digest")
        variants.setdefault(variant, []).append(RemoteFile(rel, f.size, f.git_sha1, f.lfs_sha256))
    for variant, entries in variants.items():
        if len(entries) > MAX_FILES_PER_VARIANT:
            raise bad(f"{variant} lists {len(entries)} files")
        try:  # duplicate or clashing paths (a file that is also a folder)
            Manifest(tuple(FileEntry(e.path, "0" * 64, 0) for e in entries))
        except ManifestError as exc:
            raise bad(f"{variant}: {exc}") from None
    return Listing({v: tuple(sorted(fs, key=lambda f: f.path)) for v, fs in variants.items()})


def get_listing(cache: Cache, repo_id: str, commit: str, *, offline: bool) -> Listing:
    """The commit's variants: from the cache (no request) or from the Hub (one request)."""
    if not is_commit_id(commit):
        raise IntegrityError(
            f"{repo_id}: refusing the malformed commit id {commit!r:.60}",
            hint="pin a 40-hex commit, or check HF_ENDPOINT points at a Hub you trust",
        )
    cached = cache.index.get_listing(repo_id, commit)
    if cached is not None:
        try:
            return Listing.from_json(cached)
        except (KeyError, TypeError, ValueError):
            pass  # unreadable record: fetch again
    if offline:
        from .offline import cache_miss  # an error path: kept off the warm load

        raise cache_miss(
            cache, repo_id, commit, "the variants of this commit are not cached", commit=commit
        )
    from . import hub  # only here and in fetch_object: a warm load never imports it

    listing = _validate_listing(repo_id, commit, hub.list_build_files(repo_id, commit))
    try:
        cache.ensure()
        cache.index.put_listing(repo_id, commit, listing.to_json())
    except OSError:
        pass
    return listing


def _git_blob_sha1(size: int) -> hashlib._Hash:
    h = hashlib.sha1()
    h.update(f"blob {size}\0".encode())
    return h


def _known_sha256(cache: Cache, f: RemoteFile) -> str | None:
    """The object for this remote file if the store already holds its bytes."""
    if f.lfs_sha256 is not None:
        return f.lfs_sha256 if cache.objects.has(f.lfs_sha256, f.size) else None
    assert f.git_sha1 is not None
    return cache.objects.alias_get("git-sha1", f.git_sha1)


def fetch_object(
    cache: Cache, repo_id: str, commit: str, variant: str, f: RemoteFile, progress=None
) -> str:
    """Download one file into the object store, verified; returns its sha256."""
    known = _known_sha256(cache, f)
    if known is not None:
        return known
    state: dict = {}

    # Local disk errors become CacheError where they happen: a KernelsError is never retried
    # as if it were the network, and a network error is never reported as the disk's.
    def open_sink() -> tuple[Callable[[bytes], None], Callable[[], None]]:
        with _disk_errors(cache):
            writer = cache.objects.writer()
        git = _git_blob_sha1(f.size)
        state["writer"], state["git"] = writer, git

        def write(chunk: bytes) -> None:
            if writer.size + len(chunk) > f.size:
                raise IntegrityError(
                    f"{repo_id}@{commit[:12]}: build/{variant}/{f.path} is larger than the "
                    f"{f.size} bytes the listing promised"
                )
            with _disk_errors(cache):
                writer.write(chunk)
            git.update(chunk)

        return write, writer.abort

    from . import hub

    path = f"build/{variant}/{f.path}"
    hub.download_to(repo_id, commit, path, open_sink, size=f.size, on_progress=progress)
    writer, git = state["writer"], state["git"]
    where = f"{repo_id}@{commit[:12]}:{path}"
    if writer.size != f.size:
        writer.abort()
        raise IntegrityError(f"{where}: received {writer.size} bytes, expected {f.size}")
    try:
        with _disk_errors(cache):
            if f.lfs_sha256 is not None:
                return writer.commit(f.lfs_sha256)
            if git.hexdigest() != f.git_sha1:
                writer.abort()
                raise IntegrityError(
                    f"{where}: git blob id {git.hexdigest()} does not match the listing's "
                    f"{f.git_sha1}"
                )
            sha256 = writer.commit()
            cache.objects.alias_put("git-sha1", f.git_sha1, sha256)
    except DigestMismatch as exc:
        raise IntegrityError(f"{where}: {exc}") from None
    finally:
        writer.abort()  # no-op after a commit; otherwise the temp file goes
    return sha256


@contextlib.contextmanager
def cache_lock(cache: Cache, name: str):
    """Hold the cache's inter-process lock `name`: CacheError when the disk fails (e.g. full),
    LockWaitTimeout naming the holder past KERNELS_LOCK_TIMEOUT. A cache this process cannot
    write takes no lock (kernels.cache.locks); a write through it fails later, typed."""
    from kernels.cache import LockTimeout

    with _disk_errors(cache):
        cache.ensure()
        lock = cache.lock(name)
        try:
            lock.acquire()
        except LockTimeout as exc:
            raise LockWaitTimeout(f"{name}: {exc}") from None
    try:
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def _disk_errors(cache: Cache):
    """Turn an OSError of the local filesystem (full, read-only, ...) into a CacheError."""
    try:
        yield
    except OSError as exc:
        if isinstance(exc, KernelsError):
            raise
        reason = exc.strerror or str(exc)
        raise CacheError(f"cannot write to the cache at {cache.root}: {reason}") from exc


def check_free_space(
    cache: Cache, repo_id: str, commit: str, variant: str, files: tuple[RemoteFile, ...]
) -> None:
    """InsufficientSpace, before any download, when the files the store lacks (sizes from the
    listing) do not fit in the free space of the cache's disk. Unknown free space passes: the
    writes themselves still fail typed (CacheError) on a full disk."""
    needed = sum(f.size for f in files if _known_sha256(cache, f) is None)
    from .diskspace import require_free_space  # a download only: not on a warm load

    require_free_space(cache.root, needed, f"{repo_id}@{commit[:12]}/{variant}")


def install_variant(
    cache: Cache,
    repo_id: str,
    commit: str,
    variant: str,
    files: tuple[RemoteFile, ...],
    *,
    precheck: Callable[[bytes], None] | None = None,
    progress=None,
) -> tuple[Manifest, Path]:
    """Make sure the variant's tree is in the cache; returns (manifest, tree folder).

    `precheck` gets the bytes of metadata.json before anything else is downloaded, and may raise
    to stop the install (used for the GPU-arch check), leaving only that small file cached.
    """
    with cache_lock(cache, f"variant:{repo_id}:{commit}:{variant}"):
        done = cache.installed(repo_id, commit, variant)
        if done is not None:
            return done
        cache.clean_tmp()
        check_free_space(cache, repo_id, commit, variant, files)
        ordered = sorted(files, key=lambda f: f.path != "metadata.json")
        entries = []
        for f in ordered:
            sha256 = fetch_object(cache, repo_id, commit, variant, f, progress)
            if f.path == "metadata.json" and precheck is not None:
                precheck(cache.objects.path(sha256).read_bytes())
            entries.append(FileEntry(f.path, sha256, f.size))
        manifest = Manifest(tuple(entries))
        with _disk_errors(cache):
            tree = cache.install(repo_id, commit, variant, manifest)
        return manifest, tree
