"""The reference's command line as scripts and its own tests call it (issue 28).

`kernels download PROJECT_DIR [--all-variants]` and `kernels verify-signature REPO_ID VERSION
[--all-variants] [--filter-unsigned] [--filter-no-digest]`, with the reference's arguments and
exit codes (0 ok, 1 failure, 2 usage), against `kernels serve` through the real
huggingface_hub client. The reference's own tests are ported: `tests/test_kernel_locking.py`
(`download_kernels(args)` from `kernels.cli`, then `load_kernel` from the lock) and
`tests/test_verify.py` (`verify_variant` on installed variants: signed, a bad digest, invalid or
missing metadata, no digest, no or a broken or an invalid signature), with kernels signed by the
private Sigstore of tests/sigstore_fixture.py instead of the Hub's `kernels-test/signatures`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from kernels.cli.main import main as kernels_main

from tests.kernel_repos import kernel_files, metadata

# -- kernels download (reference: tests/test_kernel_locking.py) --------------------------------


@dataclass
class DownloadArgs:  # the reference test's own stand-in for argparse's namespace
    all_variants: bool
    project_dir: Path


@pytest.fixture
def locked_project(hub, tmp_path) -> Path:
    """kernel_locking/: a kernels.lock in the reference's format pinning two kernels."""
    hub.trust("kernels-test")
    relu = hub.writer("kernels-test/relu").commit(
        kernel_files(value=1) | kernel_files(value=1, variant="torch-cpu", backend="cpu"),
        branch="v1",
    )
    versions = hub.writer("kernels-test/versions").commit(
        kernel_files(name="versions", value=2), branch="v2"
    )
    project = tmp_path / "kernel_locking"
    project.mkdir()
    (project / "pyproject.toml").write_text(
        '[tool.kernels.dependencies]\n"kernels-test/relu" = 1\n"kernels-test/versions" = 2\n'
    )
    concat = {"hash": "sha256-" + "0" * 64, "hash_type": "git_lfs_concat"}
    lock = [
        {"repo_id": "kernels-test/relu", "sha": relu, "variants": {"torch-cpu": concat}},
        {"repo_id": "kernels-test/versions", "sha": versions, "variants": {}},
    ]
    (project / "kernels.lock").write_text(json.dumps(lock, indent=2))
    return project


def _installed(repo: str) -> list[str]:
    from kernels import settings
    from kernels.cache import Cache

    cache = Cache(settings.cache_root(), endpoint=settings.endpoint())
    return sorted(v for r, _c, v, _t in cache.index.entries() if r == repo)


def test_download_all_hash_validation(locked_project):
    from kernels.cli import download_kernels

    download_kernels(DownloadArgs(all_variants=True, project_dir=locked_project))
    assert _installed("kernels-test/relu") == ["torch-cpu", "torch-universal"]
    assert _installed("kernels-test/versions") == ["torch-universal"]


def test_load_locked(locked_project, hub):
    from kernels import load_kernel
    from kernels.cli import download_kernels

    download_kernels(DownloadArgs(all_variants=False, project_dir=locked_project))
    hub.reset_requests()
    module = load_kernel("kernels-test/relu", lockfile=locked_project / "kernels.lock")
    assert module.VALUE == 1
    assert hub.requests == []  # the lock pins the commit, the download cached the files


def test_download_command_output_json_and_exit_codes(locked_project, hub, capsys):
    assert kernels_main(["download", str(locked_project)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("downloaded kernels-test/relu@") and "(torch-cpu)" in out[0]
    assert "commit pinned only (a reference-0.16 lock has no file digests)" in out[0]
    assert out[-1] == f"2 kernels from {locked_project / 'kernels.lock'}"

    assert kernels_main(["download", str(locked_project), "--all-variants", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert sorted(report) == ["failed", "kernels", "lockfile"]
    assert report["kernels"][0]["variants"] == ["torch-cpu", "torch-universal"]

    # This package's own lock format verifies every file against the lock.
    assert kernels_main(["lock", str(locked_project)]) == 0
    capsys.readouterr()
    assert kernels_main(["download", str(locked_project)]) == 0
    assert "verified against the lock" in capsys.readouterr().out


def test_download_without_a_lock_fails_as_the_reference(tmp_path, capsys):
    from kernels.cli import download_kernels

    assert kernels_main(["download", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"No kernels.lock file found in: {tmp_path}" in err and "hint: run `kernels lock" in err
    with pytest.raises(SystemExit) as exc:
        download_kernels(DownloadArgs(all_variants=False, project_dir=tmp_path))
    assert exc.value.code == 1
    assert _exit_code(["download"]) == 2  # PROJECT_DIR is required, as in the reference


def _exit_code(argv: list[str]) -> int:
    """main()'s status; argparse's usage errors leave through SystemExit."""
    try:
        return kernels_main(argv)
    except SystemExit as exc:
        return int(exc.code)


def test_download_goes_on_past_a_missing_kernel_and_exits_1(locked_project, capsys):
    lock = json.loads((locked_project / "kernels.lock").read_text())
    lock.insert(0, {"repo_id": "kernels-test/gone", "sha": "a" * 40, "variants": {}})
    (locked_project / "kernels.lock").write_text(json.dumps(lock))
    assert kernels_main(["download", str(locked_project)]) == 1
    out = capsys.readouterr()
    assert "error: kernels-test/gone" in out.err
    assert "2 of 3 kernels" in out.out  # the two after it were still downloaded
    assert _installed("kernels-test/versions") == ["torch-universal"]


# -- kernels verify-signature (reference: kernels/cli/verify_signature.py, its CI workflow) -----


@pytest.fixture
def sigstore(tmp_path, monkeypatch):
    pytest.importorskip("sigstore")
    from tests.sigstore_fixture import TestSigstore

    instance = TestSigstore()
    monkeypatch.setenv(
        "KERNELS_SIGSTORE_TRUSTED_ROOT", str(instance.trusted_root(tmp_path / "root.json"))
    )
    return instance


def _signed(sigstore, variant: str = "torch-cpu", backend: str = "cpu", **kw) -> dict:
    from tests.sigstore_fixture import sign_variant

    files = kernel_files(value=1, variant=variant, backend=backend)
    return sign_variant(sigstore, files, variant, **kw)


def test_verify_signature_of_a_signed_kernel(hub, sigstore, capsys):
    # kernels-community's CI signs its builds (the reference's default policy); no trust needed.
    commit = hub.writer("kernels-community/relu").commit(_signed(sigstore), branch="v1")
    assert kernels_main(["verify-signature", "kernels-community/relu", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"OK kernels-community/relu@{commit[:12]}/torch-cpu: kernel metadata is correctly signed",
        "1 of 1 variants correctly signed",
    ]
    # Verifying trusted nobody: loading still needs a trust decision.
    from kernels import get_kernel
    from kernels.errors import UntrustedPublisher

    with pytest.raises(UntrustedPublisher):
        get_kernel("kernels-community/relu", version=1)


def test_verify_signature_filters_and_exit_codes(hub, sigstore, capsys):
    unsigned = kernel_files(value=1)  # torch-universal: no signature at all
    no_digest = kernel_files(value=1, variant="torch-cpu", backend="cpu")
    meta = no_digest["build/torch-cpu/metadata.json"].encode()
    no_digest["build/torch-cpu/metadata.json.sigstore"] = sigstore.sign(meta)
    hub.writer("kernels-community/mixed").commit(unsigned | no_digest, branch="v1")
    repo = ["verify-signature", "kernels-community/mixed", "1", "--all-variants"]

    assert kernels_main(repo) == 1
    out = capsys.readouterr()
    assert "FAILED kernels-community/mixed@" in out.out
    assert "torch-universal: cannot verify kernel integrity, signature not found" in out.out
    assert "torch-cpu: cannot verify kernel integrity, metadata does not have a digest" in out.out
    assert "error: 2 of 2 variants of kernels-community/mixed v1 failed" in out.err
    assert "--filter-unsigned" in out.err  # the hint
    assert kernels_main([*repo, "--filter-unsigned"]) == 1
    capsys.readouterr()
    assert kernels_main([*repo, "--filter-unsigned", "--filter-no-digest"]) == 0
    out = capsys.readouterr().out
    assert (
        "SKIPPED" in out and out.splitlines()[-1] == "0 of 2 variants correctly signed, 2 skipped"
    )


def test_verify_signature_reports_each_violation(hub, sigstore, capsys):
    files = _signed(sigstore)
    files["build/torch-cpu/__init__.py"] = b"VALUE = 666\n"  # served after signing
    files["build/torch-cpu/extra.py"] = b"X = 1\n"
    hub.writer("kernels-community/relu").commit(files, branch="v1")
    assert kernels_main(["verify-signature", "kernels-community/relu", "1"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("torch-cpu: kernel integrity check failed")
    assert out[1].startswith("  File hash mismatch for __init__.py: expected: ")
    assert out[2] == "  Unknown file: extra.py"

    assert kernels_main(["verify-signature", "kernels-community/relu", "1", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert sorted(report) == ["commit", "repo_id", "variants", "version"]
    (row,) = report["variants"]
    assert row["result"] == "DigestVerificationFailure" and not row["ok"]
    assert row["details"][1] == "Unknown file: extra.py"


def test_verify_signature_usage_errors(capsys):
    assert _exit_code(["verify-signature", "kernels-community/relu", "v1"]) == 2
    assert _exit_code(["verify-signature", "kernels-community/relu"]) == 2
    assert _exit_code(["verify-signature", "not a repo", "1"]) == 2
    assert "give the repo and the version number" in capsys.readouterr().err


def test_reference_verify_signature_function(hub, sigstore):
    from kernels.cli.verify_signature import verify_signature

    @dataclass
    class Args:
        repo_id: str
        version: int
        all_variants: bool = False
        filter_unsigned: bool = False
        filter_no_digest: bool = False

    hub.writer("kernels-community/relu").commit(_signed(sigstore), branch="v1")
    assert verify_signature(Args("kernels-community/relu", 1)) is None
    hub.writer("kernels-community/plain").commit(
        kernel_files(value=1, variant="torch-cpu", backend="cpu"), branch="v1"
    )
    with pytest.raises(SystemExit) as exc:
        verify_signature(Args("kernels-community/plain", 1))
    assert exc.value.code == 1
    assert verify_signature(Args("kernels-community/plain", 1, filter_unsigned=True)) is None


# -- verify_variant on installed kernels (reference: tests/test_verify.py) ----------------------

CASES = {
    # branch of kernels-test/signatures -> the reference's expected result type
    "main": "Success",
    "invalid-digest": "DigestVerificationFailure",
    "missing-digest": "DigestMissing",
    "signature-missing": "SignatureBundleMissing",
    "signature-broken": "SignatureBundleInvalid",
    "signature-invalid": "SignatureVerificationFailure",
}


def _case_files(sigstore, case: str) -> dict:
    from tests.sigstore_fixture import TestSigstore

    files = _signed(sigstore)
    base = "build/torch-cpu/"
    if case == "invalid-digest":
        files[f"{base}_impl.py"] = b"def relu(x):\n    return x\n"
    elif case == "missing-digest":
        meta = metadata("relu", backend="cpu").encode()
        files[f"{base}metadata.json"] = meta
        files[f"{base}metadata.json.sigstore"] = sigstore.sign(meta).encode()
    elif case == "signature-missing":
        del files[f"{base}metadata.json.sigstore"]
    elif case == "signature-broken":
        files[f"{base}metadata.json.sigstore"] = b'{"mediaType": "nope"}'
    elif case == "signature-invalid":  # a bundle another Sigstore made
        files[f"{base}metadata.json.sigstore"] = (
            TestSigstore().sign(files[f"{base}metadata.json"]).encode()
        )
    return files


@pytest.mark.parametrize("case", sorted(CASES))
def test_verify_variant_of_installed_kernels(hub, sigstore, case):
    from kernels import install_kernel
    from kernels.verify import VerificationResult, verify_variant

    hub.trust("kernels-test")
    hub.writer("kernels-test/signatures").commit(_case_files(sigstore, case), branch=case)
    variant_path = install_kernel("kernels-test/signatures", revision=case)
    result = verify_variant(variant_path)
    assert type(result).__name__ == CASES[case], result
    if case == "invalid-digest":
        (violation,) = result.violations
        assert violation.kind == "mismatch" and violation.path == "_impl.py"
    if case == "main":  # a custom policy (the reference test's Identity policy) also works
        from sigstore.verify import policy

        from tests.sigstore_fixture import GITHUB_ISSUER

        identity = policy.Identity(
            identity="https://github.com/huggingface/kernels-community/.github/workflows/"
            "build.yaml@refs/heads/main",
            issuer=GITHUB_ISSUER,
        )
        assert verify_variant(variant_path, policies=[identity]) == VerificationResult.Success()


def test_verify_variant_of_invalid_or_missing_metadata(tmp_path, sigstore):
    """The reference installs these and then verifies; this package's install refuses a variant
    whose metadata.json is missing or unparsable, so the folders are made by hand."""
    from kernels.verify import VerificationResult, verify_variant

    folder = tmp_path / "torch-cpu"
    folder.mkdir()
    (folder / "__init__.py").write_text("VALUE = 1\n")
    broken = b'{"name": '
    (folder / "metadata.json").write_bytes(broken)
    (folder / "metadata.json.sigstore").write_text(sigstore.sign(broken))
    result = verify_variant(folder)
    assert isinstance(result, VerificationResult.MetadataInvalid)
    assert "Cannot parse metadata" in result.reason
    (folder / "metadata.json").unlink()
    assert verify_variant(folder) == VerificationResult.MetadataMissing()
