"""Red team, issue 28 item 7 re-run: `kernels serve` attacked by its clients, variants the fixes
did not name.

* A request whose body never ends (a POST, or a GET with Content-Length) used to hold its
  connection past the header deadline: the connection counted as being answered, which the
  bound never closes, so a handful of them stopped every honest client.
* The access log (`kernels serve -v`) wrote the request line as the client sent it: ESC, BEL and
  the one-byte CSI reached the operator's terminal.
* A kernels-mirror.toml holding an integer of more than 4,300 digits stopped `kernels serve` with
  a traceback (Python's int-parsing limit is a ValueError, not a TOMLDecodeError).

And variants that fail as they should: a folded Host header, absolute-form request targets,
many idle keep-alive connections, and a trickled request line.
"""

from __future__ import annotations

import http.client
import io
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kernels.errors import InvalidSpec
from kernels.serve import GitRepoWriter, MirrorServer
from kernels.serve.cli import TimestampedLog
from kernels.serve.mirror import read_trusted_publishers

RAW = ("\x1b", "\x07", "\x9b")


def _repo(root: Path) -> None:
    writer = GitRepoWriter(root / "evil" / "relu")
    writer.commit({"README.md": "relu\n", "w.bin": writer.lfs(b"weights" * 100)})


def _honest_get(server: MirrorServer, path: str = "/api/kernels/evil/relu/refs") -> int:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


@pytest.mark.parametrize("method", ["POST", "GET"])
def test_a_body_that_never_ends_does_not_hold_a_connection(tmp_path, monkeypatch, method):
    """Eight requests (the bound) whose bodies stop after 3 of 1,000 bytes: past the request
    deadline they are closed, and an honest client is answered. Before: each counted as being
    answered (BUSY) while the server waited for the body, so the bound refused every new
    connection for as long as the per-read timeout (120 s, renewed by each trickled byte)."""
    from kernels.serve import connections

    monkeypatch.setattr(connections, "REQUEST_DEADLINE", 1.0)
    _repo(tmp_path)
    with MirrorServer(tmp_path, max_connections=8) as server:
        socks = []
        try:
            for _ in range(8):
                s = socket.create_connection((server.host, server.port), timeout=10)
                s.sendall(
                    f"{method} /api/kernels/evil/relu/refs HTTP/1.1\r\nHost: a\r\n"
                    "Content-Length: 1000\r\n\r\nabc".encode()
                )
                socks.append(s)
            time.sleep(2.5)  # past the deadline (and a few reaper rounds)
            assert _honest_get(server) == 200
            for s in socks:
                s.settimeout(5)
                assert s.recv(1000) == b""  # closed, never answered
        finally:
            for s in socks:
                s.close()


def test_a_complete_body_is_still_read_and_answered(tmp_path):
    """The other side of the fix: a POST with its whole body gets the read-only 405, and the
    connection carries the next request."""
    _repo(tmp_path)
    with MirrorServer(tmp_path) as server:
        conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
        try:
            conn.request("POST", "/api/kernels/evil/relu/refs", body=b"x" * 5000)
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 405
            conn.request("GET", "/api/kernels/evil/relu/refs")
            assert conn.getresponse().status == 200
        finally:
            conn.close()


def test_the_access_log_escapes_the_request_line(tmp_path):
    """`kernels serve -v`: a client's request line with ESC[2K, an OSC 8 link, BEL and the
    one-byte CSI must reach the operator's terminal escaped. Before: written raw (the handler's
    log_message bypassed http.server's own escaping)."""
    log = io.StringIO()
    with MirrorServer(tmp_path, access_log=TimestampedLog(log)) as server:
        s = socket.create_connection((server.host, server.port), timeout=10)
        try:
            s.sendall(
                b"GET /\x1b[2K\x1b]8;;http://evil.example/\x07x\x9b31m HTTP/1.1\r\nHost: a\r\n\r\n"
            )
            assert s.recv(100).startswith(b"HTTP/1.1 404")
        finally:
            s.close()
        deadline = time.monotonic() + 5
        while "404" not in log.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
    text = log.getvalue()
    assert "404" in text
    assert not any(c in text for c in RAW), repr(text)
    assert "\\x1b[2K" in text


def test_a_huge_integer_in_the_mirror_config_is_a_typed_error(tmp_path):
    """Python refuses to parse an integer of more than 4,300 digits with a ValueError that
    tomllib lets through. Before: `kernels serve` died with a traceback."""
    (tmp_path / "kernels-mirror.toml").write_text(f"trusted_publishers = []\nx = {'9' * 5000}\n")
    with pytest.raises(InvalidSpec):
        read_trusted_publishers(tmp_path / "kernels-mirror.toml")
    out = subprocess.run(
        [sys.executable, "-m", "kernels", "serve", str(tmp_path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.startswith("error: cannot read mirror config"), out.stderr


# -- variants that fail as they should ---------------------------------------------------------


def test_a_folded_host_header_does_not_reach_the_redirect(tmp_path):
    """obs-fold: `Host: 127.0.0.1:PORT` continued on a second line with an attacker's text. The
    Location is the loopback twin or relative, nothing of the header is copied, and no header
    of the answer carries the continuation."""
    _repo(tmp_path)
    with MirrorServer(tmp_path) as server:
        s = socket.create_connection((server.host, server.port), timeout=10)
        try:
            s.sendall(
                f"HEAD /evil/relu/resolve/main/w.bin HTTP/1.1\r\nHost: 127.0.0.1:{server.port}"
                "\r\n Set-Cookie: evil=1\r\n\r\n".encode()
            )
            head = s.recv(4000).decode("latin-1")
        finally:
            s.close()
    assert head.startswith(("HTTP/1.1 302", "HTTP/1.1 400")), head
    assert "set-cookie" not in head.lower(), head
    location = [line for line in head.split("\r\n") if line.lower().startswith("location:")]
    assert all(line.split(":", 1)[1].strip().startswith("/_lfs/") for line in location), head


@pytest.mark.parametrize(
    "target",
    [
        "http://attacker.example/evil/relu/resolve/main/w.bin",
        "http://attacker.example/_mirror/requests",
        "//_mirror/requests",
        "*",
        "evil/relu/resolve/main/w.bin",
        "/evil/relu/resolve/main/..%2f..%2f..%2fetc%2fpasswd",
        "/api/kernels/%2e%2e/%2e%2e/revision/main",
        "/evil/relu/resolve/main/%00",
    ],
)
def test_odd_request_targets_are_refused_quietly(tmp_path, target, capfd):
    """Absolute-form and odd targets: a 4xx, no traceback on the server's stderr, no file from
    outside the mirror, and the request log routes stay hidden without the token."""
    _repo(tmp_path)
    with MirrorServer(tmp_path, control_token="sekrit") as server:
        conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
        try:
            conn.request("GET", target)
            resp = conn.getresponse()
            body = resp.read()
        finally:
            conn.close()
    assert 400 <= resp.status < 500, (resp.status, body[:200])
    assert b"root:" not in body and b'"count"' not in body
    assert "Traceback" not in capfd.readouterr().err


def test_many_idle_keep_alive_connections_make_room_for_a_new_one(tmp_path):
    """Twelve clients each finish a request and keep the connection open (keep-alive), with
    a bound of 8: idle ones are closed to make room, a new client is answered."""
    _repo(tmp_path)
    with MirrorServer(tmp_path, max_connections=8) as server:
        conns = []
        try:
            for _ in range(12):
                conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
                conn.request("GET", "/api/kernels/evil/relu/refs")
                conn.getresponse().read()
                conns.append(conn)
            assert _honest_get(server) == 200
            assert server.open_connections <= 8
        finally:
            for conn in conns:
                conn.close()
