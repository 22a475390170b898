"""File routes: resolve (HEAD/GET with ranges, ETags, LFS) and the LFS object "CDN" route."""

from __future__ import annotations

import mimetypes
import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from .git import HEX40, SMALL_BLOB, GitRepo
from .lfs import LfsPointer, is_sha256, object_path
from .protocol import (
    HubError,
    Request,
    Response,
    ServerContext,
    Stream,
    commit_or_404,
    repo_or_404,
)


def resolve(
    server: ServerContext, req: Request, org: str, name: str, rev: str, raw_path: str
) -> Response:
    """HEAD/GET of one file at a revision: the bytes, a 304, or (LFS) a 302 to the object route."""
    repo = repo_or_404(server, org, name)
    sha = commit_or_404(repo, rev)
    path = unquote(raw_path)
    tree = repo.tree(sha)
    entry = tree.entries.get(path)
    if entry is None or entry.kind != "file":
        raise HubError(404, f"Entry not found: {path}", "EntryNotFound", sha)
    headers = {"X-Repo-Commit": sha, "ETag": f'"{entry.oid}"'}
    pointer = tree.pointers.get(path)
    if pointer is None:
        headers["Content-Type"] = _content_type(path)
        data = None
        if req.method == "GET" and server.file_hook is not None:
            data = server.file_hook(f"{org}/{name}", sha, path, repo.read_blob(entry.oid))
        elif req.method == "GET" and entry.size <= SMALL_BLOB:
            data = repo.read_blob(entry.oid)
        return _content(req, headers, {entry.oid}, entry.size, data, _blob_stream(repo, entry.oid))
    headers["X-Linked-Etag"] = f'"{pointer.oid}"'
    headers["X-Linked-Size"] = str(pointer.size)
    if server.lfs_redirect:
        if _etag_matches(req.headers.get("if-none-match"), {entry.oid, pointer.oid}):
            return Response(304, headers)
        query = f"commit={sha}&path={quote(path, safe='')}"
        origin = _lfs_origin(req.host, server)
        headers["Location"] = f"{origin}/_lfs/{org}/{name}/{pointer.oid}?{query}"
        return Response(302, headers)
    return _lfs_content(server, req, repo, f"{org}/{name}", sha, path, pointer, headers)


def lfs_object(server: ServerContext, req: Request, org: str, name: str, oid: str) -> Response:
    """The CDN side of an LFS redirect: the object's bytes, plus the metadata the HEAD carried."""
    repo = repo_or_404(server, org, name)
    if not is_sha256(oid):
        raise HubError(404, f"Entry not found: LFS object {oid}", "EntryNotFound")
    commit = (req.query.get("commit") or [""])[-1]
    path = (req.query.get("path") or [""])[-1]
    commit = commit if HEX40.fullmatch(commit) else ""
    size = _lfs_size(repo, oid, path, commit)
    headers = {"ETag": f'"{oid}"', "X-Linked-Etag": f'"{oid}"', "X-Linked-Size": str(size)}
    if commit:
        headers["X-Repo-Commit"] = commit
    pointer = LfsPointer(oid=oid, size=size, pointer_size=0)
    return _lfs_content(server, req, repo, f"{org}/{name}", commit, path, pointer, headers)


def _lfs_size(repo: GitRepo, oid: str, path: str, commit: str) -> int:
    """Size of the stored LFS object; EntryNotFound when the mirror lacks it. A link in its place
    is treated as missing: the server does not follow links out of the mirror."""
    try:
        st = os.lstat(object_path(repo.gitdir, oid))
        if not stat.S_ISREG(st.st_mode):
            raise OSError("not a regular file")
        return st.st_size
    except OSError:
        raise HubError(
            404,
            f"Entry not found: the LFS object of {path or oid} is not in the mirror "
            "(run `git lfs fetch --all` in the repo)",
            "EntryNotFound",
            commit or None,
        ) from None


def _lfs_content(
    server: ServerContext,
    req: Request,
    repo: GitRepo,
    repo_id: str,
    commit: str,
    path: str,
    pointer: LfsPointer,
    headers: dict[str, str],
) -> Response:
    """The bytes of an LFS object; `headers` already hold ETag and the X-Linked-* metadata."""
    size = _lfs_size(repo, pointer.oid, path, commit)
    location = object_path(repo.gitdir, pointer.oid)
    headers["Content-Type"] = _content_type(path)
    data = None
    if req.method == "GET" and server.file_hook is not None:
        with _open_object(location) as f:
            data = server.file_hook(repo_id, commit, path, f.read())
    etags = {pointer.oid, headers["ETag"].strip('"')}
    return _content(req, headers, etags, size, data, _file_stream(location))


def _content(
    req: Request,
    headers: dict[str, str],
    etags: set[str],
    size: int,
    data: bytes | None,
    stream: Callable[[int, int], Stream],
) -> Response:
    """A 200 / 206 / 304 / 416 for content of `size` bytes: `data` when in memory, else streamed."""
    if _etag_matches(req.headers.get("if-none-match"), etags):
        return Response(304, headers)
    headers["Accept-Ranges"] = "bytes"
    if data is not None:
        size = len(data)
    try:
        span = _parse_range(req.headers.get("range"), size)
    except _Unsatisfiable:
        headers["Content-Range"] = f"bytes */{size}"
        return Response(416, headers)
    status, start, length = 200, 0, size
    if span is not None:
        status, start, length = 206, span[0], span[1] - span[0] + 1
        headers["Content-Range"] = f"bytes {span[0]}-{span[1]}/{size}"
    if data is not None:
        return Response(status, headers, data[start : start + length])
    return Response(status, headers, length=length, stream=stream(start, length))


def _blob_stream(repo: GitRepo, oid: str) -> Callable[[int, int], Stream]:
    def make(start: int, length: int) -> Stream:
        return lambda _sock, write: repo.stream_blob(oid, start, length, write)

    return make


def _file_stream(location: Path) -> Callable[[int, int], Stream]:
    def make(start: int, length: int) -> Stream:
        def send(sock: socket.socket, _write: Callable[[bytes], Any]) -> None:
            with _open_object(location) as f:
                sock.sendfile(f, offset=start, count=length)

        return send

    return make


def _open_object(location: Path):
    """An LFS object opened without following a link in its place (swapped in after the size
    check)."""
    return os.fdopen(os.open(location, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)), "rb")


class _Unsatisfiable(Exception):
    pass


def _parse_range(value: str | None, size: int) -> tuple[int, int] | None:
    """(first, last) byte of a single `bytes=N-[M]` or `bytes=-N` range; None to send everything."""
    if not value:
        return None
    unit, _, spec = value.partition("=")
    first, sep, last = spec.strip().partition("-")
    if unit.strip().lower() != "bytes" or not sep or "," in spec:
        return None  # not a single byte range: ignore it, as RFC 9110 allows
    if not (first.isdigit() or first == "") or not (last.isdigit() or last == ""):
        return None
    if first == "":
        if last == "" or int(last) == 0 or size == 0:
            raise _Unsatisfiable
        return max(0, size - int(last)), size - 1
    start = int(first)
    end = int(last) if last else size - 1
    if last and end < start:
        return None  # invalid: ignore it
    if start >= size:
        raise _Unsatisfiable
    return start, min(end, size - 1)


def _etag_matches(header: str | None, etags: set[str]) -> bool:
    if not header:
        return False
    for tag in header.split(","):
        tag = tag.strip()
        if tag == "*":
            return True
        if tag.startswith("W/"):
            tag = tag[2:]
        if tag.strip('"') in etags:
            return True
    return False


def _content_type(path: str) -> str:
    kind, _encoding = mimetypes.guess_type(path, strict=False)
    return kind or "application/octet-stream"


def _lfs_origin(client_host: str, server: ServerContext) -> str:
    """Where an LFS redirect points: "http://localhost:PORT" for a client that used 127.0.0.1
    (and the other way round, likewise for ::1), another origin as the Hub's CDN is; otherwise
    "", a relative Location the client resolves against the URL it used (a tunnel, a proxy, a
    server bound to 0.0.0.0). The Host header only picks between the two: no byte of it is
    copied into the answer, so a forged Host cannot send clients (or a cache) elsewhere."""
    if server.host not in ("127.0.0.1", "::1"):
        return ""
    bound = server.netloc
    local = f"localhost:{bound.rsplit(':', 1)[1]}"
    twin = {bound: local, local: bound}.get(client_host.lower())
    return f"http://{twin}" if twin else ""
