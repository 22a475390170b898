"""The loader core end to end: real huggingface_hub over real HTTP against `kernels serve`."""

from __future__ import annotations

import json
import os
import time

import kernels
import pytest
from kernels import (
    IntegrityError,
    InvalidMetadata,
    InvalidSpec,
    KernelNotFound,
    NoCompatibleVariant,
    OfflineCacheMiss,
    RevisionNotFound,
    UntrustedPublisher,
)

from tests.kernel_repos import kernel_files, run_python


@pytest.fixture
def relu(hub):
    """kernels-test/relu: v1 (VALUE 1), v2 (VALUE 2), a tag, main; publisher trusted."""
    hub.trust("kernels-test")
    w = hub.writer("kernels-test/relu")
    v1 = w.commit(kernel_files(value=1), branch="v1")
    w.tag("v1.0.0", v1, message="release 1.0.0")
    v2 = w.commit(kernel_files(value=2, version=2), branch="v2")
    main = w.commit(kernel_files(value=3, version=2), branch="main")
    return {"v1": v1, "v2": v2, "main": main, "writer": w}


def _requests(hub):
    return [r for r in hub.requests if "/api/agent-harnesses" not in r[1]]


def test_version_branch_tag_and_commit(hub, relu):
    assert kernels.get_kernel("kernels-test/relu", version=1).VALUE == 1
    assert kernels.get_kernel("kernels-test/relu", version=2).VALUE == 2
    assert kernels.get_kernel("kernels-test/relu", revision="main").VALUE == 3
    assert kernels.get_kernel("kernels-test/relu", revision="v1.0.0").VALUE == 1
    by_commit = kernels.get_kernel("kernels-test/relu", revision=relu["v2"])
    assert by_commit.VALUE == 2
    # The same build is the same module, whichever way it was asked for.
    assert by_commit is kernels.get_kernel("kernels-test/relu", version=2)


def test_loaded_kernel_records_origin(hub, relu):
    module = kernels.get_kernel("kernels-test/relu", version=1)
    records = [k for k in kernels.get_loaded_kernels() if k.module is module]
    assert len(records) == 1
    assert records[0].repo_info.repo_id == "kernels-test/relu"
    assert records[0].repo_info.revision == relu["v1"]
    assert records[0].variant == "torch-universal"


def test_warm_load_same_process_makes_no_request_and_is_fast(hub, relu):
    kernels.get_kernel("kernels-test/relu", version=1)
    hub.reset_requests()
    start = time.perf_counter()
    for _ in range(100):
        kernels.get_kernel("kernels-test/relu", version=1)
    per_call = (time.perf_counter() - start) / 100
    assert _requests(hub) == []
    assert per_call < 1e-3, per_call


def test_warm_load_new_process_makes_zero_requests(hub, relu):
    kernels.get_kernel("kernels-test/relu", version=1)
    hub.reset_requests()
    out = run_python(
        "import kernels; print(kernels.get_kernel('kernels-test/relu', version=1).VALUE)"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"
    assert _requests(hub) == []


def test_ttl_zero_rechecks_with_one_request_and_sees_moves(hub, relu, monkeypatch):
    assert kernels.get_kernel("kernels-test/relu", version=1).VALUE == 1
    relu["writer"].commit(kernel_files(value=11), branch="v1")  # the branch moves
    monkeypatch.setenv("KERNELS_RESOLVE_TTL", "0")
    hub.reset_requests()
    out = run_python(
        "import kernels; print(kernels.get_kernel('kernels-test/relu', version=1).VALUE)"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "11"
    hub.reset_requests()
    out = run_python(
        "import kernels; print(kernels.get_kernel('kernels-test/relu', version=1).VALUE)"
    )
    assert out.stdout.strip() == "11"
    assert len(_requests(hub)) == 1, _requests(hub)  # the re-check; everything else is cached


def test_pinned_commit_never_resolves(hub, relu):
    kernels.get_kernel("kernels-test/relu", revision=relu["v1"])
    hub.reset_requests()
    out = run_python(
        f"import kernels; print(kernels.get_kernel('kernels-test/relu', revision='{relu['v1']}').VALUE)"
    )
    assert out.stdout.strip() == "1", out.stderr
    assert _requests(hub) == []


def test_offline_after_online_version_load(hub, relu):
    kernels.get_kernel("kernels-test/relu", version=1)
    out = run_python(
        "import kernels; print(kernels.get_kernel('kernels-test/relu', version=1).VALUE)",
        env={"HF_HUB_OFFLINE": "1", "KERNELS_RESOLVE_TTL": "0"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"


def test_offline_cache_miss_names_the_command(hub, relu, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OfflineCacheMiss) as err:
        kernels.get_kernel("kernels-test/relu", version=1)
    assert "kernels pull kernels-test/relu" in str(err.value)
    assert isinstance(err.value, FileNotFoundError)  # transformers falls back on this


def test_server_down_falls_back_to_cache_with_one_notice(hub, relu):
    kernels.get_kernel("kernels-test/relu", version=1)
    # The same endpoint goes down (records are per endpoint: another URL has none to fall back on).
    from kernels.serve.faults import FaultPlan

    hub.server.faults = FaultPlan.parse("reset:1")
    dead = {"KERNELS_RESOLVE_TTL": "0"}
    code = """
        import time, torch, kernels
        t = time.perf_counter()
        a = kernels.get_kernel('kernels-test/relu', version=1)
        print(a.VALUE, round(time.perf_counter() - t, 2))
    """
    try:
        out = run_python(code, env=dead)
    finally:
        hub.server.faults = None
    assert out.returncode == 0, out.stderr
    value, seconds = out.stdout.split()
    assert value == "1"
    assert float(seconds) < 3  # the reference takes ~2.5 s and then fails
    assert out.stderr.count("unreachable") == 1, out.stderr
    assert "trust" not in out.stderr.lower()


def test_server_down_and_nothing_cached_is_a_network_error(hub, relu, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    out = run_python(
        "import kernels; kernels.get_kernel('kernels-test/relu', version=1)",
        env={"HF_ENDPOINT": "http://127.0.0.1:9"},
    )
    assert out.returncode != 0
    assert "HubUnavailable" in out.stderr
    assert "trust" not in out.stderr.lower().split("hint")[0]


def _tree_of(_module):
    # The tree in this test's cache (a module imported by an earlier test may point elsewhere).
    return kernels.install_kernel("kernels-test/relu", version=1)


def test_tampered_cached_file_is_refetched_online(hub, relu):
    module = kernels.get_kernel("kernels-test/relu", version=1)
    tree = _tree_of(module)
    target = tree / "__init__.py"
    os.chmod(target, 0o644)
    target.write_text("VALUE = 666\nfrom . import layers\n")
    out = run_python(
        "import kernels; print(kernels.get_kernel('kernels-test/relu', version=1).VALUE)"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"
    assert "changed on disk" in out.stderr


def test_tampered_cached_file_offline_is_an_integrity_error(hub, relu):
    module = kernels.get_kernel("kernels-test/relu", version=1)
    target = _tree_of(module) / "_impl.py"
    os.chmod(target, 0o644)
    with open(target, "r+b") as fh:  # same size, different bytes
        data = fh.read()
        fh.seek(0)
        fh.write(data.replace(b"min=0", b"min=9"))
    out = run_python(
        "import kernels; print(kernels.get_kernel('kernels-test/relu', version=1).relu(-5))",
        env={"HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode != 0
    assert "IntegrityError" in out.stderr


def test_truncated_cached_file_is_never_imported(hub, relu):
    module = kernels.get_kernel("kernels-test/relu", version=1)
    target = _tree_of(module) / "__init__.py"
    os.chmod(target, 0o644)
    with open(target, "r+b") as fh:
        fh.truncate(5)
    out = run_python(
        "import kernels; print(kernels.get_kernel('kernels-test/relu', version=1).VALUE)",
        env={"HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode != 0 and "IntegrityError" in out.stderr


def test_eight_processes_cold_start(hub, relu, tmp_path):
    import subprocess
    import sys

    big = os.urandom(3 << 20)
    w = hub.writer("kernels-test/big")
    w.commit(
        kernel_files(name="big", extra={"build/torch-universal/weights.bin": w.lfs(big)}),
        branch="v1",
    )
    code = "import kernels; m = kernels.get_kernel('kernels-test/big', version=1); print(m.VALUE)"
    env = dict(os.environ)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    assert all(o[0].strip() == "1" for o in outs)
    reqs = _requests(hub)
    gets = [r for r in reqs if r[0] == "GET" and "/resolve/" in r[1]]
    paths = [r[1] for r in gets]
    assert len(paths) == len(set(paths)), paths  # each file fetched once
    assert sum("weights.bin" in p for p in paths) == 1
    # The same requests one process would make: independent of the process count. (revision,
    # overview, tree, the refs behind the newer-version warning of a first resolution, files.)
    single = len(reqs)
    assert single <= 4 + len(paths) + 1, reqs


def test_listing_with_path_traversal_is_refused_and_cache_unchanged(hub, relu):
    def hook(repo_id, commit, entries):
        evil = dict(next(e for e in entries if e["type"] == "file"))
        evil["path"] = "build/torch-universal/../../evil.py"
        return entries + [evil]

    kernels.get_kernel("kernels-test/relu", version=2)  # a cache with content in it
    hub.server.tree_hook = hook
    cache_root = os.environ["KERNELS_CACHE"]
    # Resolution, trust and kernel-status records and lock files may be written; no content.
    records = ("/locks/", "/refs/", "/trust/", "/kernel-status/")
    before = sorted(p for p in _walk(cache_root) if not any(r in p for r in records))
    with pytest.raises(IntegrityError, match="unsafe"):
        kernels.get_kernel("kernels-test/relu", version=1)
    after = sorted(p for p in _walk(cache_root) if not any(r in p for r in records))
    assert before == after


@pytest.mark.parametrize(
    "bad_path",
    [
        "/etc/passwd",
        "build/torch-universal/a/../../../x.py",
        "build/torch-universal//x.py",
        "build/torch-universal/a\\b.py",
    ],
)
def test_listing_with_escaping_paths_is_refused(hub, relu, bad_path):
    def hook(repo_id, commit, entries):
        evil = dict(next(e for e in entries if e["type"] == "file"))
        evil["path"] = bad_path
        return entries + [evil]

    hub.server.tree_hook = hook
    with pytest.raises(IntegrityError):
        kernels.get_kernel("kernels-test/relu", version=1)
    assert not any("index" in p and "variants" in p for p in _walk(os.environ["KERNELS_CACHE"]))


def test_bytes_that_do_not_match_their_digest_are_rejected(hub, relu):
    def hook(repo_id, commit, path, data):
        return data.replace(b"VALUE", b"EVIL_") if path.endswith("__init__.py") else data

    hub.server.file_hook = hook
    with pytest.raises(IntegrityError):
        kernels.get_kernel("kernels-test/relu", version=1)
    assert not any("/trees/" in p for p in _walk(os.environ["KERNELS_CACHE"]))


def _walk(root):
    out = []
    for dirpath, _dirs, files in os.walk(root):
        out.extend(os.path.join(dirpath, f) for f in files)
    return out


def test_identical_files_are_stored_once_across_repos_and_versions(hub, relu):
    hub.writer("kernels-test/relu-copy").commit(kernel_files(value=1), branch="v1")
    a = kernels.get_kernel("kernels-test/relu", version=1)
    b = kernels.get_kernel("kernels-test/relu-copy", version=1)
    assert a is b  # identical variant content: one tree, one module
    kernels.get_kernel("kernels-test/relu", version=2)  # differs only in __init__/metadata
    objects = [p for p in _walk(os.environ["KERNELS_CACHE"]) if "/objects/" in p]
    # v1: metadata, __init__, _impl, layers; v2 adds only its own metadata and __init__.
    assert len(objects) == 6, objects


def test_two_builds_never_share_a_module(hub, relu):
    a = kernels.get_kernel("kernels-test/relu", version=1)
    b = kernels.get_kernel("kernels-test/relu", version=2)
    assert a is not b and a.__name__ != b.__name__
    assert a.layers is not b.layers and a.VALUE == 1 and b.VALUE == 2


def test_lfs_file_via_cdn_redirect(hub, relu):
    payload = os.urandom(200_000)
    w = hub.writer("kernels-test/lfs")
    w.commit(
        kernel_files(name="lfs", extra={"build/torch-universal/blob.bin": w.lfs(payload)}),
        branch="v1",
    )
    kernels.get_kernel("kernels-test/lfs", version=1)
    assert (
        kernels.install_kernel("kernels-test/lfs", version=1) / "blob.bin"
    ).read_bytes() == payload


# -- typed errors --------------------------------------------------------------------------


def test_missing_repo(hub, relu):
    with pytest.raises(KernelNotFound):
        kernels.get_kernel("kernels-test/nope", version=1)


def test_missing_version_lists_the_versions(hub, relu):
    with pytest.raises(RevisionNotFound) as err:
        kernels.get_kernel("kernels-test/relu", version=7)
    assert "available versions: 1, 2" in str(err.value)  # the reference's wording


def test_missing_revision(hub, relu):
    with pytest.raises(RevisionNotFound):
        kernels.get_kernel("kernels-test/relu", revision="no-such-branch")


@pytest.mark.parametrize("repo_id", ["relu", "a/b/c", "", "../x", "org/", "org/na me", "org/--x"])
def test_malformed_repo_ids(hub, repo_id):
    with pytest.raises(InvalidSpec):
        kernels.get_kernel(repo_id, version=1)


@pytest.mark.parametrize("revision", ["main~1", "v1^{commit}", "a..b", "x@{1}", "with space", ""])
def test_malformed_revisions(hub, revision):
    with pytest.raises(InvalidSpec):
        kernels.get_kernel("kernels-test/relu", revision=revision)


def test_version_and_revision_together(hub):
    with pytest.raises(InvalidSpec):
        kernels.get_kernel("kernels-test/relu", version=1, revision="main")
    with pytest.raises(ValueError):  # the reference raises ValueError when neither is given
        kernels.get_kernel("kernels-test/relu")


def test_no_compatible_variant_has_the_trace(hub):
    hub.trust("kernels-test")
    hub.writer("kernels-test/gpu-only").commit(
        kernel_files(variant="torch213-cxx11-cu130-x86_64-linux", backend="cuda")
        | kernel_files(variant="torch-rocm", backend="rocm"),
        branch="v1",
    )
    with pytest.raises(NoCompatibleVariant) as err:
        kernels.get_kernel("kernels-test/gpu-only", version=1)
    text = str(err.value)
    assert "torch213-cxx11-cu130-x86_64-linux" in text and "torch-rocm" in text
    assert len(err.value.trace) == 2


def test_broken_metadata(hub):
    hub.trust("kernels-test")
    files = kernel_files()
    files["build/torch-universal/metadata.json"] = '{"name": "Bad Name!", "id": "x"}'
    hub.writer("kernels-test/broken").commit(files, branch="v1")
    with pytest.raises(InvalidMetadata):
        kernels.get_kernel("kernels-test/broken", version=1)


def test_untrusted_publisher(hub):
    hub.writer("stranger/relu").commit(kernel_files(), branch="v1")
    with pytest.raises(UntrustedPublisher):
        kernels.get_kernel("stranger/relu", version=1)
    assert kernels.get_kernel("stranger/relu", version=1, trust_remote_code=True).VALUE == 1
    assert kernels.get_kernel("stranger/relu", version=1, trust_remote_code=["stranger"]).VALUE == 1


def test_user_allowlist(hub, monkeypatch):
    hub.writer("friend/relu").commit(kernel_files(), branch="v1")
    monkeypatch.setenv("KERNELS_TRUSTED_PUBLISHERS", "someone,friend")
    assert kernels.get_kernel("friend/relu", version=1).VALUE == 1


def test_offline_keeps_the_recorded_trust_decision(hub, relu):
    hub.writer("stranger/relu").commit(kernel_files(value=5), branch="v1")
    kernels.get_kernel("stranger/relu", version=1, trust_remote_code=True)  # cached, but untrusted
    code = "import kernels; kernels.get_kernel('stranger/relu', version=1)"
    out = run_python(code, env={"HF_HUB_OFFLINE": "1"})
    assert out.returncode != 0 and "UntrustedPublisher" in out.stderr
    ok = run_python(
        "import kernels; print(kernels.get_kernel('kernels-test/relu', version=1).VALUE)"
    )
    assert ok.stdout.strip() == "1", ok.stderr  # recorded Hub trust: offline works
    out = run_python(
        "import kernels; print(kernels.get_kernel('kernels-test/relu', version=1).VALUE)",
        env={"HF_HUB_OFFLINE": "1"},
    )
    assert out.stdout.strip() == "1", out.stderr


def test_install_has_and_variants(hub, relu):
    path = kernels.install_kernel("kernels-test/relu", version=1)
    assert (path / "metadata.json").is_file()
    assert kernels.has_kernel("kernels-test/relu", version=1)
    assert not kernels.has_kernel("kernels-test/relu", version=9)
    assert not kernels.has_kernel("kernels-test/nothing", version=1)
    trace = kernels.get_kernel_variants("kernels-test/relu", version=1)
    assert [str(e) for e in trace] == ["torch-universal: compatible, preferred"]


def test_local_kernel_root_build_and_variant(tmp_path):
    root = tmp_path / "relu"
    for rel, content in kernel_files(value=4).items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    a = kernels.get_local_kernel(root)
    assert a.VALUE == 4
    assert kernels.get_local_kernel(root / "build") is a
    assert kernels.get_local_kernel(root / "build" / "torch-universal") is a
    assert not list(root.rglob("__pycache__"))  # nothing written into the user's folder


def test_metadata_json_cache_record_is_json(hub, relu):
    kernels.get_kernel("kernels-test/relu", version=1)
    refs = [p for p in _walk(os.environ["KERNELS_CACHE"]) if "/refs/" in p]
    endpoint = kernels.settings.endpoint()  # records are kept per endpoint
    assert refs and all("commit" in json.loads(open(p).read())["endpoints"][endpoint] for p in refs)
