"""Disk trouble: a full disk, a read-only cache, cache paths with spaces and non-ASCII names.

A full disk is a real one where the sandbox allows it: a small tmpfs mounted as the cache (needs
root). Where mounting is not possible the tmpfs tests skip and say so; the RLIMIT_FSIZE test
(a per-process file-size limit: writes past it fail with EFBIG instead of ENOSPC, through the same
code path) runs everywhere. A read-only cache is tested as another user (os.setuid to `nobody`
when running as root, since root ignores permissions), as a read-only tmpfs remount, and by
chmod alone when not root.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.reliability.helpers import (
    SOAK,
    assert_user_error,
    cache_problems,
    cli_argv,
    installed_variants,
    payload,
    pure_kernel,
    python_argv,
    record,
    sha256,
    tmp_leftovers,
)

REPO = "disk-lab/big"
OTHER = "disk-lab/other"
LFS = {"weights.bin": payload(500, 1 << 20)}
PLAIN = {"table.bin": payload(501, 100_000)}
DIGESTS = {n: sha256(d) for n, d in {**LFS, **PLAIN}.items()}
IS_ROOT = os.geteuid() == 0

LOAD = """
    import json, kernels
    m = kernels.get_kernel('disk-lab/big', version=1)
    print(json.dumps([m.VALUE, m.digests()]))
"""


@pytest.fixture
def repos(hub):
    hub.trust("disk-lab")
    w = hub.writer(REPO)
    w.commit(pure_kernel("big", value=9, lfs=LFS, plain=PLAIN, writer=w), branch="v1")
    hub.writer(OTHER).commit(pure_kernel("other", value=2), branch="v1")


def _run(argv: list[str], env: dict, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, **kwargs)


def _env(cache: Path, **extra) -> dict:
    return {**os.environ, "KERNELS_CACHE": str(cache), **extra}


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A tmpfs mounted at `path` for the block; the test skips where mounting is not allowed."""
    if not IS_ROOT or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root (the RLIMIT_FSIZE test covers a full disk)")
    path.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True
    )
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _remount(path: Path, options: str) -> None:
    out = subprocess.run(["mount", "-o", f"remount,{options}", str(path)], capture_output=True)
    assert out.returncode == 0, out.stderr


def _assert_nothing_half_written(cache: Path) -> None:
    assert cache_problems(cache) == [], cache_problems(cache)
    assert tmp_leftovers(cache) == [], tmp_leftovers(cache)


# -- a full disk -------------------------------------------------------------------------------


# Sizes around what the kernel needs (~1180 KiB on tmpfs: 1 MiB LFS + 100 kB + small files and
# records), so the disk fills at different stages: objects, tree, stamps, index records.
FULL_SIZES_KIB = [8, 64, 512, 1024, 1152, 1168, 1176, 1184, 1216]
if SOAK:
    FULL_SIZES_KIB = list(range(8, 1232, 8))


def test_full_tmpfs_is_a_cache_error_and_nothing_half_written(hub, repos, tmp_path):
    outcomes = {}
    for size_kib in FULL_SIZES_KIB:
        with tmpfs(tmp_path / f"small-{size_kib}", f"size={size_kib}k") as cache:
            out = _run(cli_argv("pull", f"{REPO}@v1"), _env(cache))
            if out.returncode == 0:  # it fitted
                assert installed_variants(cache), size_kib
                outcomes[size_kib] = "fitted"
            elif "needs" in out.stderr:  # the listed sizes exceed the free space: refused first
                assert_user_error(out, "needs", "has", "free disk space")
                assert installed_variants(cache) == [], size_kib
                outcomes[size_kib] = "InsufficientSpace"
            else:  # the files fit by size, but the writes (files plus records) ran out of space
                assert_user_error(out, "cannot write to the cache", "no space left")
                assert installed_variants(cache) == [], size_kib
                outcomes[size_kib] = "CacheError"
            _assert_nothing_half_written(cache)
            _remount(cache, "size=16m")  # space freed: the next pull completes
            assert _run(cli_argv("pull", f"{REPO}@v1"), _env(cache)).returncode == 0
            assert json.loads(_run(python_argv(LOAD), _env(cache)).stdout) == [9, DIGESTS]
            _assert_nothing_half_written(cache)
    assert {"InsufficientSpace", "CacheError"} <= set(outcomes.values()), outcomes
    record(
        "full disk (the cache on a tmpfs of 8 KiB up to just past what it needs), then freed",
        len(outcomes),
        sizes_kib=f"{FULL_SIZES_KIB[0]}..{FULL_SIZES_KIB[-1]}",
        fitted=sum(v == "fitted" for v in outcomes.values()),
        insufficient_space=sum(v == "InsufficientSpace" for v in outcomes.values()),
        cache_error=sum(v == "CacheError" for v in outcomes.values()),
    )


def test_out_of_inodes_is_a_cache_error(hub, repos, tmp_path):
    with tmpfs(tmp_path / "few-inodes", "size=16m,nr_inodes=12") as cache:
        out = _run(cli_argv("pull", f"{REPO}@v1"), _env(cache))
        assert_user_error(out, "cannot write to the cache", "no space left")
        _assert_nothing_half_written(cache)
    record("out of inodes (tmpfs nr_inodes=12)", 1)


FSIZE = """
    import resource, signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a killing signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))
    import sys
    from kernels.cli.main import main
    sys.exit(main())
"""


def test_file_size_limit_is_a_cache_error_and_nothing_half_written(hub, repos, tmp_path):
    cache = tmp_path / "cache"
    out = _run(python_argv(FSIZE) + ["pull", f"{REPO}@v1"], _env(cache))
    assert_user_error(out, "cannot write to the cache", "file too large")
    assert installed_variants(cache) == []
    _assert_nothing_half_written(cache)
    assert _run(cli_argv("pull", f"{REPO}@v1"), _env(cache)).returncode == 0
    record("file-size limit (RLIMIT_FSIZE 300 kB: EFBIG mid-download)", 1)


# -- a read-only cache ------------------------------------------------------------------------


@pytest.fixture
def shared_dir():
    """A folder other users can enter (pytest's tmp folders are private to root)."""
    path = Path(tempfile.mkdtemp(prefix="kernels-ro-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        for p in [path, *path.rglob("*")]:
            with contextlib.suppress(OSError):
                p.chmod(p.stat().st_mode | stat.S_IWUSR)
        shutil.rmtree(path, ignore_errors=True)


def _populate(cache: Path) -> None:
    out = _run(cli_argv("pull", f"{REPO}@v1"), _env(cache))
    assert out.returncode == 0, out.stderr


def _make_read_only(folder: Path) -> None:
    for p in [folder, *folder.rglob("*")]:
        if not p.is_symlink():
            p.chmod(p.stat().st_mode & ~0o222)


def _check_read_only_cache(hub, cache: Path, env: dict, prefix: str = "") -> None:
    """Loads work with zero requests, `verify --all` works, an install fails cleanly and
    changes nothing. `prefix` is code each child runs first (e.g. to become another user)."""

    def child(code: str, *args: str) -> subprocess.CompletedProcess:
        return _run(python_argv(prefix + textwrap.dedent(code)) + list(args), env)

    hub.reset_requests()
    out = child(LOAD)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [9, DIGESTS]
    assert [r for r in hub.requests if "/api/agent-harnesses" not in r[1]] == []  # zero requests
    verify = child(CLI, "verify", "--all")
    assert verify.returncode == 0 and "1 variants verified" in verify.stdout, verify
    before = sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*"))
    assert_user_error(child(CLI, "pull", f"{OTHER}@v1"), "cannot write to the cache")
    assert sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*")) == before


CLI = """
    import sys
    from kernels.cli.main import main
    sys.exit(main())
"""

# The interpreter lives in a folder only root can read on some machines, so the child starts as
# root, imports what it needs, and then becomes `nobody` before it touches the cache.
AS_NOBODY = """
import os, json, hashlib, pathlib, importlib.machinery, filelock, platform, sysconfig
sysconfig.get_config_vars(), platform.machine()  # read the interpreter's own files while we can
import kernels, kernels.api, kernels.fetch, kernels.resolve, kernels.trust, kernels.importer
import kernels.select, kernels.variants, kernels.metadata, kernels.native_abi, kernels.notices
import kernels.cli.main, kernels.cli.pull, kernels.cli.common, kernels.cli.cache_cmds
# Every other module of the package too: lazy imports (a CLI hint, a cache part) would otherwise
# read the checkout as `nobody`, who may not enter it (a clone in a 0700 temp folder).
import importlib, pkgutil, kernels.cache
_mods = [*pkgutil.walk_packages(kernels.__path__, "kernels.")]
_mods += pkgutil.walk_packages(kernels.cache.__path__, "kernels.cache.")
for _mod in _mods:
    if not _mod.name.startswith(("kernels.training", "kernels.layers", "kernels.serve")) and (
        not _mod.name.endswith("__main__")  # importing it would run the command line
    ):
        try:
            importlib.import_module(_mod.name)
        except ImportError:  # an optional extra (e.g. sigstore) that this run does not need
            pass
kernels.variants.detect_system()  # imports what describing this machine needs
# and what talking to the Hub needs (a stale record or an uncached kernel goes online)
import threading, http.server
class _NotFound(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_error(404)
    def log_message(self, *args):
        pass
_warm = http.server.HTTPServer(("127.0.0.1", 0), _NotFound)
threading.Thread(target=_warm.serve_forever, daemon=True).start()
_endpoint = os.environ["HF_ENDPOINT"]
os.environ["HF_ENDPOINT"] = f"http://127.0.0.1:{_warm.server_port}"
try:  # one request to a throwaway server, so the test's hub counts none
    kernels.hub.resolve_revision("warm/up", "v1")
except kernels.KernelsError:
    pass
os.environ["HF_ENDPOINT"] = _endpoint
_warm.shutdown()
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
assert not os.access(os.environ["KERNELS_CACHE"], os.W_OK)
"""


@pytest.mark.skipif(not IS_ROOT, reason="runs as root, drops to the user `nobody`")
def test_read_only_cache_as_another_user(hub, repos, shared_dir):
    cache = shared_dir / "cache"
    _populate(cache)
    _make_read_only(cache)
    # HOME and the (absent) config file where this user may look.
    env = _env(
        cache,
        HOME=str(shared_dir),
        KERNELS_CONFIG=str(shared_dir / "config.toml"),
        HF_HOME=str(shared_dir / "hf-home"),  # the token file is looked for before a request
    )
    probe = _run(python_argv(AS_NOBODY + "open(os.environ['KERNELS_CACHE'] + '/x', 'w')"), env)
    assert "PermissionError" in probe.stderr  # the cache really is read-only for this user
    _check_read_only_cache(hub, cache, env, prefix=AS_NOBODY)
    # A HOME this user may not enter (so the default config path cannot even be looked at).
    private = shared_dir / "private-home"
    private.mkdir(mode=0o700)
    env = {k: v for k, v in env.items() if k != "KERNELS_CONFIG"} | {"HOME": str(private)}
    env.pop("XDG_CONFIG_HOME", None)
    _check_read_only_cache(hub, cache, env, prefix=AS_NOBODY)
    record("read-only cache, another user (root-populated, loaded as nobody)", 1)


def test_read_only_mount(hub, repos, tmp_path):
    with tmpfs(tmp_path / "ro", "size=16m") as cache:
        _populate(cache)
        _remount(cache, "ro")
        _check_read_only_cache(hub, cache, _env(cache))
    record("read-only mount of a populated cache", 1)


@pytest.mark.skipif(IS_ROOT, reason="root ignores permissions; covered by the `nobody` test")
def test_read_only_cache_by_permissions(hub, repos, tmp_path):
    cache = tmp_path / "cache"
    _populate(cache)
    _make_read_only(cache)
    _check_read_only_cache(hub, cache, _env(cache))


# -- paths with spaces and non-ASCII characters -----------------------------------------------


def test_cache_path_with_spaces_and_non_ascii(hub, repos, tmp_path):
    cache = tmp_path / "my cache" / "kérnels ü 缓存 🚀"
    env = _env(cache, HF_HOME=str(tmp_path / "hf home ñ"))
    assert _run(cli_argv("pull", f"{REPO}@v1"), env).returncode == 0
    hub.reset_requests()
    out = _run(python_argv(LOAD), env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [9, DIGESTS]
    assert [r for r in hub.requests if "/api/agent-harnesses" not in r[1]] == []
    for args in (["verify", "--all"], ["ls"], ["du"], ["prune", "--dry-run"]):
        done = _run(cli_argv(*args), env)
        assert done.returncode == 0, (args, done.stderr)
    assert "disk-lab/big" in _run(cli_argv("ls"), env).stdout
    _assert_nothing_half_written(cache)
    record("cache path with spaces and non-ASCII characters", 1)
