"""Issue 15 item 9: sizes are bounded before bytes are held: a compressed listing is inflated
under a cap, metadata.json is refused from its declared size, and a download that cannot fit on
the cache's disk is refused before it starts."""

from __future__ import annotations

import functools
import gzip
import json
import os
import shutil
import tracemalloc

import pytest
from kernels import fetch
from kernels import hub as hub_client
from kernels.cache import Cache
from kernels.errors import InsufficientSpace, IntegrityError, KernelNotFound, UnsafeResponse

from tests.security.hostile import (
    KernelRepo,
    Reply,
    cache_files,
    hostile,
    json_reply,
    simple_kernel,
)

__all__ = ["hostile"]

TREE = r"/api/kernels/evil/relu/tree/[^/]+/build"
BOMB_BYTES = 128 << 20  # what the listing inflates to: 4 x the client's cap


@functools.lru_cache(maxsize=1)
def _bomb() -> bytes:
    """A valid JSON listing (an empty list padded with spaces) that gzips ~1000:1."""
    raw = b"[" + b" " * (BOMB_BYTES - 2) + b"]"
    return gzip.compress(raw, compresslevel=9)


def test_a_gzip_bomb_listing_is_refused_with_bounded_memory(hostile):
    repo = KernelRepo("evil/relu", simple_kernel())
    repo.install(hostile)
    body = _bomb()
    assert len(body) < 1 << 20
    hostile.route(
        TREE,
        lambda _s, _m: Reply(
            200, {"Content-Type": "application/json", "Content-Encoding": "gzip"}, body
        ),
    )
    tracemalloc.start()
    try:
        with pytest.raises(UnsafeResponse, match="larger than"):
            hub_client.list_build_files("evil/relu", repo.commit)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The cap (32 MiB) plus one inflated piece; inflating it all would take 128 MiB at least.
    print(f"peak traced memory while refusing the bomb: {peak / 2**20:.1f} MiB")
    assert peak < hub_client.MAX_JSON_BYTES + (16 << 20), peak


def test_an_honest_gzip_listing_is_read(hostile):
    repo = KernelRepo("evil/relu", simple_kernel())
    repo.install(hostile)
    body = gzip.compress(json.dumps(repo.listing()).encode())
    hostile.route(
        TREE,
        lambda _s, _m: Reply(
            200, {"Content-Type": "application/json", "Content-Encoding": "gzip"}, body
        ),
    )
    listed = hub_client.list_build_files("evil/relu", repo.commit)
    assert sorted(f.path for f in listed) == sorted(repo.files)


def _declare_sizes(repo: KernelRepo, sizes: dict[str, int]):
    """A listing that tells the truth about everything but the sizes of `sizes`' files."""

    def answer(_seen, _match):
        entries = repo.listing()
        for entry in entries:
            entry["size"] = sizes.get(entry["path"], entry["size"])
        return json_reply(entries)

    return answer


def test_a_huge_metadata_json_is_refused_before_it_is_downloaded(hostile):
    repo = KernelRepo("evil/relu", simple_kernel())
    repo.install(hostile)
    hostile.route(TREE, _declare_sizes(repo, {"build/torch-universal/metadata.json": 300_000_000}))
    cache = Cache(os.environ["KERNELS_CACHE"])
    with pytest.raises(IntegrityError, match="metadata is at most"):
        fetch.get_listing(cache, "evil/relu", repo.commit, offline=False)
    assert hostile.paths("/resolve/") == []


def test_files_larger_than_the_free_space_are_refused_before_any_download(hostile):
    cache = Cache(os.environ["KERNELS_CACHE"])
    cache.ensure()
    free = shutil.disk_usage(cache.root).free
    # Declared sizes within the per-file bound, together more than the disk has free.
    per_file = 15 << 30
    count = free // per_file + 1
    files = simple_kernel()
    sizes = {}
    for i in range(count):
        path = f"build/torch-universal/blob{i}.bin"
        files[path] = b"x"
        sizes[path] = per_file
    repo = KernelRepo("evil/relu", files)
    repo.install(hostile)
    hostile.route(TREE, _declare_sizes(repo, sizes))
    listing = fetch.get_listing(cache, "evil/relu", repo.commit, offline=False)
    with pytest.raises(InsufficientSpace, match="free"):
        fetch.install_variant(
            cache, "evil/relu", repo.commit, "torch-universal", listing.variants["torch-universal"]
        )
    assert hostile.paths("/resolve/") == []
    assert not [p for p in cache_files(cache) if "objects" in p.parts]


def test_a_gzip_bomb_error_body_is_refused_with_bounded_memory(hostile):
    body = _bomb()
    hostile.route(
        r"/api/kernels/evil/relu/revision/[^/]+",
        lambda _s, _m: Reply(404, {"Content-Type": "text/plain", "Content-Encoding": "gzip"}, body),
    )
    tracemalloc.start()
    try:
        with pytest.raises(UnsafeResponse, match="larger than"):
            hub_client.resolve_revision("evil/relu", "main")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < hub_client.MAX_ERROR_BYTES + (16 << 20), peak


def test_a_small_error_body_still_maps_to_the_typed_error(hostile):
    hostile.route(
        r"/api/kernels/evil/relu/revision/[^/]+",
        lambda _s, _m: Reply(
            404,
            {"Content-Encoding": "gzip", "X-Error-Code": "RepoNotFound"},
            gzip.compress(b'{"error": "Repository not found"}'),
        ),
    )
    with pytest.raises(KernelNotFound):
        hub_client.resolve_revision("evil/relu", "main")
