"""The command line's hints for common mistakes (issue 31): each says what to type or what to
fix, in the place the mistake was made. In process (`kernels.cli.main.main`), against the local
Hub of tests/conftest.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from kernels.cli.main import main

from tests.kernel_repos import kernel_files

REPO = "kernels-test/relu"


@pytest.fixture
def repos(hub):
    hub.trust("kernels-test")
    w = hub.writer(REPO)
    v1 = w.commit(kernel_files(value=1), branch="v1")
    v2 = w.commit(kernel_files(value=2, version=2), branch="v2")
    return {"v1": v1, "v2": v2}


def run(capsys, *argv: str) -> tuple[int, list[str], str]:
    """(exit status, stderr lines, stdout) of `kernels ARGV`."""
    try:
        status = main(list(argv))
    except SystemExit as exc:  # argparse's usage errors
        status = exc.code
    out = capsys.readouterr()
    return status, out.err.strip().splitlines(), out.out


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["pull", REPO, "--lockd"], "hint: did you mean `--locked`?"),
        (["verify", "--reapir"], "hint: did you mean `--repair`?"),
        (["pull", REPO, "--zzz"], "hint: run `kernels pull --help` to see its options"),
    ],
)
def test_a_mistyped_flag_gets_the_closest_real_one(capsys, argv, hint):
    status, err, _ = run(capsys, *argv)
    assert status == 2
    assert err == [f"error: kernels {argv[0]}: unrecognized arguments: {argv[-1]}", hint]


def test_a_number_or_a_short_commit_as_revision_gets_what_was_meant(capsys, repos):
    status, err, _ = run(capsys, "pull", f"{REPO}@2")
    assert status == 1 and err[-1].startswith(f"hint: did you mean `{REPO}@v2`?"), err
    status, err, _ = run(capsys, "pull", f"{REPO}@{repos['v1'][:12]}")
    assert status == 1, err
    assert err[-1] == (
        f"hint: a commit is given in full (40 hex digits): did you mean `{REPO}@{repos['v1']}`?"
    )
    _, err, _ = run(capsys, "pull", f"{REPO}@7")  # no v7: the usual hint
    assert (
        err[-1] == "hint: run `kernels versions org/repo` to see the versions and branches it has"
    )


def test_a_mistyped_repo_gets_the_one_this_machine_loaded(capsys, repos):
    assert run(capsys, "pull", f"{REPO}@v1")[0] == 0
    status, err, _ = run(capsys, "pull", "kernels-test/rleu@v1")
    assert status == 1 and err[-1].startswith("hint: did you mean `kernels-test/relu`?"), err
    _, err, _ = run(capsys, "pull", "kernels-test/zzzzzz@v1")
    assert "did you mean" not in err[-1]


def _project(tmp_path: Path, body: str) -> Path:
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    (project / "pyproject.toml").write_text(body)
    return project


@pytest.mark.parametrize(
    "value, hint",
    [
        ('"1"', f'write "{REPO}" = 1 (a number) for version 1; "1" names a branch or tag'),
        ("7", f'set "{REPO}" = 2 (its versions: 1, 2)'),
        ("1.5", f'write "{REPO}" = 1 for version 1 (a number), or "{REPO}" = "<branch|tag|'),
    ],
    ids=["string-number", "missing-version", "float"],
)
def test_a_pyproject_dependency_mistake_says_what_to_write(capsys, tmp_path, repos, value, hint):
    project = _project(tmp_path, f'[tool.kernels.dependencies]\n"{REPO}" = {value}\n')
    status, err, _ = run(capsys, "lock", str(project))
    assert status == 1, err
    where = f"hint: in {project / 'pyproject.toml'}, [tool.kernels.dependencies]: "
    assert err[-1].startswith(where + hint), err


def test_a_broken_pyproject_says_to_fix_its_syntax(capsys, tmp_path):
    project = _project(tmp_path, f'[tool.kernels.dependencies\n"{REPO}" = 1\n')
    status, err, _ = run(capsys, "lock", str(project))
    assert status == 2 and err[0].startswith(f"error: project file {project}/pyproject.toml")
    assert (
        err[-1]
        == f"hint: fix the TOML syntax of {project}/pyproject.toml at the line and column named above"
    )
    (project / "kernels.lock").write_text('{"schema": 1, "kernels": []}')
    status, err, _ = run(capsys, "sync", str(project))
    assert status == 1
    assert (
        err[-1] == f"hint: fix the TOML syntax of {project}/pyproject.toml at the line named above"
    )


def test_a_cache_under_a_file_is_said_to_be_so(capsys, tmp_path, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("x")
    monkeypatch.setenv("KERNELS_CACHE", str(afile / "sub"))
    status, err, _ = run(capsys, "pull", f"{REPO}@v1")
    assert status == 1
    assert err == [
        f"error: the cache {afile}/sub is under {afile}, which is a file, not a folder",
        "hint: set KERNELS_CACHE to a folder, or a path where one can be made",
    ]
    import kernels

    with pytest.raises(kernels.CacheError, match="which is a file, not a folder"):
        kernels.get_kernel(REPO, version=1)


@pytest.mark.parametrize("sub", ["", "sub"], ids=["file", "under-a-file"])
def test_env_reports_an_unusable_cache_and_goes_on(capsys, tmp_path, monkeypatch, sub):
    afile = tmp_path / "afile"
    afile.write_text("x")
    monkeypatch.setenv("KERNELS_CACHE", str(afile / sub) if sub else str(afile))
    status, err, out = run(capsys, "env", "--json")
    assert status == 0, err
    data = json.loads(out)
    assert "a file, not a folder" in data["cache_error"] and data["cached_kernels"] == []
    assert data["endpoint"] == os.environ["HF_ENDPOINT"]  # the rest is still reported
    status, err, out = run(capsys, "env")
    assert status == 0 and "cache_error: the cache " in out and "cached kernels" in out


def test_versions_that_cannot_be_answered_is_an_error(capsys, monkeypatch, repos):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    status, err, out = run(capsys, "versions", REPO)
    assert status == 1 and out == ""
    assert err == [
        f"error: {REPO}: offline, and this machine has resolved no version of it",
        f"hint: run `kernels versions {REPO}` with the network (unset HF_HUB_OFFLINE)",
    ]
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert run(capsys, "pull", f"{REPO}@v1")[0] == 0
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    status, _, out = run(capsys, "versions", REPO)
    assert status == 0 and out.splitlines()[0] == f"{REPO} (from this machine's cache: offline)"


def test_info_says_a_universal_build_runs_on_any_backend(capsys):
    tree = Path(__file__).resolve().parent.parent / "hub_kernels" / "kernels-lab" / "training"
    status, _, out = run(capsys, "info", str(tree))
    assert status == 0
    assert "backend any (torch-universal; metadata.json says cuda)" in out, out
