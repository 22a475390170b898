"""Red team, issue 28 items 1 and 6 re-run: `kernels mirror build SRC DEST` with variants the
fixes did not name.

Found and fixed here:
* a folder tree nested 1,500 deep ended the build with an untyped RecursionError; now a
  MirrorSourceError past the depth the Hub client accepts (32 path parts);
* a metadata.json over the client's 1 MiB cap was read whole and built into a mirror whose
  every client refuses the kernel; now refused at the build (InvalidMetadata), unread.
* a file larger than the staging disk (a sparse file costs its owner nothing) was copied until
  the disk was full, then the build died with an untyped `OSError: [Errno 28]`. Now each file's
  size is checked against the staging disk's free space before it is copied, and what DEST
  lacks against DEST's disk before DEST is touched (InsufficientSpace); a disk that fills from
  elsewhere during the build is InsufficientSpace too, with DEST left as it was.

Variants that fail as they should: a folder or a file swapped for a link (or a hard link to a
private file) between the check and the open, and names with bidi, zero-width and isolate
characters.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from kernels.errors import InsufficientSpace, InvalidMetadata, MirrorSourceError
from kernels.serve import build as mirror_build
from kernels.serve import build_mirror
from kernels.serve import source as mirror_source
from kernels.serve.writer import rev

from tests.security.conftest import needs_root

VARIANT = "evil/relu/build/torch-universal"
SECRET = b"-----BEGIN OPENSSH PRIVATE KEY----- the builder's own\n"


def _kernel(src: Path) -> Path:
    variant = src / VARIANT
    variant.mkdir(parents=True, exist_ok=True)
    (variant / "metadata.json").write_text(json.dumps({"version": 1, "python-depends": []}))
    (variant / "__init__.py").write_text("VALUE = 1\n")
    return variant


def _private(tmp_path: Path) -> Path:
    folder = tmp_path / "home"
    folder.mkdir(mode=0o700)
    secret = folder / "id_ed25519"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    return secret


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kernels", "mirror", "build", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_a_very_deep_tree_is_a_typed_error(tmp_path):
    """1,500 nested folders under a variant. Before: RecursionError ('this looks like a bug')."""
    src, dest = tmp_path / "src", tmp_path / "dest"
    fd = os.open(_kernel(src), os.O_RDONLY)
    try:
        for _ in range(1500):  # by descriptor: the path is far longer than PATH_MAX
            os.mkdir("d", dir_fd=fd)
            inner = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = inner
        os.close(os.open("x.py", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd))
    finally:
        os.close(fd)
    try:
        with pytest.raises(MirrorSourceError) as err:
            build_mirror(src, dest)
        assert "deep" in err.value.message and len(err.value.message) < 400
        assert not dest.exists()
        out = _cli(str(src), str(dest))
        assert out.returncode == 1 and "RecursionError" not in out.stderr, out.stderr
        assert out.stderr.startswith("error: ") and "deep" in out.stderr
    finally:
        _remove_chain(src / VARIANT)


def _remove_chain(top: Path) -> None:
    """Remove top/d/d/.../d one level at a time (shutil.rmtree, and so pytest's clean-up of old
    tmp folders, recurses once per level and fails at this depth)."""
    while (top / "d").exists():
        os.rename(top / "d", top / "x")
        if (top / "x" / "d").exists():
            os.rename(top / "x" / "d", top / "d")
        for name in os.listdir(top / "x"):
            os.unlink(top / "x" / name)
        os.rmdir(top / "x")


def test_a_tree_as_deep_as_the_client_accepts_builds(tmp_path):
    """The bound is the client's: build/<variant>/ plus 29 folders and a file is 32 parts."""
    src, dest = tmp_path / "src", tmp_path / "dest"
    deep = _kernel(src).joinpath(*["d"] * 29)
    deep.mkdir(parents=True)
    (deep / "x.py").write_text("X = 1\n")
    [built] = build_mirror(src, dest)
    assert built.repo_id == "evil/relu"
    (deep / "e").mkdir()
    (deep / "e" / "y.py").write_text("Y = 1\n")  # 33 parts: a path every client refuses
    with pytest.raises(MirrorSourceError):
        build_mirror(src, tmp_path / "dest2")


def test_metadata_over_the_clients_cap_is_refused_unparsed(tmp_path):
    """A 64 MiB metadata.json (valid JSON, padded) was read whole into memory, and the mirror
    then served a kernel that every client refuses (their cap is 1 MiB)."""
    src, dest = tmp_path / "src", tmp_path / "dest"
    meta = _kernel(src) / "metadata.json"
    with open(meta, "w") as f:
        f.write(json.dumps({"version": 1, "python-depends": []}))
        f.truncate(64 << 20)  # NULs after the JSON: sparse, and not readable JSON either
    meta.write_bytes(meta.read_bytes().replace(b"\0", b" "))
    with pytest.raises(InvalidMetadata) as err:
        build_mirror(src, dest)
    assert "1048576" in err.value.message
    assert not dest.exists()


@pytest.fixture
def small_tmp() -> Iterator[Path]:
    """A 16 MiB tmpfs, as TMPDIR: a disk that a sparse file can fill in a second."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to mount a small tmpfs")
    where = Path(tempfile.mkdtemp(prefix="kernels-small-"))
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(where)]).returncode:
        where.rmdir()
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)
        where.rmdir()


def _fill(disk: Path, leave: int) -> None:
    """Fill `disk` until `leave` bytes are free (blocks really taken, not a sparse file)."""
    take = shutil.disk_usage(disk).free - leave
    assert take > 0
    fd = os.open(disk / f"filler-{take}", os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        os.posix_fallocate(fd, 0, take)
    finally:
        os.close(fd)


def _fill_after_check(monkeypatch, module, disk: Path, leave: int) -> None:
    """Once `module`'s real space check has passed for more than `leave` bytes, `disk` fills
    from elsewhere to `leave` bytes free: the writes that follow meet a full disk (ENOSPC)."""
    real = module.require_free_space

    def check(folder, needed, *args, **kwargs):
        real(folder, needed, *args, **kwargs)
        if needed > leave:
            _fill(disk, leave)

    monkeypatch.setattr(module, "require_free_space", check)


def _leftovers(disk: Path) -> list[str]:
    return sorted(p.name for p in disk.iterdir() if not p.name.startswith("filler-"))


@needs_root
def test_a_file_larger_than_the_staging_disk_is_a_typed_error(tmp_path, small_tmp, monkeypatch):
    """Another user's 1 GiB sparse file in a shared SRC (it costs them nothing) against a 16 MiB
    staging disk. Before: copied until the disk was full, then an untyped `OSError: [Errno 28]`
    ('this looks like a bug'). Now InsufficientSpace naming the file, before a byte is copied;
    DEST is not created and the staging folder is gone."""
    src, dest = tmp_path / "src", tmp_path / "dest"
    big = _kernel(src) / "weights.bin"
    with open(big, "wb") as f:
        f.truncate(1 << 30)
    big.chmod(0o644)
    out = _cli(str(src), str(dest), env={**os.environ, "TMPDIR": str(small_tmp)})
    assert out.returncode == 1 and not dest.exists()
    assert "looks like a bug" not in out.stderr and "Errno" not in out.stderr, out.stderr
    error, hint = out.stderr.splitlines()
    assert error.startswith("error: ") and f"weights.bin needs {1 << 30} bytes" in error, error
    assert hint.startswith("hint: ") and "TMPDIR" in hint
    assert _leftovers(small_tmp) == []  # the staging folder was removed
    monkeypatch.setattr(tempfile, "tempdir", str(small_tmp))
    with pytest.raises(InsufficientSpace) as err:
        build_mirror(src, dest)
    assert "weights.bin" in err.value.message and "needs" in err.value.message
    assert shutil.disk_usage(small_tmp).used < 1 << 20  # refused before copying, not when full
    assert not dest.exists() and _leftovers(small_tmp) == []


@needs_root
def test_a_staging_disk_that_fills_during_the_copy_is_a_typed_error(
    tmp_path, small_tmp, monkeypatch
):
    """The file fits when it is checked; then the disk fills from elsewhere while it is copied:
    InsufficientSpace (ENOSPC) naming the file, DEST not created, the staging folder gone."""
    src, dest = tmp_path / "src", tmp_path / "dest"
    (_kernel(src) / "weights.bin").write_bytes(os.urandom(4 << 20))
    monkeypatch.setattr(tempfile, "tempdir", str(small_tmp))
    _fill_after_check(monkeypatch, mirror_source, small_tmp, 1 << 20)
    with pytest.raises(InsufficientSpace) as err:
        build_mirror(src, dest)
    assert "filled up" in err.value.message and "weights.bin" in err.value.message
    assert "TMPDIR" in err.value.hint and len(err.value.hint.splitlines()) == 1
    assert not dest.exists() and _leftovers(small_tmp) == []


def test_a_file_that_grows_after_its_size_check_is_refused(tmp_path, monkeypatch):
    """The owner extends their file (sparse: free for them) right after the build checked its
    size against the free space: the copy stops at the checked size and refuses the file."""
    src, dest = tmp_path / "src", tmp_path / "dest"
    grows = _kernel(src) / "weights.bin"
    grows.write_bytes(b"w" * 1000)
    real = mirror_source.require_free_space

    def check(folder, needed, what, **kwargs):
        real(folder, needed, what, **kwargs)
        if what.endswith("weights.bin"):
            os.truncate(grows, 64 << 20)

    monkeypatch.setattr(mirror_source, "require_free_space", check)
    with pytest.raises(MirrorSourceError) as err:
        build_mirror(src, dest)
    assert "weights.bin changed" in err.value.message
    assert not dest.exists()


@needs_root
def test_files_larger_than_dests_disk_are_refused_before_dest_is_touched(tmp_path, small_tmp):
    """Staging fits, DEST (a 16 MiB disk) does not: InsufficientSpace naming DEST, nothing there.
    What counts is what DEST lacks: an unchanged rebuild on a nearly full DEST still works, and
    a change that does not fit leaves the mirror's branches where they were."""
    src, dest = tmp_path / "src", small_tmp / "mirror"
    variant = _kernel(src)
    (variant / "weights.bin").write_bytes(os.urandom(20 << 20))
    with pytest.raises(InsufficientSpace) as err:
        build_mirror(src, dest)
    assert f"the mirror build into {dest} needs" in err.value.message
    assert "DEST" in err.value.hint
    assert _leftovers(small_tmp) == []
    (variant / "weights.bin").write_bytes(os.urandom(6 << 20))
    [first] = build_mirror(src, dest)
    _fill(small_tmp, 2 << 20)  # less free than the mirror holds
    [again] = build_mirror(src, dest)
    assert (again.commit, again.changed) == (first.commit, False)
    (variant / "more.bin").write_bytes(os.urandom(4 << 20))
    with pytest.raises(InsufficientSpace):
        build_mirror(src, dest)
    assert rev(first.path, "refs/heads/main") == first.commit


@needs_root
@pytest.mark.parametrize("dest_exists", [False, True])
def test_a_dest_disk_that_fills_during_the_build_leaves_the_mirror_as_it_was(
    tmp_path, small_tmp, monkeypatch, dest_exists
):
    """DEST's disk fills from elsewhere after the space check, while the second of two repos is
    written: InsufficientSpace; a new DEST is removed, an existing one keeps every branch where
    it was (the first repo's too: no branch moves before every repo's objects are written)."""
    src, dest = tmp_path / "src", small_tmp / "mirror"
    first = _kernel(src)
    second = src / "evil" / "silu" / "build" / "torch-universal"
    shutil.copytree(first, second)
    before = {}
    if dest_exists:
        before = {b.repo_id: b.commit for b in build_mirror(src, dest)}
        (first / "__init__.py").write_text("VALUE = 2\n")
    (second / "weights.bin").write_bytes(os.urandom(4 << 20))
    _fill_after_check(monkeypatch, mirror_build, small_tmp, 2 << 20)
    with pytest.raises(InsufficientSpace) as err:
        build_mirror(src, dest)
    assert "filled up" in err.value.message and str(dest) in err.value.message
    if not dest_exists:
        assert _leftovers(small_tmp) == []
    else:
        for repo_id, commit in before.items():
            assert rev(dest / repo_id, "refs/heads/main") == commit, repo_id


# -- races: the check and the open are one descriptor apart --------------------------------------


def _swap_after_lstat(monkeypatch, name: str, swap) -> None:
    """Run `swap` right after the build lstat()s the entry `name`: the attacker wins the race
    between the check and the open (a real attacker would loop until they do)."""
    real = os.stat
    done = []

    def stat(path, *args, **kwargs):
        result = real(path, *args, **kwargs)
        if path == name and kwargs.get("follow_symlinks") is False and not done:
            done.append(True)
            swap()
        return result

    monkeypatch.setattr(os, "stat", stat)


def test_a_folder_swapped_for_a_link_after_its_check_is_refused(tmp_path, monkeypatch):
    src, dest = tmp_path / "src", tmp_path / "dest"
    variant = _kernel(src)
    (variant / "ops").mkdir()
    (variant / "ops" / "a.py").write_text("A = 1\n")
    secret = _private(tmp_path)

    def swap() -> None:
        os.rename(variant / "ops", variant / ".ops-old")
        os.symlink(secret.parent, variant / "ops")

    _swap_after_lstat(monkeypatch, "ops", swap)
    with pytest.raises(MirrorSourceError) as err:
        build_mirror(src, dest)
    # O_NOFOLLOW | O_DIRECTORY on the link: ELOOP or ENOTDIR, "a link" or "changed"
    assert "ops" in err.value.message
    assert "link" in err.value.message or "changed" in err.value.message
    assert not dest.exists()


@pytest.mark.parametrize("kind", ["symlink", "hard link"])
def test_a_file_swapped_after_its_check_is_refused(tmp_path, monkeypatch, kind):
    """A public file, checked, then replaced by a link to the builder's private key: the open
    refuses the symbolic link (O_NOFOLLOW) and the hard link is another inode than was checked."""
    src, dest = tmp_path / "src", tmp_path / "dest"
    variant = _kernel(src)
    (variant / "key.txt").write_text("public\n")
    secret = _private(tmp_path)

    def swap() -> None:
        os.unlink(variant / "key.txt")
        (os.symlink if kind == "symlink" else os.link)(secret, variant / "key.txt")

    _swap_after_lstat(monkeypatch, "key.txt", swap)
    with pytest.raises(MirrorSourceError) as err:
        build_mirror(src, dest)
    assert "key.txt" in err.value.message
    assert not dest.exists()


@pytest.mark.parametrize(
    "name",
    ["evil\u202egp.py", "zero\u200bwidth.py", "iso\u2066late.py", "line\u2028sep.py", "x\x85.py"],
)
def test_names_with_bidi_or_invisible_characters_are_refused(tmp_path, name):
    src, dest = tmp_path / "src", tmp_path / "dest"
    (_kernel(src) / name).write_text("X = 1\n")
    out = _cli(str(src), str(dest))
    assert out.returncode == 1, out.stdout
    assert name not in out.stderr and "\\u" in out.stderr or "\\x" in out.stderr
    assert not dest.exists()
