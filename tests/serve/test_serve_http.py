"""The wire format of `kernels serve`, checked with raw HTTP (http.client, no Hub client)."""

from __future__ import annotations

import hashlib
import http.client
import json
import subprocess
import time
from urllib.parse import quote, urlparse

import pytest
from kernels.serve import MirrorServer

REPO = "kernels-test/relu"
INIT = "build/torch-universal/relu/__init__.py"


def connect(url: str) -> http.client.HTTPConnection:
    parsed = urlparse(url)
    return http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=10)


def call(url: str, method: str, path: str, headers: dict | None = None):
    conn = connect(url)
    try:
        conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        return resp, resp.read()
    finally:
        conn.close()


def git_blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_resolve_headers(hub, relu):
    body = b'VERSION = "1.0.0"\n'
    for method in ("HEAD", "GET"):
        resp, data = call(hub.url, method, f"/{REPO}/resolve/v1.0.0/{INIT}")
        assert resp.status == 200
        assert resp.getheader("X-Repo-Commit") == relu.v1
        assert resp.getheader("ETag") == f'"{git_blob_sha(body)}"'
        assert resp.getheader("Content-Length") == str(len(body))
        assert resp.getheader("Accept-Ranges") == "bytes"
        assert resp.getheader("Content-Encoding") is None
        assert not [h for h, _ in resp.getheaders() if h.lower().startswith("x-xet")]
        assert data == (body if method == "GET" else b"")


@pytest.mark.parametrize("prefix", ["", "/models", "/kernels"])
def test_repo_type_prefixes_resolve_alike(hub, relu, prefix):
    resp, data = call(hub.url, "GET", f"{prefix}/{REPO}/resolve/{relu.v09}/README.md")
    assert resp.status == 200 and data == b"# relu\n"


@pytest.mark.parametrize(
    ("range_header", "status", "expected"),
    [
        ("bytes=10-", 206, (10, 17)),
        ("bytes=2-5", 206, (2, 5)),
        ("bytes=-4", 206, (14, 17)),
        ("bytes=5-1000", 206, (5, 17)),
        ("bytes=18-", 416, None),
        ("bytes=0-1,4-5", 200, None),  # several ranges: ignored, whole body
        ("items=0-1", 200, None),
    ],
)
def test_range_requests(hub, relu, range_header, status, expected):
    full = b'VERSION = "1.0.0"\n'
    resp, data = call(hub.url, "GET", f"/{REPO}/resolve/v1/{INIT}", {"Range": range_header})
    assert resp.status == status
    if status == 206:
        first, last = expected
        assert data == full[first : last + 1]
        assert resp.getheader("Content-Range") == f"bytes {first}-{last}/{len(full)}"
    elif status == 200:
        assert data == full
    else:
        assert resp.getheader("Content-Range") == f"bytes */{len(full)}"


def test_range_on_streamed_and_lfs_files(hub, relu):
    resp, data = call(
        hub.url, "GET", f"/{REPO}/resolve/main/big.bin", {"Range": "bytes=300000-300009"}
    )
    assert resp.status == 206 and data == relu.big_data[300000:300010]
    hub.server.lfs_redirect = False
    resp, data = call(
        hub.url, "GET", f"/{REPO}/resolve/main/weights.bin", {"Range": "bytes=299990-"}
    )
    assert resp.status == 206 and data == relu.lfs_data[299990:]


def test_if_none_match_gives_304(hub, relu):
    resp, _ = call(hub.url, "HEAD", f"/{REPO}/resolve/main/README.md")
    etag = resp.getheader("ETag")
    resp, data = call(hub.url, "GET", f"/{REPO}/resolve/main/README.md", {"If-None-Match": etag})
    assert resp.status == 304 and data == b""
    assert resp.getheader("X-Repo-Commit") == relu.main
    resp, _ = call(hub.url, "GET", f"/{REPO}/resolve/main/README.md", {"If-None-Match": '"abc"'})
    assert resp.status == 200


def test_lfs_redirect_goes_to_another_loopback_origin(hub, relu):
    digest = hashlib.sha256(relu.lfs_data).hexdigest()
    resp, _ = call(hub.url, "HEAD", f"/{REPO}/resolve/main/weights.bin")
    assert resp.status == 302
    assert resp.getheader("X-Linked-Etag") == f'"{digest}"'
    assert resp.getheader("X-Linked-Size") == str(len(relu.lfs_data))
    assert resp.getheader("X-Repo-Commit") == relu.main
    assert resp.getheader("Content-Length") == "0"
    location = urlparse(resp.getheader("Location"))
    assert location.hostname == "localhost" and location.port == hub.server.port
    resp, data = call(hub.url, "GET", f"{location.path}?{location.query}")
    assert resp.status == 200 and data == relu.lfs_data
    assert resp.getheader("X-Linked-Etag") == f'"{digest}"'
    assert resp.getheader("X-Repo-Commit") == relu.main


def test_lfs_inline_mode(hub, relu):
    hub.server.lfs_redirect = False
    resp, data = call(hub.url, "GET", f"/{REPO}/resolve/main/weights.bin")
    assert resp.status == 200 and data == relu.lfs_data
    assert resp.getheader("X-Linked-Size") == str(len(relu.lfs_data))


def test_lfs_object_missing_from_mirror(hub, relu):
    digest = hashlib.sha256(relu.lfs_data).hexdigest()
    obj = relu.writer.gitdir / "lfs" / "objects" / digest[:2] / digest[2:4] / digest
    obj.unlink()
    resp, _ = call(hub.url, "HEAD", f"/{REPO}/resolve/main/weights.bin")
    assert resp.status == 302  # the pointer is still in git: the metadata stays valid
    resp, data = call(hub.url, "GET", f"/_lfs/{REPO}/{digest}")
    assert resp.status == 404 and resp.getheader("X-Error-Code") == "EntryNotFound"
    assert "git lfs fetch" in json.loads(data)["error"]


@pytest.mark.parametrize(
    ("path", "code"),
    [
        (f"/{REPO}/resolve/main/nope.txt", "EntryNotFound"),
        (f"/{REPO}/resolve/main/build", "EntryNotFound"),  # a directory is not a file
        (f"/{REPO}/resolve/nope/README.md", "RevisionNotFound"),
        (f"/{REPO}/resolve/{quote('main~1', safe='')}/README.md", "RevisionNotFound"),
        ("/kernels-test/missing/resolve/main/README.md", "RepoNotFound"),
        ("/../etc/resolve/main/passwd", "RepoNotFound"),
        ("/kernels-test/.git/resolve/main/HEAD", "RepoNotFound"),
        (f"/api/models/{REPO}/revision/nope", "RevisionNotFound"),
        (f"/api/kernels/{REPO}/tree/main/nope", "EntryNotFound"),
        ("/api/kernels/kernels-test/missing", "RepoNotFound"),
    ],
)
def test_typed_errors(hub, relu, path, code):
    resp, data = call(hub.url, "GET", path)
    assert resp.status == 404
    assert resp.getheader("X-Error-Code") == code
    assert resp.getheader("X-Error-Message")
    assert "error" in json.loads(data)
    commit = resp.getheader("X-Repo-Commit")
    assert commit == (relu.main if code == "EntryNotFound" else None)


@pytest.mark.parametrize(
    "path",
    ["/", "/api/agent-harnesses", "/api/whoami-v2", "/kernels-test", "/api/models/a", "/x/y/z"],
)
def test_unknown_routes_are_json_404(hub, path):
    start = time.perf_counter()
    resp, data = call(hub.url, "GET", path)
    assert resp.status == 404 and resp.getheader("Content-Type") == "application/json"
    assert "error" in json.loads(data)
    assert time.perf_counter() - start < 1.0


def test_writes_are_refused(hub, relu):
    conn = connect(hub.url)
    conn.request("POST", f"/api/models/{REPO}/commit/main", body=b'{"x": 1}')
    resp = conn.getresponse()
    assert resp.status == 405 and "read-only" in json.loads(resp.read())["error"]
    conn.request("GET", f"/{REPO}/resolve/main/README.md")  # same connection still usable
    assert conn.getresponse().read() == b"# relu\n"
    conn.close()


def test_keep_alive_serves_many_requests_on_one_connection(hub, relu):
    conn = connect(hub.url)
    for _ in range(5):
        conn.request("HEAD", f"/{REPO}/resolve/main/README.md")
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200
        conn.request("GET", f"/api/models/{REPO}/refs")
        assert "branches" in json.loads(conn.getresponse().read())
    conn.close()


def test_tree_booleans_are_case_insensitive(hub, relu):
    def tree(query: str) -> list:
        resp, data = call(hub.url, "GET", f"/api/models/{REPO}/tree/v1?{query}")
        assert resp.status == 200
        return json.loads(data)

    shallow = tree("recursive=false&expand=False")
    assert [e["path"] for e in shallow] == ["README.md", "build"]
    assert tree("recursive=True") == tree("recursive=true") == tree("recursive=1")
    assert len(tree("recursive=TRUE")) == 9
    entry = tree("")[0]
    assert entry == {
        "type": "file",
        "oid": git_blob_sha(b"# relu\n"),
        "size": 7,
        "path": "README.md",
    }


def test_info_json_shape(hub, relu):
    _, data = call(
        hub.url, "GET", f"/api/kernels/{REPO}/revision/{quote('refs/tags/v1.0.0', safe='')}"
    )
    kernel = json.loads(data)
    assert kernel["sha"] == relu.v1 and kernel["id"] == REPO and "siblings" not in kernel
    assert kernel["lastModified"].endswith("Z")
    _, data = call(hub.url, "GET", f"/api/models/{REPO}")
    model = json.loads(data)
    assert model["sha"] == relu.main and model["modelId"] == REPO
    assert {"rfilename": "weights.bin"} in model["siblings"]


def test_empty_repo_exists_without_a_sha(hub):
    hub.writer("org/empty")
    resp, data = call(hub.url, "GET", "/api/models/org/empty")
    assert resp.status == 200 and json.loads(data)["sha"] is None


def test_control_routes_are_not_counted(hub, relu):
    hub.server.control_token = "t0ken"
    token = {"X-Mirror-Token": "t0ken"}
    try:
        call(hub.url, "GET", f"/{REPO}/resolve/main/README.md")
        _, data = call(hub.url, "GET", "/_mirror/requests", token)
        log = json.loads(data)
        assert log == {"requests": [["GET", f"/{REPO}/resolve/main/README.md"]], "count": 1}
        resp, _ = call(hub.url, "POST", "/_mirror/requests/reset", token)
        assert resp.status == 200
        _, data = call(hub.url, "GET", "/_mirror/requests", token)
        assert json.loads(data)["count"] == 0
        assert hub.requests == []
    finally:
        hub.server.control_token = None


def test_shutdown_is_fast_and_closes_keep_alive_connections(tmp_path):
    server = MirrorServer(tmp_path).start()
    conn = connect(server.url)
    conn.request("GET", "/api/agent-harnesses")
    conn.getresponse().read()
    start = time.perf_counter()
    server.shutdown()
    assert time.perf_counter() - start < 0.5
    with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
        conn.request("GET", "/api/agent-harnesses")
        conn.getresponse().read()
    conn.close()


def test_etag_matches_git(hub, relu):
    out = subprocess.run(
        ["git", f"--git-dir={relu.writer.gitdir}", "rev-parse", f"{relu.main}:big.bin"],
        capture_output=True,
        text=True,
        check=True,
    )
    resp, _ = call(hub.url, "HEAD", f"/{REPO}/resolve/main/big.bin")
    assert resp.getheader("ETag") == f'"{out.stdout.strip()}"'
    assert resp.getheader("Content-Length") == str(len(relu.big_data))


def test_internal_error_is_json_500_and_server_keeps_serving(hub, relu, capsys):
    def broken(repo_id, commit, entries):
        raise RuntimeError("hook exploded")

    hub.server.tree_hook = broken
    resp, data = call(hub.url, "GET", f"/api/models/{REPO}/tree/main")
    assert resp.status == 500
    assert json.loads(data) == {"error": "internal error in the mirror server"}
    assert "hook exploded" in capsys.readouterr().err  # the traceback goes to the server's stderr
    resp, _ = call(hub.url, "HEAD", f"/{REPO}/resolve/main/README.md")
    assert resp.status == 200
