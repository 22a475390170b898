"""Red team, issue 28 items 2 and 5 and issue 31 item 3 re-run: locks and install_kernel's
snapshot path, variants the fixes did not name.

Found and fixed here:
* a lock with file digests was served from the cache whatever repo those bytes were downloaded
  as: a lock entry that names a trusted publisher's repo and pins the digests of an untrusted
  repo's files (cached by `kernels verify-signature`, which downloads without trusting) ran the
  untrusted repo's code under the trusted publisher's name, with zero requests. Now the cache
  serves a lock's tree only when its index records that tree as that variant of the locked repo
  and commit (at any endpoint); otherwise the locked commit is fetched and compared as before
  issue 31 (IntegrityError here). A tree recorded only at other endpoints is served with a
  notice naming them (a lock written against a mirror is no longer silent at the Hub).
* install_kernel wrote through a link planted in a snapshot folder others could write before it
  checked that folder: with `snapshots/<endpoint key>/` world-writable, `nobody` points
  `<org>--<name>` at a folder only root may write, and the user's install created folders and a
  link there (then refused). The folders are now checked before anything is written.

Also fixed: a lock path below a file (`kernels sync FILE`) was reported as "not readable, so
another user could change which code runs" with a chmod hint (lstat's ENOTDIR taken for an
unreadable path); now the lock file cannot be read.

Variants that fail as they should: two endpoints on one host with different ports or paths keep
apart, and a reference-format lock (0.16 and 0.17) of a redirecting repo is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import kernels
import pytest
from kernels.cli.main import main as kernels_main
from kernels.errors import LockfileError, UnsafePermissions
from kernels.serve import MirrorServer

from tests.security.conftest import as_nobody, marker_files, needs_root

GOOD = "good-org/kernel"
EVIL = "evil-org/kernel"


def _digests(files: dict[str, str]) -> dict[str, str]:
    return {
        path.split("/", 2)[2]: hashlib.sha256(text.encode()).hexdigest()
        for path, text in files.items()
    }


def test_a_lock_cannot_lend_a_trusted_name_to_another_repos_files(hub, tmp_path, capsys):
    hub.trust("good-org")  # evil-org is not trusted
    good_ran, evil_ran = tmp_path / "good-ran", tmp_path / "evil-ran"
    good_commit = hub.writer(GOOD).commit(marker_files("kernel", good_ran), branch="v1")
    evil_files = marker_files("kernel", evil_ran, value=66)
    hub.writer(EVIL).commit(evil_files, branch="v1")
    # The user checks the stranger's kernel before deciding anything: this downloads it.
    assert kernels_main(["verify-signature", EVIL, "1"]) == 1  # unsigned
    capsys.readouterr()
    entry = {"repo_id": GOOD, "requested": {"version": 1}, "commit": good_commit,
             "variants": {"torch-universal": _digests(evil_files)}}  # fmt: skip
    lock = tmp_path / "kernels.lock"
    lock.write_text(json.dumps({"schema": 1, "kernels": [entry]}))
    hub.reset_requests()
    try:
        module = kernels.get_locked_kernel(GOOD, lockfile=lock)
    except kernels.errors.KernelsError:
        module = None
    assert not evil_ran.exists(), f"evil-org's code ran as {GOOD} ({hub.requests} requests)"
    assert module is None or module.VALUE == 1


def test_a_lock_served_from_another_endpoints_download_says_so(hub, tmp_path, monkeypatch, caplog):
    """A lock synced at one endpoint, loaded offline under another: it loads (the feature), and
    one notice names the endpoint that listed the files; at that endpoint itself, no notice."""
    hub.trust("good-org")
    commit = hub.writer(GOOD).commit(marker_files("kernel", tmp_path / "ran"), branch="v1")
    files = marker_files("kernel", tmp_path / "ran")
    entry = {"repo_id": GOOD, "requested": {"version": 1}, "commit": commit,
             "variants": {"torch-universal": _digests(files)}}  # fmt: skip
    lock = tmp_path / "kernels.lock"
    lock.write_text(json.dumps({"schema": 1, "kernels": [entry]}))
    with caplog.at_level(logging.WARNING, logger="kernels"):
        assert kernels.get_locked_kernel(GOOD, lockfile=lock).VALUE == 1
    assert "listed by" not in caplog.text
    caplog.clear()
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nobody answers there
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("KERNELS_TRUSTED_PUBLISHERS", "good-org")
    with caplog.at_level(logging.WARNING, logger="kernels"):
        assert kernels.load_kernel(GOOD, lockfile=lock).VALUE == 1
    assert f"listed by {hub.url}, not by http://127.0.0.1:9" in caplog.text, caplog.text


@needs_root
def test_a_link_planted_before_the_first_install_is_not_written_through(
    hub, shared_dir, tmp_path, monkeypatch
):
    """`snapshots/<endpoint key>/` left world-writable (a umask of long ago): before the user's
    first install_kernel of GOOD, `nobody` plants `<org>--<name>` as a link to a folder only
    root may write. Expected: UnsafePermissions, and nothing created in that folder."""
    cache = shared_dir / "cache"
    monkeypatch.setenv("KERNELS_CACHE", str(cache))
    hub.trust("good-org")
    hub.writer(GOOD).commit(marker_files("kernel", tmp_path / "ran"), branch="v1")
    hub.writer("good-org/other").commit(marker_files("other", tmp_path / "ran2"), branch="v1")
    first = kernels.install_kernel("good-org/other", version=1)  # makes snapshots/<key>/
    key_dir = first.parents[3]
    key_dir.chmod(0o777)
    protected = shared_dir / "root-only"
    protected.mkdir(mode=0o755)
    as_nobody(lambda: os.symlink(protected, key_dir / "good-org--kernel"))
    with pytest.raises(UnsafePermissions) as err:
        kernels.install_kernel(GOOD, version=1)
    assert str(key_dir) in str(err.value)
    assert list(protected.iterdir()) == []  # before: <commit>/build/torch-universal made there


def test_endpoints_on_one_host_keep_their_snapshot_paths_apart(hub, tmp_path, monkeypatch):
    """A second server on the same host (another port), and the first one named with a path
    and a trailing slash: the port makes another endpoint (its own path), the slash does not."""
    hub.trust("good-org")
    hub.writer(GOOD).commit(marker_files("kernel", tmp_path / "ran"), branch="v1")
    honest = kernels.install_kernel(GOOD, version=1)
    root = tmp_path / "second"
    root.mkdir()
    (root / "kernels-mirror.toml").write_text('trusted_publishers = ["good-org"]\n')
    writer_root = root / "good-org" / "kernel"
    from kernels.serve import GitRepoWriter

    GitRepoWriter(writer_root).commit(
        marker_files("kernel", tmp_path / "ran2", value=2), branch="v1"
    )
    with MirrorServer(root) as second:
        monkeypatch.setenv("HF_ENDPOINT", second.url)
        other = kernels.install_kernel(GOOD, version=1)
    assert other.parents[3] != honest.parents[3]  # another endpoint key
    assert b"VALUE = 1" in (honest / "__init__.py").read_bytes()
    assert b"VALUE = 2" in (other / "__init__.py").read_bytes()
    monkeypatch.setenv("HF_ENDPOINT", hub.url + "/")
    assert kernels.install_kernel(GOOD, version=1) == honest


@pytest.mark.parametrize("fmt", ["0.16", "0.17"])
def test_a_reference_lock_of_a_redirecting_repo_is_refused(hub, tmp_path, fmt):
    hub.trust("lab-org")
    redirect = 'kind = "redirect"\ndestination = "lab-org/new"\nrevision = "v1"\n'
    commit = hub.writer("lab-org/old").commit({"kernel-status.toml": redirect}, branch="v1")
    ran = tmp_path / "new-ran"
    hub.writer("lab-org/new").commit(marker_files("new", ran, value=2), branch="v1")
    if fmt == "0.17":
        data = [
            {"dependency": {"repo-id": "lab-org/old", "version": 1}, "lock": {"commit": commit}}
        ]
    else:
        data = [{"repo_id": "lab-org/old", "sha": commit, "variants": {}}]
    lock = tmp_path / "kernels.lock"
    lock.write_text(json.dumps(data))
    with pytest.raises(LockfileError, match="redirects to 'lab-org/new'"):
        kernels.get_locked_kernel("lab-org/old", lockfile=lock)
    assert not ran.exists()


def test_a_lock_path_below_a_file_is_no_lock_not_a_permission_problem(tmp_path, capsys):
    """`kernels sync FILE` (a typo): the lock `FILE/kernels.lock` cannot exist. Before: "not
    readable, so another user could change which code runs", hint `chmod -R go-w` (lstat's
    ENOTDIR was taken for an unreadable path)."""
    project = tmp_path / "pyproject.toml"
    project.write_text("[tool.kernels.dependencies]\n")
    assert kernels_main(["sync", str(project)]) == 1
    err = capsys.readouterr().err
    assert "another user" not in err and "chmod" not in err, err
    assert "kernels.lock" in err
