"""The training kernels bundled with the package (issue 31): used by the one-line switch when
`kernels-lab/training` is neither served nor cached, verified and installed like a download.

These run on this checkout's editable install (pyproject.toml maps the bundled folder to the
checkout's hub_kernels/); tests/test_packaging.py runs the same fallback from a built wheel.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import kernels
import pytest
import torch
from kernels import bundled, notices
from kernels.cache import Cache

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "hub_kernels" / "kernels-lab" / "training" / "build" / "torch-universal"
REPO = "kernels-lab/training"


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, vocab_size=128, head_dim=16,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


@pytest.fixture
def notices_seen(caplog):
    """The `kernels` logger's notices of this test (each test starts with none shown)."""
    notices.reset()
    caplog.set_level(logging.WARNING, logger="kernels")

    def seen() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "kernels"]

    return seen


def _scripts_module():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bundle_training
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return bundle_training


def test_the_record_matches_hub_kernels():
    """bundled_training.json pins the files the wheel carries: after an edit of the training
    kernels, `python scripts/bundle_training.py` must be run (this test says so)."""
    expected = _scripts_module().describe()
    recorded = json.loads(bundled.RECORD.read_text())
    assert recorded == expected, "run `python scripts/bundle_training.py` and commit the result"
    assert bundled.source_folder().resolve() == TREE.resolve()  # the editable install: the checkout


def test_offline_on_a_fresh_machine_the_switch_binds_the_bundled_copy(monkeypatch, notices_seen):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    reference, model = tiny_llama(), tiny_llama()
    report = kernels.apply_training_kernels(model)
    bound = [e for e in report if e.status == "bound"]
    assert len(bound) >= 5, str(report)  # 2 norms, rotary, MLP, head of one layer + final norm
    commit = bundled.read_bundle().commit
    served = [e for e in report if e.status in ("bound", "routed")]  # routed: TRL's fused head
    assert str(report).count(f"{REPO}@{commit[:12]}/torch-universal") == len(served), str(report)
    ids = torch.randint(0, 128, (2, 9))
    losses = [m(input_ids=ids, labels=ids).loss for m in (reference, model)]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    losses[1].backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    kernels.apply_training_kernels(tiny_llama())  # again: no second notice
    shown = notices_seen()
    assert len(shown) == 1, shown
    assert "offline" in shown[0] and "bundled with kernels" in shown[0], shown[0]
    # Installed in the cache under the pseudo-endpoint, which no endpoint's load reads.
    bundle = bundled.read_bundle()
    root = os.environ["KERNELS_CACHE"]
    found = Cache(root, endpoint=bundled.ENDPOINT).installed(REPO, bundle.commit, bundle.variant)
    assert found is not None and found[0].digest == bundle.manifest.digest
    endpoint = Cache(root, endpoint=os.environ["HF_ENDPOINT"])
    assert endpoint.installed(REPO, bundle.commit, bundle.variant) is None


def test_an_endpoint_without_the_repo_falls_back_and_names_it(hub, notices_seen):
    mapping = kernels.training_kernel_mapping(tiny_llama())
    tree = next(iter(mapping.values())).rsplit(":", 1)[0]
    assert Path(tree).is_dir() and all(v.startswith(tree + ":") for v in mapping.values())
    (shown,) = notices_seen()
    assert "not found" in shown and hub.url in shown, shown


def test_the_config_for_transformers_loads_the_bundled_tree(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = kernels.training_kernel_config(tiny_llama())
    assert config.use_local_kernel  # transformers builds LocalLayerRepository from the paths
    assert all(Path(v.rsplit(":", 1)[0]).is_dir() for v in config.kernel_mapping.values())


def test_the_bundled_config_survives_transformers_rewriting_it(monkeypatch):
    """from_pretrained rewrites the mapping into (value, metadata) tuples before it builds the
    nested form; with use_local_kernel, transformers 5.24 then splits a tuple as a string. The
    config hands it the paths again, and each layer gets a LocalLayerRepository of the tree."""
    import transformers.utils.kernel_config as tkc
    from transformers.integrations.hub_kernels import register_kernel_replacements_and_fusions

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = tiny_llama()
    config = kernels.training_kernel_config(model)
    paths = dict(config.kernel_mapping)
    register_kernel_replacements_and_fusions(type(model), model.config, config)  # as a load does
    assert all(isinstance(v, tuple) for v in config.kernel_mapping.values())
    # The one stand-in: the device a CUDA model would report (the local branch takes no "cpu").
    monkeypatch.setattr(tkc, "infer_device", lambda model: "cuda")
    model.train()
    config.create_compatible_mapping(model)
    nested = model.kernel_config.kernel_mapping
    assert sorted(nested) == sorted(paths)
    for name, value in paths.items():
        (repo,) = nested[name]["cuda"].values()
        assert type(repo).__name__ == "LocalLayerRepository", repo
        assert f"{repo.repo_path}:{repo.layer_name}" == value


def test_a_mirror_copy_wins_over_the_bundled_one(hub, notices_seen):
    hub.build(ROOT / "hub_kernels")
    mapping = kernels.training_kernel_mapping(tiny_llama())
    assert all(v.startswith(f"{REPO}:") for v in mapping.values()), mapping
    assert notices_seen() == []


@pytest.mark.parametrize(
    "request_",
    [{"version": 2}, {"revision": "main"}, {"repo": "kernels-lab/other"}],
    ids=["version", "revision", "repo"],
)
def test_a_named_repo_version_or_revision_is_never_replaced(monkeypatch, notices_seen, request_):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(kernels.OfflineCacheMiss):
        kernels.training_kernel_mapping(tiny_llama(), **request_)
    assert notices_seen() == []


def test_a_local_kernels_folder_is_never_replaced(monkeypatch, tmp_path, notices_seen):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("LOCAL_KERNELS", f"{REPO}={tmp_path / 'missing'}")
    with pytest.raises(kernels.KernelNotFound):
        kernels.training_kernel_mapping(tiny_llama())
    assert notices_seen() == []


def _copy(tmp_path: Path) -> Path:
    copy = tmp_path / "bundle"
    shutil.copytree(TREE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


@pytest.mark.parametrize("change", ["edit", "extra", "missing"])
def test_bundled_files_that_differ_from_the_record_are_refused(tmp_path, change):
    source = _copy(tmp_path)
    if change == "edit":  # same size, other bytes: only the digest tells
        path = source / "rms_norm.py"
        data = bytearray(path.read_bytes())
        data[-2] ^= 1
        path.write_bytes(bytes(data))
    elif change == "extra":
        (source / "sitecustomize.py").write_text("EVIL = 1\n")
    else:
        (source / "rope.py").unlink()
    cache = Cache(tmp_path / "cache", endpoint=bundled.ENDPOINT)
    with pytest.raises(kernels.IntegrityError, match="differ from their record"):
        bundled.install(cache, bundled.read_bundle(), source)
    assert not any(cache.trees.iter_digests())


def test_a_changed_cached_tree_is_replaced_by_a_verified_copy(tmp_path):
    bundle = bundled.read_bundle()
    cache = Cache(tmp_path / "cache", endpoint=bundled.ENDPOINT)
    tree = bundled.install(cache, bundle, TREE)
    victim = tree / "rms_norm.py"
    good = victim.read_bytes()
    victim.chmod(0o644)
    victim.write_bytes(good + b"\nEVIL = 1\n")
    assert bundled.install(cache, bundle, TREE) == tree
    assert victim.read_bytes() == good


@contextlib.contextmanager
def _read_only_folder(path: Path):
    """An empty folder this process cannot write: a read-only tmpfs for root (who ignores
    permission bits), a 0555 folder for anyone else; the test skips where root cannot mount."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(path)],
                         capture_output=True, text=True)  # fmt: skip
    if out.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {out.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_a_read_only_cache_imports_the_checked_package_folder(monkeypatch, tmp_path, notices_seen):
    """A shared cache this user cannot write, without the training kernels, offline: the switch
    still binds the bundled copy, imported from the package's folder after every file was
    checked, and the cache is left as it was."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with _read_only_folder(tmp_path / "shared-cache") as cache:
        monkeypatch.setenv("KERNELS_CACHE", str(cache))
        reference, model = tiny_llama(), tiny_llama()
        report = kernels.apply_training_kernels(model)
        assert len([e for e in report if e.status == "bound"]) >= 5, str(report)
        mapping = kernels.training_kernel_mapping(tiny_llama())
        trees = {Path(v.rsplit(":", 1)[0]).resolve() for v in mapping.values()}
        assert trees == {TREE.resolve()}, trees
        ids = torch.randint(0, 128, (2, 9))
        losses = [m(input_ids=ids, labels=ids).loss for m in (reference, model)]
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
        (shown,) = notices_seen()
        assert "bundled with kernels" in shown and "imported from the package's folder" in shown
        assert list(cache.iterdir()) == []


def test_a_read_only_cache_still_refuses_changed_bundled_files(monkeypatch, tmp_path):
    """The package-folder path checks the files as the cache path does: one changed byte in
    the bundled copy is refused, nothing is imported from it."""
    source = _copy(tmp_path)
    path = source / "rms_norm.py"
    data = bytearray(path.read_bytes())
    data[-2] ^= 1
    path.write_bytes(bytes(data))
    monkeypatch.setattr(bundled, "source_folder", lambda: source)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with _read_only_folder(tmp_path / "shared-cache") as cache:
        monkeypatch.setenv("KERNELS_CACHE", str(cache))
        with pytest.raises(kernels.IntegrityError, match="differ from their record"):
            kernels.apply_training_kernels(tiny_llama())
        assert list(cache.iterdir()) == []
