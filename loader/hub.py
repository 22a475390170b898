"""The only module that talks to the Hub, always through huggingface_hub.

It turns huggingface_hub's answers and failures into this package's types: typed errors for
"no such repo / revision", `HubUnavailable` for anything that means "the Hub could not be
reached" (so callers can fall back to the cache), and bounded retries with backoff for 429/5xx
and dropped connections. huggingface_hub is imported on first use, never at package import.
"""

from __future__ import annotations

import json
import math
import random
import time
import zlib
from collections.abc import Callable
from urllib.parse import quote, urljoin, urlsplit

from . import settings
from ._version import __version__
from .errors import (
    DownloadTimeout,
    HubUnavailable,
    KernelNotFound,
    KernelsError,
    UnsafeResponse,
)
from .remote_file import RemoteFile, is_commit_id

REPO_TYPE = "kernel"
METADATA_TIMEOUT = 10.0
DOWNLOAD_TIMEOUT = 30.0
# Metadata calls fail over to the cache quickly; downloads try harder.
METADATA_ATTEMPTS = 2
DOWNLOAD_ATTEMPTS = 4
MAX_RETRY_AFTER = 30.0
# Bounds on what a server may make this client hold or do; a hostile endpoint meets them, the Hub
# never does. A JSON answer (one listing page, refs, info) is read up to MAX_JSON_BYTES after
# decompression; a tree listing follows at most MAX_LISTING_PAGES `next` links, never one it has
# seen before and never one to another origin (it would carry the token there).
MAX_JSON_BYTES = 32 << 20
MAX_ERROR_BYTES = 1 << 20  # the body of a 4xx/5xx answer, which only feeds an error message
MAX_LISTING_PAGES = 200
# The overall deadline of one JSON answer, however slowly its bytes come.
METADATA_DEADLINE = 60.0
# The overall deadline of one file (all attempts together), unless KERNELS_DOWNLOAD_TIMEOUT says:
# a base plus the time the file takes at a slow but working rate. A server that trickles bytes
# fast enough to dodge the per-read timeout still ends here.
DOWNLOAD_DEADLINE_BASE = 120.0
DOWNLOAD_MIN_RATE = 256 << 10  # bytes per second


class _Retryable(Exception):
    def __init__(self, cause: BaseException, retry_after: float | None = None):
        super().__init__(str(cause))
        self.cause = cause
        self.retry_after = retry_after


def _get_json(url: str, params: dict | None = None):
    """GET a Hub API route through huggingface_hub's session, headers (token) and error types.
    Returns (parsed JSON, response). The body is read raw and inflated here, so that neither a
    long body nor a compression bomb can take more than MAX_JSON_BYTES. Its HfApi is not used:
    importing it costs ~0.3 s."""
    from huggingface_hub.utils import build_hf_headers, get_session

    headers = build_hf_headers(library_name="kernels", library_version=__version__)
    headers["Accept-Encoding"] = "gzip, identity"
    deadline = time.monotonic() + METADATA_DEADLINE
    with get_session().stream(
        "GET", url, params=params, headers=headers, timeout=METADATA_TIMEOUT
    ) as response:
        raise_for_status(response, what=url, deadline=deadline)
        body = read_bounded(response, MAX_JSON_BYTES, what=url, deadline=deadline)
    try:
        return json.loads(body), response
    except ValueError as exc:
        raise HubUnavailable(f"{url}: the answer is not JSON ({exc})") from None


def raise_for_status(response, *, what: str, deadline: float) -> None:
    """huggingface_hub's typed error for a 4xx/5xx streamed response, its body read under the
    same bounds as any answer (at most MAX_ERROR_BYTES, inflated here, before `deadline`):
    huggingface_hub would read a streamed error body whole."""
    from huggingface_hub.utils import hf_raise_for_status

    if response.status_code < 400:
        return
    body = read_bounded(response, MAX_ERROR_BYTES, what=what, deadline=deadline)
    # Raw bytes: a header with non-ASCII bytes must reach huggingface_hub as it came.
    headers = [(k, v) for k, v in response.headers.raw if k.lower() not in _BODY_FRAMING_HEADERS]
    # The same answer with the decoded body in memory, for huggingface_hub to read.
    copy = type(response)(response.status_code, headers=headers, content=body)
    copy.request = response.request
    hf_raise_for_status(copy)


# They describe the body on the wire, not the decoded copy handed to huggingface_hub.
_BODY_FRAMING_HEADERS = {b"content-encoding", b"content-length", b"transfer-encoding"}


def read_bounded(response, limit: int, *, what: str, deadline: float) -> bytes:
    """The body of a streamed httpx response, decoded, refusing more than `limit` bytes of it
    (UnsafeResponse) before they are held: gzip and deflate are inflated here piece by piece with
    a cap on each piece's output, so a small body cannot expand to gigabytes in memory. Past
    `deadline` (time.monotonic()), DownloadTimeout."""
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        inflater = None
    elif encoding in ("gzip", "x-gzip"):
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    elif encoding == "deflate":
        inflater = zlib.decompressobj()
    else:  # we only offered gzip and identity
        raise UnsafeResponse(f"{what}: the server sent an unrequested encoding {encoding!r}")
    out = bytearray()

    def too_large() -> UnsafeResponse:
        return UnsafeResponse(f"{what}: the answer is larger than {limit} bytes; stopped reading")

    try:
        # No chunk size: httpx would hold bytes back until a chunk fills, and the deadline is
        # checked between the pieces the network delivers.
        for raw in response.iter_raw():
            if time.monotonic() > deadline:
                raise DownloadTimeout(f"{what}: the answer did not arrive in time; gave up")
            if inflater is None:
                out += raw
            else:
                while raw:  # pieces of at most 1 MiB: never a large transient copy
                    out += inflater.decompress(raw, min(1 << 20, limit + 1 - len(out)))
                    if len(out) > limit:
                        break
                    raw = inflater.unconsumed_tail
            if len(out) > limit:
                raise too_large()
        if inflater is not None:
            out += inflater.flush()
    except zlib.error as exc:
        raise HubUnavailable(f"{what}: the compressed answer is corrupt ({exc})") from None
    if len(out) > limit:
        raise too_large()
    return bytes(out)


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


def _with_retries(
    what: str, attempts: int, call: Callable[[], object], *, deadline: float | None = None
):
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
            wait *= 1 + 0.25 * random.random()
            if deadline is not None:  # never sleep past the deadline; the next attempt reports it
                wait = max(0.0, min(wait, deadline - time.monotonic()))
            time.sleep(wait)
            delay *= 2
    raise AssertionError("unreachable")


def resolve_revision(repo_id: str, revision: str) -> str:
    """A branch, tag or commit name -> the 40-hex commit it points to now. One request."""

    def call():
        data, _ = _get_json(f"{_repo_api(repo_id)}/revision/{quote(revision, safe='')}")
        sha = data.get("sha") if isinstance(data, dict) else None
        if sha is None:
            raise HubUnavailable(f"{repo_id}@{revision}: the Hub sent no commit id")
        if not is_commit_id(sha):
            raise UnsafeResponse(
                f"{repo_id}@{revision}: the server at {settings.endpoint()} answered a malformed "
                f"commit id {sha!r:.60} (not 40 lowercase hex digits)"
            )
        return sha

    return _with_retries(f"{repo_id}@{revision}", METADATA_ATTEMPTS, call)


def list_refs(repo_id: str) -> dict[str, dict[str, str]]:
    """{'branches': {name: commit}, 'tags': {name: commit}}. One request."""

    def call():
        data, _ = _get_json(f"{_repo_api(repo_id)}/refs")
        if not isinstance(data, dict):
            raise UnsafeResponse(f"{repo_id}: the server's refs are not an object")
        refs: dict[str, dict[str, str]] = {}
        for kind in ("branches", "tags"):
            refs[kind] = {}
            for ref in data.get(kind) or []:
                name = ref.get("name") if isinstance(ref, dict) else None
                commit = ref.get("targetCommit") if isinstance(ref, dict) else None
                if not isinstance(name, str) or not is_commit_id(commit):
                    raise UnsafeResponse(
                        f"{repo_id}: the server listed a malformed ref {ref!r:.80}"
                    )
                refs[kind][name] = commit
        return refs

    return _with_retries(f"{repo_id} refs", METADATA_ATTEMPTS, call)


def list_build_files(repo_id: str, commit: str) -> list[RemoteFile]:
    """Every file under build/ at `commit`, with sizes and digests. One request per page."""

    if not is_commit_id(commit):
        raise UnsafeResponse(f"{repo_id}: refusing to list the malformed commit id {commit!r:.60}")

    def call():
        files = []
        url: str | None = f"{_repo_api(repo_id)}/tree/{quote(commit, safe='')}/build"
        params: dict | None = {"recursive": "true", "expand": "false"}
        seen: set[str] = set()  # pages read, as requested and as answered (with the query)
        pages = 0
        while url:
            if pages >= MAX_LISTING_PAGES:
                raise UnsafeResponse(
                    f"{repo_id}@{commit[:12]}: the listing runs past {MAX_LISTING_PAGES} pages"
                )
            pages += 1
            seen.add(url)
            data, response = _get_json(url, params)
            seen.add(str(response.url))
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
            url = _next_page(repo_id, commit, str(response.url), response, seen)
            params = None
        return files

    try:
        return _with_retries(f"{repo_id}@{commit[:12]} build/", METADATA_ATTEMPTS, call)
    except KernelNotFound as exc:
        if "file not found" in exc.message:  # the commit has no build/ folder at all
            return []
        raise


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower())
    return parts.scheme.lower(), (parts.hostname or "").lower(), port


def _next_page(repo_id: str, commit: str, here: str, response, seen: set[str]) -> str | None:
    """The listing's `Link: rel=next` page, if it is safe to follow: on the endpoint's origin (the
    request carries the token) and not a page already read (a loop)."""
    link = response.links.get("next", {}).get("url")
    if not link:
        return None
    url = urljoin(here, link)
    where = f"{repo_id}@{commit[:12]}"
    if _origin(url) != _origin(settings.endpoint()):
        raise UnsafeResponse(f"{where}: the listing's next page is on another origin ({url:.120})")
    if url in seen:
        raise UnsafeResponse(f"{where}: the listing's next page loops back to a page already read")
    return url


def _text_or_none(value: object) -> str | None:
    """A digest field as the listing sent it, if it is text at all (validated by the caller)."""
    return value if isinstance(value, str) else None


def publisher_trusted(publisher: str) -> bool:
    """The Hub's trusted-kernel-publisher flag of an org (False for users and unknown orgs)."""

    def call():
        url = f"{settings.endpoint()}/api/organizations/{quote(publisher, safe='')}/overview"
        try:
            data, _ = _get_json(url)
        except Exception as exc:
            if _status_of(exc) == 404:  # a user, or no such org
                return False
            raise
        return isinstance(data, dict) and data.get("trustedKernelPublisher") is True

    return _with_retries(f"publisher {publisher}", METADATA_ATTEMPTS, call)


def download_deadline(size: int) -> float:
    """Seconds one file of `size` bytes may take, all attempts together."""
    explicit = settings.download_timeout()
    if explicit is not None:
        return explicit
    return DOWNLOAD_DEADLINE_BASE + max(size, 0) / DOWNLOAD_MIN_RATE


def download_to(
    repo_id: str,
    commit: str,
    path: str,
    open_sink: Callable[[], tuple[Callable[[bytes], None], Callable[[], None]]],
    *,
    size: int = 0,
    on_progress: Callable[[int], None] | None = None,
) -> None:
    """Stream one file at `commit`. `open_sink()` returns (write, discard) for a fresh attempt;
    a failed attempt is discarded and retried. One request (+ a redirect for LFS) per attempt.
    All attempts share one deadline (download_deadline(size)); past it, DownloadTimeout."""
    from huggingface_hub.utils import build_hf_headers, get_session

    if not is_commit_id(commit):
        raise UnsafeResponse(
            f"{repo_id}: refusing to download at the malformed commit {commit!r:.60}"
        )
    url = (
        f"{settings.endpoint()}/kernels/{repo_id}/resolve/{quote(commit, safe='')}/"
        f"{quote(path, safe='/')}"
    )
    headers = build_hf_headers(library_name="kernels", library_version=__version__)
    headers["Accept-Encoding"] = "identity"
    what = f"{repo_id}@{commit[:12]}:{path}"
    budget = download_deadline(size)
    deadline = time.monotonic() + budget

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DownloadTimeout(f"{what}: not downloaded within {budget:.0f} s; gave up")
        return remaining

    def attempt():
        # A read may block at most until the deadline (plus a second for the check to fire).
        timeout = min(DOWNLOAD_TIMEOUT, left() + 1.0)
        write, discard = open_sink()
        try:
            with get_session().stream(
                "GET", url, headers=headers, follow_redirects=True, timeout=timeout
            ) as response:
                raise_for_status(response, what=what, deadline=deadline)
                encoding = response.headers.get("content-encoding", "identity").strip().lower()
                if encoding not in ("", "identity"):  # we asked for identity: no inflating here
                    raise UnsafeResponse(
                        f"{what}: the server sent an unrequested {encoding!r} body"
                    )
                # No chunk size: httpx would hold bytes back until a chunk fills, and the
                # deadline is checked between the pieces the network delivers.
                for chunk in response.iter_bytes():
                    left()
                    write(chunk)
                    if on_progress is not None:
                        on_progress(len(chunk))
        except BaseException as exc:
            discard()
            if time.monotonic() >= deadline and not isinstance(exc, KernelsError):
                left()  # a read that timed out at the deadline: report the deadline
            raise

    _with_retries(what, DOWNLOAD_ATTEMPTS, attempt, deadline=deadline)
