"""HTTP/1.1 transport: parse a request, log it, answer it from routes.py, write the response.

Every response carries Content-Length (keep-alive), nothing is compressed, and any failure
inside a route becomes a JSON 500; tracebacks go to the server's stderr, never to the client.
"""

from __future__ import annotations

import hmac
import json
import sys
import traceback
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs

from ..safe_text import safe_text
from .connections import BUSY, IDLE, IDLE_TIMEOUT, READING
from .faults import reset_connection
from .protocol import Request, Response, ServerContext, json_response
from .routes import dispatch

CONTROL_PREFIX = "/_mirror/"
_DRAIN_LIMIT = 1 << 20  # request bodies up to this size are read and dropped, larger ones close


class MirrorHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "kernels-serve"
    sys_version = ""
    disable_nagle_algorithm = True
    timeout = IDLE_TIMEOUT  # per read or write; the server's reaper bounds whole requests

    @property
    def mirror_server(self) -> ServerContext:
        return self.server.mirror_server  # type: ignore[attr-defined]

    def handle_one_request(self) -> None:
        """Wait for a request's first byte (IDLE), then read it (READING: the server closes the
        connection if the headers are not all in by the deadline), then answer it (BUSY)."""
        connections = self.server.connections  # type: ignore[attr-defined]
        connections.set(self.connection, IDLE)
        try:
            started = self.rfile.peek(1)  # type: ignore[attr-defined]
        except OSError:  # timed out, reset, or cut by the server
            started = b""
        if not started:
            self.close_connection = True
            return
        connections.set(self.connection, READING)
        super().handle_one_request()

    def do_GET(self) -> None:
        self._handle()

    def do_HEAD(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_POST

    def _handle(self) -> None:
        # The body is part of the request: it is read while the connection is still READING,
        # under the request's deadline, so a body that never ends is closed like a header that
        # never ends (BUSY connections are never closed to make room).
        if not self._drain_body():
            self.close_connection = True
            return
        self.server.connections.set(self.connection, BUSY)  # type: ignore[attr-defined]
        raw_path, _, query = self.path.partition("?")
        control = raw_path.startswith(CONTROL_PREFIX)
        if not control:
            self.mirror_server.record_request(self.command, self.path)
        try:
            if control:
                response = self._control(raw_path)
            elif self.command in ("GET", "HEAD"):
                request = Request(
                    method=self.command,
                    path=raw_path,
                    query=parse_qs(query, keep_blank_values=True),
                    headers={k.lower(): v for k, v in self.headers.items()},
                    host=self.headers.get("Host") or self.mirror_server.netloc,
                )
                response = dispatch(self.mirror_server, request)
            else:
                response = json_response(
                    {"error": "this mirror is read-only"}, 405, {"Allow": "GET, HEAD"}
                )
        except Exception:
            traceback.print_exc(file=sys.stderr)
            response = json_response({"error": "internal error in the mirror server"}, 500)
        faults = self.mirror_server.faults
        fault = (
            None if control or faults is None else faults.decide(self.command, raw_path, response)
        )
        if fault is not None:
            if fault.kind == "reset":
                self.close_connection = True
                reset_connection(self.connection)
                return
            response = fault.apply(response)
        self._send(response)

    def _control(self, path: str) -> Response:
        """The request log: GET /_mirror/requests, POST /_mirror/requests/reset; only for a client
        that shows the server's control token (none set: no client), else an unknown route."""
        server = self.mirror_server
        token = server.control_token
        shown = self.headers.get("X-Mirror-Token") or ""
        if token is None or not hmac.compare_digest(shown.encode(), token.encode()):
            return json_response({"error": f"no such route: {path}"}, 404)
        if path == "/_mirror/requests" and self.command in ("GET", "HEAD"):
            log = server.requests
            return json_response(
                {"requests": [list(r) for r in log], "count": server.requests_total}
            )
        if path == "/_mirror/requests/reset" and self.command == "POST":
            server.reset_requests()
            return json_response({"requests": [], "count": 0})
        return json_response({"error": f"no such route: {path}"}, 404)

    def _drain_body(self) -> bool:
        """Read a request body so the connection can carry the next request; False when the
        body did not all arrive (the connection was cut at its deadline, or the client left)."""
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if self.headers.get("Transfer-Encoding") or length < 0 or length > _DRAIN_LIMIT:
            self.close_connection = True
        elif length:
            try:
                return len(self.rfile.read(length)) == length
            except OSError:
                return False
        return True

    def _send(self, response: Response) -> None:
        length = response.length if response.stream is not None else len(response.body)
        self.send_response(response.status)
        for name, value in response.headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(length))
        if self.close_connection:
            self.send_header("Connection", "close")
        if self.command == "HEAD" or response.status in (204, 304) or not length:
            self.end_headers()
            return
        if response.stream is None and self.request_version == "HTTP/0.9":
            self.wfile.write(response.body)
            return
        if response.stream is None:
            # Headers and body in one write: no small-packet delay on keep-alive connections.
            self._headers_buffer.extend([b"\r\n", response.body])  # type: ignore[attr-defined]
            self.flush_headers()
            return
        self.end_headers()
        try:
            response.stream(self.connection, self.wfile.write)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception:
            # The status line is gone; all that is left is to cut the connection short.
            self.close_connection = True
            traceback.print_exc(file=sys.stderr)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Protocol errors (bad request line, oversized headers) as JSON, like every other answer."""
        self.close_connection = True
        body = json.dumps({"error": message or self.responses.get(code, ("error",))[0]}).encode()
        try:
            self.send_response(code, message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD" and code >= 200 and code not in (204, 304):
                self.wfile.write(body)
        except OSError:
            pass

    def log_message(self, format: str, *args: object) -> None:
        log = self.mirror_server.access_log
        if log is not None:
            # The request line is the client's: escaped, so it cannot drive the terminal.
            log.write(safe_text(f"{self.address_string()} - {format % args}") + "\n")
            log.flush()
