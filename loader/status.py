"""kernel-status.toml: a kernel repo's notice that it has moved (the reference's status redirects).

A publisher who retires a repo commits, at its root,

    kind = "redirect"
    destination = "org/successor"
    revision = "v1"          # optional; "main" when absent

and every load of that repo then loads `destination` at `revision` instead, with a UserWarning
"'org/old' redirected to 'org/successor'". The destination goes through the whole pipeline on its
own (trust, resolution, verification); a chain of redirects is followed up to MAX_HOPS.

The file is read at the resolved commit, so its answer never changes for that commit: it is
fetched once per commit and endpoint (one request, a 404 for most repos) and recorded in the
cache under `v1/kernel-status/<org>--<name>/<commit>-<endpoint key>` (empty: no status file), so
warm loads stay free. The record is the endpoint's answer, like every other record: a mirror's
redirect is never followed at another endpoint. Offline, a commit with no record counts as having
no status.

A redirect decides which repo's code runs, so the record sits in a cache bucket that only the user
and root can write (the cache's `exposure` check covers `kernel-status/`), and the destination gets
a trust decision of its own (api.py: `trust_remote_code=True` names the caller's repo only).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kernels.cache import Cache
from kernels.cache.fsutil import atomic_write_bytes
from kernels.cache.records import endpoint_key

from .errors import KernelNotFound, KernelStatusError

if TYPE_CHECKING:
    from .status_file import Redirect

MAX_HOPS = 4


def __getattr__(name: str):
    # The file's format is read only when a record holds a status file: most repos have none.
    if name in ("FILENAME", "MAX_BYTES", "Redirect", "parse"):
        from . import status_file

        return getattr(status_file, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _record_path(cache: Cache, repo_id: str, commit: str) -> Path:
    key = endpoint_key(cache.endpoint or "")
    return cache.status / repo_id.replace("/", "--") / f"{commit}-{key}"


def _fetch(repo_id: str, commit: str) -> bytes:
    """The file's bytes at `commit`, b"" when the repo has none. One request."""
    from . import hub
    from .status_file import FILENAME, MAX_BYTES

    chunks: list[bytes] = []
    size = 0

    def open_sink():
        chunks.clear()

        def write(chunk: bytes) -> None:
            nonlocal size
            size += len(chunk)
            if size > MAX_BYTES:
                raise KernelStatusError(f"{repo_id}@{commit[:12]}: {FILENAME} is too large")
            chunks.append(chunk)

        return write, chunks.clear

    try:
        hub.download_to(repo_id, commit, FILENAME, open_sink)
    except KernelNotFound as exc:
        if "file not found" not in exc.message:
            raise
        return b""
    return b"".join(chunks)


def _store(cache: Cache, path: Path, data: bytes) -> None:
    try:
        cache.ensure()
        atomic_write_bytes(path, data)  # folders 0755 and the file 0644 whatever the umask
    except OSError:
        pass  # a read-only cache still answers this process; the next load asks again


class NeedNetwork(Exception):
    """No record for this commit, and the caller may not make a request now."""


def lookup(cache: Cache, repo_id: str, commit: str, *, network: bool) -> Redirect | None:
    """The status of `repo_id` at `commit`, or None. Without `network`, raise NeedNetwork when
    the commit has no record yet (the caller retries with the Hub); `network=None` means
    offline: no record reads as no status. A fetched file is parsed before it is recorded, so
    a malformed one (KernelStatusError) leaves the cache as it was."""
    path = _record_path(cache, repo_id, commit)
    try:
        data: bytes | None = path.read_bytes()
    except FileNotFoundError:
        if network is None:
            return None
        if not network:
            raise NeedNetwork from None
        data = None
    except OSError:
        return None
    if data is not None:
        return _decode(data, repo_id, commit)
    data = _fetch(repo_id, commit)
    redirect = _decode(data, repo_id, commit)
    _store(cache, path, data)
    return redirect


def _decode(data: bytes, repo_id: str, commit: str) -> Redirect | None:
    """The status a file's bytes state (None for no file); KernelStatusError when malformed."""
    if not data:
        return None
    from .status_file import FILENAME, parse

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise KernelStatusError(f"{repo_id}@{commit[:12]}: {FILENAME} is not UTF-8") from None

    return parse(text, where=f"{repo_id}@{commit[:12]}/{FILENAME}")
