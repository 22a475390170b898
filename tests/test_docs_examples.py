"""docs/cli.md's examples are real output: this test runs them and compares.

Every fenced block tagged `console` in docs/cli.md is a session: `$ kernels ...` lines are run,
in order, in one scratch folder with an empty cache, against `kernels serve` over a mirror
built from hub_kernels/ (`kernels mirror build`); the lines after each command are its output
(stdout and stderr). Volatile parts are written in a fixed form: the cache root as
`~/.cache/kernels`, the mirror's address as `http://127.0.0.1:8000`. Blocks tagged otherwise are
illustrations and are not run.

When hub_kernels/ or an output format changes, regenerate the examples with
    UPDATE_DOCS=1 .venv/bin/python -m pytest -q tests/test_docs_examples.py
and review the diff.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "cli.md"
BLOCK = re.compile(r"^```console\n(.*?)^```\n", re.S | re.M)
ENDPOINT = "http://127.0.0.1:8000"


def _sessions(text: str) -> list[re.Match]:
    return list(BLOCK.finditer(text))


def _commands(block: str) -> list[str]:
    return [line[2:] for line in block.splitlines() if line.startswith("$ ")]


@pytest.fixture
def docs_env(tmp_path):
    mirror = tmp_path / "mirror"
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "kernels",
            "mirror",
            "build",
            str(ROOT / "hub_kernels"),
            str(mirror),
            "--trust",
            "kernels-lab",
        ],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr
    server = subprocess.Popen(
        [sys.executable, "-m", "kernels", "serve", str(mirror), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    url = server.stdout.readline().strip().rsplit(" ", 1)[-1]
    work = tmp_path / "work"
    (work / "proj").mkdir(parents=True)
    (work / "hub_kernels").symlink_to(ROOT / "hub_kernels")  # for `kernels mirror build`
    (work / "proj" / "pyproject.toml").write_text(
        '[project]\nname = "proj"\nversion = "0"\n\n[tool.kernels.dependencies]\n'
        '"kernels-lab/activation" = 1\n"kernels-lab/training" = 1\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "KERNELS_"))} | {
        "HF_ENDPOINT": url,
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "KERNELS_CACHE": str(tmp_path / "cache"),
        "KERNELS_CONFIG": str(tmp_path / "config.toml"),
        "COLUMNS": "100",
    }
    try:
        yield work, env, url, tmp_path / "cache"
    finally:
        server.terminate()
        server.wait(timeout=10)


def _run(command: str, work: Path, env: dict, url: str, cache: Path) -> str:
    argv = shlex.split(command)
    assert argv[0] == "kernels", command
    out = subprocess.run(
        [sys.executable, "-m", "kernels", *argv[1:]],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    return out.stdout.replace(str(cache), "~/.cache/kernels").replace(url, ENDPOINT)


def test_cli_doc_examples_are_current(docs_env):
    work, env, url, cache = docs_env
    text = DOC.read_text()
    sessions = _sessions(text)
    blocks = []
    for match in sessions:  # in order: later examples use what earlier ones installed
        lines = []
        for command in _commands(match[1]):
            lines.append(f"$ {command}")
            lines.extend(_run(command, work, env, url, cache).rstrip("\n").splitlines())
        blocks.append("\n".join(lines) + "\n")
    new = text
    for match, block in reversed(list(zip(sessions, blocks, strict=True))):
        new = new[: match.start(1)] + block + new[match.end(1) :]
    _check_json_keys(text, work, env, url, cache)
    if new != text and os.environ.get("UPDATE_DOCS"):
        DOC.write_text(new)
        return
    assert _sessions(text), "docs/cli.md has no console examples"
    assert new == text, (
        "docs/cli.md's examples are stale; rerun with UPDATE_DOCS=1 and review the diff"
    )


_TOML = re.compile(r"^```toml\n(.*?)^```\n", re.S | re.M)


def test_the_docs_dependency_tables_lock_against_the_projects_mirror(hub, tmp_path, capsys):
    """A [tool.kernels.dependencies] example in the docs names what the mirror built from
    hub_kernels/ has (e.g. no tag the mirror lacks), so copying it into a project works."""
    from kernels.cli.main import main

    hub.build(ROOT / "hub_kernels")
    tables = [
        (page, m[1])
        for page in sorted((ROOT / "docs").glob("*.md"))
        for m in _TOML.finditer(page.read_text())
        if "[tool.kernels.dependencies]" in m[1]
    ]
    assert tables, "no dependency table in the docs"
    for n, (page, table) in enumerate(tables):
        project = tmp_path / f"docs-project-{n}"
        project.mkdir()
        (project / "pyproject.toml").write_text(table)
        status = main(["lock", str(project)])
        out = capsys.readouterr()
        assert status == 0, (page.name, table, out.err)
        assert (project / "kernels.lock").is_file()


def test_every_script_the_docs_name_exists():
    """Pages name scripts by path; moving one (e.g. into scripts/probes/) must update them.
    Raw outputs in per-run folders (docs/benchmarks/<run>/) keep the command as it was run."""
    pages = [ROOT / "README.md", ROOT / "scripts" / "README.md", *ROOT.glob("docs/*.md")]
    pages += ROOT.glob("docs/benchmarks/*.md")
    missing = []
    for page in pages:
        for path in re.findall(r"\bscripts/[\w/.-]+\.(?:py|sh)\b", page.read_text()):
            if not (ROOT / path).is_file():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, missing


def test_research_probes_live_in_scripts_probes():
    """scripts/ holds tools; one-off research probes go to scripts/probes/ (scripts/README.md)."""
    stray = sorted(p.name for p in (ROOT / "scripts").glob("probe_*.py"))
    assert stray == [], f"move these to scripts/probes/ and update the pages naming them: {stray}"


# One run of each command with --json, after the sessions above filled the cache and wrote proj/.
JSON_RUNS = {
    "pull": "kernels pull kernels-lab/activation@v1 --json",
    "ls": "kernels ls --json",
    "du": "kernels du --json",
    "verify": "kernels verify --json",
    "prune": "kernels prune --dry-run --json",
    "lock": "kernels lock proj --json",
    "sync": "kernels sync proj --json",
    "download": "kernels download proj --json",
    "verify-signature": "kernels verify-signature kernels-lab/activation 1 --filter-unsigned --json",
    "info": "kernels info kernels-lab/training@v1 --json",
    "versions": "kernels versions kernels-lab/activation --json",
    "env": "kernels env --json",
    "export": "kernels export json-export --json",
    "mirror build": "kernels mirror build hub_kernels json-mirror --trust kernels-lab --json",
}


def _documented_keys(text: str) -> dict[str, list[str]]:
    """command -> the top-level keys its row in the `--json` table lists."""
    rows = re.findall(r"^\| `([a-z -]+)` \| `([a-z0-9_, ]+)` \|", text, re.M)
    return {command: [k.strip() for k in keys.split(",")] for command, keys in rows}


def _check_json_keys(text: str, work: Path, env: dict, url: str, cache: Path) -> None:
    documented = _documented_keys(text)
    assert sorted(documented) == sorted(JSON_RUNS), "the --json table lists other commands"
    for command, line in JSON_RUNS.items():
        out = _run(line, work, env, url, cache)
        first = json.loads(out.splitlines()[0])  # pull and ls: one object per line
        assert sorted(first) == sorted(documented[command]), (command, sorted(first))
