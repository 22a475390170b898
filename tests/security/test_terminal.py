"""Issue 28 item 6 (the terminal): text a server chose never reaches the terminal raw.

A hostile server (tests/security/hostile.py) names a file `ESC[2K CR "OK: verified" RLO .py`:
erase the line, go back to its start, print a verdict, reverse what follows. Every command that
prints it (an error naming the file, `kernels verify`'s CORRUPT line, `verify-signature`'s
violations, `info`'s metadata) must show the escapes, not run them; `--json` stays JSON that
round-trips the exact name.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import pytest
from kernels import notices
from kernels.cli.main import main as kernels_main
from kernels.safe_text import safe_lines, safe_text

from tests.kernel_repos import metadata
from tests.security.hostile import KernelRepo, Reply, hostile, simple_kernel

__all__ = ["hostile"]  # the fixture, used by name

EVIL = "\x1b[2K\rOK: verified\u202e.py"
SHOWN = "\\x1b[2K\\x0dOK: verified\\u202e.py"
RAW = ("\x1b", "\r", "\u202e", "\x9b", "\x07")


def _clean(text: str) -> None:
    assert not any(c in text for c in RAW), repr(text)


def test_safe_text_escapes_controls_and_bidi_and_keeps_the_rest():
    assert safe_text("kernels-lab/activation") == "kernels-lab/activation"
    assert safe_text("café 中文 ok") == "café 中文 ok"
    assert safe_text(EVIL) == SHOWN
    # C1 CSI (a one-byte ESC[ on some terminals), DEL, tab, isolates and line separators.
    assert safe_text("\x9b2K\x7f\t\u2066\u2028") == "\\x9b2K\\x7f\\x09\\u2066\\u2028"
    assert safe_lines("one\ntwo\rthree") == ["one", "two\\x0dthree"]


def _evil_repo(hostile) -> KernelRepo:
    files = simple_kernel()
    files[f"build/torch-universal/{EVIL}"] = b"x = 1\n"
    repo = KernelRepo("evil/relu", files)
    repo.install(hostile)
    return repo


def test_an_error_naming_a_server_file_is_escaped(hostile, capsys):
    """Break: report_error printing the message raw (ESC reached stderr)."""
    repo = _evil_repo(hostile)
    # Other bytes than the listing vouched for: the error names the file.
    hostile.route(
        r"/kernels/evil/relu/resolve/[^/]+/build/torch-universal/%1B.*",
        lambda _s, _m: Reply(200, {"X-Repo-Commit": repo.commit}, b"y = 2\n"),
    )
    assert kernels_main(["pull", "evil/relu@main"]) == 1
    err = capsys.readouterr().err
    _clean(err)
    assert SHOWN in err


def test_verify_escapes_corrupt_file_names_and_json_keeps_them(hostile, capsys):
    """Break: the CORRUPT line printing the names raw."""
    _evil_repo(hostile)
    assert kernels_main(["pull", "evil/relu@main"]) == 0
    trees = Path(os.environ["KERNELS_CACHE"]) / "v1" / "trees"
    (target,) = list(trees.glob(f"*/{EVIL}"))
    target.chmod(0o644)
    target.write_bytes(b"changed\n")  # a same-size edit is caught too; any change will do
    capsys.readouterr()
    assert kernels_main(["verify"]) == 1
    out = capsys.readouterr()
    _clean(out.out + out.err)
    assert re.search(rf"CORRUPT evil/relu@\w+/torch-universal: {re.escape(SHOWN)}", out.out)
    assert kernels_main(["verify", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["corrupt"][0]["files"] == [EVIL]  # JSON escapes by itself, exactly


def test_info_escapes_metadata(tmp_path, capsys):
    """A kernel's metadata is its publisher's words. Break: info printing the license raw."""
    folder = tmp_path / "kernel" / "build" / "torch-universal"
    folder.mkdir(parents=True)
    license_ = "\x1b]8;;https://evil.example\x07MIT\x1b]8;;\x07 \u202etxt.exe"
    (folder / "metadata.json").write_text(metadata("relu", license=license_))
    (folder / "__init__.py").write_text("VALUE = 1\n")
    assert kernels_main(["info", str(tmp_path / "kernel")]) == 0
    out = capsys.readouterr().out
    _clean(out)
    assert "\\x1b]8;;https://evil.example\\x07MIT" in out


def test_verify_signature_escapes_the_violations(hostile, tmp_path, monkeypatch, capsys):
    """Break: verify-signature printing each violation raw."""
    pytest.importorskip("sigstore")
    from tests.sigstore_fixture import TestSigstore, sign_variant

    sigstore = TestSigstore()
    monkeypatch.setenv(
        "KERNELS_SIGSTORE_TRUSTED_ROOT", str(sigstore.trusted_root(tmp_path / "root.json"))
    )
    files = sign_variant(sigstore, simple_kernel())
    files[f"build/torch-universal/{EVIL}"] = b"x = 1\n"  # not in the signed digest
    KernelRepo("evil/relu", files).install(hostile)
    assert kernels_main(["verify-signature", "evil/relu", "1"]) == 1
    out = capsys.readouterr()
    _clean(out.out + out.err)
    assert f"Unknown file: {SHOWN}" in out.out


def test_notices_are_escaped(caplog):
    """The loader's notices quote servers too. Break: notice_once logging the message raw."""
    with caplog.at_level(logging.WARNING, logger="kernels"):
        notices.notice_once("t", f"kernels: evil/relu: skipping {EVIL}")
    _clean(caplog.text)
    assert SHOWN in caplog.text
