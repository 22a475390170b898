"""Issue 28 items 1, 2 and 6: `kernels mirror build SRC DEST` reads SRC as somebody else's folder.

A shared SRC is written by other users, and the build runs with the builder's rights: whatever
the build copies, `kernels serve` hands to anyone who asks. So a link (to a file or a folder) is
never followed, anything but a regular file or folder is never opened, a name with control
characters is refused, and a file only the builder's rights can read is copied only when nobody
else controls where it lies. Each refusal is a MirrorSourceError naming the entry, and DEST is not
touched. The trusted-publisher list of the mirror is the builder's own (`--trust`), never SRC's.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from kernels.errors import InvalidSpec, MirrorSourceError
from kernels.serve import MirrorServer, build_mirror

from tests.security.conftest import as_nobody, needs_root

SECRET = b"-----BEGIN OPENSSH PRIVATE KEY----- the builder's own\n"
VARIANT = "evil/relu/build/torch-universal"


def _kernel(src: Path, repo: str = "evil/relu") -> Path:
    """A valid one-variant kernel folder; returns the variant folder."""
    variant = src / repo / "build" / "torch-universal"
    variant.mkdir(parents=True, exist_ok=True)
    (variant / "metadata.json").write_text(json.dumps({"version": 1, "python-depends": []}))
    (variant / "__init__.py").write_text("VALUE = 1\n")
    return variant


def _private(tmp_path: Path) -> Path:
    """A file only the builder may read (like ~/.ssh/id_ed25519)."""
    folder = tmp_path / "home"
    folder.mkdir(mode=0o700)
    secret = folder / "id_ed25519"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    return secret


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kernels", "mirror", "build", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _one_line_error(err: str) -> tuple[str, str]:
    lines = err.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    hints = [line for line in lines if line.startswith("hint: ")]
    assert len(errors) == 1 and len(hints) == 1, err
    return errors[0], hints[0]


def _plant_link(src: Path, where: str, secret: Path) -> str:
    """Put a link to `secret` (or its folder) at `where`; return the path the error must name."""
    variant = _kernel(src)
    if where == "file in a variant":
        (variant / "id_ed25519").symlink_to(secret)
        return f"{VARIANT}/id_ed25519"
    if where == "folder in a variant":
        (variant / "home").symlink_to(secret.parent, target_is_directory=True)
        return f"{VARIANT}/home"
    if where == "metadata.json":
        (variant / "metadata.json").unlink()
        meta = secret.parent / "metadata.json"
        meta.write_text('{"version": 1}')
        (variant / "metadata.json").symlink_to(meta)
        return f"{VARIANT}/metadata.json"
    if where == "build folder":
        other = _kernel(secret.parent / "k")
        (src / "evil" / "linked").mkdir()
        (src / "evil" / "linked" / "build").symlink_to(other.parent, target_is_directory=True)
        return "evil/linked/build"
    if where == "repo folder":
        _kernel(secret.parent / "k", "o/private")
        (src / "evil" / "private").symlink_to(secret.parent / "k" / "o" / "private")
        return "evil/private"
    if where == "org folder":
        _kernel(secret.parent / "k", "o/private")
        (src / "other").symlink_to(secret.parent / "k" / "o", target_is_directory=True)
        return "other"
    raise AssertionError(where)


@pytest.mark.parametrize(
    "where",
    [
        "file in a variant",
        "folder in a variant",
        "metadata.json",
        "build folder",
        "repo folder",
        "org folder",
    ],
)
def test_a_link_in_src_is_refused_and_dest_is_not_touched(tmp_path, where):
    src, dest = tmp_path / "src", tmp_path / "dest"
    named = _plant_link(src, where, _private(tmp_path))
    with pytest.raises(MirrorSourceError) as err:
        build_mirror(src, dest)
    assert named in err.value.message and "link" in err.value.message
    assert err.value.hint and "\n" not in err.value.hint
    assert not dest.exists()


def test_a_linked_secret_is_not_served(tmp_path):
    """The attack end to end: the CLI refuses, so there is no mirror to serve the key from."""
    src, dest = tmp_path / "src", tmp_path / "dest"
    _plant_link(src, "file in a variant", _private(tmp_path))
    out = _cli(str(src), str(dest))
    assert out.returncode == 1, out
    error, hint = _one_line_error(out.stderr)
    assert f"{VARIANT}/id_ed25519" in error and "symbolic link" in error
    assert not dest.exists()
    # Without the link, the same SRC builds, and the mirror has no such file.
    (src / VARIANT / "id_ed25519").unlink()
    assert _cli(str(src), str(dest)).returncode == 0
    with MirrorServer(dest) as server:
        tree = json.loads(_get(server, "/api/kernels/evil/relu/tree/main/build/torch-universal"))
    assert sorted(e["path"].rsplit("/", 1)[1] for e in tree) == ["__init__.py", "metadata.json"]


def _get(server: MirrorServer, path: str) -> bytes:
    import http.client

    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    try:
        conn.request("GET", path)
        return conn.getresponse().read()
    finally:
        conn.close()


@pytest.mark.parametrize("kind", ["fifo", "socket"])
def test_a_fifo_or_socket_is_refused_without_being_opened(tmp_path, kind):
    src, dest = tmp_path / "src", tmp_path / "dest"
    variant = _kernel(src)
    target = variant / "metadata.json"
    target.unlink()
    holder = None
    if kind == "fifo":
        os.mkfifo(target)  # opening it for reading would wait for a writer forever
    else:  # bound in a short folder (AF_UNIX paths are short), then moved into place
        short = Path(tempfile.mkdtemp(prefix="k-"))
        holder = socket.socket(socket.AF_UNIX)
        holder.bind(str(short / "s"))
        os.rename(short / "s", target)
        short.rmdir()
    try:
        out = _cli(str(src), str(dest), timeout=60)  # before the fix: a hang (TimeoutExpired)
    finally:
        if holder is not None:
            holder.close()
    assert out.returncode == 1, out
    error, hint = _one_line_error(out.stderr)
    assert f"{VARIANT}/metadata.json" in error and "not a regular file" in error
    assert not dest.exists()


@pytest.mark.parametrize(
    "name",
    ["new\nline.py", "esc\x1b[2Jclear.py", "cr\rover.py", "del\x7f.py", b"not-utf8-\xff.py"],
)
def test_a_name_with_control_characters_is_a_typed_error(tmp_path, name):
    src, dest = tmp_path / "src", tmp_path / "dest"
    variant = _kernel(src)
    raw = os.fsencode(variant) + b"/" + (name if isinstance(name, bytes) else name.encode())
    with open(raw, "wb") as f:
        f.write(b"X = 1\n")
    with pytest.raises(MirrorSourceError) as err:
        build_mirror(src, dest)
    shown = str(err.value)
    assert VARIANT in shown and all(ch.isprintable() or ch == "\n" for ch in shown), shown
    assert shown.count("\n") == 1  # the message and one hint line
    assert not dest.exists()
    out = _cli(str(src), str(dest))
    assert out.returncode == 1 and "\x1b" not in out.stderr and "\r" not in out.stderr
    _one_line_error(out.stderr)


def test_a_private_file_where_others_can_write_is_refused(tmp_path):
    """A folder others can write may hold a hard link to the builder's private file (possible
    where fs.protected_hardlinks is 0): a file not readable by everyone is refused there."""
    src, dest = tmp_path / "src", tmp_path / "dest"
    variant = _kernel(src)
    secret = _private(tmp_path)
    os.link(secret, variant / "weights.bin")  # what the other user would have done
    variant.chmod(0o777)
    with pytest.raises(MirrorSourceError) as err:
        build_mirror(src, dest)
    assert f"{VARIANT}/weights.bin" in err.value.message and "o+r" in err.value.hint
    assert not dest.exists()
    # Readable by everyone: nothing it could reveal; it is copied.
    os.unlink(variant / "weights.bin")
    (variant / "weights.bin").write_bytes(b"public\n")
    (variant / "weights.bin").chmod(0o644)
    assert build_mirror(src, dest)[0].repo_id == "evil/relu"


def test_a_private_kernel_in_the_builders_own_folder_builds(tmp_path):
    """The rule does not stop private builds: 0600 files in folders only the builder controls."""
    src = tmp_path / "src"
    variant = _kernel(src)
    for path in variant.iterdir():
        path.chmod(0o600)
    assert build_mirror(src, tmp_path / "dest")[0].version == 1


@needs_root
def test_another_users_links_and_private_files_in_a_shared_src(shared_dir, tmp_path):
    """`nobody` fills a sticky drop folder (like /tmp) that root then builds from."""
    secret = _private(tmp_path)
    src = shared_dir / "src"
    src.mkdir()
    src.chmod(0o1777)
    dest = tmp_path / "dest"

    def plant_link() -> None:
        _kernel(src)
        (src / VARIANT / "id_ed25519").symlink_to(secret)

    as_nobody(plant_link)
    with pytest.raises(MirrorSourceError, match="symbolic link"):
        build_mirror(src, dest)

    def plant_private() -> None:
        os.unlink(src / VARIANT / "id_ed25519")
        private = src / VARIANT / "mine.txt"
        private.write_text("nobody's own, mode 0600\n")
        private.chmod(0o600)

    as_nobody(plant_private)
    with pytest.raises(MirrorSourceError) as err:
        build_mirror(src, dest)
    assert f"{VARIANT}/mine.txt" in err.value.message and "uid 65534" in err.value.message
    assert not dest.exists()

    def publish() -> None:
        (src / VARIANT / "mine.txt").chmod(0o644)

    as_nobody(publish)
    assert build_mirror(src, dest)[0].repo_id == "evil/relu"


# -- item 2: whom the mirror trusts is the builder's decision -----------------------------------


def test_src_config_does_not_decide_whom_the_mirror_trusts(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    _kernel(src)
    (src / "kernels-mirror.toml").write_text('trusted_publishers = ["evil"]\n')
    build_mirror(src, dest)
    assert not (dest / "kernels-mirror.toml").exists()
    with MirrorServer(dest) as server:
        overview = json.loads(_get(server, "/api/organizations/evil/overview"))
    assert overview["trustedKernelPublisher"] is False
    # The CLI says so, loudly, and how to decide.
    out = _cli(str(src), str(tmp_path / "cli"))
    assert out.returncode == 0 and not (tmp_path / "cli" / "kernels-mirror.toml").exists()
    assert "kernels-mirror.toml" in out.stderr and "--trust" in out.stderr


def test_the_builder_names_the_trusted_publishers(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    _kernel(src)
    (src / "kernels-mirror.toml").write_text('trusted_publishers = ["evil"]\n')
    build_mirror(src, dest, trusted_publishers=["good-org"])
    config = (dest / "kernels-mirror.toml").read_text()
    assert "good-org" in config and "evil" not in config
    # A later build without a decision keeps the builder's earlier one.
    build_mirror(src, dest)
    assert (dest / "kernels-mirror.toml").read_text() == config
    with MirrorServer(dest) as server:
        overview = json.loads(_get(server, "/api/organizations/evil/overview"))
        assert overview["trustedKernelPublisher"] is False
        out = _cli(str(src), str(dest), "--trust", "evil", "--trust", "b-org", "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout.splitlines()[0])["trusted_publishers"] == ["b-org", "evil"]
        overview = json.loads(_get(server, "/api/organizations/evil/overview"))
        assert overview["trustedKernelPublisher"] is True  # the builder said so
    with pytest.raises(InvalidSpec):
        build_mirror(src, dest, trusted_publishers=["../x"])
    assert stat.S_IMODE((dest / "kernels-mirror.toml").stat().st_mode) == 0o644
