"""A hostile Hub on loopback: an http.server whose answers each test writes.

`HostileHub` speaks just enough of the Hub's read protocol (research notes: hub-test-server) for
the loader to walk a load against it: a revision answer, a tree listing of build/, file bodies and
an org overview. `KernelRepo` builds honest answers for one repo; a test then bends the one answer
it attacks with (a malformed commit id, a paging loop, a gzip bomb, a trickle, a huge declared
size). Every request is recorded with its headers, so a test can see what the client sent and to
whom. Nothing here mocks the client: the real huggingface_hub session talks real HTTP to it.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from socketserver import TCPServer
from urllib.parse import unquote

import pytest
from kernels.cache import Cache

from tests.kernel_repos import metadata


@dataclass
class Seen:
    """One request the hostile server received."""

    method: str
    path: str  # with the query string
    headers: dict[str, str]  # lower-case names


@dataclass
class Reply:
    """An answer: `body` bytes at once, or `chunks` of (bytes, seconds to wait before them)."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    chunks: Iterable[tuple[bytes, float]] | None = None
    length: int | None = None  # Content-Length to announce with `chunks`


def json_reply(data: object, status: int = 200, headers: dict[str, str] | None = None) -> Reply:
    return Reply(
        status, {"Content-Type": "application/json", **(headers or {})}, json.dumps(data).encode()
    )


def not_found(code: str = "EntryNotFound") -> Reply:
    return json_reply(
        {"error": "not found"}, 404, {"X-Error-Code": code, "X-Error-Message": "nope"}
    )


Route = Callable[[Seen, re.Match], Reply]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        hub: HostileHub = self.server.hostile  # type: ignore[attr-defined]
        seen = Seen(self.command, self.path, {k.lower(): v for k, v in self.headers.items()})
        hub.seen.append(seen)
        reply = hub.answer(seen)
        self.send_response(reply.status)
        for name, value in reply.headers.items():
            self.send_header(name, value)
        if reply.chunks is None:
            self.send_header("Content-Length", str(len(reply.body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(reply.body)
            return
        if reply.length is not None:
            self.send_header("Content-Length", str(reply.length))
        self.send_header("Connection", "close")
        self.close_connection = True
        self.end_headers()
        try:
            for data, wait in reply.chunks:
                if hub.stopping.wait(wait):
                    return
                self.wfile.write(data)
                self.wfile.flush()
        except OSError:
            return  # the client gave up: what a trickle test wants

    do_HEAD = do_GET

    def log_message(self, format: str, *args: object) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def server_bind(self) -> None:  # skip the FQDN lookup of HTTPServer
        TCPServer.server_bind(self)

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # clients that stop reading (what the tests make them do) are not errors here


class HostileHub:
    """An HTTP server on 127.0.0.1 (random port) that answers from `routes` (first match wins)."""

    def __init__(self) -> None:
        self.routes: list[tuple[re.Pattern, Route]] = []
        self.seen: list[Seen] = []
        self.stopping = threading.Event()
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self._httpd.hostile = self  # type: ignore[attr-defined]
        # A short poll: shutdown() waits for the loop's next poll, once per test.
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def route(self, pattern: str, answer: Route) -> None:
        """Answer paths (without the query) that fully match `pattern`; later routes win."""
        self.routes.insert(0, (re.compile(pattern), answer))

    def answer(self, seen: Seen) -> Reply:
        path = seen.path.partition("?")[0]
        for pattern, answer in self.routes:
            match = pattern.fullmatch(path)
            if match:
                return answer(seen, match)
        return not_found("RepoNotFound")

    def paths(self, contains: str = "") -> list[str]:
        return [s.path for s in self.seen if contains in s.path]

    def __enter__(self) -> HostileHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self._httpd.shutdown()
        self._httpd.server_close()


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class KernelRepo:
    """Honest answers for one kernel repo at one commit; tests override single routes after."""

    repo_id: str
    files: dict[str, bytes]  # path under the repo (build/<variant>/...) -> bytes
    commit: str = "c0ffee" * 6 + "c0ff"

    def listing(self) -> list[dict]:
        return [
            {"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": path}
            for path, data in sorted(self.files.items())
        ]

    def install(self, hub: HostileHub) -> None:
        repo = re.escape(self.repo_id)
        hub.route(
            rf"/api/kernels/{repo}/revision/[^/]+",
            lambda _s, _m: json_reply({"id": self.repo_id, "sha": self.commit}),
        )
        hub.route(
            rf"/api/kernels/{repo}/tree/[^/]+/build", lambda _s, _m: json_reply(self.listing())
        )

        def body(_seen: Seen, match: re.Match) -> Reply:
            data = self.files.get(unquote(match.group(1)))  # the client quotes odd names
            if data is None:
                return not_found()
            return Reply(200, {"X-Repo-Commit": self.commit}, data)

        hub.route(rf"/kernels/{repo}/resolve/[^/]+/(.+)", body)
        hub.route(
            r"/api/organizations/[^/]+/overview",
            lambda _s, m: json_reply({"name": "x", "trustedKernelPublisher": False}),
        )


def simple_kernel(variant: str = "torch-universal") -> dict[str, bytes]:
    """The files of a small pure-Python variant (no torch needed to install it)."""
    base = f"build/{variant}"
    return {
        f"{base}/metadata.json": metadata("relu").encode(),
        f"{base}/__init__.py": b"VALUE = 1\n",
    }


def cache_files(cache: Cache) -> list[Path]:
    """Every file in the cache, relative to its root (to show what a refused answer left)."""
    root = Path(cache.root)
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())


def trickle(data: bytes, every: float) -> Iterable[tuple[bytes, float]]:
    """`data` one byte at a time, `every` seconds apart."""
    for i in range(len(data)):
        yield data[i : i + 1], every


def connect_burst(host: str, port: int, count: int, wait: float) -> int:
    """Open `count` connections at once without sending anything; how many the kernel completed
    within `wait` seconds (a connection counts once the handshake is done, accepted or queued)."""
    import selectors

    sel = selectors.DefaultSelector()
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            s.connect_ex((host, port))
            socks.append(s)
            sel.register(s, selectors.EVENT_WRITE)
        done = 0
        deadline = time.monotonic() + wait
        while done < count and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=max(0.0, deadline - time.monotonic())):
                sel.unregister(key.fileobj)
                if key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    done += 1
        return done
    finally:
        sel.close()
        for s in socks:
            s.close()


@pytest.fixture
def hostile(monkeypatch: pytest.MonkeyPatch) -> Iterator[HostileHub]:
    """A hostile Hub on loopback, the endpoint of this test (the loader reads HF_ENDPOINT per
    call), with the org `evil` trusted so that only the attack under test can stop a load.
    (A fixture here rather than in a conftest: test modules import it by name.)"""
    with HostileHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("KERNELS_TRUSTED_PUBLISHERS", "evil")
        yield hub
