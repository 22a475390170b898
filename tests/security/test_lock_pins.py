"""What a kernels.lock pins, and what it does not (issue 28 item 5, issue 31 item 3).

- A lock pins a commit of the repo it names. A kernel-status.toml redirect names a *branch* of
  another repo: followed by a locked load, it turned a pinned load into an unpinned one (the
  destination branch's code of the day ran). Now a commit-only lock of a redirecting repo is
  refused (LockfileError), a lock with file digests loads the locked files themselves, and
  `kernels lock` refuses to lock a repo that redirects.
- A lock with file digests proves the bytes by itself: its kernels load from the cache whatever
  the endpoint (a mirror's download, then the Hub offline), but only the bytes it pins: a hostile
  endpoint's files for the same commit are never served for it. Trust is not in the lock: it is
  still decided at the current endpoint or by the user. A commit-only lock gets none of this.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import kernels
import pytest
from kernels.errors import LockfileError
from kernels.serve import MirrorServer

from tests.reliability.helpers import cli_argv, python_argv
from tests.security.conftest import marker_files

OLD = "lab-org/old"
NEW = "lab-org/new"
GOOD = "good-org/kernel"
INIT = "build/torch-universal/__init__.py"
DEAD = "http://127.0.0.1:9"  # an endpoint nobody answers at: offline runs never ask it

LOCKED = """
    import sys, kernels, kernels.errors
    try:
        print(kernels.get_locked_kernel(sys.argv[1], lockfile=sys.argv[2]).VALUE)
    except kernels.errors.KernelsError as exc:
        print(type(exc).__name__)
        print(exc, file=sys.stderr)
"""


def _env(**changes: str | None) -> dict:
    env = dict(os.environ)
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def _locked(repo: str, lock: Path, **env: str | None) -> subprocess.CompletedProcess:
    """get_locked_kernel in a fresh process: stdout is VALUE or the error's class name."""
    out = subprocess.run(
        python_argv(LOCKED) + [repo, str(lock)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(**env),
    )
    assert out.returncode == 0, out.stderr
    return out


def _cli(*args: str, **env: str | None) -> subprocess.CompletedProcess:
    return subprocess.run(
        cli_argv(*args), capture_output=True, text=True, timeout=120, env=_env(**env)
    )


def _redirect(destination: str, revision: str = "v1") -> str:
    return f'kind = "redirect"\ndestination = "{destination}"\nrevision = "{revision}"\n'


def _project(tmp_path: Path, deps: dict) -> Path:
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    lines = ["[tool.kernels.dependencies]"] + [f'"{r}" = {json.dumps(v)}' for r, v in deps.items()]
    (project / "pyproject.toml").write_text("\n".join(lines) + "\n")
    return project


@pytest.fixture
def mirror(tmp_path) -> Iterator[MirrorServer]:
    root = tmp_path / "mirror-root"
    root.mkdir()
    server = MirrorServer(root).start()
    try:
        yield server
    finally:
        server.shutdown()


# -- a redirect never unpins a locked load ---------------------------------------------------


def test_a_commit_only_lock_of_a_redirecting_repo_is_refused(hub, tmp_path):
    """Before: the reference-format lock pinning lab-org/old's commit ran lab-org/new@v1, and
    again after v1 moved (whatever the destination branch held that day)."""
    hub.trust("lab-org")
    commit = hub.writer(OLD).commit({"kernel-status.toml": _redirect(NEW)}, branch="v1")
    ran = tmp_path / "new-ran"
    hub.writer(NEW).commit(marker_files("new", ran, value=2), branch="v1")
    lock = tmp_path / "kernels.lock"
    dep = {"dependency": {"repo-id": OLD, "version": 1}, "lock": {"commit": commit}}
    lock.write_text(json.dumps([dep]))
    with pytest.raises(LockfileError) as err:
        kernels.get_locked_kernel(OLD, lockfile=lock)
    assert f"redirects to '{NEW}'" in str(err.value) and "pins a commit" in str(err.value)
    assert "kernels lock" in err.value.hint and len(err.value.hint.splitlines()) == 1
    with pytest.raises(LockfileError):
        kernels.load_kernel(OLD, lockfile=lock)  # cache only: the status is recorded now
    out = _cli("sync", str(tmp_path), "--lockfile", str(lock))
    assert out.returncode == 1 and f"redirects to '{NEW}'" in out.stderr, out.stderr
    out = _cli("sync", str(tmp_path), "--lockfile", str(lock), "--all-variants")
    assert out.returncode == 1 and f"redirects to '{NEW}'" in out.stderr, out.stderr
    assert not ran.exists()
    # `kernels lock` does not write a lock that pins a repo its publisher moved away from.
    project = _project(tmp_path, {OLD: 1})
    out = _cli("lock", str(project))
    assert out.returncode == 1 and f"name '{NEW}' in pyproject.toml" in out.stderr, out.stderr
    assert not (project / "kernels.lock").exists()


def test_a_digest_lock_loads_its_own_files_not_the_redirect(hub, tmp_path, caplog):
    """lab-org/old@commit has build files and a redirect; the lock pins those files. Before:
    the load followed the redirect and failed on the digests (IntegrityError)."""
    hub.trust("lab-org")
    old_ran, new_ran = tmp_path / "old-ran", tmp_path / "new-ran"
    files = marker_files("old", old_ran, value=1)
    commit = hub.writer(OLD).commit({**files, "kernel-status.toml": _redirect(NEW)}, branch="v1")
    hub.writer(NEW).commit(marker_files("new", new_ran, value=2), branch="v1")
    digests = {
        path.split("/", 2)[2]: hashlib.sha256(text.encode()).hexdigest()
        for path, text in files.items()
    }
    entry = {"repo_id": OLD, "requested": {"version": 1}, "commit": commit,
             "variants": {"torch-universal": digests}}  # fmt: skip
    lock = tmp_path / "kernels.lock"
    lock.write_text(json.dumps({"schema": 1, "kernels": [entry]}))
    with caplog.at_level(logging.WARNING, logger="kernels"):
        assert kernels.get_locked_kernel(OLD, lockfile=lock).VALUE == 1
    assert f"redirects to '{NEW}'" in caplog.text and "pins the files" in caplog.text
    assert _locked(OLD, lock).stdout.strip() == "1"  # warm, a fresh process
    assert _locked(OLD, lock, HF_HUB_OFFLINE="1").stdout.strip() == "1"
    assert not new_ran.exists()


# -- a lock with digests loads what it pins, whatever the endpoint ----------------------------


def test_a_synced_lock_loads_from_the_cache_under_another_endpoint(hub, mirror, tmp_path):
    hub.trust("kernels-test")
    ran = tmp_path / "ran"
    hub.writer("kernels-test/relu").commit(marker_files("relu", ran, value=7), branch="v1")
    project = _project(tmp_path, {"kernels-test/relu": 1})
    assert _cli("lock", str(project)).returncode == 0
    assert _cli("sync", "--frozen", str(project)).returncode == 0
    lock = project / "kernels.lock"
    hub.reset_requests()
    # The shell: HF_ENDPOINT unset (the Hub), offline.
    offline = {"HF_ENDPOINT": None, "HF_HUB_OFFLINE": "1"}
    out = _cli("sync", "--frozen", str(project), **offline)
    # The bytes are proven by the lock; trust is not: nothing says kernels-test is trusted at
    # the Hub, and the mirror's flag is the mirror's answer.
    assert out.returncode == 1, out.stdout
    assert "not from a trusted publisher" in out.stderr and "match kernels.lock" in out.stderr
    assert f"downloaded from {hub.url}" in out.stderr
    assert f"HF_ENDPOINT={hub.url}" in out.stderr  # where it is trusted
    trusted = {**offline, "KERNELS_TRUSTED_PUBLISHERS": "kernels-test"}
    out = _cli("sync", "--frozen", str(project), **trusted)
    assert out.returncode == 0 and "verified against the lock" in out.stdout, out.stderr
    assert _locked("kernels-test/relu", lock, **trusted).stdout.strip() == "7"
    # Online at another endpoint that has none of it: only its trust answer is asked for.
    (mirror.root / "kernels-mirror.toml").write_text('trusted_publishers = ["kernels-test"]\n')
    (mirror.root / "kernels-test").mkdir()  # the org, with no repos
    out = _locked("kernels-test/relu", lock, HF_ENDPOINT=mirror.url)
    assert out.stdout.strip() == "7", out.stderr
    assert [path for _m, path in mirror.requests] == ["/api/organizations/kernels-test/overview"]
    assert hub.requests == []
    # What is cached from another endpoint is named, by `kernels env` and by a plain load.
    env = json.loads(_cli("env", "--json", **offline).stdout)
    assert env["cached_kernels"] == []
    [row] = env["cached_other_endpoints"]
    assert (row["repo_id"], row["endpoints"]) == ("kernels-test/relu", [hub.url])
    assert "cached from other endpoints" in _cli("env", **offline).stdout
    plain = _cli("pull", "kernels-test/relu@v1", **trusted)
    assert plain.returncode != 0 and "local snapshot" in plain.stderr
    assert f"cached from {hub.url}" in plain.stderr and f"HF_ENDPOINT={hub.url}" in plain.stderr


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_a_hostile_endpoints_files_are_never_served_for_a_lock(hub, mirror, tmp_path):
    """A mirror serves the locked commit with another __init__.py. Its files are cached (its
    own loads run them: what it says is its answer); a lock whose digests they do not match
    must not load them at any endpoint, the mirror included."""
    hub.trust("good-org")
    good_ran, evil_ran = tmp_path / "good-ran", tmp_path / "evil-ran"
    commit = hub.writer(GOOD).commit(marker_files("kernel", good_ran), branch="v1")
    project = _project(tmp_path, {GOOD: 1})
    assert _cli("lock", str(project)).returncode == 0
    lock = project / "kernels.lock"
    shutil.copytree(hub.root / "good-org", mirror.root / "good-org")
    (mirror.root / "kernels-mirror.toml").write_text('trusted_publishers = ["good-org"]\n')
    evil = f"open({str(evil_ran)!r}, 'a').write('ran\\n')\nVALUE = 66\n".encode()

    def listing(repo_id, sha, entries):
        for entry in entries:
            if entry["path"] == INIT:
                entry.update(oid=_git_blob_id(evil), size=len(evil))
        return entries

    mirror.tree_hook = listing
    mirror.file_hook = lambda repo_id, sha, path, data: evil if path == INIT else data
    at_mirror = _env(HF_ENDPOINT=mirror.url)
    load = python_argv(
        f"import kernels; print(kernels.get_kernel({GOOD!r}, revision={commit!r}).VALUE)"
    )
    out = subprocess.run(load, capture_output=True, text=True, timeout=120, env=at_mirror)
    assert out.stdout.strip() == "66", out.stderr  # the mirror's files are in the cache now
    evil_ran.unlink()
    elsewhere = {
        "HF_ENDPOINT": DEAD,
        "HF_HUB_OFFLINE": "1",
        "KERNELS_TRUSTED_PUBLISHERS": "good-org",
    }
    out = _locked(GOOD, lock, **elsewhere)
    assert out.stdout.strip() == "OfflineCacheMiss", out.stderr  # not the bytes the lock pins
    assert not evil_ran.exists()
    # The honest bytes cached too; then the mirror's again, last (its record now names them).
    assert _cli("sync", "--frozen", str(project)).returncode == 0  # installs, imports nothing
    out = subprocess.run(load, capture_output=True, text=True, timeout=120, env=at_mirror)
    assert out.stdout.strip() == "66", out.stderr
    evil_ran.unlink()
    assert _locked(GOOD, lock, **elsewhere).stdout.strip() == "1"
    assert _locked(GOOD, lock, HF_ENDPOINT=mirror.url).stdout.strip() == "1"
    assert good_ran.exists() and not evil_ran.exists()


def test_a_commit_only_lock_is_not_served_across_endpoints(hub, tmp_path):
    """A reference-format lock has no digests: nothing proves the cached bytes, so the
    per-endpoint records decide, and the miss names where the kernel was cached from."""
    hub.trust("kernels-test")
    commit = hub.writer("kernels-test/relu").commit(
        marker_files("relu", tmp_path / "ran", value=7), branch="v1"
    )
    lock = tmp_path / "kernels.lock"
    dep = {"dependency": {"repo-id": "kernels-test/relu", "version": 1}, "lock": {"commit": commit}}
    lock.write_text(json.dumps([dep]))
    assert kernels.get_locked_kernel("kernels-test/relu", lockfile=lock).VALUE == 7
    out = _locked("kernels-test/relu", lock, HF_ENDPOINT=DEAD, HF_HUB_OFFLINE="1",
                  KERNELS_TRUSTED_PUBLISHERS="kernels-test")  # fmt: skip
    assert out.stdout.strip() == "OfflineCacheMiss", out.stderr
    assert "local snapshot" in out.stderr and f"cached from {hub.url}" in out.stderr
