"""Items 7, 11 and 12: waiting on a lock ends, prune cannot race a load, a read-only cache
never needs a write.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import textwrap
import threading
import time
from pathlib import Path

import kernels
import pytest
from kernels.cache import Cache

from tests.reliability.helpers import cache_problems, cli_argv, python_argv
from tests.security.conftest import marker_files, needs_root

GOOD = "good-org/kernel"

LOAD = """
    import sys, time, kernels, kernels.errors
    start = time.monotonic()
    try:
        print(kernels.get_kernel(sys.argv[1], version=1).VALUE)
    except kernels.errors.KernelsError as exc:
        print(type(exc).__name__)
        print(exc, file=sys.stderr)
    print(round(time.monotonic() - start, 1))
"""

HOLD = """
    import sys, time
    from kernels.cache import Cache
    lock = Cache(sys.argv[1]).lock(sys.argv[2])
    lock.acquire()
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.fixture
def good(hub, tmp_path):
    hub.trust("good-org")
    files = marker_files("kernel", tmp_path / "ran")
    hub.writer(GOOD).commit(files, branch="v1")
    return files


def test_a_stopped_lock_holder_delays_a_load_by_the_deadline_only(good, tmp_path):
    root = Path(os.environ["KERNELS_CACHE"])
    holder = subprocess.Popen(
        python_argv(HOLD) + [str(root), f"repo:{GOOD}"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        os.kill(holder.pid, signal.SIGSTOP)
        out = subprocess.run(
            python_argv(LOAD) + [GOOD],
            capture_output=True,
            text=True,
            timeout=60,  # the old loader waited here for ever
            env={**os.environ, "KERNELS_LOCK_TIMEOUT": "3"},
        )
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    kind, seconds = out.stdout.split()
    assert kind == "LockWaitTimeout", out.stderr
    assert 3 <= float(seconds) < 15
    # Said whom it waits for while waiting, and again when it gave up; and what to do.
    assert out.stderr.count(f"pid {holder.pid}") == 2, out.stderr
    assert "waiting for a cache lock" in out.stderr and "stopped" in out.stderr
    assert "KERNELS_LOCK_TIMEOUT" in out.stderr


def test_prune_during_a_cold_load_waits_for_it(hub, good):
    root = Path(os.environ["KERNELS_CACHE"])
    entered, release = threading.Event(), threading.Event()
    blocked = "build/torch-universal/__init__.py"  # fetched after metadata.json

    def hold_download(repo_id, commit, path, data):
        if path == blocked:
            entered.set()
            release.wait(60)
        return data

    hub.server.file_hook = hold_download
    result: dict = {}

    def load() -> None:
        try:
            result["tree"] = kernels.install_kernel(GOOD, version=1)
        except Exception as exc:  # reported below
            result["error"] = exc

    loader = threading.Thread(target=load)
    loader.start()
    prune = None
    try:
        assert entered.wait(60)
        meta = good["build/torch-universal/metadata.json"].encode()
        first = hashlib.sha256(meta).hexdigest()
        assert Cache(root).objects.has(first)  # downloaded, not yet indexed
        prune = subprocess.Popen(cli_argv("prune"), stdout=subprocess.PIPE, text=True)
        time.sleep(2.0)
        assert Cache(root).objects.has(first)  # prune has not taken it from under the load
    finally:
        release.set()
        loader.join(60)
    assert "error" not in result, result.get("error")
    assert prune is not None and prune.wait(60) == 0
    assert "removed 0 trees and 0 objects" in prune.stdout.read()
    assert cache_problems(root) == []
    assert kernels.get_kernel(GOOD, version=1).VALUE == 1


@needs_root
def test_a_read_only_cache_rechecks_a_stale_record_without_writing(hub, shared_dir):
    from tests.reliability.test_disk import AS_NOBODY

    hub.trust("good-org")
    markers = shared_dir / "markers"
    markers.mkdir(mode=0o777)
    markers.chmod(0o777)  # the kernel, run by `nobody`, writes its marker here
    hub.writer(GOOD).commit(marker_files("kernel", markers / "ran"), branch="v1")
    cache = shared_dir / "cache"
    env = {**os.environ, "KERNELS_CACHE": str(cache), "HOME": str(shared_dir),
           "KERNELS_CONFIG": str(shared_dir / "config.toml"),
           "HF_HOME": str(shared_dir / "hf-home")}  # fmt: skip
    pulled = subprocess.run(cli_argv("pull", f"{GOOD}@v1"), env=env, capture_output=True)
    assert pulled.returncode == 0, pulled.stderr
    for p in [cache, *cache.rglob("*")]:
        p.chmod(p.stat().st_mode & ~0o222)
    before = sorted((p, p.stat().st_mtime_ns) for p in cache.rglob("*"))
    hub.reset_requests()
    out = subprocess.run(
        python_argv(AS_NOBODY + textwrap.dedent(LOAD)) + [GOOD],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "KERNELS_RESOLVE_TTL": "0"},  # the record is stale: ask the Hub again
    )
    assert out.stdout.split()[:1] == ["1"], out.stderr
    assert any("/revision/v1" in path for _m, path in hub.requests)  # it did re-check
    assert sorted((p, p.stat().st_mtime_ns) for p in cache.rglob("*")) == before
