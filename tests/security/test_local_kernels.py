"""Issue 28 item 3: LOCAL_KERNELS (and get_local_kernel) import a folder's code, so the folder is
held to the rule of the cache, the config and the lock: only this user and root may write it,
any folder above it, or anything below it.

Before the fix a folder `nobody` made in a sticky shared folder was imported without a look at
its owner, and a relative entry was resolved against whatever the working directory was.
"""

from __future__ import annotations

import os
from pathlib import Path

import kernels
import pytest
from kernels.errors import UnsafePermissions

from tests.security.conftest import NOBODY, as_nobody, marker_files, needs_root

REPO = "lab-org/k"


def _write_kernel(root: Path, marker: Path) -> Path:
    for rel, text in marker_files("local-k", marker, value=5).items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@needs_root
def test_a_folder_another_user_owns_in_a_sticky_shared_folder_is_refused(shared_dir, monkeypatch):
    shared_dir.chmod(0o1777)  # like /tmp: anyone may create a folder in it
    marker = shared_dir / "ran"
    kernel = shared_dir / "kernel"
    as_nobody(lambda: _write_kernel(kernel, marker))
    assert kernel.stat().st_uid == NOBODY
    monkeypatch.setenv("LOCAL_KERNELS", f"{REPO}={kernel}")
    with pytest.raises(UnsafePermissions) as err:
        kernels.get_kernel(REPO, version=1)
    assert "owned by uid 65534" in str(err.value) and "chown" in err.value.hint
    with pytest.raises(UnsafePermissions):
        kernels.has_kernel(REPO, version=1)
    with pytest.raises(UnsafePermissions):
        kernels.get_local_kernel(kernel)
    assert not marker.exists()


def test_anything_others_can_write_on_the_way_or_below_is_refused(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    kernel = _write_kernel(tmp_path / "dev" / "kernel", marker)
    init = kernel / "build" / "torch-universal" / "__init__.py"
    monkeypatch.setenv("LOCAL_KERNELS", f"{REPO}={kernel}")
    for path, mode in [(init, 0o664), (init.parent, 0o775), (tmp_path / "dev", 0o777)]:
        before = path.stat().st_mode
        path.chmod(mode)
        with pytest.raises(UnsafePermissions) as err:
            kernels.get_kernel(REPO, version=1)
        assert str(path) in str(err.value) and "chmod -R go-w" in err.value.hint
        path.chmod(before)
    assert not marker.exists()
    assert kernels.get_kernel(REPO, version=1).VALUE == 5  # the positive control
    assert marker.exists()


def test_a_link_in_the_variant_is_judged_by_where_it_leads(tmp_path, monkeypatch):
    kernel = _write_kernel(tmp_path / "kernel", tmp_path / "ran")
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "helper.py").write_text("X = 1\n")
    os.symlink(shared / "helper.py", kernel / "build" / "torch-universal" / "helper.py")
    shared.chmod(0o777)
    with pytest.raises(UnsafePermissions) as err:
        kernels.get_local_kernel(kernel)
    assert str(shared) in str(err.value)
    shared.chmod(0o755)
    assert kernels.get_local_kernel(kernel).VALUE == 5


def test_a_relative_entry_needs_a_working_directory_only_the_user_can_write(tmp_path, monkeypatch):
    """`lab-org/k=../kernel`: the folder itself is the user's, but which folder the entry names
    depends on the working directory, here one that others can write: refused, then loaded
    once the working directory is the user's alone."""
    marker = tmp_path / "ran"
    _write_kernel(tmp_path / "kernel", marker)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("LOCAL_KERNELS", f"{REPO}=../kernel")
    work.chmod(0o777)
    with pytest.raises(UnsafePermissions) as err:
        kernels.get_kernel(REPO, version=1)
    assert "relative to the working directory" in str(err.value)
    assert str(work) in str(err.value)
    assert not marker.exists()
    work.chmod(0o755)
    assert kernels.get_kernel(REPO, version=1).VALUE == 5
