"""Issue 28 item 4: `kernels.verify` says Success only for what it checked.

Each test builds a variant folder the way an attacker who can write it (or serve it) would, and
checks that verify_digest / verify_variant do not call it verified: unsigned bytecode that a
plain import runs, a metadata.json swapped between the signature check and the digest check,
links (a loop through `.`, a file outside), special files, and a folder past the walk's bounds.
Signatures come from the private Sigstore of tests/sigstore_fixture.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import py_compile
import sys
import uuid
from pathlib import Path

import pytest
from kernels import verify
from kernels.verify import VerificationResult, verify_digest, verify_variant

from tests.kernel_repos import metadata, run_python

BASE = "build/torch-universal/"


def _write(folder: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return folder


def _signed_folder(tmp_path: Path, sigstore, files: dict[str, str]) -> Path:
    from tests.sigstore_fixture import sign_variant

    signed = sign_variant(
        sigstore,
        {f"{BASE}metadata.json": metadata("relu")} | {BASE + p: d for p, d in files.items()},
    )
    return _write(tmp_path / "variant", {p[len(BASE) :]: d for p, d in signed.items()})


@pytest.fixture
def sigstore(tmp_path, monkeypatch):
    pytest.importorskip("sigstore")
    from tests.sigstore_fixture import TestSigstore

    instance = TestSigstore()
    monkeypatch.setenv(
        "KERNELS_SIGSTORE_TRUSTED_ROOT", str(instance.trusted_root(tmp_path / "root.json"))
    )
    return instance


def _kinds(result) -> list[tuple[str, str]]:
    assert isinstance(result, VerificationResult.DigestVerificationFailure), result
    return [(v.kind, v.path) for v in result.violations]


def test_unsigned_bytecode_that_an_import_runs_is_not_verified(tmp_path, sigstore):
    """Break: the walk before the fix (it skipped __pycache__ and .pyc): Success."""
    marker = tmp_path / "ran"
    folder = _signed_folder(tmp_path, sigstore, {"__init__.py": "VALUE = 1\n"})
    assert verify_variant(folder) == VerificationResult.Success()
    # The attacker's bytecode: an unchecked-hash .pyc, which Python runs without its source.
    evil = tmp_path / "evil.py"
    evil.write_text(f"open({str(marker)!r}, 'a').write('ran')\nVALUE = 666\n")
    init = folder / "__init__.py"
    py_compile.compile(
        str(evil),
        cfile=importlib.util.cache_from_source(str(init)),
        invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
    )
    # A plain import of the folder (what the reference's loader does) runs it.
    name = f"victim_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(name, init)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(name, None)
    assert module.VALUE == 666 and marker.read_text() == "ran"
    # ... so a verification that says Success would vouch for code it never read.
    pyc = Path(importlib.util.cache_from_source(str(init))).relative_to(folder).as_posix()
    assert _kinds(verify_variant(folder)) == [("bytecode", pyc)]
    assert _kinds(verify_digest(folder)) == [("bytecode", pyc)]
    # A sourceless module beside the package is importable too.
    (folder / "sneaky.pyc").write_bytes(b"\0")
    assert ("bytecode", "sneaky.pyc") in _kinds(verify_digest(folder))


def test_metadata_swapped_after_its_signature_check_is_not_used(tmp_path, sigstore, monkeypatch):
    """The digest comes from the bytes whose signature was checked. Break: the code before the
    fix (it re-read metadata.json for the digest): Success for the attacker's files."""
    from sigstore.verify import Verifier

    folder = _signed_folder(tmp_path, sigstore, {"__init__.py": "VALUE = 1\n"})
    # The attacker's files, and a metadata.json whose (unsigned) digest matches them.
    (folder / "__init__.py").write_text("VALUE = 666\n")
    forged = json.loads((folder / "metadata.json").read_bytes())
    forged["digest"] = verify_digest_of(folder, "__init__.py")
    real = Verifier.verify_artifact

    def then_swap(self, data, bundle, policy):
        result = real(self, data, bundle, policy)  # the honest bytes: a valid signature
        (folder / "metadata.json").write_text(json.dumps(forged))  # the race, won
        return result

    monkeypatch.setattr(Verifier, "verify_artifact", then_swap)
    result = verify_variant(folder)
    assert _kinds(result) == [("mismatch", "__init__.py")]


def verify_digest_of(folder: Path, *paths: str) -> dict:
    import base64
    import hashlib

    return {
        "algorithm": "sha256",
        "files": {
            p: base64.b64encode(hashlib.sha256((folder / p).read_bytes()).digest()).decode()
            for p in paths
        },
    }


def _digest_folder(tmp_path: Path, files: dict[str, bytes]) -> Path:
    """An unsigned folder whose metadata.json declares the digest of `files`."""
    folder = _write(tmp_path / "variant", files)
    meta = json.loads(metadata("relu"))
    meta["digest"] = verify_digest_of(folder, *files)
    (folder / "metadata.json").write_text(json.dumps(meta))
    return folder


def _verify_in_child(folder: Path, timeout: float = 30) -> str:
    """verify_digest(folder) in a fresh interpreter; its result's repr (a hang fails the test)."""
    import subprocess

    try:
        out = run_python(
            f"from kernels.verify import verify_digest\nprint(repr(verify_digest({str(folder)!r})))",
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"verify_digest did not return within {timeout} s")
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_two_links_to_the_folder_itself_end_the_walk(tmp_path):
    """Break: the walk before the fix (os.walk following links): no answer within 30 s."""
    folder = _digest_folder(tmp_path, {"__init__.py": b"VALUE = 1\n"})
    os.symlink(".", folder / "a")
    os.symlink(".", folder / "b")
    out = _verify_in_child(folder)
    assert "kind='link', path='a'" in out and "kind='link', path='b'" in out


def test_a_link_to_a_file_with_the_signed_bytes_is_not_followed(tmp_path):
    """A link whose target has the right bytes today can point elsewhere tomorrow, and the
    import follows it then. Break: the code before the fix (it followed it): Success."""
    folder = _digest_folder(tmp_path, {"__init__.py": b"VALUE = 1\n", "_impl.py": b"X = 1\n"})
    outside = tmp_path / "outside.py"
    outside.write_bytes(b"X = 1\n")
    (folder / "_impl.py").unlink()
    os.symlink(outside, folder / "_impl.py")
    assert _kinds(verify_digest(folder)) == [("link", "_impl.py")]
    os.symlink(tmp_path, folder / "up")  # a folder link: not entered either
    assert ("link", "up") in _kinds(verify_digest(folder))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_special_files_are_refused_without_being_opened(tmp_path):
    """A FIFO named like a module is importable (the import blocks until someone writes code
    into it). Break: the code before the fix skipped it (Success) and blocked forever on a
    FIFO named metadata.json."""
    folder = _digest_folder(tmp_path, {"__init__.py": b"VALUE = 1\n"})
    os.mkfifo(folder / "evil.py")
    assert "kind='special', path='evil.py'" in _verify_in_child(folder)
    os.unlink(folder / "evil.py")
    os.unlink(folder / "metadata.json")
    os.mkfifo(folder / "metadata.json")
    assert "MetadataInvalid" in _verify_in_child(folder)


def test_the_walk_is_bounded(tmp_path, monkeypatch):
    """Break: the bounds removed (both folders verify as Success)."""
    deep = _digest_folder(tmp_path / "a", {"__init__.py": b"VALUE = 1\n"})
    nested = deep
    for _ in range(verify.MAX_DEPTH + 2):
        nested = nested / "d"
    nested.mkdir(parents=True)
    result = _kinds(verify_digest(deep))
    assert [k for k, _ in result] == ["limit"], result

    wide = _digest_folder(tmp_path / "b", {f"m{i}.py": b"" for i in range(12)})
    monkeypatch.setattr(verify, "MAX_ENTRIES", 10)
    assert [k for k, _ in _kinds(verify_digest(wide))] == ["limit"]
    monkeypatch.setattr(verify, "MAX_ENTRIES", 20)
    monkeypatch.setattr(verify, "MAX_BYTES", 4)
    (wide / "m0.py").write_bytes(b"12345")
    assert "limit" in [k for k, _ in _kinds(verify_digest(wide))]
