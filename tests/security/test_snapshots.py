"""Issue 28 item 2: the folder install_kernel returns must show the files verified for that
endpoint, commit and variant, and nobody else may be able to point it elsewhere.

`install_kernel` returns `<cache>/v1/snapshots/<endpoint key>/<org>--<name>/<commit>/build/
<variant>`, a link to the verified tree. Before the fix the path had no endpoint in it, so the
path handed out at an honest endpoint later led to a hostile mirror's files for the same commit;
and a folder below `snapshots/` that another user could write let them swap what the path showed
(`install_kernel` never checked where its link resolved).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import kernels
import pytest
from kernels.errors import IntegrityError, UnsafePermissions
from kernels.serve import MirrorServer

from tests.security.conftest import NOBODY, as_nobody, marker_files, needs_root

GOOD = "good-org/kernel"
INIT = "build/torch-universal/__init__.py"


@pytest.fixture
def mirror(tmp_path) -> Iterator[MirrorServer]:
    root = tmp_path / "mirror-root"
    root.mkdir()
    server = MirrorServer(root).start()
    try:
        yield server
    finally:
        server.shutdown()


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _hostile_copy(hub, mirror: MirrorServer, evil: bytes) -> None:
    """The mirror serves GOOD's real commit, with another __init__.py (listed and sent)."""
    shutil.copytree(hub.root / "good-org", mirror.root / "good-org")
    (mirror.root / "kernels-mirror.toml").write_text('trusted_publishers = ["good-org"]\n')

    def listing(repo_id, sha, entries):
        for entry in entries:
            if entry["path"] == INIT:
                entry.update(oid=_git_blob_id(evil), size=len(evil))
        return entries

    mirror.tree_hook = listing
    mirror.file_hook = lambda repo_id, sha, path, data: evil if path == INIT else data


def test_a_snapshot_path_keeps_showing_its_endpoints_files(hub, mirror, tmp_path, monkeypatch):
    hub.trust("good-org")
    commit = hub.writer(GOOD).commit(marker_files("kernel", tmp_path / "good"), branch="v1")
    evil_marker = tmp_path / "evil-ran"
    evil = f"open({str(evil_marker)!r}, 'a').write('ran\\n')\nVALUE = 66\n".encode()
    _hostile_copy(hub, mirror, evil)
    honest = kernels.install_kernel(GOOD, revision=commit)
    assert honest.parent.parent.name == commit  # the reference's <commit>/build/<variant>
    assert b"VALUE = 1" in (honest / "__init__.py").read_bytes()
    monkeypatch.setenv("HF_ENDPOINT", mirror.url)
    hostile = kernels.install_kernel(GOOD, revision=commit)
    assert (hostile / "__init__.py").read_bytes() == evil  # the mirror's own answer, there
    assert hostile != honest
    # The path handed out at the honest endpoint still shows the honest files.
    assert b"VALUE = 1" in (honest / "__init__.py").read_bytes()
    assert kernels.get_local_kernel(honest.parent.parent).VALUE == 1
    assert not evil_marker.exists()


def _plant_lookalike(base: Path, link: Path, cache: Path, evil_marker: Path) -> Path:
    """Under `base`, a copy of the snapshot layout whose variant link has the very text of the
    real one, so that from there it resolves to a tree of the attacker's."""
    snapshots = cache / "v1" / "snapshots"
    rel = link.relative_to(snapshots)  # <key>/<org>--<name>/<commit>/build/<variant>
    fake = base / "v1" / "snapshots" / rel
    fake.parent.mkdir(parents=True)
    text = os.readlink(link)
    os.symlink(text, fake)
    tree = Path(os.path.normpath(fake.parent / text))
    tree.mkdir(parents=True)
    (tree / "metadata.json").write_text((link / "metadata.json").read_text())
    (tree / "__init__.py").write_text(
        f"open({str(evil_marker)!r}, 'a').write('ran\\n')\nVALUE = 66\n"
    )
    return base / "v1" / "snapshots" / rel.parts[0] / rel.parts[1]


@needs_root
def test_a_repo_folder_another_user_can_write_is_refused(hub, shared_dir, monkeypatch, tmp_path):
    """`snapshots/<key>/<org>--<name>/` left world-writable (an old umask, a careless chmod):
    `nobody` swaps the commit folder for a link to a look-alike of theirs. The next
    install_kernel must refuse, not hand back a path that runs their code."""
    cache = shared_dir / "cache"
    monkeypatch.setenv("KERNELS_CACHE", str(cache))
    hub.trust("good-org")
    commit = hub.writer(GOOD).commit(marker_files("kernel", tmp_path / "good"), branch="v1")
    link = kernels.install_kernel(GOOD, version=1)
    repo_dir = link.parent.parent.parent
    repo_dir.chmod(0o777)
    evil_marker = shared_dir / "evil-ran"
    attacker = shared_dir / "attacker"
    attacker.mkdir()
    os.chown(attacker, NOBODY, NOBODY)

    def swap() -> None:
        fake_repo = _plant_lookalike(attacker, link, cache, evil_marker)
        os.rename(repo_dir / commit, repo_dir / ".old")
        os.symlink(fake_repo / commit, repo_dir / commit)

    as_nobody(swap)
    assert (link / "__init__.py").read_text().startswith("open(")  # it now shows theirs
    with pytest.raises(UnsafePermissions) as err:
        kernels.install_kernel(GOOD, version=1)
    assert str(repo_dir) in str(err.value)  # the folder on the way that is not the user's
    assert not evil_marker.exists()


def test_a_link_that_leads_elsewhere_is_not_returned(hub, tmp_path):
    """The same look-alike planted by the user's own hand (no folder others can write): the
    link's text is right, where it leads is not. install_kernel checks where it resolves."""
    hub.trust("good-org")
    hub.writer(GOOD).commit(marker_files("kernel", tmp_path / "good"), branch="v1")
    link = kernels.install_kernel(GOOD, version=1)
    cache = Path(os.environ["KERNELS_CACHE"])
    evil_marker = tmp_path / "evil-ran"
    fake_repo = _plant_lookalike(tmp_path / "elsewhere", link, cache, evil_marker)
    commit_dir = link.parent.parent
    shutil.rmtree(commit_dir)
    os.symlink(fake_repo / commit_dir.name, commit_dir)
    with pytest.raises(IntegrityError) as err:
        kernels.install_kernel(GOOD, version=1)
    assert "not to the verified tree" in str(err.value) and "remove" in err.value.hint
    assert not evil_marker.exists()
    os.unlink(commit_dir)  # the fix the hint names: the next call makes a good link
    again = kernels.install_kernel(GOOD, version=1)
    assert again == link and kernels.get_local_kernel(again.parent.parent).VALUE == 1
