"""transformers 5.24 uses this package as its `kernels`: use_kernels=True, mappings registered
here, training retention, KernelConfig limits, and attn_implementation="org/repo" (CPU)."""

from __future__ import annotations

import logging
import textwrap
import uuid
from pathlib import Path

import kernels
import pytest
import torch
from kernels.layers import (
    KernelFunction,
    LocalLayerRepository,
    Mode,
    last_report,
    mapping,
    register_kernel_mapping,
)
from kernels.layers.binding import bound_layer

from tests.layers.helpers import (
    ACTIVATIONS,
    NORMS,
    ROTARIES,
    calls_of,
    kernel_files,
    metadata,
    tiny_qwen3,
    tokens,
    write_repo,
)

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _fresh_mapping():
    token = mapping._MAPPING.set(())
    yield
    mapping._MAPPING.reset(token)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A tiny Qwen3 checkpoint on disk (random weights, no download)."""
    path = tmp_path_factory.mktemp("qwen3")
    tiny_qwen3(seed=7).save_pretrained(path)
    return path


@pytest.fixture
def repo_path(tmp_path: Path) -> Path:
    return write_repo(tmp_path / "testlayers", kernel_files(salt=uuid.uuid4().hex))


def load(path: Path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def cpu_mapping(repo_path: Path, norm: str = "RMSNorm") -> dict:
    return {
        "RMSNorm": {"cpu": LocalLayerRepository(repo_path, layer_name=norm)},
        "rotary_pos_emb": {"cpu": LocalLayerRepository(repo_path, layer_name="Rotary")},
        "SiLU": {"cpu": LocalLayerRepository(repo_path, layer_name="SiLU")},
    }


def counts(report) -> dict[str, int]:
    found: dict[str, int] = {}
    for entry in report.bound:
        found[entry.layer_name] = found.get(entry.layer_name, 0) + 1
    return found


def test_transformers_takes_this_package_as_kernels():
    from transformers.integrations import hub_kernels
    from transformers.models.qwen3 import modeling_qwen3
    from transformers.utils.import_utils import is_kernels_available

    assert is_kernels_available()
    assert kernels.__version__ == "0.18.2"
    assert hub_kernels.LayerRepository is kernels.LayerRepository
    assert modeling_qwen3.Qwen3RMSNorm.kernel_layer_name == "RMSNorm"
    assert isinstance(modeling_qwen3.apply_rotary_pos_emb, KernelFunction)


def test_use_kernels_on_cpu_keeps_original_layers_without_a_cpu_mapping(saved):
    plain = load(saved)
    model = load(saved, use_kernels=True)
    assert model.use_kernels
    report = last_report(model)
    assert report.mode == Mode.INFERENCE and report.device == "cpu" and report.bound == ()
    assert {e.layer_name for e in report.kept} == {"RMSNorm", "rotary_pos_emb", "SiLU"}
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, plain(x).logits, rtol=0, atol=0)


def test_a_cpu_mapping_registered_here_stays_bound_through_training(saved, repo_path):
    reference = load(saved)
    register_kernel_mapping(cpu_mapping(repo_path))
    model = load(saved, use_kernels=True)
    assert counts(last_report(model)) == {
        "RMSNorm": NORMS,
        "rotary_pos_emb": ROTARIES,
        "SiLU": ACTIVATIONS,
    }
    calls = calls_of(bound_layer(model.model.norm))
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, reference(x).logits, rtol=1e-5, atol=1e-5)
    assert calls == {"RMSNorm": NORMS, "Rotary": ROTARIES, "SiLU": ACTIVATIONS}

    model.train()  # transformers re-kernelizes in TRAINING mode
    reference.train()
    report = last_report(model)
    assert report.mode == Mode.TRAINING
    assert counts(report) == {"RMSNorm": NORMS, "rotary_pos_emb": ROTARIES, "SiLU": ACTIVATIONS}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    start = model.model.norm.weight.detach().clone()
    for step in range(3):
        calls.clear()
        loss = model(x, labels=x).loss
        ref_loss = reference(x, labels=x).loss
        torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5, msg=f"step {step}")
        loss.backward()
        ref_loss.backward()
        assert calls == {"RMSNorm": NORMS, "Rotary": ROTARIES, "SiLU": ACTIVATIONS}
        assert model.model.norm.weight.grad.abs().sum() > 0
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
    assert not torch.equal(model.model.norm.weight, start)
    model.eval()
    assert last_report(model).mode == Mode.INFERENCE
    assert counts(last_report(model))["RMSNorm"] == NORMS


def test_two_models_in_one_process_stay_independent(saved, repo_path):
    register_kernel_mapping(cpu_mapping(repo_path))
    kernelized = load(saved, use_kernels=True)
    plain = load(saved)
    calls = calls_of(bound_layer(kernelized.model.norm))
    x = tokens()
    with torch.no_grad():
        expected = plain(x).logits
        kernelized(x)
    assert calls["Rotary"] == ROTARIES  # the shared rotary function ran the kernel for one model
    calls.clear()
    with torch.no_grad():
        again = plain(x).logits
    assert calls == {}
    torch.testing.assert_close(again, expected, rtol=0, atol=0)


def test_kernel_config_refuses_cpu_inside_transformers(saved, repo_path):
    # transformers' own check (KERNELS_SUPPORTED_DEVICE_TYPES has no "cpu"): on CPU, register a
    # mapping through this package instead (see docs/transformers.md).
    from transformers import KernelConfig

    config = KernelConfig({"RMSNorm": f"{repo_path}:RMSNorm"}, use_local_kernel=True)
    with pytest.raises(ValueError, match="Only devices in"):
        load(saved, kernel_config=config)


def test_kernel_config_mapping_survives_model_train(saved, repo_path, caplog):
    """The mapping a KernelConfig becomes ({layer: {device: {Mode.INFERENCE: repo}}}) stays
    bound after transformers' own train() re-kernelization; the reference drops it."""
    from transformers import KernelConfig

    model = load(saved)
    config = KernelConfig()
    config.kernel_mapping = {
        "RMSNorm": {"cpu": {Mode.INFERENCE: LocalLayerRepository(repo_path, layer_name="RMSNorm")}}
    }
    model.kernel_config = config
    model.set_use_kernels(True)
    assert counts(last_report(model)) == {"RMSNorm": NORMS}
    model.train()
    report = last_report(model)
    assert report.mode == Mode.TRAINING and counts(report) == {"RMSNorm": NORMS}
    assert all("serves training" in e.reason for e in report.bound)
    calls = calls_of(bound_layer(model.model.norm))
    calls.clear()
    x = tokens()
    model(x, labels=x).loss.backward()
    assert calls["RMSNorm"] == NORMS

    model.eval()
    config.kernel_mapping = {
        "RMSNorm": {
            "cpu": {Mode.INFERENCE: LocalLayerRepository(repo_path, layer_name="RMSNormNoBackward")}
        }
    }
    model.set_use_kernels(True)
    assert counts(last_report(model)) == {"RMSNorm": NORMS}
    with caplog.at_level(logging.WARNING, logger="kernels"):
        model.train()
    assert counts(last_report(model)) == {}
    assert sum("has no backward" in r.getMessage() for r in caplog.records) == 1


def test_transformers_kernelize_entry_point(saved, repo_path):
    from transformers import kernelize as transformers_kernelize

    model = load(saved)
    register_kernel_mapping(cpu_mapping(repo_path))
    transformers_kernelize(model)
    assert model.use_kernels and counts(last_report(model))["RMSNorm"] == NORMS


SDPA_VARLEN = '''
"""flash-attn's varlen entry point on top of torch's scaled_dot_product_attention."""
import collections

import torch
import torch.nn.functional as F

CALLS = collections.Counter()


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    dropout_p=0.0, softmax_scale=None, causal=False,
):
    CALLS["varlen"] += 1
    out = torch.empty_like(q)
    for i in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        # (tokens, heads, dim) -> (1, heads, tokens, dim)
        qi, ki, vi = (t.transpose(0, 1).unsqueeze(0) for t in (q[qs:qe], k[ks:ke], v[ks:ke]))
        o = F.scaled_dot_product_attention(
            qi, ki, vi, dropout_p=dropout_p, is_causal=causal, scale=softmax_scale, enable_gqa=True
        )
        out[qs:qe] = o[0].transpose(0, 1)
    return out
'''


def test_attn_implementation_from_a_hub_repo_runs_on_cpu(hub, saved):
    hub.trust("kernels-test")
    files = {
        "build/torch-universal/metadata.json": metadata("sdpa-varlen"),
        "build/torch-universal/__init__.py": textwrap.dedent(SDPA_VARLEN),
    }
    hub.writer("kernels-test/sdpa-varlen").commit(files, branch="v1")
    reference = load(saved, attn_implementation="sdpa")
    model = load(saved, attn_implementation="kernels-test/sdpa-varlen")
    assert model.config._attn_implementation == "kernels-test/sdpa-varlen"
    kernel = kernels.get_kernel("kernels-test/sdpa-varlen", version=1)
    x = tokens(batch=2, length=8)
    mask = torch.ones_like(x)
    mask[0, :3] = 0  # left padding: the varlen path
    with torch.no_grad():
        got = model(x, attention_mask=mask).logits
        expected = reference(x, attention_mask=mask).logits
    assert kernel.CALLS["varlen"] == 2  # one call per decoder layer
    keep = mask.bool()
    torch.testing.assert_close(got[keep], expected[keep], rtol=1e-5, atol=1e-5)


def test_the_shipped_training_kernels_serve_a_cpu_model_through_the_hub(hub, saved):
    """The docs' CPU example: kernels-lab/training from a mirror of hub_kernels/, registered for
    "cpu", bound by transformers' own kernelize, kept through train(), forward and backward."""
    from kernels import LayerRepository

    built = {
        repo.repo_id: repo
        for repo in hub.build(Path(__file__).resolve().parents[1] / "hub_kernels")
    }
    commit = built["kernels-lab/training"].commit
    register_kernel_mapping(
        {
            "RMSNorm": {
                "cpu": LayerRepository("kernels-lab/training", layer_name="RMSNorm", version=1)
            },
            "rotary_pos_emb": {
                "cpu": LayerRepository(
                    "kernels-lab/training", layer_name="rotary_pos_emb", version=1
                )
            },
        }
    )
    reference = load(saved).train()
    model = load(saved, use_kernels=True)
    model.train()
    report = last_report(model)
    assert counts(report) == {"RMSNorm": NORMS, "rotary_pos_emb": ROTARIES}
    assert report["model.norm"].kernel == f"kernels-lab/training@{commit}/torch-universal:RMSNorm"
    x = tokens()
    loss, ref_loss = model(x, labels=x).loss, reference(x, labels=x).loss
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(
        model.model.norm.weight.grad, reference.model.norm.weight.grad, rtol=1e-4, atol=1e-5
    )
