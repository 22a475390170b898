"""Issue 15 item 7: one download has one overall deadline, whatever the server's pace."""

from __future__ import annotations

import hashlib
import json
import os
import time

import pytest
from kernels import fetch
from kernels import hub as hub_client
from kernels.cache import Cache
from kernels.errors import DownloadTimeout

from tests.security.hostile import KernelRepo, Reply, cache_files, hostile, simple_kernel, trickle

__all__ = ["hostile"]

BODY = b"x" * 100
PATH = "build/torch-universal/blob.bin"


def _install(repo: KernelRepo) -> float:
    """Install the repo's only variant; returns how long it took (or raised after)."""
    cache = Cache(os.environ["KERNELS_CACHE"])
    listing = fetch.get_listing(cache, repo.repo_id, repo.commit, offline=False)
    start = time.monotonic()
    fetch.install_variant(
        cache, repo.repo_id, repo.commit, "torch-universal", listing.variants["torch-universal"]
    )
    return time.monotonic() - start


def _repo(hostile, answer) -> KernelRepo:
    repo = KernelRepo("evil/relu", {**simple_kernel(), PATH: BODY})
    repo.install(hostile)
    hostile.route(r"/kernels/evil/relu/resolve/[^/]+/" + PATH, answer)
    return repo


def test_a_trickling_server_meets_the_deadline(hostile, monkeypatch):
    # One byte every 0.1 s: each read succeeds well within the per-read timeout, and the whole
    # file would take 10 s.
    monkeypatch.setenv("KERNELS_DOWNLOAD_TIMEOUT", "1.5")
    repo = _repo(
        hostile, lambda _s, _m: Reply(200, {}, chunks=trickle(BODY, 0.1), length=len(BODY))
    )
    start = time.monotonic()
    with pytest.raises(DownloadTimeout, match="not downloaded within 2 s"):
        _install(repo)
    assert time.monotonic() - start < 4.0
    cache = Cache(os.environ["KERNELS_CACHE"])
    # Neither the object nor a partial temp file of it stays behind.
    assert not cache.objects.has(hashlib.sha256(BODY).hexdigest(), len(BODY))
    assert not [p for p in cache_files(cache) if "tmp" in p.parts and p.suffix != ".lock"]
    assert cache.installed(repo.repo_id, repo.commit, "torch-universal") is None


def test_a_stalled_server_meets_the_deadline_not_the_read_timeouts(hostile, monkeypatch):
    # Headers, then silence: only the per-read timeout (30 s, 4 attempts) would end it.
    monkeypatch.setenv("KERNELS_DOWNLOAD_TIMEOUT", "1.5")
    repo = _repo(hostile, lambda _s, _m: Reply(200, {}, chunks=[(BODY, 120.0)], length=len(BODY)))
    start = time.monotonic()
    with pytest.raises(DownloadTimeout):
        _install(repo)
    assert time.monotonic() - start < 5.0


def test_a_prompt_server_is_unaffected(hostile, monkeypatch):
    monkeypatch.setenv("KERNELS_DOWNLOAD_TIMEOUT", "5")
    repo = _repo(hostile, lambda _s, _m: Reply(200, {}, BODY))
    assert _install(repo) < 5.0
    cache = Cache(os.environ["KERNELS_CACHE"])
    assert cache.installed(repo.repo_id, repo.commit, "torch-universal") is not None


def test_a_trickled_listing_meets_its_deadline(hostile, monkeypatch):
    monkeypatch.setattr(hub_client, "METADATA_DEADLINE", 1.0, raising=False)
    repo = KernelRepo("evil/relu", simple_kernel())
    repo.install(hostile)
    body = json.dumps(repo.listing()).encode()  # a few hundred bytes: 30 s and more at this pace
    hostile.route(
        r"/api/kernels/evil/relu/tree/[^/]+/build",
        lambda _s, _m: Reply(200, {"Content-Type": "application/json"}, chunks=trickle(body, 0.1)),
    )
    start = time.monotonic()
    with pytest.raises(DownloadTimeout):
        hub_client.list_build_files("evil/relu", repo.commit)
    assert time.monotonic() - start < 4.0
