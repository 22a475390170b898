"""Hostile input, fuzzed with hypothesis: only typed errors (kernels.errors), never a crash.

Parsers (spec strings, repo ids, revisions, metadata.json, kernels.lock) run in-process; server
listings and file bodies go through the real client over HTTP, rewritten by the server's
`tree_hook` / `file_hook`, into a copy of a populated cache whose content buckets (objects/,
aliases/, trees/, manifests/, index/) must be unchanged after a refused listing. CI runs a few
hundred cases per property (derandomized); KERNELS_SOAK=1 runs thousands of new ones.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import shutil
import time
import types
from collections import Counter

import kernels
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from kernels import InvalidMetadata, KernelsError
from kernels import hub as hub_client
from kernels.cache import Cache
from kernels.cache.fsutil import safe_key
from kernels.lockfile import parse_lock
from kernels.metadata import Metadata
from kernels.serve.faults import FaultPlan, Rule
from kernels.spec import make_spec, parse_spec

from tests.reliability.helpers import (
    bucket_snapshot,
    cache_problems,
    fuzz,
    installed_variants,
    payload,
    pure_kernel,
    record,
    sha256,
    tmp_leftovers,
)

NASTY = list("/@:.-_~^{}[]\\ \t\n\x00%*?$'\"") + ["..", "//", "@{", "é", "🚀", "\u202e", "v1", "v"]
nasty_text = st.lists(st.one_of(st.sampled_from(NASTY), st.text(max_size=6)), max_size=12).map(
    "".join
)
names = st.one_of(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True), nasty_text)
refs = st.one_of(
    st.from_regex(r"v[0-9]{1,3}", fullmatch=True),
    st.from_regex(r"[0-9a-f]{40}", fullmatch=True),
    st.from_regex(r"[A-Za-z0-9._/-]{1,30}", fullmatch=True),
    nasty_text,
)
specs = st.one_of(
    st.text(max_size=200),
    nasty_text,
    st.builds(
        lambda org, name, at, ref, colon, layer: f"{org}/{name}{at}{ref}{colon}{layer}",
        names,
        names,
        st.sampled_from(["", "@", "@@"]),
        refs,
        st.sampled_from(["", ":", "::"]),
        st.one_of(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,10}", fullmatch=True), nasty_text),
    ),
    st.builds(lambda a, b: f"{a}{b}", st.sampled_from(["/", "~", "~/", "C:\\", "C:/"]), nasty_text),
)


WHAT = {
    "test_spec_strings": "fuzz: kernel spec strings (parse_spec)",
    "test_repo_ids": "fuzz: repo ids",
    "test_revisions": "fuzz: revisions",
    "test_metadata_json": "fuzz: metadata.json bytes (Metadata.from_bytes)",
    "test_lockfiles": "fuzz: kernels.lock text (parse_lock)",
    "test_hostile_listings": "fuzz: server tree listings over HTTP (tree_hook)",
    "test_hostile_file_bodies": "fuzz: server file bodies over HTTP (file_hook)",
    "test_hostile_retry_after": "fuzz: Retry-After header values over HTTP",
}
_SEEN: Counter = Counter()  # outcome -> cases run, for the test running now


@pytest.fixture(autouse=True)
def _count_cases(request):
    _SEEN.clear()
    yield
    if _SEEN:
        record(WHAT[request.node.originalname], sum(_SEEN.values()), outcomes=dict(_SEEN))


def _typed(call, *args, **kwargs):
    """Run `call`; a KernelsError is an answer, any other exception fails the test."""
    try:
        result = call(*args, **kwargs)
    except KernelsError as exc:
        assert exc.message and "\n" not in exc.hint
        _SEEN["refused"] += 1
        return None
    _SEEN["accepted"] += 1
    return result


@fuzz()
@given(specs)
@example("~nosuchuser-kernels/relu:ReLU")
@example("org/repo@" + "a" * 300)
def test_spec_strings(text):
    spec = _typed(parse_spec, text)
    if spec is None or spec.path is not None:
        return
    org, name = spec.repo_id.split("/")
    assert "/" not in safe_key(spec.repo_id) and safe_key(spec.repo_id) not in (".", "..")
    assert ".." not in spec.repo_id and org and name
    if spec.ref is not None:
        key = safe_key(spec.ref)
        assert "/" not in key and key not in (".", "..")
    assert parse_spec(str(spec)) == spec  # what it prints, it reads back


@fuzz()
@given(st.one_of(names, st.builds(lambda a, b: f"{a}/{b}", names, names), st.none(),
                 st.integers(), st.binary(max_size=20)))  # fmt: skip
def test_repo_ids(repo_id):
    spec = _typed(make_spec, repo_id, version=1)
    if spec is not None:
        assert repo_id.count("/") == 1 and ".." not in repo_id
        assert all(c.isascii() and (c.isalnum() or c in "._-/") for c in repo_id)


@fuzz()
@given(st.one_of(refs, st.none(), st.integers(), st.lists(st.text(max_size=3), max_size=2)))
def test_revisions(revision):
    spec = _typed(make_spec, "org/repo", revision=revision)
    if spec is not None and revision is not None:
        assert not any(bad in revision for bad in ("..", "@{", " ", "~", "^", ":", "\\", "\x00"))


# -- metadata.json -----------------------------------------------------------------------------

VALID_METADATA = {
    "name": "relu",
    "id": "_relu_universal",
    "version": 1,
    "license": "Apache-2.0",
    "backend": {"type": "universal"},
    "python-depends": [],
}
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
              st.text(max_size=20)),
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.text(max_size=12), children, max_size=4)),
    max_leaves=20,
)  # fmt: skip
metadata_keys = st.sampled_from([*VALID_METADATA, "kernels-minver", "kernel-depends", "x"])


def _mutated(base: dict, keys, values):
    return st.lists(st.tuples(keys, values), max_size=4).map(
        lambda changes: {**copy.deepcopy(base), **dict(changes)}
    )


@fuzz()
@given(
    st.one_of(
        st.binary(max_size=500),
        json_values.map(lambda v: json.dumps(v).encode()),
        _mutated(VALID_METADATA, metadata_keys, json_values).map(lambda d: json.dumps(d).encode()),
    )
)
@example(b"[" * 100_000)
@example(json.dumps({**VALID_METADATA, "kernel-depends": 5}).encode())
@example(json.dumps({**VALID_METADATA, "backend": {"type": "cuda", "archs": "8.0"}}).encode())
@example(json.dumps({**VALID_METADATA, "version": True}).encode())
def test_metadata_json(data):
    meta = _typed(Metadata.from_bytes, data)
    if meta is not None:
        # bool is an int subclass: `True` must be refused as a version, never read as 1.
        assert type(meta.version) is int
        assert meta.version == json.loads(data)["version"]


def test_metadata_version_true_is_refused():
    """JSON `true` is a Python int subclass; the parser's bool guard must refuse it."""
    with pytest.raises(InvalidMetadata, match="'version' must be int"):
        Metadata.from_bytes(json.dumps({**VALID_METADATA, "version": True}).encode())


# -- kernels.lock ------------------------------------------------------------------------------

VALID_LOCK = {
    "schema": 1,
    "kernels": [
        {
            "repo_id": "org/relu",
            "requested": {"version": 1},
            "commit": "a" * 40,
            "variants": {"torch-universal": {"__init__.py": "b" * 64}},
        }
    ],
}
lock_keys = st.sampled_from(["repo_id", "requested", "commit", "variants", "x"])


@fuzz()
@given(
    st.one_of(
        st.text(max_size=300),
        json_values.map(json.dumps),
        _mutated(VALID_LOCK["kernels"][0], lock_keys, json_values).map(
            lambda entry: json.dumps({"schema": 1, "kernels": [entry]})
        ),
        st.lists(st.dictionaries(st.sampled_from(["repo_id", "sha", "dependency", "lock"]),
                                 json_values, max_size=3), max_size=2).map(json.dumps),
    )
)  # fmt: skip
@example(json.dumps({"schema": 1, "kernels": [{**VALID_LOCK["kernels"][0], "commit": 7}]}))
@example(json.dumps([{"repo_id": "org/relu", "sha": 7}]))
@example("[" * 100_000)
def test_lockfiles(text):
    lock = _typed(parse_lock, text)
    if lock is not None:
        for entry in lock.entries:
            assert len(entry.commit) == 40


# -- server listings (tree_hook) ---------------------------------------------------------------

BASE, TARGET = "fuzz-lab/base", "fuzz-lab/target"
# Different blobs: the target's must be downloaded, not found in the template's store.
BLOBS = {BASE: payload(600, 3000), TARGET: payload(601, 3000)}

hostile_paths = st.one_of(
    st.sampled_from(
        ["/etc/passwd", "build/torch-universal/../../x.py", "build/../x.py", "build",
         "build/torch-universal//x.py", "build/torch-universal/./x.py", "build/torch-universal",
         "build/torch-universal/a\\b.py", "C:/x.py", "build/torch-universal/x\x00.py",
         "build/torch-universal/" + "a" * 2000, "", ".", "..", "build/..", "build/../build/x",
         "build/torch-universal/__pycache__/x.pyc", "build/évil/x.py", "build/x y/z.py",
         "build/torch-universal/metadata.json/x", "build/torch-universal/x\ny.py",
         "build/torch-universal/" + "/".join(["d"] * 40) + "/f.py"]
    ),
    st.lists(st.one_of(st.sampled_from(["..", ".", "", "build", "torch-universal", "~"]),
                       st.text(max_size=8)), min_size=1, max_size=8).map("/".join),
    nasty_text.map(lambda t: "build/torch-universal/" + t),
)  # fmt: skip
hostile_numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70), st.floats(), st.booleans(), st.none(),
    st.text(max_size=5), st.sampled_from([2**34, 16 << 30, (16 << 30) + 1, -1, 0]),
)  # fmt: skip
hostile_digests = st.one_of(
    st.none(), st.integers(), st.text(max_size=70), st.from_regex(r"[0-9a-f]{40}", fullmatch=True),
    st.from_regex(r"[0-9a-f]{64}", fullmatch=True), st.lists(st.integers(), max_size=2),
)  # fmt: skip
index = st.integers(min_value=0, max_value=20)
mutations = st.one_of(
    st.tuples(st.just("path"), index, hostile_paths),
    st.tuples(st.just("size"), index, hostile_numbers),
    st.tuples(st.just("oid"), index, hostile_digests),
    st.tuples(st.just("lfs"), index, st.one_of(
        hostile_digests,
        st.fixed_dictionaries({"oid": hostile_digests, "size": hostile_numbers}),
    )),
    st.tuples(st.just("type"), index, st.one_of(st.sampled_from(["file", "directory"]),
                                                 json_values)),
    st.tuples(st.just("duplicate"), index, st.none()),
    st.tuples(st.just("clash"), index, st.none()),
    st.tuples(st.just("drop"), index, st.none()),
    st.tuples(st.just("junk"), index, json_values),
    st.tuples(st.just("many"), st.integers(min_value=1, max_value=3), st.none()),
)  # fmt: skip
listings = st.one_of(
    st.lists(mutations, min_size=1, max_size=5),
    json_values.map(lambda v: [("replace", 0, v)]),
)


def _mutate(entries: list, ops: list) -> object:
    out = [dict(e) for e in entries]
    for op, i, value in ops:
        files = [e for e in out if isinstance(e, dict) and e.get("type") == "file"]
        pick = files[i % len(files)] if files else {}
        if op == "replace":
            return value
        if op in ("path", "size", "oid", "lfs", "type"):
            pick[op] = value
        elif op == "duplicate":
            out.append(dict(pick))
        elif op == "clash":  # a file that is also a folder
            out.append({**pick, "path": f"{pick.get('path')}/inner.py"})
        elif op == "drop" and out:
            out.pop(i % len(out))
        elif op == "junk":
            out.append(value)
        elif op == "many":  # more files than a variant may have
            out.extend({**pick, "path": f"build/torch-universal/m{n}.py"} for n in range(10_001))
    return out


@pytest.fixture
def fuzz_cache(hub, tmp_path):
    """A populated cache to copy per example, and the repos the examples load."""
    hub.trust("fuzz-lab")
    for repo, value in ((BASE, 1), (TARGET, 2)):
        w = hub.writer(repo)
        files = pure_kernel(
            repo.split("/")[1], value=value, lfs={"blob.bin": BLOBS[repo]}, writer=w
        )
        w.commit(files, branch="v1")
    template = tmp_path / "template"
    os.environ["KERNELS_CACHE"] = str(template)  # the autouse env fixture restores it
    kernels.get_kernel(BASE, version=1)
    counter = itertools.count()

    def fresh():
        root = tmp_path / f"example-{next(counter)}"
        shutil.copytree(template, root, symlinks=True)
        os.environ["KERNELS_CACHE"] = str(root)
        return root

    return fresh


def _load_target(hub, root) -> str:
    """'loaded', 'refused' (listing refused, buckets unchanged) or 'failed' (typed, sound).

    A listing may leave files out (the server decides what a commit holds); whatever is
    installed must be what was listed, with the bytes the digests vouch for.
    """
    before = bucket_snapshot(root)
    try:
        module = kernels.get_kernel(TARGET, version=1)
    except KernelsError as exc:
        if "listing is unsafe" in exc.message:
            assert bucket_snapshot(root) == before
            outcome = "refused"
        else:
            outcome = "failed"
    else:
        # The module may be one imported by an earlier example (same content, same module), so
        # the bytes are checked in this example's cache.
        assert module.VALUE == 2
        [(repo, commit, variant)] = [e for e in installed_variants(root) if e[0] == TARGET]
        blob = Cache(root).installed(repo, commit, variant)[1] / "blob.bin"
        assert not blob.is_file() or sha256(blob.read_bytes()) == sha256(BLOBS[TARGET])
        outcome = "loaded"
    assert cache_problems(root) == [], cache_problems(root)
    assert tmp_leftovers(root) == []
    return outcome


@fuzz(ci=100, soak=3000)
@given(ops=listings)
def test_hostile_listings(hub, fuzz_cache, ops):
    root = fuzz_cache()
    hub.server.tree_hook = lambda repo, commit, entries: (
        _mutate(entries, ops) if repo == TARGET else entries
    )
    try:
        outcome = _load_target(hub, root)
    finally:
        hub.server.tree_hook = None
        shutil.rmtree(root, ignore_errors=True)
    _SEEN[outcome] += 1


bodies = st.one_of(
    st.binary(max_size=200),
    st.tuples(st.integers(min_value=0), st.integers(min_value=0, max_value=255)).map(
        lambda t: ("flip", t)
    ),
    st.integers(min_value=0, max_value=4000).map(lambda n: ("cut", n)),
    st.binary(min_size=1, max_size=50).map(lambda b: ("extend", b)),
)


def _rewrite(data: bytes, how) -> bytes:
    if isinstance(how, bytes):
        return how
    kind, arg = how
    if kind == "flip":
        at, value = arg
        if not data:
            return bytes([value])
        out = bytearray(data)
        out[at % len(out)] = value
        return bytes(out)
    if kind == "cut":
        return data[: arg % (len(data) + 1)]
    return data + arg


@fuzz(ci=75, soak=2000)
@given(target=st.sampled_from(["blob.bin", "__init__.py", "metadata.json"]), how=bodies)
def test_hostile_file_bodies(hub, fuzz_cache, target, how):
    root = fuzz_cache()
    changed = []

    def hook(repo, commit, path, data):
        if repo != TARGET or not path.endswith(target):
            return data
        rewritten = _rewrite(data, how)
        changed.append(rewritten != data)
        return rewritten

    hub.server.file_hook = hook
    try:
        outcome = _load_target(hub, root)
    finally:
        hub.server.file_hook = None
        shutil.rmtree(root, ignore_errors=True)
    assert changed  # the file was served, through the hook
    # Changed bytes never load; bytes the rewrite left intact always do.
    assert outcome == ("failed" if changed[0] else "loaded"), (changed, outcome)
    _SEEN[outcome] += 1


@fuzz(ci=60, soak=1000)
@given(value=st.one_of(st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=255),
                                max_size=30), hostile_numbers.map(str)))  # fmt: skip
def test_hostile_retry_after(hub, fuzz_cache, value, monkeypatch_session):
    root = fuzz_cache()
    hub.server.faults = FaultPlan(
        [Rule("status", status=429, first=1, retry_after=value, match="/_lfs/")]
    )
    try:
        assert _load_target(hub, root) == "loaded"
        assert hub.server.faults.injected == {"429": 1}  # the header was sent, and survived
        _SEEN["loaded"] += 1
    finally:
        hub.server.faults = None
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def monkeypatch_session(monkeypatch):
    """Retry-After is capped (30 s) before it is slept on; a small cap keeps the fuzz fast. A
    value the client cannot parse takes its own backoff (0.25 s and up), slept here at a
    hundredth: a wait that would make time.sleep raise (negative, NaN) or hang (infinite) still
    does, and the 60 examples take a second instead of ~17."""
    monkeypatch.setattr(hub_client, "MAX_RETRY_AFTER", 0.01)
    clock = types.SimpleNamespace(monotonic=time.monotonic, sleep=lambda s: time.sleep(s / 100))
    monkeypatch.setattr(hub_client, "time", clock)
    return monkeypatch
