"""Red team, issue 28 item 4 and the signature policy, variants the fixes did not name.

Found and fixed here:
* KERNELS_SIGNATURE_POLICY (and `[signatures.publishers]`) keys that can never match (a repo
  id, which reads like a per-repo rule; `require;lab-org`; an empty key) were accepted and
  ignored, so `kernels-community/activation=require` left the policy `off` without a word.
  Now InvalidSpec.
* the Sigstore trust root (KERNELS_SIGSTORE_TRUSTED_ROOT) was read whoever could write it. It
  decides whose signatures count, like the config file decides whom to trust, but the config
  file was refused when others could write it and the trust root was not: another user who
  could rewrite it made `require` accept a kernel signed by their own Sigstore. Now the root
  file and every folder above it are held to the config file's rule (UnsafePermissions).

Variants that fail as they should: odd values, a config file reached through a link into a
folder others can write, and `verify_variant` on bytecode under other names, an extra shared
library, a link to /dev/zero, a file that turns into a FIFO or grows between the listing and the
read, and more entries than the bound.
"""

from __future__ import annotations

import os

import pytest
from kernels import get_kernel, settings, verify
from kernels.errors import InvalidSpec, SignatureError, UnsafePermissions
from kernels.verify import VerificationResult, verify_digest, verify_variant

from tests.kernel_repos import metadata
from tests.security.conftest import as_nobody, marker_files, needs_root

REPO = "lab-org/act"
BASE = "build/torch-universal/"


def _serve(hub, files: dict, repo: str = REPO) -> str:
    hub.trust(repo.split("/")[0])
    return hub.writer(repo).commit(files, branch="v1")


@needs_root
def test_a_trust_root_another_user_can_write_is_not_used(hub, shared_dir, tmp_path, monkeypatch):
    """The classic /tmp race: `nobody` creates /tmp/trusted_root.json (0666) before the user
    saves the real root there (the file keeps its owner), then swaps in the root of a Sigstore
    of their own and signs their kernel as kernels-community's CI. Expected: refused."""
    pytest.importorskip("sigstore")
    from tests.sigstore_fixture import TestSigstore, sign_variant

    shared_dir.chmod(0o1777)
    root = shared_dir / "trusted_root.json"

    def precreate() -> None:
        root.touch()
        root.chmod(0o666)

    as_nobody(precreate)
    honest = TestSigstore()
    honest.trusted_root(root)  # the user saves the real root: the file is still nobody's
    monkeypatch.setenv("KERNELS_SIGSTORE_TRUSTED_ROOT", str(root))
    monkeypatch.setenv("KERNELS_SIGNATURE_POLICY", "require")
    attacker = TestSigstore()
    staged = tmp_path / "attacker-root.json"
    attacker.trusted_root(staged)
    data = staged.read_bytes()
    as_nobody(lambda: root.write_bytes(data))
    marker = tmp_path / "evil-ran"
    _serve(hub, sign_variant(attacker, marker_files("act", marker)))
    with pytest.raises((UnsafePermissions, SignatureError)):
        get_kernel(REPO, version=1)
    assert not marker.exists()


@pytest.mark.parametrize("exposed", ["file", "folder"])
def test_a_trust_root_others_can_write_is_refused_with_the_fix(hub, tmp_path, monkeypatch, exposed):
    """The user's own root, group-writable (an old umask) or in a folder anyone can write (not
    sticky): UnsafePermissions naming it, with the chmod that fixes it; nothing recorded, so
    after the chmod the kernel loads. The same for `kernels verify-signature`."""
    pytest.importorskip("sigstore")
    from kernels.cli.main import main as kernels_main

    from tests.sigstore_fixture import TestSigstore, sign_variant

    sigstore = TestSigstore()
    folder = tmp_path / "roots"
    folder.mkdir()
    root = sigstore.trusted_root(folder / "trusted_root.json")
    bad = root if exposed == "file" else folder
    bad.chmod(0o664 if exposed == "file" else 0o777)
    monkeypatch.setenv("KERNELS_SIGSTORE_TRUSTED_ROOT", str(root))
    monkeypatch.setenv("KERNELS_SIGNATURE_POLICY", "require")
    marker = tmp_path / "ran"
    _serve(hub, sign_variant(sigstore, marker_files("act", marker)))
    with pytest.raises(UnsafePermissions) as err:
        get_kernel(REPO, version=1)
    assert str(bad) in err.value.message and "trust root" in err.value.message
    assert f"chmod -R go-w {bad}" in err.value.hint
    assert not marker.exists()
    assert kernels_main(["verify-signature", REPO, "1"]) != 0
    bad.chmod(0o644 if exposed == "file" else 0o755)
    assert get_kernel(REPO, version=1).VALUE == 1
    assert marker.exists()


@pytest.mark.parametrize("value", ["lab-org/act=require", "require;lab-org=off", "=require"])
def test_a_policy_entry_that_can_never_match_is_an_error(hub, tmp_path, monkeypatch, value):
    """Before: accepted, ignored, and the unsigned kernel loaded (the policy stayed off)."""
    marker = tmp_path / "ran"
    _serve(hub, marker_files("act", marker))
    monkeypatch.setenv("KERNELS_SIGNATURE_POLICY", value)
    with pytest.raises(InvalidSpec, match="neither a publisher"):
        get_kernel(REPO, version=1)
    assert not marker.exists()


def test_a_config_publisher_that_can_never_match_is_an_error():
    config = os.environ["KERNELS_CONFIG"]
    with open(config, "w") as f:
        f.write('[signatures.publishers]\n"lab-org/act" = "require"\n')
    with pytest.raises(InvalidSpec, match="neither a publisher"):
        settings.signature_policy(REPO)


@pytest.mark.parametrize("value", ["require;", "lab-org:require", "https://x=on", "="])
def test_odd_policy_values_are_errors(monkeypatch, value):
    monkeypatch.setenv("KERNELS_SIGNATURE_POLICY", value)
    with pytest.raises(InvalidSpec):
        settings.signature_policy(REPO)


def test_spaces_case_and_trailing_slashes_are_read_as_meant(monkeypatch):
    monkeypatch.setenv("KERNELS_SIGNATURE_POLICY", " Require , lab-org = off ")
    # "lab-org = off" splits at the spaces: three entries, the last two not valid
    with pytest.raises(InvalidSpec):
        settings.signature_policy(REPO)
    monkeypatch.setenv("KERNELS_SIGNATURE_POLICY", "REQUIRE,https://hub.example/=Warn")
    assert settings.signature_policy(REPO, "https://hub.example") == "warn"
    assert settings.signature_policy(REPO, "https://other.example") == "require"


def test_a_config_file_linked_from_a_folder_others_can_write_is_refused(tmp_path, monkeypatch):
    """KERNELS_CONFIG is a link to a config in a folder others can write (the link's own
    folder is the user's): refused, naming the folder, before any policy is read."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "config.toml").write_text('[signatures]\npolicy = "off"\n')
    shared.chmod(0o777)
    link = tmp_path / "mine" / "config.toml"
    link.parent.mkdir()
    link.symlink_to(shared / "config.toml")
    monkeypatch.setenv("KERNELS_CONFIG", str(link))
    monkeypatch.setenv("KERNELS_SIGNATURE_POLICY", "")
    try:
        with pytest.raises(UnsafePermissions) as err:
            settings.signature_policy(REPO)
        assert str(shared) in str(err.value)
    finally:
        shared.chmod(0o755)


# -- verify_variant: what may be imported is what was checked ----------------------------------


@pytest.fixture
def signed(tmp_path, monkeypatch):
    """A correctly signed variant folder (private Sigstore), and its trust root in use."""
    pytest.importorskip("sigstore")
    from tests.sigstore_fixture import TestSigstore, sign_variant

    sigstore = TestSigstore()
    monkeypatch.setenv(
        "KERNELS_SIGSTORE_TRUSTED_ROOT", str(sigstore.trusted_root(tmp_path / "root.json"))
    )
    files = sign_variant(
        sigstore,
        {f"{BASE}metadata.json": metadata("relu"), f"{BASE}__init__.py": "VALUE = 1\n"},
    )
    folder = tmp_path / "variant"
    for rel, data in files.items():
        path = folder / rel[len(BASE) :]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    assert verify_variant(folder) == VerificationResult.Success()
    return folder


@pytest.mark.parametrize(
    "rel",
    [
        "__pycache__/__init__.cpython-311.opt-1.pyc",
        "__pycache__/__init__.cpython-312.pyc",
        "__pycache__/helper.txt",
        "helper.pyc",
        "sub/__pycache__/x.cpython-311.pyc",
        "helper.PYC",
        "_ops.cpython-311-x86_64-linux-gnu.so",
        "_ops.abi3.so",
        "sub/__init__.py",
        ".hidden.py",
    ],
)
def test_anything_added_to_a_signed_variant_fails(signed, rel):
    path = signed / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x00" * 16)
    result = verify_variant(signed)
    assert isinstance(result, VerificationResult.DigestVerificationFailure), result
    assert any(v.path == rel for v in result.violations), result


def test_a_link_to_dev_zero_is_not_read(signed):
    (signed / "__init__.py").unlink()
    (signed / "__init__.py").symlink_to("/dev/zero")
    result = verify_variant(signed)
    assert isinstance(result, VerificationResult.DigestVerificationFailure)
    assert ("link", "__init__.py") in [(v.kind, v.path) for v in result.violations]


def _swap_before_open(monkeypatch, name: str, swap) -> None:
    """Run `swap` after the walk listed the folder and before it opens `name`."""
    real = verify._Folder.open_file

    def open_file(self, entry: str) -> int:
        if entry == name:
            swap()
        return real(self, entry)

    monkeypatch.setattr(verify._Folder, "open_file", open_file)


def test_a_file_that_becomes_a_fifo_after_the_listing_is_not_waited_on(signed, monkeypatch):
    init = signed / "__init__.py"

    def swap() -> None:
        init.unlink()
        os.mkfifo(init)

    _swap_before_open(monkeypatch, "__init__.py", swap)
    result = verify_digest(signed)  # returns at once: opened non-blocking, refused by fstat
    assert ("special", "__init__.py") in [(v.kind, v.path) for v in result.violations]


def test_a_file_that_grows_after_the_listing_is_hashed_as_read(signed, monkeypatch):
    init = signed / "__init__.py"
    _swap_before_open(monkeypatch, "__init__.py", lambda: init.write_text("VALUE = 666\n"))
    result = verify_variant(signed)
    assert ("mismatch", "__init__.py") in [(v.kind, v.path) for v in result.violations]


def test_more_entries_than_the_bound_is_a_failure(signed, monkeypatch):
    monkeypatch.setattr(verify, "MAX_ENTRIES", 50)
    for i in range(60):
        (signed / f"f{i}.txt").write_text("x")
    result = verify_digest(signed)
    assert isinstance(result, VerificationResult.DigestVerificationFailure)
    assert any(v.kind == "limit" for v in result.violations)
