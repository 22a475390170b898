"""Item 1: whoever else can write the cache, the config or a lock must not decide what runs.

A second user (`nobody`) attacks a cache that is shared the usual way (group- or world-writable
folders), or one they own; the loader must refuse it with UnsafePermissions and the fix, before
any of the planted code runs. The positive controls show the same setups load once fixed.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time
from pathlib import Path

import kernels
import pytest
from kernels.cache import Cache
from kernels.errors import UnsafePermissions

from tests.reliability.helpers import cli_argv, python_argv
from tests.security.conftest import as_nobody, marker_files, needs_root, open_up

GOOD = "good-org/kernel"
EVIL = "evil-org/kernel"

LOAD = """
    import sys, kernels, kernels.errors
    try:
        print(kernels.get_kernel(sys.argv[1], version=1).VALUE)
    except kernels.errors.KernelsError as exc:
        print(type(exc).__name__)
        print(exc, file=sys.stderr)
"""


def _load(repo: str) -> subprocess.CompletedProcess:
    """A load in a fresh process (no in-process memo), as root."""
    out = subprocess.run(
        python_argv(LOAD) + [repo], capture_output=True, text=True, timeout=120, env=os.environ
    )
    assert out.returncode == 0, out.stderr
    return out


@pytest.fixture
def cache(shared_dir, monkeypatch) -> Path:
    root = shared_dir / "cache"
    monkeypatch.setenv("KERNELS_CACHE", str(root))
    return root


@needs_root
def test_a_trust_record_planted_by_another_user_is_refused(hub, cache, tmp_path):
    hub.trust("good-org")  # the Hub trusts good-org only
    marker = tmp_path / "evil-ran"
    hub.writer(EVIL).commit(marker_files("kernel", marker, value=66), branch="v1")
    hub.writer(GOOD).commit(marker_files("kernel", tmp_path / "good-ran"), branch="v1")
    assert _load(GOOD).stdout.strip() == "1"  # the cache exists, with a trust folder
    open_up(cache)  # shared the usual way: others may write it
    trust_dir = Cache(cache).records.trust_dir

    def plant() -> None:
        record = {"trusted": True, "source": "hub", "checked_at": time.time(),
                  "endpoint": hub.url}  # fmt: skip
        (trust_dir / "evil-org.json").write_text(json.dumps(record))

    as_nobody(plant)
    out = _load(EVIL)
    assert out.stdout.strip() == "UnsafePermissions", (out.stdout, out.stderr)
    assert "chmod -R go-w" in out.stderr and "world-writable" in out.stderr
    assert not marker.exists()  # the planted decision ran nothing
    hub.reset_requests()
    with pytest.raises(UnsafePermissions):
        kernels.get_kernel(EVIL, version=1)
    assert hub.requests == []  # refused before asking anyone


@needs_root
def test_a_same_size_swap_with_a_forged_stamp_is_refused(hub, cache, tmp_path):
    hub.trust("good-org")
    marker, evil_marker = tmp_path / "good-ran", tmp_path / "evil-ran"
    hub.writer(GOOD).commit(marker_files("kernel", marker), branch="v1")
    assert _load(GOOD).stdout.strip() == "1"
    store = Cache(cache)
    [(repo, commit, variant, digest)] = list(store.index.entries())
    tree = store.trees.path(digest)
    target = tree / "__init__.py"
    original = target.read_bytes()
    evil = f"open({str(evil_marker)!r}, 'a').write('ran\\n')\nVALUE = 1\n".encode()
    evil = evil.ljust(len(original), b"#")
    assert len(evil) == len(original)
    open_up(cache, 0o020)  # group-writable: the other user is in the cache's group
    os.chown(cache, -1, 65534)
    for p in cache.rglob("*"):
        os.chown(p, -1, 65534, follow_symlinks=False)
    stamps = store.trees.stamps / f"{digest}.json"

    def swap() -> None:
        tmp = tree / ".swap"
        tmp.write_bytes(evil)
        os.replace(tmp, target)
        forged = json.loads(stamps.read_text())
        st = target.stat()
        forged["__init__.py"] = [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]
        stamps.unlink()
        stamps.write_text(json.dumps(forged))

    as_nobody(swap, groups=(65534,))  # a member of the cache's group
    out = _load(GOOD)
    assert out.stdout.strip() == "UnsafePermissions", (out.stdout, out.stderr)
    assert "group-writable" in out.stderr
    assert not evil_marker.exists()
    verify = subprocess.run(cli_argv("verify"), capture_output=True, text=True, timeout=120)
    assert verify.returncode == 1 and "UNSAFE" in verify.stdout, verify.stdout
    assert "CORRUPT good-org/kernel" in verify.stdout  # content, not the forged stamp


@needs_root
def test_a_cache_owned_by_another_user_is_refused(hub, cache, tmp_path):
    hub.trust("good-org")
    hub.writer(GOOD).commit(marker_files("kernel", tmp_path / "ran"), branch="v1")
    assert _load(GOOD).stdout.strip() == "1"
    for p in [cache, *cache.rglob("*")]:
        os.chown(p, 65534, 65534, follow_symlinks=False)
    out = _load(GOOD)
    assert out.stdout.strip() == "UnsafePermissions", out.stderr
    assert "owned by uid 65534" in out.stderr and "chown" in out.stderr


def test_a_cache_made_under_a_group_umask_stays_usable(hub, cache, tmp_path):
    """Folders are made 0755 whatever the umask, so the rule never refuses the user's own cache."""
    hub.trust("good-org")
    hub.writer(GOOD).commit(marker_files("kernel", tmp_path / "ran"), branch="v1")
    code = "import os; os.umask(0o002)\n" + textwrap.dedent(LOAD)
    out = subprocess.run(python_argv(code) + [GOOD], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "1", out.stderr
    writable = [p for p in [cache, *cache.rglob("*")] if p.lstat().st_mode & 0o022]
    assert writable == []
    assert _load(GOOD).stdout.strip() == "1"


def test_a_config_file_others_can_write_is_refused(hub, tmp_path, monkeypatch):
    marker = tmp_path / "evil-ran"
    hub.writer(EVIL).commit(marker_files("kernel", marker), branch="v1")
    config = tmp_path / "config.toml"
    config.write_text('trusted_publishers = ["evil-org"]\n')
    monkeypatch.setenv("KERNELS_CONFIG", str(config))
    config.chmod(0o666)
    with pytest.raises(UnsafePermissions) as err:
        kernels.get_kernel(EVIL, version=1)
    assert str(config) in str(err.value) and "chmod" in err.value.hint
    assert not marker.exists()
    config.chmod(0o644)  # the positive control: the user's own config decides
    assert kernels.get_kernel(EVIL, version=1).VALUE == 1
    assert marker.exists()


def test_an_in_place_same_size_edit_with_its_mtime_restored_is_caught_by_stamps(hub, tmp_path):
    """The owner's own tools (an editor, `cp -p`, rsync) can keep size, inode and mtime; the
    stamp's ctime still moves, so `kernels verify` (stamps) and the next load see the edit."""
    hub.trust("good-org")
    hub.writer(GOOD).commit(marker_files("kernel", tmp_path / "ran"), branch="v1")
    kernels.install_kernel(GOOD, version=1)
    store = Cache(os.environ["KERNELS_CACHE"])
    [(_r, _c, _v, digest)] = list(store.index.entries())
    target = store.trees.path(digest) / "__init__.py"
    before = target.stat()
    data = target.read_bytes().replace(b"VALUE = 1", b"VALUE = 7")
    target.chmod(0o644)
    with open(target, "r+b") as fh:  # same inode, same size
        fh.write(data)
    target.chmod(before.st_mode)
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = target.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino, before.st_size, before.st_mtime_ns)  # fmt: skip
    verify = subprocess.run(cli_argv("verify"), capture_output=True, text=True, timeout=120)
    assert verify.returncode == 1 and "CORRUPT good-org/kernel" in verify.stdout, verify.stdout
    assert _load(GOOD).stdout.strip() == "1"  # the load re-hashed, and fetched a clean copy
