"""The only module that talks to the Hub, always through huggingface_hub.

It turns huggingface_hub's answers and failures into this package's types: typed errors for
"no such repo / revision", `HubUnavailable` for anything that means "the Hub could not be
reached" (so callers can fall back to the cache), and bounded retries with backoff for 429/5xx
and dropped connections. huggingface_hub is imported on first use, never at package import.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote

from . import settings
from ._version import __version__
from .errors import HubUnavailable, KernelNotFound, KernelsError

REPO_TYPE = "kernel"
METADATA_TIMEOUT = 10.0
DOWNLOAD_TIMEOUT = 30.0
# Metadata calls fail over to the cache quickly; downloads try harder.
METADATA_ATTEMPTS = 2
DOWNLOAD_ATTEMPTS = 4
MAX_RETRY_AFTER = 30.0


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


class _Retryable(Exception):
    def __init__(self, cause: BaseException, retry_after: float | None = None):
        super().__init__(str(cause))
        self.cause = cause
        self.retry_after = retry_after


def _get_json(url: str, params: dict | None = None):
    """GET a Hub API route through huggingface_hub's session, headers (token) and error types.
    Returns (parsed JSON, response). Its HfApi is not used: importing it costs ~0.3 s."""
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    headers = build_hf_headers(library_name="kernels", library_version=__version__)
    response = get_session().get(url, params=params, headers=headers, timeout=METADATA_TIMEOUT)
    hf_raise_for_status(response)
    return response.json(), response


def _repo_api(repo_id: str) -> str:
    return f"{settings.endpoint()}/api/{REPO_TYPE}s/{repo_id}"


def _status_of(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def _classify(exc: BaseException, what: str) -> BaseException:
    """Map a huggingface_hub / transport exception to ours (or to _Retryable)."""
    from huggingface_hub import errors as hf

    from .hub_errors import repository_not_found, revision_not_found

    if isinstance(exc, KernelsError):
        return exc
    if isinstance(exc, hf.OfflineModeIsEnabled):
        return HubUnavailable(f"{what}: huggingface_hub is in offline mode")
    # Both also huggingface_hub's own error, which callers of the reference API catch.
    if isinstance(exc, hf.RevisionNotFoundError):
        return revision_not_found(f"{what}: no such revision", exc)
    if isinstance(exc, hf.RepositoryNotFoundError):  # also GatedRepoError, 401s
        return repository_not_found(f"{what}: repository not found (or not accessible)", exc)
    if isinstance(exc, hf.RemoteEntryNotFoundError):
        return KernelNotFound(f"{what}: file not found")
    status = _status_of(exc)
    if status == 429 or (status is not None and status >= 500):
        retry_after = None
        headers = getattr(getattr(exc, "response", None), "headers", {}) or {}
        raw = headers.get("retry-after") if hasattr(headers, "get") else None
        if raw:
            try:
                seconds = float(raw)
            except ValueError:
                seconds = math.nan  # e.g. an HTTP date: use our own backoff
            # A negative, NaN or infinite value would make time.sleep raise or hang.
            if math.isfinite(seconds) and seconds >= 0:
                retry_after = min(seconds, MAX_RETRY_AFTER)
        return _Retryable(exc, retry_after)
    if status is not None:
        return HubUnavailable(f"{what}: the Hub answered HTTP {status}")
    # Connection refused, DNS, timeouts, resets, truncated bodies: transport errors of httpx,
    # httpx2 or requests, or plain OSErrors.
    module = type(exc).__module__.split(".")[0]
    if module in {"httpx", "httpx2", "requests", "urllib3", "h11", "httpcore", "httpcore2"}:
        return _Retryable(exc)
    if isinstance(exc, (OSError, TimeoutError)):
        return _Retryable(exc)
    return exc


def _with_retries(what: str, attempts: int, call: Callable[[], object]):
    delay = 0.25
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except BaseException as exc:  # noqa: BLE001 - classified below
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            mapped = _classify(exc, what)
            if not isinstance(mapped, _Retryable):
                if mapped is exc:
                    raise
                raise mapped from exc
            if attempt == attempts:
                raise HubUnavailable(
                    f"{what}: could not reach the Hub at {settings.endpoint()} "
                    f"({type(mapped.cause).__name__}: {str(mapped.cause).splitlines()[0][:160]})"
                ) from exc
            wait = mapped.retry_after if mapped.retry_after is not None else delay
            time.sleep(wait * (1 + 0.25 * random.random()))
            delay *= 2
    raise AssertionError("unreachable")


def resolve_revision(repo_id: str, revision: str) -> str:
    """A branch, tag or commit name -> the 40-hex commit it points to now. One request."""

    def call():
        data, _ = _get_json(f"{_repo_api(repo_id)}/revision/{quote(revision, safe='')}")
        sha = data.get("sha") if isinstance(data, dict) else None
        if not isinstance(sha, str) or len(sha) != 40:
            raise HubUnavailable(f"{repo_id}@{revision}: the Hub sent no commit id")
        return sha

    return _with_retries(f"{repo_id}@{revision}", METADATA_ATTEMPTS, call)


def list_refs(repo_id: str) -> dict[str, dict[str, str]]:
    """{'branches': {name: commit}, 'tags': {name: commit}}. One request."""

    def call():
        data, _ = _get_json(f"{_repo_api(repo_id)}/refs")
        return {
            kind: {r["name"]: r["targetCommit"] for r in data.get(kind, [])}
            for kind in ("branches", "tags")
        }

    return _with_retries(f"{repo_id} refs", METADATA_ATTEMPTS, call)


def list_build_files(repo_id: str, commit: str) -> list[RemoteFile]:
    """Every file under build/ at `commit`, with sizes and digests. One request per page."""

    def call():
        files = []
        url = f"{_repo_api(repo_id)}/tree/{quote(commit, safe='')}/build"
        params: dict | None = {"recursive": "true", "expand": "false"}
        while url:
            data, response = _get_json(url, params)
            if not isinstance(data, list):
                raise HubUnavailable(f"{repo_id}@{commit[:12]}: the tree listing is not a list")
            for item in data:
                if not isinstance(item, dict) or item.get("type") != "file":
                    continue
                lfs = item.get("lfs") if isinstance(item.get("lfs"), dict) else {}
                files.append(
                    RemoteFile(
                        str(item.get("path")),
                        item.get("size") if isinstance(item.get("size"), int) else -1,
                        _text_or_none(item.get("oid")),
                        _text_or_none(lfs.get("oid")),
                    )
                )
            url = response.links.get("next", {}).get("url")  # the Hub pages long listings
            params = None
        return files

    try:
        return _with_retries(f"{repo_id}@{commit[:12]} build/", METADATA_ATTEMPTS, call)
    except KernelNotFound as exc:
        if "file not found" in exc.message:  # the commit has no build/ folder at all
            return []
        raise


def _text_or_none(value: object) -> str | None:
    """A digest field as the listing sent it, if it is text at all (validated by the caller)."""
    return value if isinstance(value, str) else None


def publisher_trusted(publisher: str) -> bool:
    """The Hub's trusted-kernel-publisher flag of an org (False for users and unknown orgs)."""

    def call():
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        url = f"{settings.endpoint()}/api/organizations/{quote(publisher, safe='')}/overview"
        response = get_session().get(
            url, headers=build_hf_headers(library_name="kernels"), timeout=METADATA_TIMEOUT
        )
        if response.status_code == 404:
            return False
        hf_raise_for_status(response)
        return bool(response.json().get("trustedKernelPublisher", False))

    return _with_retries(f"publisher {publisher}", METADATA_ATTEMPTS, call)


def download_to(
    repo_id: str,
    commit: str,
    path: str,
    open_sink: Callable[[], tuple[Callable[[bytes], None], Callable[[], None]]],
    *,
    on_progress: Callable[[int], None] | None = None,
) -> None:
    """Stream one file at `commit`. `open_sink()` returns (write, discard) for a fresh attempt;
    a failed attempt is discarded and retried. One request (+ a redirect for LFS) per attempt."""
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    url = (
        f"{settings.endpoint()}/kernels/{repo_id}/resolve/{quote(commit, safe='')}/"
        f"{quote(path, safe='/')}"
    )
    headers = build_hf_headers(library_name="kernels", library_version=__version__)
    headers["Accept-Encoding"] = "identity"

    def attempt():
        write, discard = open_sink()
        try:
            with get_session().stream(
                "GET", url, headers=headers, follow_redirects=True, timeout=DOWNLOAD_TIMEOUT
            ) as response:
                hf_raise_for_status(response)
                for chunk in response.iter_bytes(1 << 20):
                    write(chunk)
                    if on_progress is not None:
                        on_progress(len(chunk))
        except BaseException:
            discard()
            raise

    _with_retries(f"{repo_id}@{commit[:12]}:{path}", DOWNLOAD_ATTEMPTS, attempt)
