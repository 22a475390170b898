"""The types every part of the server shares: the Hub's request and response shapes, typed 404s,
JSON bodies, and `ServerContext`, what the routes and the handler may use of the server.

This module imports no other part of the server except the repo readers, so the handler, the
routes and the faults can all import it without an import circle back to `server`.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

from .git import GitRepo
from .mirror import Mirror

# The Hub's limit on an org or repo name; a longer one is simply not there (and never reaches the
# filesystem, which would refuse a name over 255 bytes with an error).
MAX_NAME_CHARS = 96
REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space", "kernels": "kernel"}
_TRUE = {"1", "true", "yes", "on"}

# stream(sock, write): sends exactly the response's `length` bytes after the headers.
Stream = Callable[[socket.socket, Callable[[bytes], Any]], None]
# tree_hook(repo_id, commit, entries) -> entries; file_hook(repo_id, commit, path, data) -> data
TreeHook = Callable[[str, str, list[dict[str, Any]]], list[dict[str, Any]]]
FileHook = Callable[[str, str, str, bytes], bytes]


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


class Fault(Protocol):
    """One decided fault (kernels.serve.faults.Fault)."""

    @property
    def kind(self) -> str: ...

    def apply(self, response: Response) -> Response: ...


class Faults(Protocol):
    """A fault plan (kernels.serve.faults.FaultPlan)."""

    def decide(self, method: str, path: str, response: Response) -> Fault | None: ...


class ServerContext(Protocol):
    """What the routes and the handler use of the server; MirrorServer is the implementation."""

    mirror: Mirror
    lfs_redirect: bool
    tree_hook: TreeHook | None
    file_hook: FileHook | None
    faults: Faults | None
    access_log: TextIO | None
    control_token: str | None

    @property
    def host(self) -> str: ...

    @property
    def netloc(self) -> str: ...

    @property
    def requests(self) -> list[tuple[str, str]]: ...

    @property
    def requests_total(self) -> int: ...

    def reset_requests(self) -> None: ...

    def record_request(self, method: str, target: str) -> None: ...


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


def repo_or_404(server: ServerContext, org: str, name: str) -> GitRepo:
    """The repo, or a RepoNotFound error."""
    if len(org) > MAX_NAME_CHARS or len(name) > MAX_NAME_CHARS:
        raise HubError(404, f"Repository not found: {org:.100}/{name:.100}", "RepoNotFound")
    repo = server.mirror.repo(org, name)
    if repo is None:
        raise HubError(404, f"Repository not found: {org}/{name}", "RepoNotFound")
    return repo


def commit_or_404(repo: GitRepo, rev: str) -> str:
    """The commit `rev` names, or a RevisionNotFound error."""
    sha = repo.resolve(rev)
    if sha is None:
        raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
    return sha
