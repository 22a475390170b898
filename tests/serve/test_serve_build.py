"""build_mirror (Hub-layout folders -> git repos) and GitRepoWriter."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from huggingface_hub import HfApi, hf_hub_download
from kernels.errors import InvalidMetadata, InvalidSpec
from kernels.serve import GitRepoWriter, build_mirror


def write_kernel(src: Path, repo_id: str, versions: dict[str, int | None], extra: str = "") -> None:
    """A Hub-layout kernel folder with one build variant per entry of `versions`."""
    repo = src / repo_id
    (repo / "README.md").parent.mkdir(parents=True, exist_ok=True)
    (repo / "README.md").write_text(f"# {repo_id}\n{extra}")
    for variant, version in versions.items():
        pkg = repo / "build" / variant
        (pkg / "__pycache__").mkdir(parents=True, exist_ok=True)
        (pkg / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"junk")
        (pkg / "stale.pyc").write_bytes(b"junk")
        (pkg / "__init__.py").write_text(f"VARIANT = {variant!r}\n")
        meta = {"name": repo_id.split("/")[1], "license": "Apache-2.0", "python-depends": []}
        if version is not None:
            meta["version"] = version
        (pkg / "metadata.json").write_text(json.dumps(meta))


def git(gitdir: Path, *args: str) -> str:
    out = subprocess.run(
        ["git", f"--git-dir={gitdir}", *args], capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_build_mirror_makes_main_and_version_branch(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    write_kernel(src, "org-a/relu", {"torch-universal": 2, "torch-cpu": 2})
    write_kernel(src, "org-b/gelu", {"torch-universal": 1})
    (src / "org-b" / "not-a-kernel").mkdir()  # no build/: skipped
    (src / "kernels-mirror.toml").write_text('trusted_publishers = ["org-a"]\n')
    built = build_mirror(src, dest, trusted_publishers=["org-b"])
    assert [(b.repo_id, b.version, b.changed) for b in built] == [
        ("org-a/relu", 2, True),
        ("org-b/gelu", 1, True),
    ]
    relu = built[0]
    assert relu.path == dest / "org-a" / "relu"
    assert git(relu.path, "rev-parse", "main") == git(relu.path, "rev-parse", "v2") == relu.commit
    files = git(relu.path, "ls-tree", "-r", "--name-only", "main").splitlines()
    assert files == [
        "README.md",
        "build/torch-cpu/__init__.py",
        "build/torch-cpu/metadata.json",
        "build/torch-universal/__init__.py",
        "build/torch-universal/metadata.json",
    ]
    # The builder's list, not SRC's (tests/security/test_hostile_mirror_build.py has the attack).
    config = (dest / "kernels-mirror.toml").read_text()
    assert 'trusted_publishers = ["org-b"]' in config and "org-a" not in config
    assert not (dest / "org-b" / "not-a-kernel").exists()


def test_build_is_deterministic_and_idempotent(tmp_path):
    src = tmp_path / "src"
    write_kernel(src, "org/relu", {"torch-universal": 1})
    first = build_mirror(src, tmp_path / "one")
    again = build_mirror(src, tmp_path / "one")
    elsewhere = build_mirror(src, tmp_path / "two")
    assert first[0].commit == again[0].commit == elsewhere[0].commit
    assert again[0].changed is False
    gitdir = first[0].path
    assert git(gitdir, "rev-list", "--all", "--count") == "1"
    assert git(gitdir, "log", "-1", "--format=%an <%ae> %ad", "--date=unix") == (
        "kernels mirror <mirror@kernels.invalid> 1704067200"
    )


def test_version_bump_keeps_the_old_branch(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    write_kernel(src, "org/relu", {"torch-universal": 1})
    v1 = build_mirror(src, dest)[0].commit
    write_kernel(src, "org/relu", {"torch-universal": 2}, extra="new\n")
    v2 = build_mirror(src, dest)[0]
    gitdir = v2.path
    assert v2.changed and v2.commit != v1
    assert git(gitdir, "rev-parse", "v1") == v1
    assert git(gitdir, "rev-parse", "v2") == git(gitdir, "rev-parse", "main") == v2.commit


@pytest.mark.parametrize(
    ("versions", "message"),
    [
        ({"torch-universal": 1, "torch-cpu": 2}, "disagree on version"),
        ({"torch-universal": None}, 'no integer "version"'),
        ({"torch-universal": True}, 'no integer "version"'),
    ],
)
def test_bad_versions_are_typed_errors_and_write_nothing(tmp_path, versions, message):
    src, dest = tmp_path / "src", tmp_path / "dest"
    write_kernel(src, "org/good", {"torch-universal": 1})
    write_kernel(src, "org/bad", versions)
    with pytest.raises(InvalidMetadata, match=message) as err:
        build_mirror(src, dest)
    assert err.value.hint
    assert not dest.exists()


def test_missing_or_broken_metadata(tmp_path):
    src = tmp_path / "src"
    write_kernel(src, "org/relu", {"torch-universal": 1})
    meta = src / "org/relu/build/torch-universal/metadata.json"
    meta.write_text("{not json")
    with pytest.raises(InvalidMetadata, match="not readable JSON"):
        build_mirror(src, tmp_path / "dest")
    meta.unlink()
    with pytest.raises(InvalidMetadata, match="missing"):
        build_mirror(src, tmp_path / "dest")


def test_src_config_is_never_read(tmp_path):
    src = tmp_path / "src"
    write_kernel(src, "org/relu", {"torch-universal": 1})
    (src / "kernels-mirror.toml").write_text("trusted_publishers = 'org'\n")  # broken, and SRC's
    assert build_mirror(src, tmp_path / "dest")[0].repo_id == "org/relu"
    assert not (tmp_path / "dest" / "kernels-mirror.toml").exists()
    with pytest.raises(InvalidSpec, match="not an org name"):
        build_mirror(src, tmp_path / "dest", trusted_publishers=["org", "a b"])


def test_built_mirror_is_served(hub, tmp_path):
    src = tmp_path / "src"
    write_kernel(src, "org/relu", {"torch-universal": 3})
    built = hub.build(src, trust=["org"])
    api = HfApi()
    branches = {
        b.name: b.target_commit for b in api.list_repo_refs("org/relu", repo_type="kernel").branches
    }
    assert branches == {"main": built[0].commit, "v3": built[0].commit}
    path = hf_hub_download(
        "org/relu",
        "build/torch-universal/__init__.py",
        revision="v3",
        repo_type="kernel",
        cache_dir=tmp_path,
    )
    assert Path(path).read_text() == "VARIANT = 'torch-universal'\n"
    assert api.get_organization_overview("org").trustedKernelPublisher is True


def test_writer_refs_tags_and_lfs(tmp_path):
    w = GitRepoWriter(tmp_path / "org" / "repo")
    first = w.commit({"a.txt": "1"})
    second = w.commit({"b.txt": b"2"}, message="second")
    assert git(w.gitdir, "rev-parse", f"{second}^") == first  # history is linear on the branch
    assert git(w.gitdir, "ls-tree", "--name-only", second) == "b.txt"  # a full snapshot
    other = w.commit({"c.txt": "3"}, branch="other")
    assert git(w.gitdir, "rev-list", "--count", other) == "1"  # a new branch starts a new root
    w.tag("light", first)
    w.tag("annotated", second, message="notes")
    assert git(w.gitdir, "cat-file", "-t", "light") == "commit"
    assert git(w.gitdir, "cat-file", "-t", "annotated") == "tag"
    assert w.head("annotated") == second and w.head("main") == second and w.head("nope") is None
    w.delete_ref("refs/tags/light")
    assert w.head("light") is None
    pointer = w.lfs(b"x" * 2000)
    assert pointer.startswith(b"version https://git-lfs.github.com/spec/v1\noid sha256:")
    with pytest.raises(ValueError):
        w.branch("x", "no-such-ref")
    assert GitRepoWriter(tmp_path / "org" / "repo").head() == second  # reopening keeps the repo


def test_commit_sha_depends_only_on_the_files(tmp_path, monkeypatch):
    # A user's git identity and config must not leak into mirror commits: the sha below was
    # computed once for these two files, and any machine must reproduce it.
    monkeypatch.setenv("GIT_AUTHOR_NAME", "someone else")
    monkeypatch.setenv("GIT_COMMITTER_DATE", "2001-01-01T00:00:00Z")
    home = tmp_path / "home"
    home.mkdir()
    (home / ".gitconfig").write_text("[user]\n  name = x\n[core]\n  autocrlf = true\n")
    monkeypatch.setenv("HOME", str(home))
    variant = tmp_path / "src" / "org" / "k" / "build" / "torch-universal"
    variant.mkdir(parents=True)
    (variant / "metadata.json").write_text('{"version": 1}')
    (variant / "__init__.py").write_text("X = 1\r\n")
    for f in variant.iterdir():
        f.chmod(0o644)
    assert build_mirror(tmp_path / "src", tmp_path / "dest")[0].commit == (
        "6ab0b678cd31205864740708a7f9e1657a988331"
    )
