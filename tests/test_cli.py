"""The `kernels` command line, through its real entry point, against `kernels serve`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.kernel_repos import kernel_files, run_python

KERNELS = str(Path(sys.executable).parent / "kernels")


def cli(
    *args: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 180
) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [KERNELS, *args], capture_output=True, text=True, env=full_env, cwd=cwd, timeout=timeout
    )


@pytest.fixture
def repos(hub):
    hub.trust("kernels-test")
    w = hub.writer("kernels-test/relu")
    v1 = w.commit(
        kernel_files(value=1) | kernel_files(value=1, variant="torch-cpu", backend="cpu"),
        branch="v1",
    )
    v2 = w.commit(kernel_files(value=2, version=2), branch="v2")
    hub.writer("kernels-test/other").commit(kernel_files(name="other", value=7), branch="v1")
    return {"v1": v1, "v2": v2}


def _no_traceback(out: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in out.stderr, out.stderr


# -- help and usage ------------------------------------------------------------------------

COMMANDS = [
    "pull",
    "lock",
    "sync",
    "download",
    "ls",
    "du",
    "verify",
    "verify-signature",
    "prune",
    "info",
    "versions",
    "env",
    "mirror",
    "serve",
    "export",
]


def test_top_level_help_lists_every_command_and_is_fast():
    start = time.perf_counter()
    out = cli("--help")
    elapsed = time.perf_counter() - start
    assert out.returncode == 0
    for name in COMMANDS:  # a long name has its help on the next line
        assert re.search(rf"^    {re.escape(name)}\s", out.stdout, re.M), name
    assert "Exit codes" in out.stdout
    assert elapsed < 2.0  # measured ~0.07 s; the budget leaves room for a loaded CI machine


@pytest.mark.parametrize(
    "command, needle",
    [
        ("pull", "--all-variants"),
        ("lock", "pyproject.toml"),
        ("sync", "--frozen"),
        ("download", "--all-variants"),
        ("verify-signature", "--filter-no-digest"),
        ("ls", "--json"),
        ("du", "--json"),
        ("verify", "re-hash"),
        ("prune", "--dry-run"),
        ("info", "local kernel folder"),
        ("versions", "org/repo"),
        ("env", "--json"),
        ("mirror", "SRC"),
        ("serve", "--port"),
        ("export", "--repo"),
    ],
)
def test_each_command_help(command, needle):
    out = cli(command, "--help")
    assert out.returncode == 0, out.stderr
    assert f"kernels {command}" in out.stdout and needle in out.stdout


def test_version_and_usage_errors():
    out = cli("--version")
    assert out.returncode == 0 and out.stdout.startswith("kernels 0.18.")
    assert cli("frobnicate").returncode == 2
    assert cli("pull", "--no-such-flag").returncode == 2
    assert cli().returncode == 2


# -- pull ----------------------------------------------------------------------------------


def test_pull_prints_what_it_got(hub, repos):
    out = cli("pull", "kernels-test/relu@v1")
    assert out.returncode == 0, out.stderr
    assert f"kernels-test/relu@{repos['v1'][:12]} (v1) -> torch-cpu" in out.stdout
    assert "verified" in out.stdout
    out = cli("pull", "kernels-test/relu@v1", "--json")
    row = json.loads(out.stdout)
    assert (
        row["commit"] == repos["v1"]
        and row["variant"] == "torch-cpu"
        and Path(row["path"]).is_dir()
    )


def test_pull_default_is_the_newest_version(hub, repos):
    row = json.loads(cli("pull", "kernels-test/relu", "--json").stdout)
    assert row["commit"] == repos["v2"] and row["requested"] == "v2"


def test_pull_variant_and_all_variants(hub, repos):
    row = json.loads(
        cli("pull", "kernels-test/relu@v1", "--variant", "torch-universal", "--json").stdout
    )
    assert row["variant"] == "torch-universal"
    rows = [
        json.loads(line)
        for line in cli(
            "pull", "kernels-test/relu@v1", "--all-variants", "--json"
        ).stdout.splitlines()
    ]
    assert sorted(r["variant"] for r in rows) == ["torch-cpu", "torch-universal"]
    bad = cli("pull", "kernels-test/relu@v1", "--variant", "torch-nope")
    assert bad.returncode == 1 and "torch-nope" in bad.stderr
    _no_traceback(bad)


@pytest.mark.parametrize(
    "spec, error, status",
    [
        ("kernels-test/missing@v1", "not found", 1),
        ("kernels-test/relu@v9", "Version 9 not found", 1),
        ("not a repo", "not a kernel spec", 2),  # a malformed argument is a usage error
        ("kernels-test/relu@main~1", "not a valid revision", 2),
    ],
)
def test_pull_user_errors_are_one_line_and_a_hint(hub, repos, spec, error, status):
    out = cli("pull", spec)
    assert out.returncode == status
    _no_traceback(out)
    lines = out.stderr.strip().splitlines()
    assert lines[0].startswith("error: ") and error in out.stderr
    assert lines[-1].startswith("hint: ")


# The CLI's entry point in a fresh interpreter, saying whether torch was imported.
PULL_AND_SAY_IF_TORCH = """
import sys
from kernels.cli.main import main
code = main({argv!r})
print("RESULT", code, "torch" in sys.modules)
"""


def _pull_in_fresh_process(*argv: str) -> tuple[str, str]:
    out = run_python(PULL_AND_SAY_IF_TORCH.format(argv=["pull", *argv]))
    (result,) = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    return result, out.stderr


def test_a_pull_that_fails_before_choosing_a_variant_does_not_import_torch(hub, repos):
    """torch describes the machine only once a variant is chosen: a repo or version that does
    not exist is answered without its import (2 of the command's 3 s on a CPU machine)."""
    for spec in ("kernels-test/missing@v1", "kernels-test/relu@v9"):
        result, err = _pull_in_fresh_process(spec)
        assert result == "RESULT 1 False", (spec, result, err)
        assert "not found" in err
    # the contrast: a pull that chooses a variant describes the machine with torch
    assert _pull_in_fresh_process("kernels-test/relu@v1")[0] == "RESULT 0 True"


def test_a_backend_this_machine_lacks_is_refused_before_any_request(hub, repos):
    hub.reset_requests()
    out = cli("pull", "kernels-test/missing@v1", "--backend", "rocm")
    assert out.returncode == 2, out.stderr
    assert "Invalid backend 'rocm'" in out.stderr
    assert hub.requests == []


def test_pull_when_the_hub_is_down_is_a_clear_error(hub, repos):
    out = cli("pull", "kernels-test/relu@v1", env={"HF_ENDPOINT": "http://127.0.0.1:9"})
    assert out.returncode == 1
    _no_traceback(out)
    assert "could not reach the Hub" in out.stderr


# -- cache commands ------------------------------------------------------------------------


def test_ls_du_verify(hub, repos):
    cli("pull", "kernels-test/relu@v1", "--all-variants")
    cli("pull", "kernels-test/other@v1")
    ls = cli("ls")
    assert ls.returncode == 0
    assert "kernels-test/relu@" in ls.stdout and "(v1)" in ls.stdout and "torch-cpu" in ls.stdout
    rows = [json.loads(line) for line in cli("ls", "--json").stdout.splitlines()]
    assert len(rows) == 3
    du = json.loads(cli("du", "--json").stdout)
    assert du["variants"] == 3 and du["repos"] == 2
    # identical files across relu's two variants and `other` are stored once
    assert du["objects"] < sum(r["files"] for r in rows)
    ok = cli("verify", "--all")
    assert ok.returncode == 0 and "3 variants verified (full re-hash)" in ok.stdout


def test_verify_catches_a_changed_byte(hub, repos):
    row = json.loads(cli("pull", "kernels-test/relu@v1", "--json").stdout)
    target = Path(row["path"]) / "_impl.py"
    os.chmod(target, 0o644)
    data = bytearray(target.read_bytes())
    data[-2] ^= 1
    target.write_bytes(bytes(data))
    os.utime(target, ns=(0, 0))  # even with the stamp's mtime faked, --all re-hashes
    out = cli("verify", "--all")
    assert (
        out.returncode == 1
        and "CORRUPT kernels-test/relu@" in out.stdout
        and "_impl.py" in out.stdout
    )


def test_prune_keeps_installed_and_locked_and_drops_orphans(hub, repos, tmp_path):
    cli("pull", "kernels-test/relu@v1")
    project = _project(tmp_path, {"kernels-test/other": 1})
    assert cli("lock", str(project)).returncode == 0
    cache = Path(os.environ["KERNELS_CACHE"]) / "v1"
    orphan_tree = cache / "trees" / ("0" * 64)
    orphan_tree.mkdir(parents=True)
    (orphan_tree / "x").write_text("x")
    dry = cli("prune", "--dry-run", "--lockfile", str(project / "kernels.lock"))
    assert dry.returncode == 0 and "would remove 1 trees" in dry.stdout
    assert orphan_tree.exists()
    out = cli("prune", "--lockfile", str(project / "kernels.lock"))
    assert out.returncode == 0 and not orphan_tree.exists()
    # what was installed still loads with zero requests
    hub.reset_requests()
    loaded = run_python(
        "import kernels; print(kernels.get_kernel('kernels-test/relu', version=1).VALUE)"
    )
    assert loaded.stdout.strip() == "1", loaded.stderr
    assert [r for r in hub.requests if "agent-harnesses" not in r[1]] == []


# -- info, versions, env -------------------------------------------------------------------


def test_info_hub_and_local(hub, repos, tmp_path):
    out = cli("info", "kernels-test/relu@v1")
    assert out.returncode == 0, out.stderr
    assert repos["v1"] in out.stdout and "torch-cpu: compatible, preferred" in out.stdout
    local = tmp_path / "k"
    for rel, content in kernel_files(value=3).items():
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        (local / rel).write_text(content)
    data = json.loads(cli("info", str(local), "--json").stdout)
    assert data["metadata"]["name"] == "relu"
    assert data["path"] == str(local.resolve())
    assert data["variants"] == [
        {
            "variant": "torch-universal",
            "compatible": True,
            "preferred": True,
            "reason": None,
            "files_checked": True,
        }
    ]


def test_versions_online_and_offline(hub, repos):
    data = json.loads(cli("versions", "kernels-test/relu", "--json").stdout)
    assert [(v["version"], v["commit"]) for v in data["versions"]] == [
        (1, repos["v1"]),
        (2, repos["v2"]),
    ]
    assert data["versions"][0]["variant"] == "torch-cpu"
    cli("pull", "kernels-test/relu@v1")
    offline = json.loads(
        cli("versions", "kernels-test/relu", "--json", env={"HF_HUB_OFFLINE": "1"}).stdout
    )
    assert [v["version"] for v in offline["versions"]] == [1]
    text = cli("versions", "kernels-test/relu").stdout
    assert "v1" in text and "-> torch-cpu" in text


def test_env(hub, repos):
    cli("pull", "kernels-test/relu@v1")
    data = json.loads(cli("env", "--json").stdout)
    assert data["kernels"].startswith("0.18.")
    assert data["backend"] == "cpu" and data["cache"] == os.environ["KERNELS_CACHE"]
    assert data["endpoint"] == os.environ["HF_ENDPOINT"] and data["offline"] is False
    assert data["cached_kernels"] == [
        {"repo_id": "kernels-test/relu", "ref": "v1", "commit": repos["v1"], "variant": "torch-cpu"}
    ]
    text = cli("env").stdout
    assert "torch:" in text and "cached kernels" in text
    # the config file the trust hint names is shown
    assert data["config"] == os.environ["KERNELS_CONFIG"]


# -- lock and sync -------------------------------------------------------------------------


def _project(tmp_path: Path, deps: dict) -> Path:
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    lines = ["[project]", 'name = "demo"', 'version = "0"', "", "[tool.kernels.dependencies]"]
    lines += [f'"{repo}" = {json.dumps(value)}' for repo, value in deps.items()]
    (project / "pyproject.toml").write_text("\n".join(lines) + "\n")
    return project


def test_lock_records_every_variant_and_sync_verifies(hub, repos, tmp_path):
    project = _project(tmp_path, {"kernels-test/relu": 1, "kernels-test/other": "v1"})
    out = cli("lock", str(project))
    assert out.returncode == 0, out.stderr
    lock = json.loads((project / "kernels.lock").read_text())
    assert lock["schema"] == 1
    relu = next(k for k in lock["kernels"] if k["repo_id"] == "kernels-test/relu")
    assert relu["commit"] == repos["v1"] and relu["requested"] == {"version": 1}
    assert sorted(relu["variants"]) == ["torch-cpu", "torch-universal"]
    assert all(len(s) == 64 for files in relu["variants"].values() for s in files.values())
    other = next(k for k in lock["kernels"] if k["repo_id"] == "kernels-test/other")
    assert other["requested"] == {"revision": "v1"}
    out = cli("sync", "--frozen", str(project))
    assert out.returncode == 0, out.stderr
    assert "2 kernels match" in out.stdout


def test_sync_frozen_refuses_a_stale_lock(hub, repos, tmp_path):
    project = _project(tmp_path, {"kernels-test/relu": 1})
    cli("lock", str(project))
    _project(tmp_path, {"kernels-test/relu": 2})  # pyproject moved on, the lock did not
    out = cli("sync", "--frozen", str(project))
    assert out.returncode == 1
    _no_traceback(out)
    assert "out of date" in out.stderr and "kernels lock" in out.stderr
    _project(tmp_path, {"kernels-test/relu": 1, "kernels-test/other": 1})
    assert cli("sync", "--frozen", str(project)).returncode == 1


def test_sync_refuses_bytes_that_differ_from_the_lock(hub, repos, tmp_path):
    project = _project(tmp_path, {"kernels-test/relu": 1})
    cli("lock", str(project))
    path = project / "kernels.lock"
    lock = json.loads(path.read_text())
    files = lock["kernels"][0]["variants"]["torch-cpu"]
    files["__init__.py"] = "f" * 64
    path.write_text(json.dumps(lock))
    out = cli("sync", str(project))
    assert out.returncode == 1 and "differ from the lock" in out.stderr
    _no_traceback(out)
    code = f"""
        import kernels
        try:
            kernels.get_locked_kernel('kernels-test/relu', lockfile={str(path)!r})
        except kernels.IntegrityError as e:
            print('refused')
    """
    assert run_python(code).stdout.strip() == "refused"


def test_reference_lock_formats(hub, repos, tmp_path):
    ref17 = tmp_path / "ref17.lock"
    ref17.write_text(
        json.dumps(
            [
                {
                    "dependency": {"repo-id": "kernels-test/relu", "version": 1},
                    "lock": {"commit": repos["v1"]},
                }
            ]
        )
    )
    ref16 = tmp_path / "ref16.lock"
    ref16.write_text(
        json.dumps(
            [
                {
                    "repo_id": "kernels-test/relu",
                    "sha": repos["v2"],
                    "variants": {
                        "torch-universal": {"hash": "sha256-x", "hash_type": "git_lfs_concat"}
                    },
                }
            ]
        )
    )
    code = f"""
        import kernels
        a = kernels.get_locked_kernel('kernels-test/relu', lockfile={str(ref17)!r})
        b = kernels.get_locked_kernel('kernels-test/relu', lockfile={str(ref16)!r})
        print(a.VALUE, b.VALUE)
    """
    out = run_python(code)
    assert out.stdout.strip() == "1 2", out.stderr


def test_lockfile_discovery_and_locked_load_without_requests(hub, repos, tmp_path):
    project = _project(tmp_path, {"kernels-test/relu": 1})
    cli("lock", str(project))
    sub = project / "src" / "pkg"
    sub.mkdir(parents=True)
    code = "import kernels; print(kernels.get_locked_kernel('kernels-test/relu').VALUE)"
    subprocess.run(
        [sys.executable, "-c", code], cwd=sub, capture_output=True, text=True, env=dict(os.environ)
    )
    hub.reset_requests()
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=sub, capture_output=True, text=True, env=dict(os.environ)
    )
    assert out.stdout.strip() == "1", out.stderr
    assert [r for r in hub.requests if "agent-harnesses" not in r[1]] == []
    # KERNELS_LOCKFILE wins over the working directory; load_kernel never downloads.
    code = "import kernels; print(kernels.load_kernel('kernels-test/relu').VALUE)"
    out = run_python(code, env={"KERNELS_LOCKFILE": str(project / "kernels.lock")})
    assert out.stdout.strip() == "1", out.stderr
    missing = run_python("import kernels; kernels.get_locked_kernel('kernels-test/relu')")
    assert "LockfileError" in missing.stderr


# -- the air-gapped flow -------------------------------------------------------------------


# `kernels serve` opens its request log to this token (KERNELS_SERVE_TOKEN).
_LOG_TOKEN = {"X-Mirror-Token": "test-cli-log-token"}


def _requests_at(url: str) -> list:
    with urllib.request.urlopen(
        urllib.request.Request(f"{url}/_mirror/requests", headers=_LOG_TOKEN)
    ) as r:
        data = json.loads(r.read())
    return [x for x in data["requests"] if "agent-harnesses" not in x[1]]


def test_pull_export_serve_sync_frozen_then_load_with_zero_requests(hub, repos, tmp_path):
    # On the connected machine: lock, pull what the lock pins, export.
    project = _project(tmp_path, {"kernels-test/relu": 1, "kernels-test/other": 1})
    assert cli("lock", str(project)).returncode == 0
    assert (
        cli(
            "pull", "--locked", "--lockfile", str(project / "kernels.lock"), "--all-variants"
        ).returncode
        == 0
    )
    export = tmp_path / "export"
    out = cli("export", str(export))
    assert out.returncode == 0, out.stderr
    assert "kernels-test" in (export / "kernels-mirror.toml").read_text()
    # On the cluster: serve the export, an empty cache, sync --frozen, then load.
    server = subprocess.Popen(
        [KERNELS, "serve", str(export), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "KERNELS_SERVE_TOKEN": _LOG_TOKEN["X-Mirror-Token"]},
    )
    try:
        url = server.stdout.readline().strip().rsplit(" ", 1)[-1]
        cluster = {
            "HF_ENDPOINT": url,
            "KERNELS_CACHE": str(tmp_path / "cluster-cache"),
            "HF_HOME": str(tmp_path / "cluster-hf"),
        }
        out = cli("sync", "--frozen", str(project), env=cluster)
        assert out.returncode == 0, out.stderr
        assert "2 kernels match" in out.stdout
        _requests_at(url)
        urllib.request.urlopen(
            urllib.request.Request(
                f"{url}/_mirror/requests/reset", method="POST", headers=_LOG_TOKEN
            )
        ).read()
        code = """
            import kernels
            a = kernels.get_locked_kernel('kernels-test/relu')
            b = kernels.get_kernel('kernels-test/other', version=1)
            print(a.VALUE, b.VALUE)
        """
        out = subprocess.run(
            [sys.executable, "-c", __import__("textwrap").dedent(code)],
            cwd=project,
            capture_output=True,
            text=True,
            env={**os.environ, **cluster},
        )
        assert out.stdout.strip() == "1 7", out.stderr
        assert _requests_at(url) == []
    finally:
        server.terminate()
        server.wait(timeout=10)


# -- issue 19: the newcomer's path ----------------------------------------------------------


def test_python_dash_m_kernels_is_the_cli():
    out = subprocess.run(
        [sys.executable, "-m", "kernels", "--version"], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.startswith("kernels 0.18.")


def test_a_mistyped_command_names_the_closest_one():
    out = cli("verfy")
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        "error: 'verfy' is not a kernels command",
        "hint: did you mean `kernels verify`?",
    ]
    assert "run `kernels --help`" in cli("zzzzzz").stderr


def test_help_ends_with_no_repo_relative_path():
    out = cli("--help")
    assert "docs/" not in out.stdout and "kernels COMMAND --help" in out.stdout


@pytest.mark.parametrize(
    "args, hint",
    [
        (["pull", "https://huggingface.co/kernels-test/relu"], "hint: use kernels-test/relu"),
        (
            ["pull", "https://huggingface.co/kernels-test/relu/tree/v2"],
            "hint: use kernels-test/relu@v2",
        ),
        (["info", "kernels-test/relu:ReLU"], "hint: use org/repo or org/repo@"),
        (["pull", "not a repo"], "hint: use org/repo or org/repo@"),
        (["versions", "kernels-test/relu@v1"], "hint: give the repo alone, e.g. org/repo"),
    ],
)
def test_bad_specs_are_usage_errors_with_hints_for_the_command(args, hint):
    out = cli(*args)
    assert out.returncode == 2, out.stderr
    _no_traceback(out)
    lines = out.stderr.strip().splitlines()
    assert lines[0].startswith("error: ") and lines[-1].startswith(hint)
    assert ":Layer" not in lines[-1]


def test_hints_speak_cli_not_python(hub, repos, tmp_path):
    hub.writer("stranger/relu").commit(kernel_files(value=5), branch="v1")
    config = tmp_path / "config.toml"
    out = cli("pull", "stranger/relu@v1", env={"KERNELS_CONFIG": str(config)})
    assert out.returncode == 1
    hint = out.stderr.strip().splitlines()[-1]
    assert "--trust-remote-code" in hint and "trust_remote_code" not in hint
    assert str(config) in hint  # the config file it names is the one this machine reads
    out = cli("pull", "kernels-test/relu@v9")
    assert out.stderr.strip().splitlines()[-1] == "hint: use @v2"
    out = cli("pull", "kernels-test/relu@v1", "--backend", "cuda")
    assert out.returncode == 2
    assert "drop --backend" in out.stderr and "backend=None" not in out.stderr


def test_a_cache_path_that_is_a_file_is_an_error(tmp_path):
    file = tmp_path / "cache"
    file.write_text("x")
    for command in ("ls", "du", "verify"):  # `env` reports it and goes on (test_cli_hints.py)
        out = cli(command, env={"KERNELS_CACHE": str(file)})
        assert out.returncode == 1, (command, out.stdout)
        assert out.stderr.splitlines()[0] == f"error: the cache {file} is a file, not a folder"


def test_quiet_and_verbose(hub, repos):
    quiet = cli("pull", "kernels-test/relu@v1", "-q")
    assert quiet.returncode == 0 and quiet.stdout == ""
    assert cli("ls", "-q").stdout == ""
    verbose = cli("pull", "kernels-test/relu@v1", "-v")
    assert verbose.returncode == 0 and verbose.stdout.startswith("kernels-test/relu@")
    assert f"kernels-test/relu@v1 -> {repos['v1']} (from " in verbose.stderr
    assert "  torch-cpu: compatible, preferred" in verbose.stderr
    assert cli("pull", "-q", "-v", "kernels-test/relu@v1").returncode == 2


def test_json_on_every_command_that_prints_data(hub, repos, tmp_path):
    project = _project(tmp_path, {"kernels-test/relu": 1})
    lock = json.loads(cli("lock", str(project), "--json").stdout)
    assert lock["lockfile"] == str(project / "kernels.lock")
    assert lock["kernels"] == [
        {
            "repo_id": "kernels-test/relu",
            "requested": "v1",
            "commit": repos["v1"],
            "variants": {"torch-cpu": 4, "torch-universal": 4},
        }
    ]
    sync = json.loads(cli("sync", str(project), "--json").stdout)
    assert sync == {
        "lockfile": str(project / "kernels.lock"),
        "stale": [],
        "kernels": [
            {
                "repo_id": "kernels-test/relu",
                "commit": repos["v1"],
                "variants": ["torch-cpu"],
                "verified": True,  # `kernels lock` writes file digests, which sync checks
            }
        ],
    }
    verify = json.loads(cli("verify", "--json").stdout)
    assert verify == {
        "mode": "stamps",
        "checked": 1,
        "corrupt": [],
        "repaired": [],
        "unsafe": None,  # the folder others could write, when there is one
    }
    prune = json.loads(cli("prune", "--dry-run", "--json").stdout)
    assert prune["dry_run"] is True and prune["trees"] == []
    assert sorted(prune) == ["bytes", "dry_run", "objects", "trees"]
    export = json.loads(cli("export", str(tmp_path / "out"), "--json").stdout)
    assert export["variants"] == [
        {"repo_id": "kernels-test/relu", "commit": repos["v1"], "variant": "torch-cpu"}
    ]
    info = json.loads(cli("info", "kernels-test/relu@v1", "--json").stdout)
    assert (info["repo_id"], info["ref"], info["commit"]) == (
        "kernels-test/relu",
        "v1",
        repos["v1"],
    )
    assert info["variants"][0] == {
        "variant": "torch-cpu",
        "compatible": True,
        "preferred": True,
        "reason": None,
        "files_checked": True,
        "files": 4,
        "bytes": info["variants"][0]["bytes"],
    }
    assert info["variants"][1]["files_checked"] is False  # torch-universal is not installed


def test_sync_warns_when_pyproject_moved_on(hub, repos, tmp_path):
    project = _project(tmp_path, {"kernels-test/relu": 1})
    assert cli("lock", str(project)).returncode == 0
    _project(tmp_path, {"kernels-test/relu": 2})
    out = cli("sync", str(project))
    assert out.returncode == 0, out.stderr  # it still installs the lock as written
    assert "warning: " in out.stderr and "asks for v2, the lock has v1" in out.stderr
    assert "run `kernels lock`" in out.stderr
    assert "1 kernel matches" in out.stdout
    _project(tmp_path, {})
    out = cli("sync", str(project))
    assert "kernels-test/relu is in the lock but not in pyproject.toml" in out.stderr


def test_lock_without_a_project_or_a_table_says_what_to_write(tmp_path):
    out = cli("lock", str(tmp_path))
    assert out.returncode == 1 and "no pyproject.toml in" in out.stderr
    assert "run `kernels lock`" not in out.stderr and "[tool.kernels.dependencies]" in out.stderr
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    out = cli("lock", str(tmp_path))
    assert out.returncode == 1 and "has no [tool.kernels.dependencies] table" in out.stderr
    assert not (tmp_path / "kernels.lock").exists()
    (tmp_path / "kernels.lock").write_text('{"schema": 99, "kernels": []}\n')
    out = cli("sync", str(tmp_path))
    assert out.returncode == 1 and "upgrade kernels" in out.stderr
    assert "run `kernels lock`" not in out.stderr


def test_lock_counts_read_as_english(hub, repos, tmp_path):
    hub.writer("kernels-test/one").commit(kernel_files(name="one"), branch="v1")
    project = _project(tmp_path, {"kernels-test/one": 1})
    out = cli("lock", str(project))
    assert "(1 variant, 4 files)" in out.stdout, out.stdout


def test_verify_names_the_repair_and_repair_works(hub, repos, tmp_path):
    row = json.loads(cli("pull", "kernels-test/relu@v1", "--json").stdout)
    target = Path(row["path"]) / "_impl.py"
    os.chmod(target, 0o644)
    target.write_text("broken\n")
    out = cli("verify")
    assert out.returncode == 1
    assert (
        out.stderr.strip().splitlines()[-1]
        == "hint: run `kernels verify --repair` to re-download them"
    )
    export = cli("export", str(tmp_path / "export"))
    assert export.returncode == 1 and "is not intact" in export.stderr
    assert export.stderr.strip().splitlines()[-1].startswith("hint: run `kernels verify --repair`")
    fixed = cli("verify", "--repair")
    assert fixed.returncode == 0, fixed.stderr
    assert "repaired kernels-test/relu@" in fixed.stdout
    assert cli("verify", "--all").returncode == 0


def test_versions_falls_back_to_the_cache_when_the_hub_is_down(hub, repos):
    cli("pull", "kernels-test/relu@v1")
    # The same endpoint goes down: records are per endpoint, another URL has none to fall back on.
    from kernels.serve.faults import FaultPlan

    hub.server.faults = FaultPlan.parse("reset:1")
    try:
        out = cli("versions", "kernels-test/relu", "--json")
    finally:
        hub.server.faults = None
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["source"] == "cache (the Hub is unreachable)"
    assert [v["version"] for v in data["versions"]] == [1]
    assert "warning: " in out.stderr


def test_a_variant_whose_native_library_cannot_load_is_skipped_visibly(hub, repos):
    from tests.test_native_abi import craft_elf

    so, _ = craft_elf(requires=(("libc.so.6", "GLIBC_9.99"),))
    w = hub.writer("kernels-test/native")
    w.commit(
        kernel_files(
            name="native", variant="torch-cpu", backend="cpu", extra={"build/torch-cpu/_ops.so": so}
        )
        | kernel_files(name="native", value=2),
        branch="v1",
    )
    out = cli("pull", "kernels-test/native@v1", "--json")
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)
    assert row["variant"] == "torch-universal"
    assert [s["variant"] for s in row["skipped"]] == ["torch-cpu"]
    assert "GLIBC 9.99" in row["skipped"][0]["reason"]
    assert "skipping torch-cpu" in out.stderr  # the loader's notice
    info = cli("info", "kernels-test/native@v1")
    assert "torch-universal: compatible, preferred" in info.stdout
    assert "torch-cpu: " in info.stdout and "GLIBC 9.99" in info.stdout


def test_every_python_hint_the_cli_can_show_is_rewritten():
    """In-process: each loader hint written for Python callers reads as CLI advice."""
    from kernels.cli.hints import cli_hint
    from kernels.errors import IntegrityError, InvalidSpec, RevisionNotFound, UntrustedPublisher

    cases = {
        UntrustedPublisher("x"): "pass --trust-remote-code, or add the org",
        IntegrityError("x"): "run `kernels verify --repair` to fetch clean copies",
        RevisionNotFound("x", hint="use version=3"): "use @v3",
        InvalidSpec(
            "x", hint="pass backend=None to use the detected backend, or one of: cpu"
        ): "drop --backend to use the detected backend, or one of: cpu",
        InvalidSpec(
            "x", hint="pass version=1 (the branch 'v1') or revision='<branch|tag|commit>'"
        ): "add @v1 (the branch 'v1') or @<branch|tag|commit> to the repo",
    }
    for exc, hint in cases.items():
        assert cli_hint(exc).startswith(hint), (exc, cli_hint(exc))
        assert not any(k in cli_hint(exc) for k in ("=True", "=None", "version=", "revision="))


@pytest.mark.parametrize(
    "text, fix",
    [
        ("https://huggingface.co/kernels-community/activation", "use kernels-community/activation"),
        (
            "huggingface.co/kernels-community/activation/tree/v1",
            "use kernels-community/activation@v1",
        ),
        ("http://127.0.0.1:8000/org/repo/tree/main/build", "use org/repo@main"),
    ],
)
def test_a_pasted_url_names_the_spec_to_write(text, fix):
    """In-process, the Python API too: a Hub page address is not a repo id."""
    import kernels
    from kernels.errors import InvalidSpec
    from kernels.spec import parse_spec

    for call in (lambda: parse_spec(text), lambda: kernels.get_kernel(text, version=1)):
        with pytest.raises(InvalidSpec) as info:
            call()
        assert "is a URL, not a kernel spec" in info.value.message
        assert info.value.hint == fix
