"""Red team, issue 28 item 3 re-run: LOCAL_KERNELS and get_local_kernel, variants the fix did not
name.

Found and fixed here:
* a variant folder that leads into another user's folder (a link in the user's build/) had its
  metadata.json read, and its native libraries parsed, before the ownership check: a FIFO
  named metadata.json there hung the load forever instead of UnsafePermissions.
* a link in the kernel whose target did not exist yet, in a sticky shared folder (/tmp): the
  check judged a missing target by its folder, and a sticky folder passed; whoever created the
  target between the check and the import ran their code. Now a link whose target is missing is
  refused when its nearest existing folder is writable by others, sticky or not
  (UnsafePermissions: create the target yourself first, or remove the link).

Variants that fail as they should: `..` after a link in the entry, a group-writable file 12
folders down, a hard link to another user's file, another user's `__pycache__` bytecode.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kernels
import pytest
from kernels import local_kernels
from kernels.errors import UnsafePermissions

from tests.security.conftest import NOBODY, as_nobody, marker_files, needs_root

REPO = "lab-org/k"


def _write_kernel(root: Path, marker: Path, variant: str = "torch-universal") -> Path:
    for rel, text in marker_files("local-k", marker, value=5).items():
        path = root / rel.replace("torch-universal", variant)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _sticky(shared_dir: Path) -> Path:
    shared_dir.chmod(0o1777)  # like /tmp
    return shared_dir


@needs_root
def test_a_variant_leading_into_another_users_folder_is_refused_before_it_is_read(
    shared_dir, tmp_path
):
    """The user's kernel, whose build/torch-universal is a link to a nightly folder in a shared
    place; `nobody` owns it and put a FIFO there as metadata.json. Before: the load hung on the
    FIFO (metadata is read before the ownership check). Run in a child with a 30 s bound."""
    _sticky(shared_dir)
    nightly = shared_dir / "nightly"

    def plant() -> None:
        nightly.mkdir()
        os.mkfifo(nightly / "metadata.json")
        (nightly / "__init__.py").write_text("VALUE = 66\n")

    as_nobody(plant)
    kernel = tmp_path / "dev" / "kernel"
    (kernel / "build").mkdir(parents=True)
    (kernel / "build" / "torch-universal").symlink_to(nightly, target_is_directory=True)
    code = (
        "import sys, kernels\n"
        "from kernels.errors import UnsafePermissions\n"
        "try:\n"
        "    kernels.get_local_kernel(sys.argv[1])\n"
        "except UnsafePermissions as exc:\n"
        "    print('refused', exc)\n"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code, str(kernel)], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the load hung on another user's FIFO instead of refusing their folder")
    assert out.stdout.startswith("refused") and "uid 65534" in out.stdout, out.stderr


@needs_root
def test_a_dangling_link_into_a_sticky_folder_is_not_a_way_in(shared_dir, tmp_path, monkeypatch):
    """The user's kernel imports ops.py, a link to /tmp-like shared/ops.py that does not exist
    yet (a build step writes it). `nobody` creates it right after the check: the attacker
    winning the race, made deterministic by running their step at that point."""
    _sticky(shared_dir)
    marker = shared_dir / "evil-ran"
    kernel = _write_kernel(tmp_path / "kernel", tmp_path / "ran")
    variant = kernel / "build" / "torch-universal"
    (variant / "__init__.py").write_text("from .ops import OPS\nVALUE = 5\n")
    target = shared_dir / "ops.py"
    (variant / "ops.py").symlink_to(target)
    real_check = local_kernels.check_imported

    def check_then_race(folder, what="the local kernel"):
        real_check(folder, what)

        def plant() -> None:
            target.write_text(f"open({str(marker)!r}, 'a').write('ran')\nOPS = 1\n")

        as_nobody(plant)

    monkeypatch.setattr(local_kernels, "check_imported", check_then_race)
    try:
        kernels.get_local_kernel(kernel)
    except (UnsafePermissions, ImportError, kernels.errors.KernelsError):
        pass
    assert not marker.exists(), "another user's code ran from a link the check let through"


def test_a_dangling_link_is_judged_by_who_could_create_its_target(tmp_path):
    """A link to a missing file: into a folder only the user can write it loads (nobody else
    can create the target); into a sticky folder others can write it is refused, naming the
    link, with a one-line hint; once the user created the target there themselves, it loads."""
    marker = tmp_path / "ran"
    kernel = _write_kernel(tmp_path / "kernel", marker)
    variant = kernel / "build" / "torch-universal"
    (tmp_path / "mine").mkdir(mode=0o755)
    (variant / "later.py").symlink_to(tmp_path / "mine" / "later.py")  # built later
    assert kernels.get_local_kernel(kernel).VALUE == 5
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    (variant / "ops.py").symlink_to(shared / "ops.py")
    with pytest.raises(UnsafePermissions) as err:
        kernels.get_local_kernel(kernel)
    assert str(variant / "ops.py") in err.value.message
    assert f"{shared / 'ops.py'}, which does not exist" in err.value.message
    assert len(err.value.hint.splitlines()) == 1 and f"create {shared / 'ops.py'}" in err.value.hint
    (shared / "ops.py").write_text("OPS = 1\n")  # the user's own file now: nobody can swap it
    (shared / "ops.py").chmod(0o644)
    assert kernels.get_local_kernel(kernel).VALUE == 5


@needs_root
def test_dot_dot_after_a_link_is_judged_where_it_leads(shared_dir, tmp_path, monkeypatch):
    """`lab-org/k=/home/me/link/../kernel`: lexically that is /home/me/kernel (the user's), but
    the link makes it `nobody`'s folder. Refused, their code does not run."""
    _sticky(shared_dir)
    marker = shared_dir / "ran"
    as_nobody(lambda: (shared_dir / "theirs" / "sub").mkdir(parents=True))
    as_nobody(lambda: _write_kernel(shared_dir / "theirs" / "kernel", marker) and None)
    home = tmp_path / "home"
    home.mkdir()
    (home / "link").symlink_to(shared_dir / "theirs" / "sub", target_is_directory=True)
    monkeypatch.setenv("LOCAL_KERNELS", f"{REPO}={home}/link/../kernel")
    with pytest.raises(UnsafePermissions) as err:
        kernels.get_kernel(REPO, version=1)
    assert "65534" in str(err.value)
    assert not marker.exists()


def test_a_group_writable_file_deep_in_the_tree_is_refused(tmp_path):
    marker = tmp_path / "ran"
    kernel = _write_kernel(tmp_path / "kernel", marker)
    deep = (kernel / "build" / "torch-universal").joinpath(*[f"d{i}" for i in range(12)])
    deep.mkdir(parents=True)
    (deep / "data.py").write_text("X = 1\n")
    (deep / "data.py").chmod(0o664)
    with pytest.raises(UnsafePermissions) as err:
        kernels.get_local_kernel(kernel)
    assert str(deep / "data.py") in str(err.value)
    assert not marker.exists()


@needs_root
def test_a_hard_link_to_another_users_file_is_refused(shared_dir, tmp_path):
    """Root may hard-link anything: a file in the user's kernel that is another user's inode
    (`nobody` can still write it through their own name)."""
    _sticky(shared_dir)
    marker = tmp_path / "ran"
    kernel = _write_kernel(tmp_path / "kernel", marker)
    theirs = shared_dir / "helper.py"
    as_nobody(lambda: theirs.write_text("X = 1\n"))
    os.link(theirs, kernel / "build" / "torch-universal" / "helper.py")
    with pytest.raises(UnsafePermissions) as err:
        kernels.get_local_kernel(kernel)
    assert "65534" in str(err.value)
    assert not marker.exists()


@needs_root
def test_another_users_bytecode_in_pycache_is_refused(shared_dir, tmp_path):
    """A `__pycache__` folder `nobody` owns, in a kernel whose folder was once group-writable:
    refused (and the importer never reads bytecode anyway)."""
    marker = tmp_path / "ran"
    kernel = _write_kernel(tmp_path / "kernel", marker)
    cache = kernel / "build" / "torch-universal" / "__pycache__"
    cache.mkdir()
    os.chown(cache, NOBODY, NOBODY)
    with pytest.raises(UnsafePermissions) as err:
        kernels.get_local_kernel(kernel)
    assert "65534" in str(err.value)
    assert not marker.exists()
