"""The real huggingface_hub client against `kernels serve`, over HTTP on 127.0.0.1."""

from __future__ import annotations

import hashlib
from pathlib import Path
from urllib.parse import urlparse

import huggingface_hub
import pytest
from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

REPO = "kernels-test/relu"
INIT = "build/torch-universal/relu/__init__.py"


def read(path: str | Path) -> str:
    return Path(path).read_text()


def snapshot_commit(path: str | Path) -> str:
    """The commit folder of a file under <cache>/<repo>/snapshots/<commit>/..."""
    parts = Path(path).parts
    return parts[parts.index("snapshots") + 1]


@pytest.mark.parametrize(
    ("revision", "commit_attr", "version"),
    [
        ("main", "main", "1.1.0-dev"),
        ("v1", "v1", "1.0.0"),  # branch
        ("v1.0.0", "v1", "1.0.0"),  # annotated tag, peeled to its commit
        ("v0.9.0", "v09", "0.9.0"),  # lightweight tag
        ("refs/heads/v1", "v1", "1.0.0"),  # full ref name
    ],
)
def test_download_by_branch_tag_and_ref(hub, relu, tmp_path, revision, commit_attr, version):
    path = hf_hub_download(REPO, INIT, revision=revision, cache_dir=tmp_path)
    assert read(path) == f'VERSION = "{version}"\n'
    assert snapshot_commit(path) == getattr(relu, commit_attr)
    ref_file = tmp_path / "models--kernels-test--relu" / "refs" / revision
    assert ref_file.read_text() == getattr(relu, commit_attr)


def test_download_by_commit_and_kernel_repo_type(hub, relu, tmp_path):
    path = hf_hub_download(REPO, INIT, revision=relu.v09, repo_type="kernel", cache_dir=tmp_path)
    assert read(path) == 'VERSION = "0.9.0"\n'
    assert Path(path).is_relative_to(tmp_path / "kernels--kernels-test--relu")
    assert ("HEAD", f"/kernels/{REPO}/resolve/{relu.v09}/{INIT}") in hub.requests


def test_default_cache_is_the_isolated_hf_home(hub, relu):
    path = hf_hub_download(REPO, "README.md")
    assert Path(path).is_relative_to(Path(constants.HF_HUB_CACHE))
    assert "hf-home" in constants.HF_HUB_CACHE


def test_missing_file_is_entry_not_found_and_cached_as_no_exist(hub, relu, tmp_path):
    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download(REPO, "nope.txt", revision="v1", cache_dir=tmp_path)
    marker = tmp_path / "models--kernels-test--relu" / ".no_exist" / relu.v1 / "nope.txt"
    assert marker.is_file()


def test_bad_revision_is_revision_not_found(hub, relu, tmp_path):
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(REPO, INIT, revision="v9.9.9", cache_dir=tmp_path)
    with pytest.raises(RevisionNotFoundError):
        HfApi().repo_info(REPO, revision="v9.9.9")


@pytest.mark.parametrize(
    "expression", ["main~1", "v1.0.0^{commit}", "main^", "v1..main", "main@{0}", "main:README.md"]
)
def test_revision_expressions_are_refused(hub, relu, tmp_path, expression):
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(REPO, INIT, revision=expression, cache_dir=tmp_path)
    with pytest.raises(RevisionNotFoundError):
        HfApi().repo_info(REPO, revision=expression)


def test_short_sha_is_refused_and_full_sha_accepted(hub, relu):
    api = HfApi()
    with pytest.raises(RevisionNotFoundError):
        api.repo_info(REPO, revision=relu.v1[:7])
    assert api.repo_info(REPO, revision=relu.v1).sha == relu.v1
    assert api.repo_info(REPO, revision=relu.v1.upper()).sha == relu.v1
    with pytest.raises(RevisionNotFoundError):
        api.repo_info(REPO, revision="0" * 40)


def test_missing_repo_is_repository_not_found(hub, relu, tmp_path):
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("kernels-test/missing", INIT, cache_dir=tmp_path)
    with pytest.raises(RepositoryNotFoundError):
        HfApi().repo_info("kernels-test/missing")
    assert HfApi().repo_exists(REPO)
    assert not HfApi().repo_exists("kernels-test/missing")


@pytest.mark.parametrize("repo_type", [None, "kernel"])
def test_snapshot_download_with_allow_patterns(hub, relu, tmp_path, repo_type):
    folder = snapshot_download(
        REPO,
        revision="v1.0.0",
        repo_type=repo_type,
        allow_patterns=["build/torch-universal/*"],
        cache_dir=tmp_path,
    )
    files = sorted(p.relative_to(folder).as_posix() for p in Path(folder).rglob("*") if p.is_file())
    assert files == ["build/torch-universal/relu/__init__.py", "build/torch-universal/relu/_ops.py"]
    assert Path(folder).name == relu.v1


def test_list_repo_refs(hub, relu):
    relu.writer.branch("pr-source", relu.v09)
    relu.writer.set_ref("refs/pr/1", relu.v09)
    relu.writer.set_ref("refs/convert/parquet", relu.v1)
    refs = HfApi().list_repo_refs(REPO, include_pull_requests=True)
    assert {b.name: b.target_commit for b in refs.branches} == {
        "main": relu.main,
        "v1": relu.v1,
        "pr-source": relu.v09,
    }
    assert {t.name: t.target_commit for t in refs.tags} == {"v0.9.0": relu.v09, "v1.0.0": relu.v1}
    assert [(c.ref, c.target_commit) for c in refs.converts] == [("refs/convert/parquet", relu.v1)]
    assert [(p.ref, p.target_commit) for p in refs.pull_requests] == [("refs/pr/1", relu.v09)]
    assert HfApi().list_repo_refs(REPO, repo_type="kernel").pull_requests is None


def test_refs_moving_while_serving_are_seen(hub, relu, tmp_path):
    api = HfApi()
    assert api.repo_info(REPO, revision="v1").sha == relu.v1
    newer = relu.writer.commit({"README.md": "moved\n"}, branch="v1", message="move v1")
    assert api.repo_info(REPO, revision="v1").sha == newer
    relu.writer.delete_ref("refs/tags/v0.9.0")
    with pytest.raises(RevisionNotFoundError):
        api.repo_info(REPO, revision="v0.9.0")


def test_repo_info_for_model_and_kernel(hub, relu):
    api = HfApi()
    info = api.model_info(REPO, revision="v1.0.0", files_metadata=True)
    assert info.id == REPO and info.sha == relu.v1
    assert {s.rfilename for s in info.siblings} == {
        "README.md",
        "build/torch-universal/relu/__init__.py",
        "build/torch-universal/relu/_ops.py",
        "build/torch28-cxx11-cu128-x86_64-linux/relu/__init__.py",
    }
    assert {s.rfilename: s.size for s in info.siblings}["README.md"] == len("# relu\n")
    main = api.model_info(REPO, files_metadata=True)
    weights = {s.rfilename: s for s in main.siblings}["weights.bin"]
    assert weights.size == len(relu.lfs_data)
    assert weights.lfs.sha256 == hashlib.sha256(relu.lfs_data).hexdigest()
    kernel = api.repo_info(REPO, repo_type="kernel")
    assert type(kernel).__name__ == "KernelInfo"
    assert kernel.id == REPO and kernel.sha == relu.main


def test_list_repo_tree_and_files(hub, relu):
    api = HfApi()
    build = list(
        api.list_repo_tree(REPO, path_in_repo="build", revision="v1.0.0", repo_type="kernel")
    )
    assert [(type(e).__name__, e.path) for e in build] == [
        ("RepoFolder", "build/torch-universal"),
        ("RepoFolder", "build/torch28-cxx11-cu128-x86_64-linux"),
    ]
    deep = list(api.list_repo_tree(REPO, path_in_repo="build/torch-universal", recursive=True))
    assert [e.path for e in deep] == [
        "build/torch-universal/relu",
        "build/torch-universal/relu/__init__.py",
        "build/torch-universal/relu/_ops.py",
    ]
    root = {e.path: e for e in api.list_repo_tree(REPO, expand=True)}
    assert root["weights.bin"].size == len(relu.lfs_data)
    assert root["weights.bin"].lfs.sha256 == hashlib.sha256(relu.lfs_data).hexdigest()
    assert root["big.bin"].size == len(relu.big_data) and root["big.bin"].lfs is None
    assert root["README.md"].last_commit.oid == relu.v09  # unchanged since the first commit
    assert api.list_repo_files(REPO, revision="v0.9.0") == [
        "README.md",
        "build/torch-universal/relu/__init__.py",
    ]
    with pytest.raises(RemoteEntryNotFoundError):
        list(api.list_repo_tree(REPO, path_in_repo="nope"))


def test_list_repo_commits(hub, relu):
    commits = HfApi().list_repo_commits(REPO, revision="v1.0.0")
    assert [c.commit_id for c in commits] == [relu.v1, relu.v09]
    assert [c.title for c in commits] == ["v1.0.0", "initial"]


@pytest.mark.parametrize("redirect", [True, False])
def test_lfs_download_sha256_verified(hub, relu, tmp_path, redirect):
    hub.server.lfs_redirect = redirect
    path = hf_hub_download(REPO, "weights.bin", cache_dir=tmp_path)
    digest = hashlib.sha256(relu.lfs_data).hexdigest()
    assert hashlib.sha256(Path(path).read_bytes()).hexdigest() == digest
    assert Path(path).resolve().name == digest  # the blob is named by X-Linked-Etag
    lfs_gets = [p for m, p in hub.requests if p.startswith("/_lfs/")]
    assert len(lfs_gets) == (1 if redirect else 0)
    meta = huggingface_hub.get_hf_file_metadata(huggingface_hub.hf_hub_url(REPO, "weights.bin"))
    assert meta.etag == digest and meta.size == len(relu.lfs_data) and meta.commit_hash == relu.main
    if redirect:  # a different origin, as the Hub's CDN: the client must not follow the HEAD there
        location = urlparse(meta.location)
        assert location.hostname == "localhost" and location.path.startswith("/_lfs/")


def test_large_plain_file_is_streamed_intact(hub, relu, tmp_path):
    path = hf_hub_download(REPO, "big.bin", cache_dir=tmp_path)
    assert Path(path).read_bytes() == relu.big_data


def test_organization_overview_trusted_flag(hub, relu):
    api = HfApi()
    assert api.get_organization_overview("kernels-test").trustedKernelPublisher is False
    hub.trust("kernels-test")
    assert api.get_organization_overview("kernels-test").trustedKernelPublisher is True
    (hub.root / "other-org").mkdir()
    assert api.get_organization_overview("other-org").trustedKernelPublisher is False
    with pytest.raises(HfHubHTTPError) as err:
        api.get_organization_overview("no-such-org")
    assert err.value.response.status_code == 404


def test_request_log_counts(hub, relu, tmp_path):
    hf_hub_download(REPO, INIT, revision=relu.v1, cache_dir=tmp_path)
    target = f"/{REPO}/resolve/{relu.v1}/{INIT}"
    assert hub.requests == [("HEAD", target), ("GET", target)]
    hf_hub_download(REPO, INIT, revision=relu.v1, cache_dir=tmp_path)  # cached under a sha: no call
    assert len(hub.requests) == 2
    hub.reset_requests()
    assert hub.requests == []


def test_hooks_rewrite_listings_and_bodies(hub, relu, tmp_path):
    evil = {
        "type": "file",
        "oid": "0" * 40,
        "size": 10**15,
        "path": "build/torch-universal/../../evil.py",
    }
    seen = []

    def tree_hook(repo_id, commit, entries):
        seen.append((repo_id, commit))
        return [*entries, evil]

    hub.server.tree_hook = tree_hook
    listed = list(HfApi().list_repo_tree(REPO, path_in_repo="build/torch-universal", revision="v1"))
    assert listed[-1].path == evil["path"] and listed[-1].size == 10**15
    assert seen == [(REPO, relu.v1)]

    def file_hook(repo_id, commit, path, data):
        return data.replace(b"1.0.0", b"6.6.6") if path == INIT else data

    hub.server.file_hook = file_hook
    path = hf_hub_download(REPO, INIT, revision="v1", cache_dir=tmp_path)
    assert read(path) == 'VERSION = "6.6.6"\n'

    hub.server.file_hook = lambda repo_id, commit, path, data: b"\0" * len(data)
    path = hf_hub_download(REPO, "weights.bin", cache_dir=tmp_path / "lfs")
    assert Path(path).read_bytes() == b"\0" * len(relu.lfs_data)


def test_non_bare_repo_is_served(hub, tmp_path):
    from kernels.serve import GitRepoWriter

    w = GitRepoWriter(hub.root / "org" / "worktree", bare=False)
    sha = w.commit({"a.txt": "a\n"})
    assert (hub.root / "org" / "worktree" / ".git").is_dir()
    path = hf_hub_download("org/worktree", "a.txt", cache_dir=tmp_path)
    assert read(path) == "a\n" and snapshot_commit(path) == sha
