"""MirrorServer: the Hub's read protocol over a folder of git repos, on a background thread."""

from __future__ import annotations

import errno
import ipaddress
import shutil
import socket
import sys
import threading
import time
from collections import deque
from http.server import ThreadingHTTPServer
from pathlib import Path
from socketserver import TCPServer
from typing import Any, TextIO

from .connections import Connections, default_limit
from .faults import FaultPlan
from .handler import MirrorHandler
from .mirror import Mirror
from .protocol import FileHook, TreeHook

# The request log keeps the newest LOG_CAPACITY requests, each target cut at LOG_TARGET_CHARS:
# a few MiB at most, however long the server runs or however long the URLs a client sends.
LOG_CAPACITY = 10_000
LOG_TARGET_CHARS = 1024
# Connections the kernel queues before `accept` (socketserver's default is 5, which made clients
# of a cluster starting at once time out); the kernel caps it at net.core.somaxconn.
LISTEN_BACKLOG = 1024


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, address: tuple[str, int], mirror_server: MirrorServer, max_connections: int):
        self.mirror_server = mirror_server
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.connections = Connections(max_connections)
        super().__init__(address, MirrorHandler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind looks up the FQDN, which stalls on hosts without DNS.
        TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            return super().get_request()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                # Out of descriptors despite the bound (files, pipes): make room, and give the
                # closed connection's thread a moment before the loop tries again.
                self.connections.evict_one()
                time.sleep(0.01)
            raise

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.connections.add(request):
            self.shutdown_request(request)  # every open connection is being answered
            return
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        self.connections.remove(request)
        super().shutdown_request(request)

    def service_actions(self) -> None:
        super().service_actions()
        self.connections.reap()

    def close_connections(self) -> None:
        """Cut every open keep-alive connection, so handler threads end with the server."""
        for sock in self.connections.all():
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return  # the client went away: nothing to report
        super().handle_error(request, client_address)


class MirrorServer:
    """Serve `root` (`root/<org>/<name>` git repos) over HTTP, read-only, as the Hub would.

    The socket is bound on construction (so `.url` is known and port clashes surface at once);
    `start()` serves on a daemon thread. Attributes tests may set while it runs:
    `tree_hook(repo_id, commit, entries) -> entries` rewrites tree listings before they are sent;
    `file_hook(repo_id, commit, path, data) -> data` rewrites file bodies of GETs (HEAD metadata
    keeps describing the true content); `lfs_redirect` picks a CDN-style 302 or inline LFS bytes;
    `root` re-points the server at another folder (with fresh caches); `faults` (a FaultPlan, see
    kernels.serve.faults) makes the server misbehave on purpose.

    At most `max_connections` connections are open at once (default: half the descriptor limit,
    up to 1024); at the bound a new one closes the connection that has waited longest for a
    request, and a started request must be complete within a deadline (kernels.serve.connections).

    The request log (`requests`, `reset_requests()`, bounded: LOG_CAPACITY entries) is for the
    process that owns the server. Over HTTP it exists only when `control_token` is set: then
    `GET /_mirror/requests` and `POST /_mirror/requests/reset` answer requests that carry the
    header `X-Mirror-Token: <token>`, and every other client gets the 404 of an unknown route.
    """

    def __init__(
        self,
        root: Path | str,
        host: str = "127.0.0.1",
        port: int = 0,
        lfs_redirect: bool = True,
        access_log: TextIO | None = None,
        control_token: str | None = None,
        max_connections: int | None = None,
    ):
        if shutil.which("git") is None:
            raise FileNotFoundError("kernels serve needs the `git` executable on PATH")
        self.mirror = Mirror(root)
        self.lfs_redirect = lfs_redirect
        self.tree_hook: TreeHook | None = None
        self.file_hook: FileHook | None = None
        self.faults: FaultPlan | None = None
        self.access_log = access_log
        self.control_token = control_token or None
        self._log: deque[tuple[str, str]] = deque(maxlen=LOG_CAPACITY)
        self._log_total = 0
        self._log_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        limit = max_connections or default_limit()
        self._httpd = _HTTPServer((host.strip("[]"), port), self, limit)

    @property
    def root(self) -> Path:
        return self.mirror.root

    @root.setter
    def root(self, value: Path | str) -> None:
        self.mirror = Mirror(value)

    @property
    def host(self) -> str:
        return str(self._httpd.server_address[0])

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def netloc(self) -> str:
        host = self.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def url(self) -> str:
        """The endpoint to give huggingface_hub (HF_ENDPOINT), e.g. http://127.0.0.1:41234."""
        return f"http://{self.netloc}"

    @property
    def open_connections(self) -> int:
        """Connections open now (at most `max_connections`)."""
        return len(self._httpd.connections)

    @property
    def is_loopback(self) -> bool:
        return is_loopback(self.host)

    def start(self) -> MirrorServer:
        """Serve on a daemon thread; returns self."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._httpd.serve_forever,
                kwargs={"poll_interval": 0.05},
                name=f"kernels-serve:{self.port}",
                daemon=True,
            )
            self._thread.start()
        return self

    def shutdown(self) -> None:
        """Stop serving, close the socket and every open connection (returns within ~0.1 s)."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()
        self._httpd.close_connections()

    def __enter__(self) -> MirrorServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def requests(self) -> list[tuple[str, str]]:
        """(method, request target) of the requests since the last reset, oldest first (the newest
        LOG_CAPACITY of them; targets cut at LOG_TARGET_CHARS); control routes excluded."""
        with self._log_lock:
            return list(self._log)

    @property
    def requests_total(self) -> int:
        """How many requests were recorded since the last reset, including those the log dropped."""
        with self._log_lock:
            return self._log_total

    def reset_requests(self) -> None:
        with self._log_lock:
            self._log.clear()
            self._log_total = 0

    def record_request(self, method: str, target: str) -> None:
        """Add one request to the log (the handler calls it; control routes are not recorded)."""
        if len(target) > LOG_TARGET_CHARS:
            target = target[:LOG_TARGET_CHARS] + "..."
        with self._log_lock:
            self._log.append((method, target))
            self._log_total += 1


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
