"""The Hub's read routes, as pure functions from a parsed request to a response.

URL shapes (as huggingface_hub sends them; `rev` is one percent-encoded segment):
  HEAD|GET [/{models|datasets|spaces|kernels}]/{org}/{name}/resolve/{rev}/{path}
  GET /api/{type}s/{org}/{name}[/revision/{rev}]      repo info
  GET /api/{type}s/{org}/{name}/refs[?include_prs=1]
  GET /api/{type}s/{org}/{name}/tree/{rev}[/{path}]?recursive=&expand=
  GET /api/{type}s/{org}/{name}/commits/{rev}
  GET /api/organizations/{org}/overview
  GET /_lfs/{org}/{name}/{sha256}?commit=&path=         LFS bytes (the "CDN" that resolve redirects to)
Errors are 404s with the Hub's X-Error-Code / X-Error-Message headers, and a JSON body.
"""

from __future__ import annotations

import hashlib
import json
import mimetypes
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

from .git import HEX40, SMALL_BLOB, CommitInfo, Entry, GitRepo, Tree
from .lfs import LfsPointer, is_sha256, object_path

if TYPE_CHECKING:
    from .server import MirrorServer

REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space", "kernels": "kernel"}
_TRUE = {"1", "true", "yes", "on"}

# stream(sock, write): sends exactly the response's `length` bytes after the headers.
Stream = Callable[[socket.socket, Callable[[bytes], Any]], None]


@dataclass
class Request:
    method: str  # "GET" | "HEAD"
    path: str  # raw (percent-encoded) path, without the query string
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-case names
    host: str  # the Host the client used ("127.0.0.1:8000")

    def flag(self, name: str) -> bool:
        """A boolean query parameter; case-insensitive, since requests-based clients send `True`."""
        values = self.query.get(name)
        return bool(values) and values[-1].strip().lower() in _TRUE


@dataclass
class Response:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    length: int | None = None  # set (with `stream`) when the body is streamed
    stream: Stream | None = None


class HubError(Exception):
    """An error response in the Hub's shape; raised by routes, turned into a Response by dispatch."""

    def __init__(
        self, status: int, message: str, code: str | None = None, commit: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.commit = status, message, code, commit

    def response(self) -> Response:
        headers = {"X-Error-Message": _header_safe(self.message)}
        if self.code:
            headers["X-Error-Code"] = self.code
        if self.commit:
            # Lets the client cache the miss under .no_exist/<commit>/.
            headers["X-Repo-Commit"] = self.commit
        return json_response({"error": self.message}, self.status, headers)


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    body = json.dumps(data).encode("utf-8")
    return Response(status, {"Content-Type": "application/json", **(headers or {})}, body)


def route_not_found(path: str) -> HubError:
    return HubError(404, f"no such route: {path}")


def _header_safe(text: str) -> str:
    return " ".join(text.split()).encode("latin-1", "replace").decode("latin-1")


def dispatch(server: MirrorServer, req: Request) -> Response:
    """Answer one GET or HEAD request."""
    try:
        return _route(server, req)
    except HubError as err:
        return err.response()


def _route(server: MirrorServer, req: Request) -> Response:
    segs = req.path.split("/")[1:]
    if segs[0] == "api":
        return _api(server, req, segs[1:])
    if segs[0] == "_lfs" and len(segs) == 4:
        return _lfs_object(server, req, segs[1], segs[2], segs[3])
    if len(segs) >= 6 and segs[0] in REPO_TYPES and segs[3] == "resolve":
        return _resolve(server, req, segs[1], segs[2], unquote(segs[4]), "/".join(segs[5:]))
    if len(segs) >= 5 and segs[2] == "resolve":
        return _resolve(server, req, segs[0], segs[1], unquote(segs[3]), "/".join(segs[4:]))
    raise route_not_found(req.path)


def _repo(server: MirrorServer, org: str, name: str) -> GitRepo:
    repo = server.mirror.repo(org, name)
    if repo is None:
        raise HubError(404, f"Repository not found: {org}/{name}", "RepoNotFound")
    return repo


def _commit(repo: GitRepo, rev: str) -> str:
    sha = repo.resolve(rev)
    if sha is None:
        raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
    return sha


def _iso(seconds: int) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")


# -- JSON API ---------------------------------------------------------------------------------


def _api(server: MirrorServer, req: Request, segs: list[str]) -> Response:
    if len(segs) == 3 and segs[0] == "organizations" and segs[2] == "overview":
        return _org_overview(server, unquote(segs[1]))
    if len(segs) < 3 or segs[0] not in REPO_TYPES:
        raise route_not_found(req.path)
    repo_type, org, name, rest = REPO_TYPES[segs[0]], segs[1], segs[2], segs[3:]
    repo = _repo(server, org, name)
    repo_id = f"{org}/{name}"
    if not rest:
        return _info(repo, repo_id, repo_type, None, req.flag("blobs"))
    head, args = rest[0], [unquote(s) for s in rest[1:]]
    if head == "revision" and args:
        return _info(repo, repo_id, repo_type, "/".join(args), req.flag("blobs"))
    if head == "refs" and not args:
        return _refs(repo, req.flag("include_prs"))
    if head == "tree" and args:
        path = "/".join(args[1:]).strip("/")
        return _tree(
            server, repo, repo_id, args[0], path, req.flag("recursive"), req.flag("expand")
        )
    if head == "commits" and len(args) == 1:
        return _commits(repo, args[0])
    raise route_not_found(req.path)


def _info(repo: GitRepo, repo_id: str, repo_type: str, rev: str | None, blobs: bool) -> Response:
    if rev is None:  # the default branch; a repo without commits still exists
        refs = repo.refs()
        sha = refs.commits.get(refs.head) if refs.head else None
    else:
        sha = _commit(repo, rev)
    org = repo_id.split("/")[0]
    info: dict[str, Any] = {
        "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
        "id": repo_id,
        "author": org,
        "sha": sha,
        "private": False,
        "gated": False,
        "disabled": False,
        "tags": [],
        "downloads": 0,
        "likes": 0,
    }
    if repo_type == "model":
        info["modelId"] = repo_id
    if sha is not None:
        history = repo.log(sha)
        info["lastModified"] = _iso(history[0].time)
        info["createdAt"] = _iso(history[-1].time)
    if repo_type != "kernel":  # the Hub's kernel info has no siblings
        tree = repo.tree(sha) if sha else None
        info["siblings"] = (
            [_sibling(tree, e, blobs) for e in tree.walk("") if e.kind == "file"] if tree else []
        )
    return json_response(info)


def _sibling(tree: Tree, entry: Entry, blobs: bool) -> dict[str, Any]:
    sibling: dict[str, Any] = {"rfilename": entry.path}
    if blobs:
        pointer = tree.pointers.get(entry.path)
        sibling["blobId"] = entry.oid
        sibling["size"] = pointer.size if pointer else entry.size
        if pointer:
            sibling["lfs"] = {
                "sha256": pointer.oid,
                "size": pointer.size,
                "pointerSize": pointer.pointer_size,
            }
    return sibling


def _refs(repo: GitRepo, include_prs: bool) -> Response:
    groups: dict[str, list[dict[str, str]]] = {
        "branches": [],
        "tags": [],
        "converts": [],
        "pullRequests": [],
    }
    prefixes = {
        "refs/heads/": "branches",
        "refs/tags/": "tags",
        "refs/convert/": "converts",
        "refs/pr/": "pullRequests",
    }
    for ref, sha in sorted(repo.refs().commits.items()):
        for prefix, group in prefixes.items():
            if ref.startswith(prefix):
                groups[group].append({"name": ref[len(prefix) :], "ref": ref, "targetCommit": sha})
    if not include_prs:
        del groups["pullRequests"]
    return json_response(groups)


def _tree(
    server: MirrorServer,
    repo: GitRepo,
    repo_id: str,
    rev: str,
    path: str,
    recursive: bool,
    expand: bool,
) -> Response:
    sha = _commit(repo, rev)
    tree = repo.tree(sha)
    if path:
        entry = tree.entries.get(path)
        if entry is None or entry.kind != "directory":
            raise HubError(404, f"Entry not found: {path} is not a directory", "EntryNotFound", sha)
    listed = tree.walk(path) if recursive else tree.children.get(path, [])
    entries = [
        _tree_entry(tree, e, repo.last_commit(sha, e.path) if expand else None) for e in listed
    ]
    hook = server.tree_hook
    if hook is not None:
        entries = hook(repo_id, sha, entries)
    return json_response(entries)


def _tree_entry(tree: Tree, entry: Entry, last: CommitInfo | None) -> dict[str, Any]:
    item: dict[str, Any] = {
        "type": entry.kind,
        "oid": entry.oid,
        "size": entry.size,
        "path": entry.path,
    }
    pointer = tree.pointers.get(entry.path)
    if pointer:
        item["size"] = pointer.size
        item["lfs"] = {
            "oid": pointer.oid,
            "size": pointer.size,
            "pointerSize": pointer.pointer_size,
        }
    if last is not None:
        item["lastCommit"] = {"id": last.sha, "title": last.title, "date": _iso(last.time)}
    return item


def _commits(repo: GitRepo, rev: str) -> Response:
    sha = _commit(repo, rev)
    return json_response(
        [
            {
                "id": c.sha,
                "title": c.title,
                "message": c.message,
                "date": _iso(c.time),
                "authors": [{"user": c.author}],
            }
            for c in repo.log(sha)
        ]
    )


def _org_overview(server: MirrorServer, org: str) -> Response:
    if not server.mirror.has_org(org):
        raise HubError(404, f"Organization not found: {org}")
    return json_response(
        {
            "name": org,
            "fullname": org,
            "type": "org",
            "avatarUrl": "",
            "isVerified": False,
            "trustedKernelPublisher": org in server.mirror.trusted_publishers(),
        }
    )


# -- files ------------------------------------------------------------------------------------


def _resolve(
    server: MirrorServer, req: Request, org: str, name: str, rev: str, raw_path: str
) -> Response:
    repo = _repo(server, org, name)
    sha = _commit(repo, rev)
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
        cdn = _cdn_host(req.host, server.host)
        headers["Location"] = f"http://{cdn}/_lfs/{org}/{name}/{pointer.oid}?{query}"
        return Response(302, headers)
    return _lfs_content(server, req, repo, f"{org}/{name}", sha, path, pointer, headers)


def _lfs_object(server: MirrorServer, req: Request, org: str, name: str, oid: str) -> Response:
    """The CDN side of an LFS redirect: the object's bytes, plus the metadata the HEAD carried."""
    repo = _repo(server, org, name)
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
    """Size of the stored LFS object; EntryNotFound when the mirror lacks it."""
    try:
        return os.stat(object_path(repo.gitdir, oid)).st_size
    except OSError:
        raise HubError(
            404,
            f"Entry not found: the LFS object of {path or oid} is not in the mirror "
            "(run `git lfs fetch --all` in the repo)",
            "EntryNotFound",
            commit or None,
        ) from None


def _lfs_content(
    server: MirrorServer,
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
        data = server.file_hook(repo_id, commit, path, location.read_bytes())
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
            with open(location, "rb") as f:
                sock.sendfile(f, offset=start, count=length)

        return send

    return make


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


def _cdn_host(host: str, bound: str) -> str:
    """Another name for this server, so that an LFS redirect crosses origins as the Hub's CDN does.

    127.0.0.1 <-> localhost; any other name stays (a same-origin redirect, which clients follow;
    the object route repeats the metadata headers for that case).
    """
    name, sep, port = host.rpartition(":")
    if not sep or name == "" or "]" in port:
        name, port = host, ""
    swap = {"127.0.0.1": "localhost", "[::1]": "localhost"}
    swap["localhost"] = "[::1]" if ":" in bound else "127.0.0.1"
    name = swap.get(name.lower(), name)
    return f"{name}:{port}" if port else name
