"""Item 2: what one endpoint said is never taken as another endpoint's answer.

Two real servers on loopback: the test's Hub (`hub`) and a second mirror. Trust decisions,
resolution records, listings and installed variants recorded while HF_ENDPOINT pointed at one
must not be used at the other: the other is asked, and its answer wins.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import kernels
import pytest
from kernels.errors import UntrustedPublisher
from kernels.serve import MirrorServer

from tests.reliability.helpers import cli_argv, python_argv
from tests.security.conftest import marker_files

GOOD = "good-org/kernel"
EVIL = "evil-org/kernel"

LOAD = """
    import json, sys, kernels, kernels.errors
    repo, how, ref = sys.argv[1:4]
    kwargs = {"version": int(ref)} if how == "version" else {"revision": ref}
    try:
        print(kernels.get_kernel(repo, **kwargs).VALUE)
    except kernels.errors.KernelsError as exc:
        print(type(exc).__name__)
"""


def _load(endpoint: str, repo: str, how: str, ref: str, **env: str) -> str:
    out = subprocess.run(
        python_argv(LOAD) + [repo, how, ref],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_ENDPOINT": endpoint, **env},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.fixture
def mirror(tmp_path) -> Iterator[MirrorServer]:
    """A second server on loopback, over its own folder of repos."""
    root = tmp_path / "mirror-root"
    root.mkdir()
    server = MirrorServer(root).start()
    try:
        yield server
    finally:
        server.shutdown()


def _copy_repo(hub, mirror: MirrorServer, repo: str, *trusted: str) -> None:
    org, name = repo.split("/")
    shutil.copytree(hub.root / org / name, mirror.root / org / name)
    names = ", ".join(f'"{o}"' for o in trusted)
    (mirror.root / "kernels-mirror.toml").write_text(f"trusted_publishers = [{names}]\n")


def test_a_mirrors_trust_is_not_used_at_another_endpoint(hub, mirror, tmp_path, monkeypatch):
    hub.trust("someone-else")  # the Hub does not trust evil-org
    marker = tmp_path / "evil-ran"
    hub.writer(EVIL).commit(marker_files("kernel", marker), branch="v1")
    _copy_repo(hub, mirror, EVIL, "evil-org")  # ... a mirror says it does
    monkeypatch.setenv("HF_ENDPOINT", mirror.url)
    assert kernels.get_kernel(EVIL, version=1).VALUE == 1
    marker.unlink()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    with pytest.raises(UntrustedPublisher):  # in this process (the module is imported already)
        kernels.get_kernel(EVIL, version=1)
    assert _load(hub.url, EVIL, "version", "1") == "UntrustedPublisher"  # a fresh process
    offline = _load(hub.url, EVIL, "version", "1", HF_HUB_OFFLINE="1")
    assert offline in ("UntrustedPublisher", "OfflineCacheMiss")  # nothing recorded for the Hub
    assert not marker.exists()
    assert _load(mirror.url, EVIL, "version", "1", HF_HUB_OFFLINE="1") == "1"  # its own record


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_a_hostile_listing_for_a_real_commit_stays_with_its_endpoint(hub, mirror, tmp_path):
    hub.trust("good-org")
    good_marker, evil_marker = tmp_path / "good-ran", tmp_path / "evil-ran"
    commit = hub.writer(GOOD).commit(marker_files("kernel", good_marker), branch="v1")
    _copy_repo(hub, mirror, GOOD, "good-org")
    evil = f"open({str(evil_marker)!r}, 'a').write('ran\\n')\nVALUE = 66\n".encode()
    init = "build/torch-universal/__init__.py"

    def listing(repo_id, sha, entries):  # the same commit, another __init__.py
        for entry in entries:
            if entry["path"] == init:
                entry.update(oid=_git_blob_id(evil), size=len(evil))
        return entries

    mirror.tree_hook = listing
    mirror.file_hook = lambda repo_id, sha, path, data: evil if path == init else data
    assert _load(mirror.url, GOOD, "revision", commit) == "66"  # the hostile endpoint's code
    evil_marker.unlink()
    hub.reset_requests()
    assert _load(hub.url, GOOD, "revision", commit) == "1"  # pinned: the honest listing
    assert any("/tree/" in path for _m, path in hub.requests)  # it was asked, not remembered
    assert _load(hub.url, GOOD, "version", "1") == "1"
    assert not evil_marker.exists()
    verify = subprocess.run(cli_argv("verify", "--all"), capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout
    rows = subprocess.run(cli_argv("ls", "--json"), capture_output=True, text=True).stdout
    trees = {json.loads(line)["tree"] for line in rows.splitlines()}
    assert len(trees) == 1  # the variant record names the honest tree only
    # The hostile endpoint keeps getting its own answer, not the Hub's (and not silently).
    assert _load(mirror.url, GOOD, "revision", commit) == "66"
    assert Path(evil_marker).exists()


@pytest.fixture
def liar() -> Iterator[str]:
    """A server on loopback that answers every revision with a 40-character non-commit."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"sha": "../" * 13 + "x"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    ).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()


def test_a_commit_id_that_is_not_hex_is_refused_and_not_recorded(liar, monkeypatch):
    from kernels.cache import Cache
    from kernels.errors import IntegrityError

    monkeypatch.setenv("HF_ENDPOINT", liar)
    with pytest.raises(IntegrityError, match="not 40 lowercase hex"):
        kernels.get_kernel(GOOD, version=1, trust_remote_code=True)
    assert Cache(os.environ["KERNELS_CACHE"]).records.get(GOOD, "v1") is None
