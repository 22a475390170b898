"""Network faults from `kernels serve`'s fault mode, against the real client over real HTTP.

What must hold: transient failures are retried a bounded number of times with backoff (attempts
counted at the server), bytes that do not match their digest are refused with IntegrityError and
nothing is published, an unreachable Hub falls back to the verified cache with one notice, and
a failure is a typed error (in Python) or `error:` + `hint:` and exit 1 (on the command line).
"""

from __future__ import annotations

import os
import random
import subprocess
import time

import kernels
import pytest
from kernels import HubUnavailable, IntegrityError, KernelsError
from kernels import hub as hub_client
from kernels.cache import Cache
from kernels.serve.faults import FaultPlan

from tests.kernel_repos import run_python
from tests.reliability.helpers import (
    assert_user_error,
    cache_problems,
    installed_variants,
    kernels_cli,
    payload,
    pure_kernel,
    record,
    sha256,
    soak_only,
    tmp_leftovers,
    trials,
)

REPO = "net-lab/relu"
BLOB = payload(7, 400_000)
TABLE = payload(8, 90_000)  # a plain git file: verified by its git blob id


@pytest.fixture
def repo(hub):
    hub.trust("net-lab")
    w = hub.writer(REPO)
    files = pure_kernel(
        "relu", value=3, lfs={"blob.bin": BLOB}, plain={"table.bin": TABLE}, writer=w
    )
    return w.commit(files, branch="v1")


def _cache() -> str:
    return os.environ["KERNELS_CACHE"]


def _nothing_published() -> None:
    assert installed_variants(_cache()) == []
    assert list(Cache(_cache()).trees.iter_digests()) == []
    assert cache_problems(_cache()) == []
    assert tmp_leftovers(_cache()) == []


def _loaded_ok(module) -> None:
    assert module.VALUE == 3
    assert module.digests() == {"blob.bin": sha256(BLOB), "table.bin": sha256(TABLE)}


def _gaps(events) -> list[float]:
    return [b.at - a.at for a, b in zip(events, events[1:], strict=False)]


# -- retries, counted at the server -----------------------------------------------------------


@pytest.mark.parametrize("kind", ["500", "502", "503", "reset", "truncate"])
def test_transient_faults_are_retried_with_backoff(hub, repo, kind):
    # The plain file fails twice; the LFS object (served by the /_lfs/ "CDN" route) once.
    spec = f"{kind}:first=2:match=table.bin,{kind}:first=1:match=/_lfs/"
    hub.server.faults = plan = FaultPlan.parse(spec)
    _loaded_ok(kernels.get_kernel(REPO, version=1))
    attempts = [e for e in plan.attempts("table.bin") if e.method == "GET"]
    assert [e.fault for e in attempts] == [kind, kind, None]
    gaps = _gaps(attempts)
    # Backoff 0.25 s then 0.5 s, with up to 25% jitter on top.
    assert 0.25 <= gaps[0] < 0.25 * 1.25 + 0.5, gaps
    assert 0.5 <= gaps[1] < 0.5 * 1.25 + 0.5, gaps
    assert [e.fault for e in plan.attempts("/_lfs/")] == [kind, None]
    assert cache_problems(_cache()) == [] and tmp_leftovers(_cache()) == []
    record(
        f"transient `{kind}` on file downloads (retried with backoff)", sum(plan.injected.values())
    )


def test_persistent_download_failure_is_bounded_and_publishes_nothing(hub, repo):
    hub.server.faults = plan = FaultPlan.parse("500:1:match=table.bin")
    with pytest.raises(HubUnavailable) as err:
        kernels.get_kernel(REPO, version=1)
    assert "could not reach the Hub" in err.value.message
    attempts = [e for e in plan.attempts("table.bin") if e.method == "GET"]
    assert len(attempts) == hub_client.DOWNLOAD_ATTEMPTS == 4
    span = attempts[-1].at - attempts[0].at  # backoff 0.25 + 0.5 + 1 s, plus jitter
    assert 1.75 <= span < 1.75 * 1.25 + 0.5, span
    _nothing_published()
    hub.server.faults = None
    _loaded_ok(kernels.get_kernel(REPO, version=1))  # and the next try completes
    record("persistent 500 on a download (bounded: 4 attempts)", len(attempts))


def test_persistent_metadata_failure_is_bounded(hub, repo):
    hub.server.faults = plan = FaultPlan.parse("503:1:match=/revision/")
    with pytest.raises(HubUnavailable):
        kernels.get_kernel(REPO, version=1)
    assert len(plan.attempts("/revision/")) == hub_client.METADATA_ATTEMPTS == 2
    _nothing_published()


def test_429_retry_after_is_honoured(hub, repo):
    hub.server.faults = plan = FaultPlan.parse("429:first=1:retry-after=1:match=table.bin")
    _loaded_ok(kernels.get_kernel(REPO, version=1))
    attempts = [e for e in plan.attempts("table.bin") if e.method == "GET"]
    assert [e.fault for e in attempts] == ["429", None]
    assert 1.0 <= _gaps(attempts)[0] < 1.25 + 0.5


@pytest.mark.parametrize("value", ["-5", "nan", "soon", "", "0", "1e-9", "-inf", "0x10"])
def test_hostile_retry_after_values_are_survived(hub, repo, value):
    hub.server.faults = plan = FaultPlan.parse(f"429:first=1:retry-after={value}:match=table.bin")
    start = time.monotonic()
    _loaded_ok(kernels.get_kernel(REPO, version=1))
    assert time.monotonic() - start < 5
    assert [e.fault for e in plan.attempts("table.bin") if e.method == "GET"] == ["429", None]
    record("hostile Retry-After values (negative, NaN, text, ...)", 1)


def test_read_timeouts_are_retried(hub, repo, monkeypatch):
    monkeypatch.setattr(hub_client, "METADATA_TIMEOUT", 0.5)
    monkeypatch.setattr(hub_client, "DOWNLOAD_TIMEOUT", 0.5)
    hub.server.faults = plan = FaultPlan.parse(
        ",".join(f"delay:first=1:1.5s:match={m}" for m in ("/revision/", "table.bin", "/_lfs/"))
    )
    _loaded_ok(kernels.get_kernel(REPO, version=1))
    for fragment in ("/revision/", "table.bin", "/_lfs/"):
        attempts = [e.fault for e in plan.attempts(fragment) if e.method == "GET"]
        assert attempts == ["delay", None], (fragment, attempts)
    record("read timeouts (server holds the answer past the client timeout)", 3)


# -- bytes that do not match their digest ------------------------------------------------------


@pytest.mark.parametrize(
    "target, content", [("/_lfs/", BLOB), ("table.bin", TABLE), ("__init__.py", None)]
)
def test_corrupt_bytes_are_refused_and_nothing_published(hub, repo, target, content):
    hub.server.faults = plan = FaultPlan.parse(f"corrupt:1:match={target}")
    with pytest.raises(IntegrityError):
        kernels.get_kernel(REPO, version=1)
    assert plan.injected["corrupt"] >= 1
    _nothing_published()
    if content is not None:  # a corrupt copy would have the same size: there is none
        store = Cache(_cache()).objects
        sizes = {store.path(d).stat().st_size for d in store.iter_digests()}
        assert len(content) not in sizes
    hub.server.faults = None
    _loaded_ok(kernels.get_kernel(REPO, version=1))
    record("bytes that do not match their digest (IntegrityError, nothing published)", 1)


# -- the Hub unreachable: the verified cache, one notice ------------------------------------


@pytest.mark.parametrize("spec", ["503:1", "reset:1", "500:1:match=/revision/"])
def test_unreachable_hub_falls_back_to_the_cache_with_one_notice(
    hub, repo, spec, caplog, monkeypatch
):
    first = kernels.get_kernel(REPO, version=1)
    hub.server.faults = FaultPlan.parse(spec)
    monkeypatch.setenv("KERNELS_RESOLVE_TTL", "0")  # every load asks the Hub
    with caplog.at_level("WARNING", logger="kernels"):
        for _ in range(3):
            assert kernels.get_kernel(REPO, version=1) is first
    notices = [r.getMessage() for r in caplog.records]
    assert len(notices) == 1 and "unreachable" in notices[0], notices
    assert "trust" not in notices[0].lower()
    record("Hub unreachable with a warm cache (fallback, one notice)", 3)


def test_unreachable_hub_notice_in_a_new_process(hub, repo):
    kernels.get_kernel(REPO, version=1)
    hub.server.faults = FaultPlan.parse("503:1")
    code = """
        import kernels
        for _ in range(3):
            m = kernels.get_kernel('net-lab/relu', version=1)
        print(m.VALUE)
    """
    out = run_python(code, env={"KERNELS_RESOLVE_TTL": "0"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3"
    notices = [line for line in out.stderr.splitlines() if line.startswith("kernels:")]
    assert len(notices) == 1 and "unreachable" in notices[0], out.stderr
    assert "trust" not in out.stderr.lower()


def test_unreachable_trust_check_is_a_network_error_not_a_trust_decision(hub, repo):
    hub.server.faults = FaultPlan.parse("503:1:match=/overview")
    with pytest.raises(HubUnavailable):
        kernels.get_kernel(REPO, version=1)
    _nothing_published()
    hub.server.faults = None
    _loaded_ok(kernels.get_kernel(REPO, version=1))  # no negative trust decision was recorded


# -- a random mix of faults ----------------------------------------------------------------


MIX = "500:0.3,429:0.1:retry-after=1,reset:0.1,truncate:0.1,slow:0.1:{slow},corrupt:0.05"


def test_random_fault_mix(hub, repo, tmp_path, monkeypatch):
    n = trials(6, 120)
    outcomes = {"loaded": 0, "typed_error": 0}
    injected: dict[str, int] = {}
    rng = random.Random(2024)
    for trial in range(n):
        monkeypatch.setenv("KERNELS_CACHE", str(tmp_path / f"cache-{trial}"))
        seed = rng.randrange(1 << 30)
        hub.server.faults = plan = FaultPlan.parse(MIX.format(slow="0.3s") + f",seed={seed}")
        try:
            module = kernels.get_kernel(REPO, version=1)
        except KernelsError:
            outcomes["typed_error"] += 1
        else:
            _loaded_ok(module)
            outcomes["loaded"] += 1
        for name, count in plan.injected.items():
            injected[name] = injected.get(name, 0) + count
        root = os.environ["KERNELS_CACHE"]
        assert cache_problems(root) == [], (seed, cache_problems(root))
        assert tmp_leftovers(root) == [], seed
        hub.server.faults = None
        _loaded_ok(kernels.get_kernel(REPO, version=1))  # the next clean load completes
    assert outcomes["loaded"] + outcomes["typed_error"] == n
    record(
        "random per-request fault mix (500, 429, reset, truncate, slow, corrupt) on a load",
        sum(injected.values()),
        trials=n,
        faults=injected,
        **outcomes,
    )


# -- the command line: error + hint, exit 1, never a traceback --------------------------------


def test_cli_reports_network_failures_as_user_errors(hub, repo):
    cases = [("503:1", "could not reach"), ("corrupt:1:match=table.bin", "table.bin")]
    cases.append(("reset:1:match=/resolve/", "could not reach"))
    for spec, needle in cases:
        hub.server.faults = FaultPlan.parse(spec)
        out = kernels_cli("pull", f"{REPO}@v1")
        assert_user_error(out, needle)
        assert "cannot write to the cache" not in out.stderr  # the network, not the disk
    _nothing_published()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["pull", "net-lab/relu@v9"], "Version 9 not found"),
        (["pull", "net-lab/nope@v1"], "not found"),
        (["pull", "not a spec"], "not a kernel spec"),
        (["pull", "net-lab/relu@a..b"], "not a valid revision"),
        (["pull", "stranger/relu@v1"], "not a trusted"),
        (["pull", "--locked", "--lockfile", "/nonexistent/kernels.lock"], "no such lockfile"),
        (["info", "net-lab/relu@zzz"], "no branch"),
        (["versions", "bad//id"], "not a valid repo id"),
        (["pull", "net-lab/relu@v1", "--backend", "rocm"], "Invalid backend 'rocm'"),
    ],
)
def test_cli_user_errors_have_a_hint_and_no_traceback(hub, repo, args, needle, capsys):
    """In-process (the same main() the console script runs), so each case costs no interpreter."""
    from kernels.cli.main import main

    hub.writer("stranger/relu").commit(pure_kernel("relu"), branch="v1")
    code = main(args)
    err = capsys.readouterr().err
    assert_user_error(subprocess.CompletedProcess(args, code, "", err), needle)


def test_cli_offline_miss_and_dead_endpoint(hub, repo):
    out = kernels_cli("pull", f"{REPO}@v1", env={"HF_HUB_OFFLINE": "1"})
    assert_user_error(out, "offline")
    out = kernels_cli("pull", f"{REPO}@v1", env={"HF_ENDPOINT": "http://127.0.0.1:9"})
    assert_user_error(out, "could not reach")


@pytest.mark.slow
@soak_only
def test_a_huge_retry_after_is_capped(hub, repo):
    """Soak: Retry-After: 3600 waits the 30 s cap, not an hour."""
    hub.server.faults = plan = FaultPlan.parse("429:first=1:retry-after=3600:match=table.bin")
    _loaded_ok(kernels.get_kernel(REPO, version=1))
    attempts = [e for e in plan.attempts("table.bin") if e.method == "GET"]
    cap = hub_client.MAX_RETRY_AFTER
    gap = _gaps(attempts)[0]
    assert cap <= gap < cap * 1.25 + 1
    record("Retry-After: 3600 (waits the 30 s cap)", 1, waited_s=round(gap, 1))
