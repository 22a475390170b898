"""Code written against the reference `kernels` API runs unchanged (issue 18).

Each test uses the reference's documented public API the way its docs and its own tests do,
against `kernels serve` on loopback through the real huggingface_hub client, and checks what the
reference promises: names, return shapes, the exception *types* callers catch, and the message
fragments callers match. Deliberate differences are in docs/compatibility.md.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path

import kernels
import pytest
import torch
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
from kernels import (
    Benchmark,
    FuncRepository,
    KernelNotFound,
    KernelStatusError,
    LayerRepository,
    LoadedKernel,
    LocalLayerRepository,
    Mode,
    RevisionNotFound,
    VariantAccepted,
    get_kernel,
    get_kernel_variants,
    get_loaded_kernels,
    get_local_kernel,
    has_kernel,
    install_kernel,
    kernelize,
)

from tests.kernel_repos import kernel_files, metadata, run_python

# The reference 0.17.2's `kernels.__all__`.
REFERENCE_ALL = [
    "__version__",
    "Benchmark",
    "CUDAProperties",
    "Device",
    "KernelizeFallback",
    "ROCMProperties",
    "FuncRepository",
    "LayerRepository",
    "LoadedKernel",
    "LocalFuncRepository",
    "LocalLayerRepository",
    "LockedFuncRepository",
    "LockedLayerRepository",
    "Metadata",
    "Mode",
    "RepoInfo",
    "VariantAccepted",
    "VariantRejected",
    "get_kernel",
    "get_kernel_dep",
    "get_kernel_variants",
    "get_loaded_kernels",
    "get_local_kernel",
    "get_locked_kernel",
    "has_kernel",
    "install_kernel",
    "kernelize",
    "load_kernel",
    "register_kernel_mapping",
    "replace_kernel_forward_from_hub",
    "use_kernel_forward_from_hub",
    "use_kernel_func_from_hub",
    "use_kernel_mapping",
    "use_kernelized_func",
]

REPO = "kernels-test/versions"


@pytest.fixture
def versions(hub):
    """kernels-test/versions with branches v1, v2 and v10 (VALUE = N) and main; trusted."""
    hub.trust("kernels-test")
    w = hub.writer(REPO)
    # A name of its own: identical bytes elsewhere would be the same (already imported) build.
    commits = {
        n: w.commit(kernel_files(name="v-relu", value=n, version=n), branch=f"v{n}")
        for n in (1, 2, 10)
    }
    commits["main"] = w.commit(kernel_files(name="v-relu", value=99, version=10), branch="main")
    return commits


def _variant_files(**fields) -> dict[str, str]:
    """kernel_files() whose metadata.json has extra `fields` (python-depends, provenance...)."""
    files = kernel_files(name="dep-kernel")
    files["build/torch-universal/metadata.json"] = metadata("dep-kernel", **fields)
    return files


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    return root


def _requests(hub) -> list[tuple[str, str]]:
    return [r for r in hub.requests if "/api/agent-harnesses" not in r[1]]


def test_every_reference_name_is_exported():
    assert set(REFERENCE_ALL) <= set(kernels.__all__)
    for name in REFERENCE_ALL:
        assert getattr(kernels, name) is not None, name


# -- 1. install_kernel's layout -------------------------------------------------------------


def test_install_kernel_returns_build_variant_under_a_repo_root(hub, versions):
    path = install_kernel(REPO, version=1)
    assert (path.parent.name, path.name) == ("build", "torch-universal")
    assert path.parent.parent.name == versions[1]  # <snapshot>/<commit>/build/<variant>
    # Callers hand the repo root to the local loaders, as the reference's docs do.
    root = path.parent.parent
    assert get_local_kernel(root).VALUE == 1
    layer = LocalLayerRepository(root, layer_name="ReLU").load()
    assert issubclass(layer, torch.nn.Module)
    # The files are the verified ones in the cache, not a second copy.
    cache = Path(os.environ["KERNELS_CACHE"]).resolve()
    assert path.resolve().is_relative_to(cache / "v1" / "trees")
    assert install_kernel(REPO, version=1) == path  # stable across calls


# -- 2. a missing version is a ValueError ----------------------------------------------------


def test_missing_version_is_a_value_error_in_the_reference_wording(hub, versions):
    # Numerical order: 2 before 10.
    with pytest.raises(ValueError, match="Version 0 not found, available versions: 1, 2, 10"):
        get_kernel(REPO, version=0)
    with pytest.raises(RevisionNotFound):  # still this package's typed error
        get_kernel(REPO, version=0)
    with pytest.raises(ValueError, match=r"Version 0 not found, available versions: 1, 2.*"):
        LayerRepository(REPO, layer_name="ReLU", version=0).load()


# -- 3. missing repos and revisions are huggingface_hub's errors; LOCAL_KERNELS -------------


def test_missing_repo_and_revision_are_also_huggingface_hub_errors(hub, versions):
    with pytest.raises(RepositoryNotFoundError) as err:
        get_kernel("kernels-test/activation", revision="main")
    assert isinstance(err.value, KernelNotFound) and isinstance(err.value, FileNotFoundError)
    assert err.value.response.status_code in (401, 404)
    with pytest.raises(HfHubHTTPError):
        get_kernel("kernels-test/activation", version=1)
    with pytest.raises(RevisionNotFoundError) as err:
        get_kernel(REPO, revision="no-such-branch")
    assert isinstance(err.value, RevisionNotFound)


def test_local_kernels_maps_repo_ids_to_folders(hub, versions, tmp_path, monkeypatch):
    local = _write(tmp_path / "activation", kernel_files(name="activation", value=42))
    repo = "kernels-test/activation"  # not on the Hub: a load can only come from the folder
    with pytest.raises(HfHubHTTPError):
        get_kernel(repo, revision="main")
    hub.reset_requests()
    for value in (
        f"{repo}={local}:kernels-test/non-existing2=/non/existing",
        f"kernels-test/non-existing2=/non/existing:{repo}={local}",
    ):
        monkeypatch.setenv("LOCAL_KERNELS", value)
        assert get_kernel(repo, revision="main").VALUE == 42
        assert has_kernel(repo, revision="main")
        assert LayerRepository(repo, layer_name="ReLU", version=1).load().__name__ == "ReLU"
    assert _requests(hub) == []  # no Hub, no trust check

    monkeypatch.setenv(
        "LOCAL_KERNELS", f"kernels-test/non-existing2=/non/existing:{repo}=/non/existing"
    )
    with pytest.raises(FileNotFoundError, match=r"Could not find kernel in /non/existing"):
        get_kernel(repo, revision="main")
    assert not has_kernel(repo, revision="main")
    monkeypatch.setenv("LOCAL_KERNELS", f"kernels-test/non-existing2=/non/existing:{repo}")
    with pytest.raises(ValueError, match=r"Invalid LOCAL_KERNELS entry"):
        get_kernel(repo, revision="main")


# -- 4. the dependency allow-list ------------------------------------------------------------


def test_unsupported_dependency_is_refused_before_the_download(hub):
    hub.trust("kernels-test")
    hub.writer("kernels-test/dep").commit(
        _variant_files(**{"python-depends": ["numpy"]}), branch="v1"
    )
    for call in (
        lambda: get_kernel("kernels-test/dep", version=1),
        lambda: install_kernel("kernels-test/dep", version=1, validate_dependencies=True),
    ):
        hub.reset_requests()
        with pytest.raises(ValueError, match=r"Kernel module `dep_kernel` uses.*numpy"):
            call()
        # Only metadata.json was ever downloaded (the second call finds it cached).
        fetched = [p for _m, p in _requests(hub) if "/build/" in p and "/resolve/" in p]
        assert all(p.endswith("/metadata.json") for p in fetched), fetched
    cache = Path(os.environ["KERNELS_CACHE"])
    assert not list(cache.glob("v1/trees/*"))  # nothing installed
    # install_kernel validates only when asked, as the reference's does.
    assert (install_kernel("kernels-test/dep", version=1) / "__init__.py").is_file()


def test_allowed_dependency_must_be_installed(hub, tmp_path):
    pytest.importorskip("torch")
    if __import__("importlib").util.find_spec("einops") is not None:
        pytest.skip("einops is installed here")
    hub.trust("kernels-test")
    hub.writer("kernels-test/dep").commit(
        _variant_files(**{"python-depends": ["einops"]}), branch="v1"
    )
    with pytest.raises(
        ImportError,
        match=r"Kernel module `dep_kernel` requires Python "
        r"dependency `einops`",
    ):
        get_kernel("kernels-test/dep", version=1)
    local = _write(tmp_path / "k", _variant_files(**{"python-depends": ["kepler-22b"]}))
    with pytest.raises(ValueError, match=r"Kernel module `dep_kernel` uses.*kepler-22b"):
        get_local_kernel(local)


# -- 5. the newer-version warning ------------------------------------------------------------


def test_newer_version_warning(hub, versions, caplog):
    with caplog.at_level(logging.WARNING, logger="kernels._versions"):
        assert get_kernel(REPO, version=1).VALUE == 1
    assert "You are using version 1 of 'kernels-test/versions', but version 10 is available." in (
        caplog.text
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kernels._versions"):
        assert get_kernel(REPO, version=10).VALUE == 10
    assert "but version" not in caplog.text


# -- 6. LoadedKernel and Metadata ------------------------------------------------------------


def test_loaded_kernel_is_the_reference_dataclass_plus_optional_fields(hub, versions):
    module = get_kernel(REPO, version=2)
    (record,) = [k for k in get_loaded_kernels() if k.module is module]
    # Constructed and compared with the reference's three fields only.
    same = LoadedKernel(metadata=record.metadata, module=module, repo_info=record.repo_info)
    assert same == LoadedKernel(record.metadata, module, record.repo_info)
    assert record.repo_info.revision == versions[2] and record.variant == "torch-universal"
    assert record.metadata.name == "v-relu" and record.metadata.name.python_name == "v_relu"


def test_metadata_name_python_name_and_provenance(tmp_path):
    provenance = {
        "kernel-builder": {"version": "0.1.0", "commit": "a" * 40, "dirty": False},
        "kernel": {"commit": "b" * 40, "dirty": False},
    }
    folder = _write(tmp_path / "k", _variant_files(provenance=provenance))
    meta = kernels.Metadata.read_from_file(folder / "build/torch-universal/metadata.json")
    assert meta.name == "dep-kernel" and meta.name.python_name == "dep_kernel"
    assert not meta.provenance.dirty and meta.provenance.kernel.commit == "b" * 40
    assert meta.provenance.kernel_builder.git.commit == "a" * 40


# -- 7. Benchmark and the variant objects -----------------------------------------------------


def test_benchmark_base_class():
    class Relu(Benchmark):
        seed = 42

        def setup(self):
            self.x = torch.randn(4, 8, device=self.device)

        def benchmark_relu(self):
            self.out = self.kernel.relu(self.x)

        def verify_relu(self):
            return torch.relu(self.x)

    bench = Relu()
    assert (bench.kernel, bench.out, bench.device, Benchmark.seed) == (None, None, "cpu", None)
    bench.kernel = torch
    bench.setup()
    bench.benchmark_relu()
    torch.testing.assert_close(bench.out, bench.verify_relu())


def test_variant_decisions_have_variant_objects(hub, versions):
    # The reference's docstring example, verbatim in shape.
    lines = []
    for decision in get_kernel_variants(REPO, version=1):
        name = decision.variant.variant_str
        if isinstance(decision, VariantAccepted):
            lines.append(f"{name}: compatible")
        else:
            lines.append(f"{name}: rejected ({decision.reason})")
    assert lines == ["torch-universal: compatible"]


# -- 8. messages callers match ----------------------------------------------------------------


def test_messages_callers_match(hub, versions):
    with pytest.raises(ValueError, match="A kernel version or revision must be specified"):
        get_kernel(REPO)
    with pytest.raises(ValueError, match="A kernel version or revision must be specified"):
        has_kernel(REPO)
    with pytest.raises(ValueError, match="Only one of `revision` or `version` must be specified"):
        get_kernel(REPO, version=1, revision="main")
    with pytest.raises(ValueError, match="Invalid backend 'xpu'"):
        get_kernel(REPO, version=1, backend="xpu")
    with pytest.raises(ValueError, match="Either a revision or a version must be specified"):
        LayerRepository(REPO, layer_name="ReLU")
    with pytest.raises(ValueError, match=r"Either a revision or a version.*not both"):
        LayerRepository(REPO, layer_name="ReLU", version=1, revision="main")
    with pytest.raises(ValueError, match="mutually exclusive"):
        Mode.INFERENCE | Mode.TRAINING
    with pytest.raises(ValueError, match="cannot be combined with other modes"):
        Mode.FALLBACK | Mode.TRAINING
    with pytest.raises(ValueError, match="can only be used to register kernel mappings"):
        kernelize(torch.nn.Linear(2, 2), mode=Mode.FALLBACK)
    with pytest.raises(ValueError, match="mode must contain"):
        kernelize(torch.nn.Linear(2, 2), mode=Mode.TORCH_COMPILE)
    with pytest.deprecated_call(match="kernels 0.17"):
        FuncRepository(REPO, func_name="relu", version=1)


# The reference's own tests of three messages (kernels/tests/test_basic.py, test_resolver.py,
# test_func.py at its `main`), ported as they are: same calls, same `match=`. The repos they
# name are served by `kernels serve` here; this package's hint line must still follow.


def test_reference_trust_remote_code_blocks_untrusted_org(hub, versions, monkeypatch):
    # test_basic.py::test_trust_remote_code_blocks_untrusted_org (and test_resolver.py's
    # test_hub_resolver_blocks_untrusted_org, the same check through its resolver class)
    hub.writer("kernels-test-untrusted/not-a-trused-org-kernel").commit(
        kernel_files(name="untrusted"), branch="v1"
    )
    with pytest.raises(ValueError, match=r"not from a trusted publisher") as err:
        get_kernel("kernels-test-untrusted/not-a-trused-org-kernel", version=1)
    assert "\nhint: " in str(err.value)
    # Offline, a cached kernel of the org (installed with trust_remote_code=True): the same
    # words, from the decision recorded when the endpoint was asked.
    lock = _commit_only_lock(hub, "kernels-test-untrusted/not-a-trused-org-kernel")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"not from a trusted publisher"):
        kernels.get_locked_kernel("kernels-test-untrusted/not-a-trused-org-kernel", lockfile=lock)


def _commit_only_lock(hub, repo_id: str) -> Path:
    """A reference-format lock of `repo_id` at a new v2 commit, whose files this cache holds."""
    commit = hub.writer(repo_id).commit(kernel_files(name="untrusted", value=3), branch="v2")
    kernels.install_kernel(repo_id, revision=commit, trust_remote_code=True)
    lock = hub.root.parent / "kernels.lock"
    dep = {"dependency": {"repo-id": repo_id, "version": 2}, "lock": {"commit": commit}}
    lock.write_text(json.dumps([dep]))
    return lock


def test_reference_install_kernel_offline_uncached_revision(hub, monkeypatch):
    # test_basic.py::test_install_kernel_offline_uncached_revision (and test_resolver.py's
    # test_hub_cache_resolver_uncached_repo)
    with pytest.raises(FileNotFoundError, match=r"local snapshot") as err:
        install_kernel(
            "kernels-test/this-repo-should-not-exist",
            revision="0000000000000000000000000000000000000000",
            local_files_only=True,
        )
    assert "\nhint: " in str(err.value)
    # The same words from every offline miss: a revision never resolved, a commit not cached.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"local snapshot.*offline mode"):
        get_kernel("kernels-test/this-repo-should-not-exist", version=1)
    with pytest.raises(FileNotFoundError, match=r"local snapshot"):
        get_kernel("kernels-test/this-repo-should-not-exist", revision="0" * 40)


def test_reference_use_kernelized_func_used_on_non_kernelized_func():
    # test_func.py::test_use_kernelized_func_used_on_non_kernelized_func
    from kernels import use_kernelized_func

    def not_kernelized(x):
        return x

    with pytest.raises(ValueError, match="Function `not_kernelized` is not decorated") as err:

        @use_kernelized_func(not_kernelized)
        class NotKernelized(torch.nn.Module):
            def forward(self, x: torch.Tensor):
                return not_kernelized(x)

    assert "\nhint: " in str(err.value)


# -- 9. dirty builds -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kernel_dirty", "builder_dirty", "expected"),
    [(True, False, "kernel source"), (False, True, "kernel-builder"), (False, False, None)],
)
def test_dirty_build_warns(tmp_path, kernel_dirty, builder_dirty, expected):
    provenance = {
        "kernel-builder": {"version": "0.1.0", "commit": "a" * 40, "dirty": builder_dirty},
        "kernel": {"commit": "b" * 40, "dirty": kernel_dirty},
    }
    files = _variant_files(provenance=provenance)
    # A distinct module body per case: the same build is imported (and warned about) once.
    files["build/torch-universal/_impl.py"] += f"\nCASE = {str(tmp_path)!r}\n"
    folder = _write(tmp_path / "k", files)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        get_local_kernel(folder)
    dirty = [str(w.message) for w in caught if "dirty git tree" in str(w.message)]
    if expected is None:
        assert dirty == []
    else:
        assert len(dirty) == 1 and expected in dirty[0]
        assert issubclass(caught[0].category, UserWarning)


def test_metadata_json_extra_fields_do_not_break_loading(tmp_path):
    files = _variant_files(upstream="https://example.invalid/up", source="src")
    folder = _write(tmp_path / "k", files)
    get_local_kernel(folder)
    (record,) = [k for k in get_loaded_kernels() if k.path == folder / "build/torch-universal"]
    assert record.metadata.upstream == "https://example.invalid/up"
    assert json.loads((folder / "build/torch-universal/metadata.json").read_text())["source"]


# -- 9. kernel-status.toml redirects ----------------------------------------------------------


def _redirect(destination: str, revision: str | None = None, kind: str = "redirect") -> str:
    lines = [f'kind = "{kind}"', f'destination = "{destination}"']
    if revision is not None:
        lines.append(f'revision = "{revision}"')
    return "\n".join(lines) + "\n"


def test_status_redirect_loads_the_destination(hub, versions):
    hub.writer("kernels-test/old").commit(
        {"kernel-status.toml": _redirect(REPO, "v2"), "README.md": "moved\n"}, branch="v1"
    )
    with pytest.warns(
        UserWarning, match="'kernels-test/old' redirected to 'kernels-test/versions'"
    ):
        module = get_kernel("kernels-test/old", version=1)
    assert module.VALUE == 2
    # The record names what was loaded: the destination at its commit.
    (record,) = [k for k in get_loaded_kernels() if k.module is module]
    assert (record.repo_info.repo_id, record.repo_info.revision) == (REPO, versions[2])
    snapshot = install_kernel("kernels-test/old", version=1).parent.parent
    assert (snapshot.parent.name, snapshot.name) == ("kernels-test--versions", versions[2])
    assert has_kernel("kernels-test/old", version=1)
    # A warm load in a new process reads the recorded status: zero requests.
    hub.reset_requests()
    out = run_python(
        "import kernels; print(kernels.get_kernel('kernels-test/old', version=1).VALUE)"
    )
    assert out.stdout.strip() == "2", out.stderr
    assert _requests(hub) == []


def test_status_file_errors(hub, versions):
    hub.writer("kernels-test/odd").commit(
        {"kernel-status.toml": _redirect(REPO, kind="retired")}, branch="v1"
    )
    with pytest.raises(ValueError, match="Unknown kernel status kind"):
        get_kernel("kernels-test/odd", version=1)
    hub.writer("kernels-test/ping").commit(
        {"kernel-status.toml": _redirect("kernels-test/pong", "v1")}, branch="v1"
    )
    hub.writer("kernels-test/pong").commit(
        {"kernel-status.toml": _redirect("kernels-test/ping", "v1")}, branch="v1"
    )
    with pytest.raises(KernelStatusError, match="redirects"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            get_kernel("kernels-test/ping", version=1)


# -- 9. metadata.json digests (kernels.verify) -------------------------------------------------

# kernel-builder's own test vector: sha256("hello world"), base64.
HELLO_SHA256 = "uU0nuZNNPgilLlLX2n2r+sSE7+N6U4DukIj3rOLvzek="


def _digest_variant(tmp_path: Path, files: dict[str, str] | None) -> Path:
    folder = tmp_path / "torch-universal"
    folder.mkdir()
    (folder / "_extension.so").write_bytes(b"hello world")
    extra = {} if files is None else {"digest": {"algorithm": "sha256", "files": files}}
    (folder / "metadata.json").write_text(metadata("dep-kernel", **extra))
    return folder


def test_verify_digest(tmp_path):
    from kernels.verify import VerificationResult, verify_digest, verify_variant

    folder = _digest_variant(tmp_path, {"_extension.so": HELLO_SHA256})
    assert verify_digest(folder) == VerificationResult.Success()
    # Bytecode is importable and no digest covers it: here a violation (the reference skips it;
    # docs/compatibility.md). An empty __pycache__ is nothing.
    (folder / "__pycache__").mkdir()
    assert verify_digest(folder) == VerificationResult.Success()
    (folder / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"unverified")
    (folder / "stray.pyc").write_bytes(b"unverified too")
    assert [(v.kind, v.path) for v in verify_digest(folder).violations] == [
        ("bytecode", "__pycache__/x.cpython-311.pyc"),
        ("bytecode", "stray.pyc"),
    ]
    (folder / "__pycache__" / "x.cpython-311.pyc").unlink()
    (folder / "stray.pyc").unlink()

    (folder / "_extension.so").write_bytes(b"hello world!")
    (folder / "extra.py").write_text("x = 1\n")
    result = verify_digest(folder)
    assert isinstance(result, VerificationResult.DigestVerificationFailure)
    assert [(v.kind, v.path) for v in result.violations] == [
        ("mismatch", "_extension.so"),
        ("unknown", "extra.py"),
    ]
    (folder / "_extension.so").unlink()
    assert [v.kind for v in verify_digest(folder).violations] == ["missing", "unknown"]

    (tmp_path / "b").mkdir()
    bare = _digest_variant(tmp_path / "b", None)
    assert verify_digest(bare) == VerificationResult.DigestMissing()
    assert verify_digest(tmp_path / "nowhere") == VerificationResult.MetadataMissing()
    # Without a valid signature the answer fails closed, never Success.
    assert verify_variant(folder) == VerificationResult.SignatureBundleMissing()
    (folder / "metadata.json.sigstore").write_text("{}")
    assert isinstance(
        verify_variant(folder),
        (
            VerificationResult.SignatureBundleInvalid,
            VerificationResult.SignatureVerificationFailure,
        ),
    )


# -- 9. Sigstore signatures, against a private Sigstore made on the spot -----------------------


def _signed_variant(tmp_path: Path, sigstore, **sign_kwargs) -> Path:
    folder = _digest_variant(tmp_path, {"_extension.so": HELLO_SHA256})
    bundle = sigstore.sign((folder / "metadata.json").read_bytes(), **sign_kwargs)
    (folder / "metadata.json.sigstore").write_text(bundle)
    return folder


def test_signed_variant_verifies_offline_against_a_pinned_root(tmp_path, monkeypatch):
    pytest.importorskip("sigstore")
    from kernels.verify import VerificationResult, verify_variant

    from tests.sigstore_fixture import TestSigstore

    sigstore = TestSigstore()
    root = sigstore.trusted_root(tmp_path / "trusted_root.json")
    folder = _signed_variant(tmp_path, sigstore)
    assert verify_variant(folder, trusted_root=root) == VerificationResult.Success()
    monkeypatch.setenv("KERNELS_SIGSTORE_TRUSTED_ROOT", str(root))
    assert verify_variant(folder) == VerificationResult.Success()
    # A file changed after signing: the signature holds, the digest does not.
    (folder / "_extension.so").write_bytes(b"hello world!")
    result = verify_variant(folder)
    assert isinstance(result, VerificationResult.DigestVerificationFailure)


def test_signature_failures(tmp_path):
    pytest.importorskip("sigstore")
    from kernels.verify import GitHubWorkflowPolicy, VerificationResult, verify_variant

    from tests.sigstore_fixture import TestSigstore

    failed = VerificationResult.SignatureVerificationFailure
    sigstore = TestSigstore()
    root = sigstore.trusted_root(tmp_path / "trusted_root.json")

    (tmp_path / "a").mkdir()
    tampered = _signed_variant(tmp_path / "a", sigstore)
    (tampered / "metadata.json").write_text(metadata("dep-kernel", version=2))
    assert isinstance(verify_variant(tampered, trusted_root=root), failed)

    # Signed by another repo's CI: refused by the default policy, accepted by one naming it.
    (tmp_path / "b").mkdir()
    other = _signed_variant(tmp_path / "b", sigstore, repo="someone/fork")
    assert isinstance(verify_variant(other, trusted_root=root), failed)
    fork = GitHubWorkflowPolicy(
        "someone/fork",
        ("https://github.com/someone/fork/.github/workflows/build.yaml@refs/heads/main",),
    )
    assert verify_variant(other, [fork], trusted_root=root) == VerificationResult.Success()

    # A bundle from another Sigstore instance, and this instance's bundle against the public
    # root sigstore ships: neither chains to the root it is checked against.
    (tmp_path / "c").mkdir()
    stranger = _signed_variant(tmp_path / "c", TestSigstore())
    assert isinstance(verify_variant(stranger, trusted_root=root), failed)
    (tmp_path / "d").mkdir()
    assert isinstance(verify_variant(_signed_variant(tmp_path / "d", sigstore)), failed)
