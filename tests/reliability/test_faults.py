"""The fault mode of `kernels serve` itself: each fault does what it says, and only that.

The rest of the suite measures the loader against these faults, so they are checked first, with
a plain HTTP client (http.client) against the real server.
"""

from __future__ import annotations

import http.client
import re
import subprocess
import sys
import time
from urllib.parse import urlsplit

import pytest
from kernels.serve.faults import FaultPlan, FaultSpecError, Rule

from tests.reliability.helpers import payload, pure_kernel

REPO = "fault-lab/relu"


@pytest.fixture
def repo(hub):
    w = hub.writer(REPO)
    blob = payload(1, 300_000)
    commit = w.commit(pure_kernel("relu", lfs={"blob.bin": blob}, writer=w), branch="v1")
    return {"commit": commit, "blob": blob}


def _get(hub, path: str, method: str = "GET"):
    """(status, headers, body) of one request on a fresh connection."""
    conn = http.client.HTTPConnection(urlsplit(hub.url).netloc, timeout=10)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def _file(commit: str, name: str = "_impl.py") -> str:
    return f"/kernels/{REPO}/resolve/{commit}/build/torch-universal/{name}"


def test_parse_the_documented_spec():
    plan = FaultPlan.parse(
        "500:0.3,429:0.1:retry-after=1,reset:0.1,truncate:0.1,slow:0.1:2s,corrupt:0.05,seed=7"
    )
    assert plan.seed == 7
    assert [r.name for r in plan.rules] == ["500", "429", "reset", "truncate", "slow", "corrupt"]
    assert plan.rules[1].retry_after == "1" and plan.rules[4].seconds == 2.0
    first = FaultPlan.parse("reset:first=3:each:match=/resolve/,delay:1:250ms").rules
    assert first[0] == Rule("reset", first=3, each=True, match="/resolve/")
    assert first[1].seconds == 0.25


@pytest.mark.parametrize(
    "spec",
    ["", "500", "700:0.1", "boom:0.1", "500:1.5", "500:x", "slow:0.1", "slow:0.1:-2s",
     "500:first=x", "500:0.1:colour=red", "seed=x,500:0.1", "500:0.1:first=2"],
)  # fmt: skip
def test_bad_specs_are_refused(spec):
    with pytest.raises(FaultSpecError):
        FaultPlan.parse(spec)


def test_status_first_n_then_real_answers(hub, repo):
    hub.server.faults = FaultPlan.parse("503:first=2:retry-after=7")
    path = _file(repo["commit"])
    answers = [_get(hub, path) for _ in range(3)]
    assert [a[0] for a in answers] == [503, 503, 200]
    assert answers[0][1]["Retry-After"] == "7"
    assert answers[2][2] == b"def double(x):\n    return 2 * x\n"
    assert hub.server.faults.injected == {"503": 2}


def test_each_counts_per_path_and_match_filters(hub, repo):
    hub.server.faults = FaultPlan.parse("500:first=1:each:match=/resolve/")
    a, b = _file(repo["commit"]), _file(repo["commit"], "__init__.py")
    api = f"/api/kernels/{REPO}/revision/v1"
    statuses = [_get(hub, p)[0] for p in (a, a, b, b, api, api)]
    assert statuses == [500, 200, 500, 200, 200, 200]


def test_reset_sends_no_response(hub, repo):
    hub.server.faults = FaultPlan.parse("reset:first=1")
    with pytest.raises((ConnectionResetError, http.client.RemoteDisconnected)):
        _get(hub, _file(repo["commit"]))
    assert _get(hub, _file(repo["commit"]))[0] == 200


def test_truncate_sends_half_the_promised_body(hub, repo):
    hub.server.faults = FaultPlan.parse("truncate:first=1:match=/_lfs/")
    lfs = f"/_lfs/{REPO}/{_sha(repo['blob'])}"
    conn = http.client.HTTPConnection(urlsplit(hub.url).netloc, timeout=10)
    conn.request("GET", lfs)
    resp = conn.getresponse()
    assert resp.getheader("Content-Length") == str(len(repo["blob"]))
    with pytest.raises(http.client.IncompleteRead) as err:
        resp.read()
    assert len(err.value.partial) == len(repo["blob"]) // 2
    conn.close()
    assert _get(hub, lfs)[2] == repo["blob"]  # the next request is whole


def test_corrupt_flips_one_byte_of_file_bodies_only(hub, repo):
    hub.server.faults = FaultPlan.parse("corrupt:1")
    api_status, _, api_body = _get(hub, f"/api/kernels/{REPO}/revision/v1")
    assert api_status == 200 and repo["commit"].encode() in api_body  # JSON untouched
    status, _, body = _get(hub, f"/_lfs/{REPO}/{_sha(repo['blob'])}")
    assert status == 200 and len(body) == len(repo["blob"])
    assert sum(x != y for x, y in zip(body, repo["blob"], strict=True)) == 1
    # HEAD and redirects carry no body: nothing to corrupt, nothing counted.
    assert _get(hub, _file(repo["commit"], "blob.bin"), "HEAD")[0] == 302
    assert hub.server.faults.injected == {"corrupt": 1}


def test_slow_trickles_and_delay_holds_the_headers(hub, repo):
    hub.server.faults = FaultPlan.parse("slow:first=1:0.6s,delay:first=1:400ms")
    start = time.monotonic()
    assert _get(hub, _file(repo["commit"]))[2].startswith(b"def double")
    assert time.monotonic() - start >= 0.6
    start = time.monotonic()
    assert _get(hub, f"/api/kernels/{REPO}/revision/v1")[0] == 200
    assert time.monotonic() - start >= 0.4


def test_seeded_plans_repeat_themselves(hub, repo):
    runs = []
    for _ in range(2):
        hub.server.faults = FaultPlan.parse("500:0.5,seed=11")
        runs.append([_get(hub, _file(repo["commit"]))[0] for _ in range(20)])
    assert runs[0] == runs[1]
    assert 0 < runs[0].count(500) < 20


def test_events_record_every_request_with_its_fault(hub, repo):
    hub.server.faults = plan = FaultPlan.parse("500:first=1")
    _get(hub, _file(repo["commit"]))
    _get(hub, _file(repo["commit"]))
    events = plan.attempts("/resolve/")
    assert [e.fault for e in events] == ["500", None]
    assert events[0].at <= events[1].at


def _sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


SERVING = re.compile(r"^serving .+ on (?P<url>http://\S+)$")


def test_cli_faults_flag(hub, repo):
    proc = subprocess.Popen(
        [sys.executable, "-m", "kernels.serve", str(hub.root), "--port", "0",
         "--faults", "503:first=1,seed=3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        match = SERVING.match(proc.stdout.readline().strip())
        assert match, proc.stderr.read()
        netloc = urlsplit(match["url"]).netloc
        statuses = []
        for _ in range(2):
            conn = http.client.HTTPConnection(netloc, timeout=10)
            conn.request("GET", f"/api/kernels/{REPO}/revision/v1")
            statuses.append(conn.getresponse().status)
            conn.close()
        assert statuses == [503, 200]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert "injecting faults: 503:first=1,seed=3 (seed 3)" in proc.stderr.read()


def test_cli_refuses_a_bad_faults_spec(hub):
    out = subprocess.run(
        [sys.executable, "-m", "kernels.serve", str(hub.root), "--port", "0", "--faults", "oops"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.startswith("error: --faults:")
