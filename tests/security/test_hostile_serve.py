"""Issue 15 items 6 and 10: `kernels serve` as the attacked side. It never reads outside DIR
(no symbolic links out of an export snapshot or in place of an LFS object), queues a burst of
connections, keeps a bounded request log that only the token holder can read or reset over HTTP,
and answers over-long names with a 404, not a 500."""

from __future__ import annotations

import hashlib
import http.client
import json
from pathlib import Path

import pytest
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
