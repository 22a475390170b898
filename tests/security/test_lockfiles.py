"""Items 3 and 13: a lock decides which commit runs, so only the user's own lock may decide,
pull-request revisions need an explicit opt-in, and a lock that verifies nothing is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import kernels
import pytest
from kernels.errors import InvalidSpec, LockfileError, UnsafePermissions
from kernels.locked import get_locked_kernel
from kernels.lockfile import find_lockfile, parse_lock

from tests.reliability.helpers import assert_user_error, cli_argv
from tests.security.conftest import as_nobody, marker_files, needs_root

GOOD = "good-org/kernel"


@pytest.fixture
def repo(hub, tmp_path):
    """GOOD (a trusted publisher): v1, and a pull request refs/pr/1 whose code is not merged."""
    hub.trust("good-org")
    w = hub.writer(GOOD)
    v1_files = marker_files("kernel", tmp_path / "v1-ran")
    v1 = w.commit(v1_files, branch="v1")
    pr_files = marker_files("kernel", tmp_path / "pr-ran", value=99)
    pr = w.commit(pr_files, branch="pr-work")
    w.set_ref("refs/pr/1", pr)
    w.delete_ref("refs/heads/pr-work")
    return {"v1": v1, "pr": pr, "pr_files": pr_files, "pr_marker": tmp_path / "pr-ran"}


def _lock_text(commit: str, files: dict, requested: dict | None = None) -> str:
    prefix = "build/torch-universal/"
    digests = {
        path[len(prefix) :]: hashlib.sha256(data.encode()).hexdigest()
        for path, data in files.items()
    }
    entry = {
        "repo_id": GOOD,
        "requested": requested or {"version": 1},
        "commit": commit,
        "variants": {"torch-universal": digests},
    }
    return json.dumps({"schema": 1, "kernels": [entry]})


@needs_root
def test_lock_discovery_ignores_a_strangers_lock_above(repo, shared_dir, monkeypatch):
    # A sticky, world-writable parent (like /tmp) and a project folder of root's inside it.
    shared_dir.chmod(0o1777)
    project = shared_dir / "project"
    project.mkdir(mode=0o755)
    planted = shared_dir / "kernels.lock"
    text = _lock_text(repo["pr"], repo["pr_files"])  # "version 1", pinned to the PR's commit

    as_nobody(lambda: planted.write_text(text))
    assert planted.stat().st_uid != os.geteuid()
    monkeypatch.chdir(project)
    with pytest.raises(UnsafePermissions, match="world-writable"):  # seen, named, not used
        find_lockfile()
    with pytest.raises(UnsafePermissions):
        get_locked_kernel(GOOD)
    with pytest.raises(UnsafePermissions, match="owned by uid"):  # named explicitly: still not
        get_locked_kernel(GOOD, lockfile=planted)
    assert not repo["pr_marker"].exists()
    # The positive control: the user's own lock, in the project, is found and used.
    (project / "kernels.lock").write_text(_lock_text(repo["pr"], repo["pr_files"]))
    assert find_lockfile() == project / "kernels.lock"


def test_a_lock_file_others_can_write_is_refused(repo, tmp_path):
    lock = tmp_path / "kernels.lock"
    lock.write_text(_lock_text(repo["pr"], repo["pr_files"]))
    lock.chmod(0o664)
    with pytest.raises(UnsafePermissions, match="group-writable"):
        get_locked_kernel(GOOD, lockfile=lock)
    assert not repo["pr_marker"].exists()
    lock.chmod(0o644)
    assert get_locked_kernel(GOOD, lockfile=lock).VALUE == 99  # the user's own lock decides


def test_pull_request_revisions_need_an_explicit_opt_in(repo, hub, monkeypatch):
    hub.reset_requests()
    with pytest.raises(InvalidSpec, match="pull request") as err:
        kernels.get_kernel(GOOD, revision="refs/pr/1")
    assert "KERNELS_ALLOW_PR_REVISIONS" in err.value.hint
    assert hub.requests == [] and not repo["pr_marker"].exists()
    with pytest.raises(LockfileError, match="pull request"):
        parse_lock(_lock_text(repo["pr"], repo["pr_files"], {"revision": "refs/pr/1"}))
    monkeypatch.setenv("KERNELS_ALLOW_PR_REVISIONS", "1")
    assert kernels.get_kernel(GOOD, revision="refs/pr/1").VALUE == 99
    assert repo["pr_marker"].exists()


@pytest.mark.parametrize("variants", [{}, {"torch-universal": {}}])
def test_a_lock_without_digests_is_not_verified(repo, tmp_path, variants):
    project = tmp_path / "project"
    project.mkdir()
    entry = {"repo_id": GOOD, "requested": {"version": 1}, "commit": repo["v1"],
             "variants": variants}  # fmt: skip
    (project / "kernels.lock").write_text(json.dumps({"schema": 1, "kernels": [entry]}))
    out = subprocess.run(cli_argv("sync", str(project)), capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert_user_error(out, "no file digests")
    assert "verified" not in out.stdout
    assert not Path(tmp_path / "v1-ran").exists()


def test_sync_of_a_commit_only_lock_does_not_claim_verification(repo, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    reference = [{"dependency": {"repo-id": GOOD, "version": 1}, "lock": {"commit": repo["v1"]}}]
    (project / "kernels.lock").write_text(json.dumps(reference))
    out = subprocess.run(cli_argv("sync", str(project)), capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "commit pinned only" in out.stdout and "verified" not in out.stdout
