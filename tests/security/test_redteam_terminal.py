"""Red team, issue 28 item 6 (the terminal) re-run over every subcommand that prints text a
server chose: a hostile server names a file `ESC[2K CR "OK: verified" RLO .py`, answers errors
with ESC in X-Error-Message, and lists a branch named with ESC; `pull -v`, `info`, `versions`,
`ls`, `env`, `verify`, `lock`, `sync`, `download` and `verify-signature` (and their errors) run
in process against it, and no raw ESC, CR, RLO, BEL or one-byte CSI reaches stdout or stderr.
(`kernels serve -v` is in test_redteam_serve.py; `mirror build` in test_redteam_mirror_build.py.)
All of these fail as they should; the test keeps it so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from kernels.cli.main import main as kernels_main

from tests.kernel_repos import metadata
from tests.security.hostile import KernelRepo, Reply, hostile, json_reply

__all__ = ["hostile"]  # the fixture, used by name

EVIL = "\x1b[2K\rOK: verified\u202e\x9b1m\x07.py"
HEADER_EVIL = "\x1b[2KOK\x9b1m\x07"  # what an HTTP header can carry (latin-1, no CR)
RAW = ("\x1b", "\r", "\u202e", "\x9b", "\x07")


def _clean(text: str, what: str) -> None:
    assert not any(c in text for c in RAW), f"{what}: {text!r}"


def _run(capsys, *args: str) -> int:
    code = kernels_main(list(args))
    out = capsys.readouterr()
    _clean(out.out + out.err, " ".join(args))
    return code


def test_every_subcommand_escapes_what_the_server_chose(hostile, tmp_path, capsys, monkeypatch):
    files = {
        "build/torch-universal/metadata.json": metadata("relu", license=EVIL).encode(),
        "build/torch-universal/__init__.py": b"VALUE = 1\n",
        f"build/torch-universal/{EVIL}": b"x = 1\n",
    }
    repo = KernelRepo("evil/relu", files)
    repo.install(hostile)
    hostile.route(
        r"/api/kernels/evil/relu/refs",
        lambda _s, _m: json_reply(
            {
                "branches": [
                    {"name": "v1", "ref": "refs/heads/v1", "targetCommit": repo.commit},
                    {
                        "name": f"v2{EVIL}",
                        "ref": f"refs/heads/v2{EVIL}",
                        "targetCommit": repo.commit,
                    },
                ],
                "tags": [],
                "converts": [],
            }
        ),
    )
    for code in (404, 403, 500):
        hostile.route(
            rf"/api/kernels/evil/e{code}/.*",
            lambda _s, _m, code=code: Reply(
                code,
                {
                    "X-Error-Code": "RepoNotFound" if code == 404 else "",
                    "X-Error-Message": HEADER_EVIL,
                },
                json.dumps({"error": EVIL}).encode(),
            ),
        )
    monkeypatch.setenv("KERNELS_DOWNLOAD_TIMEOUT", "5")
    assert _run(capsys, "pull", "-v", "evil/relu@v1") == 0
    assert _run(capsys, "info", "evil/relu@v1") == 0
    assert _run(capsys, "versions", "evil/relu") == 0
    assert _run(capsys, "ls") == 0
    assert _run(capsys, "env") == 0
    for code in (404, 403, 500):
        assert _run(capsys, "pull", f"evil/e{code}@v1") == 1
        _run(capsys, "versions", f"evil/e{code}")  # 403/500: the cache's answer, with a warning
        assert _run(capsys, "verify-signature", f"evil/e{code}", "1") == 1
    assert _run(capsys, "verify-signature", "evil/relu", "1") == 1  # unsigned
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text('[tool.kernels.dependencies]\n"evil/relu" = 1\n')
    assert _run(capsys, "lock", str(project)) == 0
    assert _run(capsys, "sync", str(project)) == 0
    assert _run(capsys, "download", str(project)) == 0
    # The evil file changes in the cache: verify's CORRUPT line names it.
    trees = Path(os.environ["KERNELS_CACHE"]) / "v1" / "trees"
    (target,) = list(trees.glob(f"*/{EVIL}"))
    target.chmod(0o644)
    target.write_bytes(b"changed\n")
    assert _run(capsys, "verify") == 1
    # The server now sends other bytes for the evil name: sync and download name it in errors.
    hostile.route(
        r"/kernels/evil/relu/resolve/[^/]+/build/torch-universal/%1B.*",
        lambda _s, _m: Reply(200, {"X-Repo-Commit": repo.commit}, b"y = 2\n"),
    )
    _run(capsys, "verify", "--repair")  # the re-download gets the server's other bytes
    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path / "cache2"))
    assert _run(capsys, "sync", str(project)) == 1
    assert _run(capsys, "download", str(project)) == 1
    assert _run(capsys, "pull", "--all-variants", "evil/relu@v1") == 1


@pytest.mark.parametrize("field", ["name", "license", "python-depends", "kernel-depends"])
def test_hostile_metadata_fields_are_escaped_in_errors_and_info(hostile, capsys, field):
    value: object = EVIL if field in ("name", "license") else [EVIL]
    meta = json.loads(metadata("relu"))
    meta[field] = value
    files = {
        "build/torch-universal/metadata.json": json.dumps(meta).encode(),
        "build/torch-universal/__init__.py": b"VALUE = 1\n",
    }
    KernelRepo("evil/meta", files).install(hostile)
    _run(capsys, "pull", "evil/meta@v1")
    _run(capsys, "info", "evil/meta@v1")
