"""kernel-status.toml redirects decide which repo's code runs: who may write them, whose answer
they are, and what trust the destination needs.

A redirect recorded in the cache (`v1/kernel-status/`) sends a load to another repo, so the
record must be as hard to forge as a trust record: its folders are 0755 whatever the umask, the
permission check covers them, and it is the answer of the endpoint that gave it. The
destination is another publisher's code: `trust_remote_code=True` names the caller's repo only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import warnings
from collections.abc import Iterator

import kernels
import pytest
from kernels.cache import Cache
from kernels.errors import UnsafePermissions, UntrustedPublisher
from kernels.serve import MirrorServer

from tests.reliability.helpers import python_argv
from tests.security.conftest import IS_ROOT, NOBODY, as_nobody, marker_files, open_up

OLD = "lab-org/old"
EVIL = "evil-org/kernel"

LOAD = """
    import sys, warnings, kernels, kernels.errors
    warnings.simplefilter("ignore")
    repo, how, ref = sys.argv[1:4]
    kwargs = {"version": int(ref)} if how == "version" else {"revision": ref}
    try:
        print(kernels.get_kernel(repo, trust_remote_code=True, **kwargs).VALUE)
    except kernels.errors.KernelsError as exc:
        print(type(exc).__name__)
        print(exc, file=sys.stderr)
"""


def _load(repo: str, how: str = "version", ref: str = "1", **env: str) -> str:
    """get_kernel(repo, trust_remote_code=True) in a fresh process: VALUE or the error's name."""
    out = subprocess.run(
        python_argv(LOAD) + [repo, how, ref],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _redirect(destination: str, revision: str = "v1") -> str:
    return f'kind = "redirect"\ndestination = "{destination}"\nrevision = "{revision}"\n'


def _store() -> Cache:
    return Cache(os.environ["KERNELS_CACHE"], endpoint=os.environ["HF_ENDPOINT"])


def test_status_and_snapshot_folders_are_0755_under_a_group_umask(hub, tmp_path):
    hub.trust("lab-org")
    hub.writer(OLD).commit({"kernel-status.toml": _redirect("lab-org/new")}, branch="v1")
    hub.writer("lab-org/new").commit(marker_files("new", tmp_path / "ran", value=2), branch="v1")
    code = (
        "import os; os.umask(0o002)\nimport warnings; warnings.simplefilter('ignore')\n"
        "import kernels\nkernels.install_kernel('lab-org/old', version=1)\n"
        "print(kernels.get_kernel('lab-org/old', version=1).VALUE)\n"
    )
    out = subprocess.run(python_argv(code), capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "2", out.stderr
    store = _store()
    assert store.status.is_dir() and store.snapshots.is_dir()
    writable = [
        p
        for p in [store.root, *store.root.rglob("*")]
        if not p.is_symlink() and p.stat().st_mode & 0o022
    ]
    assert writable == []
    assert store.exposure() is None
    assert _load(OLD) == "2"  # the user's own cache stays usable


def test_a_group_writable_status_folder_is_refused(hub, shared_dir, monkeypatch, tmp_path):
    """A group member plants a redirect for the commit the user loads; the load must refuse the
    cache before following it (here the destination would even be trusted: allow-listed)."""
    cache = shared_dir / "cache"
    monkeypatch.setenv("KERNELS_CACHE", str(cache))
    hub.trust("good-org")
    good, evil = tmp_path / "good-ran", tmp_path / "evil-ran"
    commit = hub.writer("good-org/kernel").commit(marker_files("kernel", good), branch="v1")
    hub.writer(EVIL).commit(marker_files("evil", evil, value=66), branch="v1")
    assert _load("good-org/kernel") == "1"
    status = _store().status
    record = next((status / "good-org--kernel").iterdir())
    assert record.name.startswith(commit) and record.read_bytes() == b""
    open_up(status, 0o020)  # shared with a group, as a umask-002 cache of the old code was
    for path in [status, *status.rglob("*")]:
        os.chown(path, -1, NOBODY)

    def plant() -> None:
        staged = record.with_name(".planted")
        staged.write_text(_redirect(EVIL))
        os.replace(staged, record)

    if IS_ROOT:
        as_nobody(plant, groups=(NOBODY,))
    else:
        plant()  # as the user, standing in for the group member
    out = _load("good-org/kernel", KERNELS_TRUSTED_PUBLISHERS="evil-org")
    assert out == "UnsafePermissions"
    assert not evil.exists()
    with pytest.raises(UnsafePermissions) as err:
        kernels.get_kernel("good-org/kernel", version=1, trust_remote_code=True)
    assert "kernel-status" in str(err.value) and "chmod" in err.value.hint
    assert not evil.exists()


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


def test_a_redirect_recorded_at_one_endpoint_is_not_used_at_another(hub, mirror, tmp_path):
    hub.trust("lab-org")
    commit = hub.writer(OLD).commit({"kernel-status.toml": _redirect("lab-org/new")}, branch="v1")
    hub.writer("lab-org/new").commit(marker_files("new", tmp_path / "new", value=2), branch="v1")
    hub.writer("lab-org/other").commit(marker_files("other", tmp_path / "o", value=66), branch="v1")
    for name in ("old", "new", "other"):
        shutil.copytree(hub.root / "lab-org" / name, mirror.root / "lab-org" / name)
    (mirror.root / "kernels-mirror.toml").write_text('trusted_publishers = ["lab-org"]\n')

    def status(repo_id, sha, path, data):  # the same commit, another destination
        return _redirect("lab-org/other").encode() if path == "kernel-status.toml" else data

    mirror.file_hook = status
    assert _load(OLD, "revision", commit, HF_ENDPOINT=mirror.url) == "66"
    hub.reset_requests()
    assert _load(OLD, "revision", commit) == "2"  # the Hub's own status file
    assert any("kernel-status.toml" in path for _m, path in hub.requests)  # asked, not recalled
    assert _load(OLD) == "2"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert kernels.get_kernel(OLD, version=1).VALUE == 2
    # Each endpoint keeps its own answer.
    assert _load(OLD, "revision", commit, HF_ENDPOINT=mirror.url) == "66"


def test_trust_remote_code_does_not_cover_a_redirect_destination(hub, tmp_path, monkeypatch):
    hub.trust("someone-else")  # the Hub trusts neither lab-org nor evil-org
    marker = tmp_path / "evil-ran"
    hub.writer(OLD).commit({"kernel-status.toml": _redirect(EVIL)}, branch="v1")
    hub.writer(EVIL).commit(marker_files("evil", marker, value=66), branch="v1")
    for trust in (True, [OLD], ["lab-org"]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(UntrustedPublisher) as err:
                kernels.get_kernel(OLD, version=1, trust_remote_code=trust)
        assert EVIL in err.value.hint and OLD in err.value.hint
        assert len(err.value.hint.splitlines()) == 1
    with pytest.raises(UntrustedPublisher):
        kernels.install_kernel(OLD, version=1, trust_remote_code=True)
    assert _load(OLD) == "UntrustedPublisher"  # a fresh process, warm status record
    assert not marker.exists()
    # The destination trusted on its own: named in the list, or allow-listed.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "redirected" was said once already
        module = kernels.get_kernel(OLD, version=1, trust_remote_code=[OLD, EVIL])
    assert module.VALUE == 66 and marker.exists()
    marker.unlink()
    assert _load(OLD, KERNELS_TRUSTED_PUBLISHERS="evil-org") == "66"
    assert marker.exists()
