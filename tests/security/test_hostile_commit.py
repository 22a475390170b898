"""Issue 15 item 5: a server's commit id is validated before it reaches the cache or a path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from kernels import hub as hub_client
from kernels import settings
from kernels.cache import Cache, FileEntry, Manifest
from kernels.cli.main import main as kernels_main
from kernels.errors import UnsafeResponse

from tests.security.hostile import KernelRepo, cache_files, hostile, json_reply, simple_kernel

__all__ = ["hostile"]  # the fixture, used by name

# 40 characters, as the old check wanted, that climb out of any folder they are joined to.
ESCAPING = "../../../../ESCAPED-" + "x" * 20


def test_resolve_refuses_a_commit_id_that_is_not_40_lowercase_hex(hostile, tmp_path):
    KernelRepo("evil/relu", simple_kernel(), commit=ESCAPING).install(hostile)
    with pytest.raises(UnsafeResponse, match="malformed"):
        hub_client.resolve_revision("evil/relu", "main")
    # Upper-case hex is not how the Hub writes a commit either (and would alias a cache key).
    KernelRepo("evil/relu", simple_kernel(), commit="ABCDEF0123" * 4).install(hostile)
    with pytest.raises(UnsafeResponse):
        hub_client.resolve_revision("evil/relu", "main")


def test_pull_of_a_hostile_commit_caches_nothing(hostile, tmp_path, capsys):
    KernelRepo("evil/relu", simple_kernel(), commit=ESCAPING).install(hostile)
    assert kernels_main(["pull", "evil/relu@main", "--all-variants"]) != 0
    assert "malformed" in capsys.readouterr().err
    cache = Cache(os.environ["KERNELS_CACHE"])
    assert not [p for p in cache_files(cache) if "ESCAPED" in str(p)]
    assert hostile.paths("/tree/") == []  # no listing was asked for under that "commit"


def test_refs_with_a_malformed_target_commit_are_refused(hostile):
    hostile.route(
        r"/api/kernels/evil/relu/refs",
        lambda _s, _m: json_reply(
            {"branches": [{"name": "v1", "ref": "refs/heads/v1", "targetCommit": ESCAPING}]}
        ),
    )
    with pytest.raises(UnsafeResponse):
        hub_client.list_refs("evil/relu")


def _plant(cache: Cache, repo: str, commit: str, variant: str, data: bytes) -> None:
    """A cache entry as a client without the check could have written it."""
    writer = cache.objects.writer()
    writer.write(data)
    sha256 = writer.commit()
    cache.install(repo, commit, variant, Manifest((FileEntry("__init__.py", sha256, len(data)),)))


def test_export_and_ls_skip_a_cached_entry_with_a_malformed_commit(tmp_path, capsys):
    # Planted for the session's endpoint: export copies that endpoint's variants only (records
    # are scoped to the server that answered them), so an unscoped entry would not be seen.
    cache = Cache(os.environ["KERNELS_CACHE"], endpoint=settings.endpoint())
    cache.ensure()
    good = "a" * 40
    _plant(cache, "evil/relu", good, "torch-universal", b"VALUE = 1\n")
    _plant(cache, "evil/relu", ESCAPING, "torch-universal", b"VALUE = 2\n")
    dest = tmp_path / "a" / "b" / "c" / "d" / "dest"
    assert kernels_main(["export", str(dest)]) == 0
    out = capsys.readouterr()
    assert "malformed cache entry" in out.err
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written and all(dest in p.parents for p in written), written
    assert (dest / "evil/relu/commits" / good / "build/torch-universal/__init__.py").is_file()
    assert not list(Path(tmp_path).rglob("ESCAPED*"))

    assert kernels_main(["ls"]) == 0
    out = capsys.readouterr()
    assert good[:12] in out.out and "ESCAPED" not in out.out + out.err
    assert "skipped 1 malformed" in out.err
