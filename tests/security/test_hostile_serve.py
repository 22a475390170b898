"""Issue 15 items 6 and 10, issue 28 item 7: `kernels serve` as the attacked side. It never reads
outside DIR (no symbolic links out of an export snapshot or in place of an LFS object), queues a
burst of connections, keeps a bounded request log that only the token holder can read or reset
over HTTP, answers over-long names with a 404, not a 500, keeps answering honest clients while
many connections sit on half-sent requests, and never builds a redirect from the Host header."""

from __future__ import annotations

import hashlib
import http.client
import json
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from huggingface_hub import HfApi, hf_hub_download
from kernels import hub as hub_client
from kernels.serve import GitRepoWriter, MirrorServer
from kernels.serve import server as server_module
from kernels.serve.lfs import object_path

from tests.security.hostile import connect_burst

COMMIT = "ab" * 20
OTHER = "cd" * 20


def _get(server: MirrorServer, path: str, method: str = "GET", headers: dict | None = None):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    try:
        conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _snapshot(root: Path, outside: Path) -> Path:
    """An export of evil/relu whose commit folder holds links that lead out of the mirror."""
    (outside / "secret").mkdir(parents=True)
    (outside / "secret" / "passwd").write_text("root:x:0:0:secret\n")
    (outside / "secret" / "inner.txt").write_text("also secret\n")
    repo = root / "evil" / "relu"
    variant = repo / "commits" / COMMIT / "build" / "torch-universal"
    variant.mkdir(parents=True)
    (variant / "__init__.py").write_text("VALUE = 1\n")
    (variant / "passwd").symlink_to(outside / "secret" / "passwd")
    (variant / "leak").symlink_to(outside / "secret", target_is_directory=True)
    # A whole commit folder that is a link to a folder outside.
    (repo / "commits" / OTHER).symlink_to(outside / "secret", target_is_directory=True)
    refs = {"main": COMMIT, "other": OTHER}
    (repo / "kernels-export.json").write_text(json.dumps({"format": 1, "refs": {"branches": refs}}))
    return repo


def test_serve_does_not_follow_links_out_of_an_export(tmp_path, monkeypatch):
    root = tmp_path / "mirror"
    _snapshot(root, tmp_path / "outside")
    with MirrorServer(root) as server:
        status, body = _get(server, f"/api/kernels/evil/relu/tree/{COMMIT}?recursive=1")
        assert status == 200
        paths = {entry["path"] for entry in json.loads(body)}
        assert paths == {"build", "build/torch-universal", "build/torch-universal/__init__.py"}
        for path in ("passwd", "leak/inner.txt"):
            status, body = _get(server, f"/evil/relu/resolve/{COMMIT}/build/torch-universal/{path}")
            assert status == 404 and b"secret" not in body
        # The linked commit folder is no commit of this mirror.
        status, _ = _get(server, "/api/kernels/evil/relu/revision/other")
        assert status == 404
        status, body = _get(server, f"/evil/relu/resolve/{OTHER}/passwd")
        assert status == 404 and b"secret" not in body
        # And the loader, through the real client, lists only the real file.
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        listed = hub_client.list_build_files("evil/relu", COMMIT)
        assert [f.path for f in listed] == ["build/torch-universal/__init__.py"]


def test_serve_does_not_follow_a_link_in_place_of_an_lfs_object(tmp_path):
    secret = tmp_path / "outside-secret"
    secret.write_bytes(b"secret bytes of another user\n")
    writer = GitRepoWriter(tmp_path / "mirror" / "evil" / "relu")
    data = b"weights" * 100
    writer.commit({"build/torch-universal/w.bin": writer.lfs(data)})
    location = object_path(writer.gitdir, hashlib.sha256(data).hexdigest())
    location.unlink()
    location.symlink_to(secret)
    with MirrorServer(tmp_path / "mirror", lfs_redirect=False) as server:
        status, body = _get(server, "/evil/relu/resolve/main/build/torch-universal/w.bin")
        assert status == 404 and b"secret" not in body


def test_a_burst_of_connections_is_queued_not_dropped(tmp_path):
    # Bound but not yet serving: every connection has to wait in the listen queue.
    server = MirrorServer(tmp_path)
    try:
        wanted = min(200, int(Path("/proc/sys/net/core/somaxconn").read_text()))
        assert connect_burst(server.host, server.port, 200, wait=0.5) >= wanted
    finally:
        server.shutdown()


def test_the_request_log_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(server_module, "LOG_CAPACITY", 50, raising=False)
    with MirrorServer(tmp_path) as server:
        conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
        try:
            for i in range(80):
                conn.request("GET", f"/org/name/resolve/main/{i}-" + "x" * 8000)
                conn.getresponse().read()
        finally:
            conn.close()
        log = server.requests
        assert len(log) == 50
        assert log[-1][1].startswith("/org/name/resolve/main/79-")
        assert max(len(target) for _, target in log) <= server_module.LOG_TARGET_CHARS + 3
        assert server.requests_total == 80


def test_the_request_log_is_not_readable_or_resettable_without_the_token(tmp_path):
    with MirrorServer(tmp_path) as server:
        _get(server, "/org/name/resolve/main/a.txt")
        assert _get(server, "/_mirror/requests")[0] == 404
        assert _get(server, "/_mirror/requests/reset", "POST")[0] == 404
        assert len(server.requests) == 1
    with MirrorServer(tmp_path, control_token="s3cret") as server:
        _get(server, "/org/name/resolve/main/a.txt")
        wrong = {"X-Mirror-Token": "guess"}
        assert _get(server, "/_mirror/requests", headers=wrong)[0] == 404
        assert _get(server, "/_mirror/requests/reset", "POST", wrong)[0] == 404
        assert len(server.requests) == 1
        right = {"X-Mirror-Token": "s3cret"}
        status, body = _get(server, "/_mirror/requests", headers=right)
        assert status == 200 and json.loads(body)["count"] == 1
        assert _get(server, "/_mirror/requests/reset", "POST", right)[0] == 200
        assert server.requests == []


@pytest.mark.parametrize(
    "path",
    [
        "/api/kernels/{long}/relu",
        "/api/kernels/evil/{long}/tree/main",
        "/api/models/{long}/{long}/revision/main",
        "/{long}/relu/resolve/main/a.txt",
        "/kernels/evil/{long}/resolve/main/a.txt",
        "/api/organizations/{long}/overview",
    ],
)
def test_over_long_names_are_not_found_not_errors(tmp_path, capfd, path):
    (tmp_path / "evil").mkdir()
    with MirrorServer(tmp_path) as server:
        status, body = _get(server, path.format(long="a" * 300))
    assert status == 404, body
    assert "Traceback" not in capfd.readouterr().err


# -- issue 28 item 7: half-sent connections, and the Host header ---------------------------------

SERVE_FD_LIMIT = 1024  # the usual default soft and hard limit of a login shell
HALF_SENT = 1100


def _half_sent_connections(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` connections that each send part of a request's headers and then stay silent."""
    socks = []
    for _ in range(count):
        s = socket.create_connection((host, port), timeout=10)
        s.sendall(b"GET /api/kernels/evil/relu HTTP/1.1\r\nHost: x\r\nUser-Agent: slow")
        socks.append(s)
    return socks


def _raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"needs {needed} open files; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def test_half_sent_connections_do_not_stop_honest_clients(tmp_path):
    """1,100 connections that never finish their headers, against `kernels serve` limited to
    1,024 open files (it cannot even hold them all): a real client is still answered at once.
    This test process needs ~1,200 files of its own, so it raises its soft limit (not the
    server's: the server runs with soft = hard = 1,024)."""
    root = tmp_path / "mirror"
    GitRepoWriter(root / "evil" / "relu").commit({"README.md": "relu\n"})
    _raise_fd_limit(HALF_SENT + 200)

    # `kernels serve` in a process of its own, limited as a login shell would limit it (set in
    # that process, not with preexec_fn, which is unsafe in this threaded test process).
    serve = (
        "import resource, sys; from kernels.serve import main; "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({SERVE_FD_LIMIT}, {SERVE_FD_LIMIT})); "
        "sys.exit(main(sys.argv[1:]))"
    )
    server = subprocess.Popen(
        [sys.executable, "-c", serve, str(root), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    socks: list[socket.socket] = []
    try:
        url = server.stdout.readline().strip().rsplit(" ", 1)[-1]
        host, port = url.removeprefix("http://").rsplit(":", 1)
        socks = _half_sent_connections(host, int(port), HALF_SENT)
        time.sleep(0.5)  # let the server take in what it will
        started = time.monotonic()
        api = HfApi(endpoint=url)
        # Before the fix this client waited in the listen queue until its own timeout.
        refs = api.list_repo_refs("evil/relu", repo_type="kernel")
        assert [b.name for b in refs.branches] == ["main"]
        assert time.monotonic() - started < 5
        # And again, with every half-sent connection still open on this side.
        started = time.monotonic()
        assert api.list_repo_refs("evil/relu", repo_type="kernel").branches
        assert time.monotonic() - started < 5
    finally:
        for s in socks:
            s.close()
        server.terminate()
        server.wait(timeout=20)


def test_connections_over_the_bound_close_the_oldest_waiting_one(tmp_path):
    """In process, with a bound of 8: the oldest half-sent connection is closed to make room,
    an honest request on a new connection is answered, and the count never exceeds the bound."""
    GitRepoWriter(tmp_path / "evil" / "relu").commit({"README.md": "relu\n"})
    with MirrorServer(tmp_path, max_connections=8) as server:
        socks = _half_sent_connections(server.host, server.port, 20)
        try:
            time.sleep(0.3)
            status, _ = _get(server, "/api/kernels/evil/relu/refs")
            assert status == 200
            socks[0].settimeout(5)
            assert socks[0].recv(100) == b""  # the first one was closed
            assert server.open_connections <= 8
        finally:
            for s in socks:
                s.close()


def test_a_waiting_connection_is_closed_at_its_deadline(tmp_path, monkeypatch):
    """A client that sends one header byte at a time never trips a per-read timeout; it is
    closed when the whole request has not arrived within the deadline."""
    from kernels.serve import connections

    monkeypatch.setattr(connections, "REQUEST_DEADLINE", 1.0)
    with MirrorServer(tmp_path) as server:
        s = socket.create_connection((server.host, server.port), timeout=10)
        try:
            s.sendall(b"GET / HTTP/1.1\r\n")
            started = time.monotonic()
            closed = False
            while time.monotonic() - started < 6:
                try:
                    s.sendall(b"X")
                except OSError:
                    closed = True
                    break
                s.settimeout(0.2)
                try:
                    if s.recv(100) == b"":
                        closed = True
                        break
                except TimeoutError:
                    pass
            assert closed and time.monotonic() - started < 4
        finally:
            s.close()


def test_the_lfs_redirect_is_not_built_from_the_host_header(tmp_path):
    writer = GitRepoWriter(tmp_path / "evil" / "relu")
    writer.commit({"w.bin": writer.lfs(b"weights" * 100)})
    with MirrorServer(tmp_path) as server:
        for host in ("attacker.example", "attacker.example:80", f"127.0.0.1:{server.port}@x.y"):
            conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
            try:
                conn.request("HEAD", "/evil/relu/resolve/main/w.bin", headers={"Host": host})
                resp = conn.getresponse()
                location = resp.getheader("Location") or ""
            finally:
                conn.close()
            assert resp.status == 302
            assert "attacker" not in location and "x.y" not in location, location
            assert location.startswith(("/_lfs/", f"http://localhost:{server.port}/_lfs/"))


def test_an_lfs_redirect_on_an_address_without_a_twin_is_relative(tmp_path):
    """Bound to 127.0.0.2 (no other name for it): the 302 is relative, and the real client
    follows it to the bytes."""
    data = b"weights" * 1000
    writer = GitRepoWriter(tmp_path / "evil" / "relu")
    writer.commit({"w.bin": writer.lfs(data)})
    with MirrorServer(tmp_path, host="127.0.0.2") as server:
        conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
        conn.request("HEAD", "/evil/relu/resolve/main/w.bin")
        location = conn.getresponse().getheader("Location")
        conn.close()
        assert location.startswith("/_lfs/evil/relu/")
        path = hf_hub_download("evil/relu", "w.bin", cache_dir=tmp_path / "hf", endpoint=server.url)
        assert Path(path).read_bytes() == data
        assert any(p.startswith("/_lfs/") for _, p in server.requests)
