"""`kernels serve` under a bounded loopback load: many clients, a fixed request count, a deadline.

The server runs as its own process (`kernels serve DIR --port 0`), the clients are threads of the
test sharing huggingface_hub's HTTP session, and the mix is what loaders send: revision lookups,
tree listings, publisher overviews, small files, LFS files through the CDN redirect, HEADs and
404s. Every answer is checked (status and body size); throughput, latency and the error count go
to docs/reliability.md.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from kernels.serve import GitRepoWriter

from tests.reliability.helpers import SOAK, payload, pure_kernel, record, trials

SERVING = re.compile(r"^serving .+ on (?P<url>http://\S+)$")
REPOS = [f"load-lab/k{i}" for i in range(4)]
LFS_SIZE = 256 << 10


@pytest.fixture
def server(tmp_path):
    root = tmp_path / "mirror"
    commits = {}
    for i, repo in enumerate(REPOS):
        w = GitRepoWriter(root / repo)
        files = pure_kernel(repo.split("/")[1], value=i, lfs={"w.bin": payload(800 + i, LFS_SIZE)},
                            writer=w)  # fmt: skip
        commits[repo] = (w.commit(files, branch="v1"), files)
    (root / "kernels-mirror.toml").write_text('trusted_publishers = ["load-lab"]\n')
    proc = subprocess.Popen(
        [sys.executable, "-m", "kernels.serve", str(root), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        match = SERVING.match(proc.stdout.readline().strip())
        assert match, proc.stderr.read()
        yield match["url"], commits
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert proc.returncode == 0
    assert "Traceback" not in proc.stderr.read()


def _requests(url: str, commits: dict, rng: random.Random):
    """(method, url, expected status, expected body length or None) forever, in a random mix."""
    while True:
        repo = rng.choice(REPOS)
        commit, files = commits[repo]
        base = f"{url}/kernels/{repo}/resolve/{commit}/build/torch-universal"
        init = files["build/torch-universal/__init__.py"].encode()
        yield rng.choice(
            [
                ("GET", f"{url}/api/kernels/{repo}/revision/v1", 200, None),
                ("GET", f"{url}/api/kernels/{repo}/tree/{commit}/build?recursive=true", 200, None),
                ("GET", f"{url}/api/organizations/load-lab/overview", 200, None),
                ("GET", f"{base}/__init__.py", 200, len(init)),
                ("HEAD", f"{base}/__init__.py", 200, 0),
                ("GET", f"{base}/w.bin", 200, LFS_SIZE),  # 302 to /_lfs/, followed
                ("GET", f"{base}/missing.py", 404, None),
            ]
        )


def test_bounded_loopback_load(server):
    from huggingface_hub.utils import get_session

    url, commits = server
    total, clients = trials(2000, 20000), trials(16, 64)
    deadline = 600.0 if SOAK else 120.0
    session = get_session()
    lock = threading.Lock()
    latencies: list[float] = []
    errors: list[str] = []
    received = [0]

    def client(seed: int, count: int) -> None:
        rng = random.Random(seed)
        mix = _requests(url, commits, rng)
        for _ in range(count):
            method, target, status, size = next(mix)
            start = time.perf_counter()
            try:
                resp = session.request(method, target, follow_redirects=True, timeout=30)
                body = resp.content
                problem = None
                if resp.status_code != status:
                    problem = f"{method} {target}: HTTP {resp.status_code}"
                elif size is not None and len(body) != size:
                    problem = f"{method} {target}: {len(body)} bytes, expected {size}"
            except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
                problem, body = f"{method} {target}: {type(exc).__name__}: {exc}", b""
            elapsed = time.perf_counter() - start
            with lock:
                latencies.append(elapsed)
                received[0] += len(body)
                if problem:
                    errors.append(problem)

    per_client = [total // clients + (i < total % clients) for i in range(clients)]
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(client, i, n) for i, n in enumerate(per_client)]
        for future in futures:
            future.result(timeout=deadline)
    wall = time.perf_counter() - start
    assert len(latencies) == total
    assert errors == [], errors[:5]
    latencies.sort()
    figures = {
        "requests": total,
        "clients": clients,
        "errors": len(errors),
        "wall_s": round(wall, 2),
        "requests_per_s": round(total / wall),
        "mib_per_s": round(received[0] / wall / (1 << 20), 1),
        "p50_ms": round(latencies[len(latencies) // 2] * 1000, 1),
        "p99_ms": round(latencies[int(len(latencies) * 0.99)] * 1000, 1),
    }
    record("`kernels serve` bounded loopback load (requests)", total, **figures)
    assert wall < deadline
