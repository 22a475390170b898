"""Issue 28: a signature policy at load time (off / warn / require, per endpoint or publisher).

Kernels are served by `kernels serve` (the `hub` fixture) through the real huggingface_hub
client, signed by the private Sigstore of tests/sigstore_fixture.py. A marker kernel writes a
file when imported, so "nothing was imported" is a file that does not exist. The verdict of a
check is recorded in the cache per endpoint, so a warm load repeats no crypto and no request:
shown by a warm load in a new process where sigstore cannot be imported at all.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from kernels import get_kernel, settings
from kernels.errors import InvalidSpec, SignatureError, UnsafePermissions

from tests.kernel_repos import run_python
from tests.security.conftest import marker_files

REPO = "lab-org/act"


@pytest.fixture
def sigstore(tmp_path, monkeypatch):
    pytest.importorskip("sigstore")
    from tests.sigstore_fixture import TestSigstore

    instance = TestSigstore()
    monkeypatch.setenv(
        "KERNELS_SIGSTORE_TRUSTED_ROOT", str(instance.trusted_root(tmp_path / "root.json"))
    )
    return instance


def _serve(hub, files: dict, repo: str = REPO) -> str:
    hub.trust(repo.split("/")[0])
    return hub.writer(repo).commit(files, branch="v1")


def _signed(sigstore, marker: Path, **kw) -> dict:
    from tests.sigstore_fixture import sign_variant

    return sign_variant(sigstore, marker_files("act", marker), **kw)


def _records() -> list[Path]:
    folder = settings.cache_root() / "v1" / "signatures"
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


def test_default_is_off_and_checks_nothing(hub, tmp_path):
    """Today's behaviour: an unsigned kernel loads, nothing is read or recorded."""
    marker = tmp_path / "ran"
    _serve(hub, marker_files("act", marker))
    assert settings.signature_policy(REPO) == "off"
    assert get_kernel(REPO, version=1).VALUE == 1
    assert marker.exists() and _records() == []


def test_warn_loads_an_unsigned_kernel_and_says_so_once(hub, tmp_path, monkeypatch, caplog):
    """Break: enforce() returning at once under warn (no notice)."""
    marker = tmp_path / "ran"
    _serve(hub, marker_files("act", marker))
    monkeypatch.setenv("KERNELS_SIGNATURE_POLICY", "warn")
    with caplog.at_level(logging.WARNING, logger="kernels"):
        assert get_kernel(REPO, version=1).VALUE == 1
    assert marker.exists()
    warned = [r.message for r in caplog.records if "signature policy: warn" in r.message]
    assert warned == [
        f"kernels: {REPO}: cannot verify kernel integrity, signature not found "
        "(signature policy: warn)"
    ]
    assert len(_records()) == 1  # "unsigned", recorded: later processes do not re-check


def test_require_refuses_an_unsigned_kernel_before_importing_it(hub, tmp_path, monkeypatch):
    """Break: import_tree without the policy check (the kernel ran)."""
    marker = tmp_path / "ran"
    _serve(hub, marker_files("act", marker))
    monkeypatch.setenv("KERNELS_SIGNATURE_POLICY", "require")
    with pytest.raises(SignatureError, match="signature not found") as exc:
        get_kernel(REPO, version=1)
    assert not marker.exists()
    assert "\n" not in exc.value.hint and "KERNELS_SIGNATURE_POLICY=lab-org=warn" in exc.value.hint


def test_require_loads_a_signed_kernel_and_a_warm_load_repeats_nothing(
    hub, tmp_path, monkeypatch, sigstore
):
    """The verdict is recorded: a new process loads with zero requests and without sigstore.
    Break: enforce() ignoring the record (the child, without sigstore, is refused)."""
    marker = tmp_path / "ran"
    _serve(hub, _signed(sigstore, marker))
    monkeypatch.setenv("KERNELS_SIGNATURE_POLICY", "require")
    assert get_kernel(REPO, version=1).VALUE == 1
    assert marker.read_text() == "ran\n"
    assert len(_records()) == 1
    hub.reset_requests()
    out = run_python(
        f"""
        import sys
        sys.modules["sigstore"] = None  # no crypto library: a re-check could not even start
        from kernels import get_kernel
        print(get_kernel({REPO!r}, version=1).VALUE)
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"
    assert hub.requests == []
    assert marker.read_text() == "ran\nran\n"


def test_require_refuses_files_that_differ_from_the_signed_digest(
    hub, tmp_path, monkeypatch, sigstore
):
    """A server that serves the signed metadata with other code, and a bundle from another
    Sigstore: both refused, neither imported. Break: verdict taken as signed whatever it is."""
    from tests.sigstore_fixture import TestSigstore

    marker = tmp_path / "ran"
    files = _signed(sigstore, marker)
    files["build/torch-universal/__init__.py"] += b"VALUE = 666\n"
    _serve(hub, files)
    monkeypatch.setenv("KERNELS_SIGNATURE_POLICY", "require")
    with pytest.raises(SignatureError, match="kernel integrity check failed: File hash mismatch"):
        get_kernel(REPO, version=1)
    _serve(hub, _signed(TestSigstore(), marker), repo="lab-org/other")
    with pytest.raises(SignatureError, match="metadata signature verification failed"):
        get_kernel("lab-org/other", version=1)
    assert not marker.exists()


def test_policy_per_publisher_and_endpoint(hub, tmp_path, monkeypatch):
    """The most specific rule wins: publisher, then endpoint, then the default; the
    environment before the config file. Break: rules read in another order."""
    url = hub.url
    set_env = lambda value: monkeypatch.setenv("KERNELS_SIGNATURE_POLICY", value)  # noqa: E731
    set_env(f"require,lab-org=off,{url}/=warn")
    assert settings.signature_policy(REPO) == "off"
    assert settings.signature_policy("other/x") == "warn"
    assert settings.signature_policy("other/x", "https://elsewhere.example") == "require"
    config = Path(os.environ["KERNELS_CONFIG"])
    config.write_text(
        '[signatures]\npolicy = "warn"\npublishers = { "lab-org" = "require" }\n'
        f'endpoints = {{ "{url}" = "off" }}\n'
    )
    set_env("")
    assert settings.signature_policy(REPO) == "require"
    assert settings.signature_policy("other/x") == "off"
    assert settings.signature_policy("other/x", "https://elsewhere.example") == "warn"
    set_env("lab-org=warn")  # the environment wins at the same level
    assert settings.signature_policy(REPO) == "warn"
    set_env("")
    marker = tmp_path / "ran"
    _serve(hub, marker_files("act", marker))
    with pytest.raises(SignatureError):  # the config's publisher rule, at load time
        get_kernel(REPO, version=1)
    assert not marker.exists()


@pytest.mark.parametrize("value", ["strict", "lab-org=maybe"])
def test_a_policy_that_is_not_off_warn_or_require_is_an_error(monkeypatch, value):
    monkeypatch.setenv("KERNELS_SIGNATURE_POLICY", value)
    with pytest.raises(InvalidSpec, match="not a signature policy"):
        settings.signature_policy(REPO)


def test_a_verdict_others_could_forge_is_never_read(hub, tmp_path, monkeypatch):
    """The records live in a bucket the cache's permission check covers. Break: `signatures`
    left out of the guarded buckets (the forged "signed" verdict let the kernel run)."""
    from kernels import settings as s
    from kernels.cache import Cache, VerdictRecord

    marker = tmp_path / "ran"
    _serve(hub, marker_files("act", marker))
    monkeypatch.setenv("KERNELS_SIGNATURE_POLICY", "require")
    with pytest.raises(SignatureError):
        get_kernel(REPO, version=1)
    (record,) = _records()
    tree, key = record.name[: -len(".json")].rsplit("-", 1)
    cache = Cache(s.cache_root(), endpoint=s.endpoint())
    cache.signatures.put(VerdictRecord(tree, key, "signed", "forged", 0.0))
    record.parent.chmod(0o777)  # as a shared cache would be: anyone could have written it
    with pytest.raises(UnsafePermissions, match="signatures"):
        get_kernel(REPO, version=1)
    assert not marker.exists()


def test_locked_loads_are_checked_too(hub, tmp_path, monkeypatch):
    """Every import of a kernel from an endpoint goes through the check (here a locked load)."""
    from kernels import get_locked_kernel

    marker = tmp_path / "ran"
    _serve(hub, marker_files("act", marker))
    project = tmp_path / "proj"
    project.mkdir()
    (project / "pyproject.toml").write_text('[tool.kernels.dependencies]\n"lab-org/act" = 1\n')
    from kernels.cli.main import main as kernels_main

    assert kernels_main(["lock", str(project)]) == 0
    monkeypatch.setenv("KERNELS_SIGNATURE_POLICY", "require")
    with pytest.raises(SignatureError):
        get_locked_kernel(REPO, lockfile=project / "kernels.lock")
    assert not marker.exists()


def test_a_publisher_can_name_its_own_signers(hub, tmp_path, monkeypatch, sigstore):
    """`[signatures.signers]` accepts a publisher's own CI; the default signers do not.
    Break: signer_policies ignoring the config (the kernel is refused)."""
    marker = tmp_path / "ran"
    own = "lab-org/kernels"
    _serve(hub, _signed(sigstore, marker, repo=own))
    monkeypatch.setenv("KERNELS_SIGNATURE_POLICY", "require")
    with pytest.raises(SignatureError, match="signature verification failed"):
        get_kernel(REPO, version=1)
    config = Path(os.environ["KERNELS_CONFIG"])
    uri = f"https://github.com/{own}/.github/workflows/build.yaml@refs/heads/main"
    config.write_text(f'[signatures.signers]\n"lab-org" = ["{uri}"]\n')
    assert get_kernel(REPO, version=1).VALUE == 1  # a new key: checked again, and signed
    assert marker.exists()
    config.write_text('[signatures.signers]\n"lab-org" = ["https://example.com/ci"]\n')
    from kernels.signatures import signer_policies

    with pytest.raises(InvalidSpec, match="not a GitHub workflow URI"):
        signer_policies("lab-org")
