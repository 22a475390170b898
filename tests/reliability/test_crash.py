"""Crash safety: `kill -9` a `kernels pull` at random points of a multi-file download.

The server trickles every file body (the fault mode's `slow`), so the kills land mid-transfer:
before a trial kills a pull it waits until a random number of file downloads have started, then a
random fraction of one file's transfer time. After every kill: the cache is sound by its own rules
(every object hashes to its name, every tree matches its manifest), `kernels verify --all` passes,
an offline load either gets the whole kernel or a clean OfflineCacheMiss, the dead process's locks
are free at once (flock: the OS drops them), and the next pull completes and leaves tmp/ empty.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time

import pytest
from kernels.cache import Cache
from kernels.serve.faults import FaultPlan

from tests.reliability.helpers import (
    SOAK,
    cache_problems,
    cli_argv,
    installed_variants,
    payload,
    pure_kernel,
    python_argv,
    record,
    sha256,
    soak_only,
    tmp_leftovers,
    trials,
    wait_for,
)

REPO = "crash-lab/big"
LFS = {f"weights/part{i}.bin": payload(100 + i, 1 << 20) for i in range(4)}  # 4 MiB of LFS
PLAIN = {"table.bin": payload(200, 200_000)}  # a git blob, checked by its git id
N_FILES = 3 + len(LFS) + len(PLAIN)  # + metadata.json, __init__.py, _impl.py
SLOW = 0.4  # seconds each file body takes to arrive
DIGESTS = {name: sha256(data) for name, data in {**LFS, **PLAIN}.items()}

LOAD = """
    import json, kernels
    try:
        m = kernels.get_kernel('crash-lab/big', version=1)
    except kernels.OfflineCacheMiss as exc:
        print(json.dumps({'miss': str(exc)}))
    else:
        print(json.dumps({'value': m.VALUE, 'digests': m.digests()}))
"""


@pytest.fixture
def big(hub):
    hub.trust("crash-lab")
    w = hub.writer(REPO)
    return w.commit(pure_kernel("big", value=5, lfs=LFS, plain=PLAIN, writer=w), branch="v1")


def _file_gets(plan: FaultPlan) -> int:
    return sum(
        1
        for e in list(plan.events)
        if e.method == "GET" and ("/_lfs/" in e.path or ("/resolve/" in e.path and e.fault))
    )


def _lock_names(commit: str) -> list[str]:
    return [f"repo:{REPO}", f"variant:{REPO}:{commit}:torch-universal"]


def _held(cache: Cache, name: str) -> bool:
    """True when another process holds the lock now (a non-blocking try)."""
    from kernels.cache import LockTimeout

    try:
        with cache.lock(name, timeout=0):
            return False
    except LockTimeout:
        return True


def _offline_load(env: dict) -> dict:
    out = subprocess.run(
        python_argv(LOAD),
        capture_output=True,
        text=True,
        env={**env, "HF_HUB_OFFLINE": "1"},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr  # anything but a clean miss is a failure
    return json.loads(out.stdout)


def _check_after_kill(root, env: dict, commit: str) -> dict:
    cache = Cache(root)
    # The dead process's locks are free now, without waiting for any timeout.
    for name in _lock_names(commit):
        start = time.monotonic()
        with cache.lock(name, timeout=10):
            pass
        assert time.monotonic() - start < 1.0, name
    assert cache_problems(root) == [], cache_problems(root)
    verify = subprocess.run(
        cli_argv("verify", "--all"), capture_output=True, text=True, env=env, timeout=120
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    loaded = _offline_load(env)
    if "miss" not in loaded:
        assert loaded == {"value": 5, "digests": DIGESTS}
    return loaded


def test_kill_9_during_pull_never_leaves_a_partial_variant(hub, big, tmp_path):
    n = trials(5, 50)
    kills_per_trial = 2
    rng = random.Random(1234)
    hub.server.faults = plan = FaultPlan.parse(
        f"slow:1:{SLOW}s:match=/_lfs/,slow:1:{SLOW}s:match=/resolve/"
    )
    figures = {"kills": 0, "killed_mid_transfer": 0, "finished_before_kill": 0}
    figures |= {"locks_held_at_kill": 0, "partial_files_left_by_kills": 0, "offline_misses": 0}
    figures |= {"offline_loads_whole": 0}
    for trial in range(n):
        root = tmp_path / f"cache-{trial}"
        env = {**os.environ, "KERNELS_CACHE": str(root)}
        for _ in range(kills_per_trial):
            before = _file_gets(plan)
            started = rng.randint(0, N_FILES)
            extra = rng.uniform(0.0, SLOW * 1.5)  # up to past the end of the last file
            proc = subprocess.Popen(
                cli_argv("pull", f"{REPO}@v1"),
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                wait_for(
                    lambda b=before, s=started, p=proc: (
                        _file_gets(plan) - b >= s or p.poll() is not None
                    ),
                    timeout=120,
                )
                time.sleep(extra)
                held = any(_held(Cache(root), name) for name in _lock_names(big))
                proc.kill()  # SIGKILL: no handler, no cleanup
            finally:
                proc.wait(timeout=30)
            figures["kills"] += 1
            if proc.returncode == 0:
                figures["finished_before_kill"] += 1
            else:
                assert proc.returncode == -9, proc.stderr.read()
                figures["locks_held_at_kill"] += held
                in_flight = 0 < _file_gets(plan) - before
                figures["killed_mid_transfer"] += in_flight and not installed_variants(root)
            figures["partial_files_left_by_kills"] += len(tmp_leftovers(root))
            loaded = _check_after_kill(root, env, big)
            figures["offline_misses" if "miss" in loaded else "offline_loads_whole"] += 1
            proc.stderr.close()
        # The next pull completes, and cleans what the killed ones left in tmp/.
        hub.server.faults = None
        done = subprocess.run(
            cli_argv("pull", f"{REPO}@v1"), capture_output=True, text=True, env=env, timeout=120
        )
        hub.server.faults = plan
        assert done.returncode == 0, done.stderr
        assert tmp_leftovers(root) == [], tmp_leftovers(root)
        assert installed_variants(root) == [(REPO, big, "torch-universal")]
        assert _check_after_kill(root, env, big) == {"value": 5, "digests": DIGESTS}
    assert figures["killed_mid_transfer"] >= 1  # the kills did land inside downloads
    record(
        "kill -9 of `kernels pull` at a random point of a multi-file download (4 MiB LFS)",
        figures["kills"],
        trials=n,
        torch_imported=SOAK,
        **figures,
    )


CLAIM = """
    import sys, time
    from kernels.cache import Cache
    cache = Cache(sys.argv[1])
    with cache.objects.writer() as w:  # an object write in progress, never committed
        w.write(b"x" * 1000)
        w._fh.flush()
        print(cache.staging.folder(), flush=True)
        time.sleep(120)
"""


def test_tmp_of_a_live_writer_is_kept_and_a_dead_ones_is_removed(tmp_path):
    root = tmp_path / "cache"
    proc = subprocess.Popen(python_argv(CLAIM) + [str(root)], stdout=subprocess.PIPE, text=True)
    try:
        folder = proc.stdout.readline().strip()
        assert folder and len(tmp_leftovers(root)) == 1
        cache = Cache(root)
        assert cache.clean_tmp(older_than=0) == 0  # alive: kept, however old
        assert len(tmp_leftovers(root)) == 1
    finally:
        proc.kill()
        proc.wait()
    assert cache.clean_tmp() == 1  # dead: removed at once, however young
    assert list(cache.tmp.iterdir()) == []


def test_a_normal_exit_leaves_tmp_empty(tmp_path):
    code = """
        import sys
        from kernels.cache import Cache
        cache = Cache(sys.argv[1])
        cache.objects.ingest_bytes(b"abc")
    """
    out = subprocess.run(python_argv(code) + [str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert list(Cache(tmp_path).tmp.iterdir()) == []
    assert Cache(tmp_path).objects.has(sha256(b"abc"))


HOLD = """
    import sys, time
    from kernels.cache import Cache
    lock = Cache(sys.argv[1]).lock(sys.argv[2])  # kept referenced: a collected lock releases
    lock.acquire()
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_pull_waits_for_a_live_lock_holder_and_not_for_a_dead_one(hub, big, tmp_path):
    root = tmp_path / "cache"
    env = {**os.environ, "KERNELS_CACHE": str(root)}
    holder = subprocess.Popen(
        python_argv(HOLD) + [str(root), f"repo:{REPO}"], stdout=subprocess.PIPE, text=True
    )
    pull = None
    try:
        assert holder.stdout.readline().strip() == "held"
        pull = subprocess.Popen(
            cli_argv("pull", f"{REPO}@v1"), env=env, stdout=subprocess.PIPE, text=True
        )
        time.sleep(2.0)
        assert pull.poll() is None  # a live holder: the pull waits
        holder.kill()  # SIGKILL: the holder never releases the lock itself
        holder.wait()
        start = time.monotonic()
        assert pull.wait(timeout=60) == 0
        assert time.monotonic() - start < 30  # the OS freed the lock: the pull went on at once
    finally:
        for proc in (holder, pull):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert installed_variants(root) == [(REPO, big, "torch-universal")]
    record("lock holder killed while a pull waits on it", 1)


MIX = "500:0.2,429:0.05:retry-after=1,reset:0.1,truncate:0.1,corrupt:0.05"


@pytest.mark.slow
@soak_only
def test_kill_9_under_random_faults(hub, big, tmp_path):
    """Soak: kills land while the server also fails, resets, truncates and corrupts."""
    rng = random.Random(4321)
    n = 30
    lost = 0
    for trial in range(n):
        root = tmp_path / f"cache-{trial}"
        env = {**os.environ, "KERNELS_CACHE": str(root)}
        spec = f"{MIX},slow:1:{SLOW}s:match=/_lfs/,seed={rng.randrange(1 << 30)}"
        hub.server.faults = FaultPlan.parse(spec)
        proc = subprocess.Popen(cli_argv("pull", f"{REPO}@v1"), env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        time.sleep(rng.uniform(0.2, 4.0))
        proc.kill()
        proc.wait()
        _check_after_kill(root, env, big)
        hub.server.faults = None
        done = subprocess.run(cli_argv("pull", f"{REPO}@v1"), env=env, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert tmp_leftovers(root) == []
        lost += _check_after_kill(root, env, big) != {"value": 5, "digests": DIGESTS}
    assert lost == 0
    record("kill -9 of `kernels pull` while the server injects random faults", n)


def test_offline_load_after_a_pull_killed_at_the_trust_check(hub, big, tmp_path):
    """The revision is resolved and recorded, then the pull dies while asking about the
    publisher: offline, the kernel is not cached, and that is what the error says."""
    root = tmp_path / "cache"
    env = {**os.environ, "KERNELS_CACHE": str(root)}
    hub.server.faults = plan = FaultPlan.parse("delay:first=1:30s:match=/overview")
    proc = subprocess.Popen(cli_argv("pull", f"{REPO}@v1"), env=env, stderr=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: plan.attempts("/overview"), timeout=60)
        proc.kill()
    finally:
        proc.wait()
    assert Cache(root).records.get(REPO, "v1") is not None  # it got as far as resolving
    hub.server.faults = None
    code = """
        import kernels
        try:
            kernels.get_kernel('crash-lab/big', version=1)
        except kernels.OfflineCacheMiss as exc:
            print(exc)
    """
    out = subprocess.run(python_argv(code), capture_output=True, text=True,
                         env={**env, "HF_HUB_OFFLINE": "1"}, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "not cached" in out.stdout and "kernels pull crash-lab/big@v1" in out.stdout
