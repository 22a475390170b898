"""Concurrency: 32 processes x 4 threads loading the same and different kernels, cold then warm.

The worker processes hide torch even in a soak run: 32 imports of it need ~10 GiB of memory and
~100 s of CPU on 2 cores, and the cache, the locks and the network do not depend on it.

Everyone must succeed with the right bytes; every file is fetched once however many processes ask
(GETs counted per path at the server); a warm start makes no request at all; no lock is held
forever (the whole run has a deadline, and every lock is free afterwards).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections import Counter

import pytest
from kernels.cache import Cache

from tests.reliability.helpers import (
    cache_problems,
    payload,
    pure_kernel,
    python_argv,
    record,
    sha256,
    tmp_leftovers,
    trials,
)

ORG = "conc-lab"
KERNELS = 4  # conc-lab/k0 .. k3, plus conc-lab/shared that every thread loads
PROCESSES = 32
THREADS = 4
DEADLINE = 300.0  # seconds for all processes of one round together

WORKER = """
    import json, sys, threading
    import kernels

    index, threads = int(sys.argv[1]), int(sys.argv[2])
    barrier = threading.Barrier(threads)
    results = [None] * threads

    def work(t):
        barrier.wait()  # every thread of the process asks at the same moment
        try:
            shared = kernels.get_kernel('conc-lab/shared', version=1)
            k = (index + t) % 4
            own = kernels.get_kernel(f'conc-lab/k{k}', version=1)
            results[t] = {'shared': [shared.VALUE, shared.digests()], 'shared_id': id(shared),
                          'own': [k, own.VALUE, own.digests()]}
        except BaseException as exc:
            results[t] = {'error': f'{type(exc).__name__}: {exc}'}

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    print(json.dumps(results))
"""


def _files(i: int) -> tuple[dict, dict]:
    lfs = {"weights.bin": payload(300 + i, 256 << 10)}
    plain = {"table.bin": payload(400 + i, 64 << 10)}
    return lfs, plain


@pytest.fixture
def repos(hub):
    hub.trust(ORG)
    expected = {}
    for i, name in enumerate(["shared", *(f"k{n}" for n in range(KERNELS))]):
        lfs, plain = _files(i)
        w = hub.writer(f"{ORG}/{name}")
        w.commit(pure_kernel(name, value=i, lfs=lfs, plain=plain, writer=w), branch="v1")
        expected[name] = [i, {n: sha256(d) for n, d in {**lfs, **plain}.items()}]
    return expected


def _round(env: dict) -> tuple[list[list[dict]], float]:
    """Start every process at once; all must finish before the deadline."""
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            python_argv(WORKER, hide_torch=True) + [str(i), str(THREADS)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(PROCESSES)
    ]
    outs = []
    try:
        for proc in procs:
            left = max(1.0, DEADLINE - (time.monotonic() - start))
            out, err = proc.communicate(timeout=left)
            assert proc.returncode == 0, err
            outs.append(json.loads(out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outs, time.monotonic() - start


def _check(outs: list[list[dict]], expected: dict) -> None:
    for index, threads in enumerate(outs):
        assert all("error" not in r for r in threads), threads
        assert len({r["shared_id"] for r in threads}) == 1  # one module per process
        for t, r in enumerate(threads):
            assert r["shared"] == expected["shared"]
            k = (index + t) % KERNELS
            assert r["own"] == [k, *expected[f"k{k}"]]


def _content_key(path: str) -> str:
    """What a file GET downloads: the LFS object id, else repo/file (commit-independent)."""
    if path.startswith("/_lfs/"):
        return path.split("?")[0].rsplit("/", 1)[1]
    return path.split("/resolve/")[0] + "/" + path.rsplit("/", 1)[1]


def test_32_processes_x_4_threads_cold_then_warm(hub, repos):
    env = dict(os.environ)
    rounds = trials(1, 3)
    figures: dict = {"processes": PROCESSES, "threads": THREADS, "rounds": rounds}
    for r in range(rounds):
        root = os.path.join(os.environ["KERNELS_CACHE"], f"round-{r}")
        env["KERNELS_CACHE"] = root
        hub.reset_requests()
        outs, cold_s = _round(env)
        _check(outs, repos)
        reqs = [(m, p) for m, p in hub.requests if "/api/agent-harnesses" not in p]
        gets = [p for m, p in reqs if m == "GET" and ("/resolve/" in p or "/_lfs/" in p)]
        per_path = Counter(gets)
        assert max(per_path.values()) == 1, per_path.most_common(3)  # each file fetched once
        per_content = Counter(_content_key(p) for p in gets)
        revisions = sum("/revision/" in p for _m, p in reqs)
        trees = sum("/tree/" in p for _m, p in reqs)
        assert revisions == KERNELS + 1 and trees == KERNELS + 1, reqs
        assert cache_problems(root) == [] and tmp_leftovers(root) == []
        cache = Cache(root)
        for lock in sorted(cache.locks.iterdir()):  # nobody holds any lock any more
            from filelock import FileLock

            with FileLock(str(lock), timeout=0):
                pass
        hub.reset_requests()
        warm_outs, warm_s = _round(env)
        _check(warm_outs, repos)
        assert [r for r in hub.requests if "/api/agent-harnesses" not in r[1]] == []
        figures.setdefault("cold_s", []).append(round(cold_s, 1))
        figures.setdefault("warm_s", []).append(round(warm_s, 1))
        figures.setdefault("requests_cold", []).append(len(reqs))
        figures.setdefault("file_gets_cold", []).append(len(gets))
        figures.setdefault("max_gets_per_path", []).append(max(per_path.values()))
        figures.setdefault("max_gets_per_content", []).append(max(per_content.values()))
    record(
        "concurrent loads: 32 processes x 4 threads, 2 kernels each, cold then warm",
        PROCESSES * THREADS * 2 * 2 * rounds,
        **figures,
    )


def test_threads_in_one_process_share_one_download(hub, repos, tmp_path):
    """16 threads of one process, cold: each file fetched once, one module per kernel."""
    code = WORKER.replace("threads = int(sys.argv[1]), int(sys.argv[2])", "threads = 0, 16")
    hub.reset_requests()
    out = subprocess.run(python_argv(code), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    threads = json.loads(out.stdout)
    assert all("error" not in r for r in threads), threads
    gets = [p for m, p in hub.requests if m == "GET" and ("/resolve/" in p or "/_lfs/" in p)]
    assert max(Counter(gets).values()) == 1
