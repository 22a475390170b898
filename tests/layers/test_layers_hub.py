"""Layers from Hub repos over real HTTP (the local Hub of tests/conftest.py)."""

from __future__ import annotations

import uuid

import pytest
import torch
from kernels import KernelNotFound, RevisionNotFound, UntrustedPublisher
from kernels.layers import (
    KernelizeFallback,
    LayerRepository,
    Mode,
    apply_kernels,
    kernelize,
    last_report,
    register_kernel_mapping,
)
from kernels.layers.binding import bound_layer

from .helpers import NORMS, calls_of, kernel_files, tiny_qwen3, tokens

REPO = "kernels-test/testlayers"


@pytest.fixture
def published(hub):
    """kernels-test/testlayers with v1 and v2 branches (trusted publisher)."""
    hub.trust("kernels-test")
    writer = hub.writer(REPO)
    salt = uuid.uuid4().hex
    v1 = writer.commit(kernel_files(salt=f"{salt}-1"), branch="v1")
    v2 = writer.commit(kernel_files(salt=f"{salt}-2", version=2), branch="v2")
    writer.branch("main", v2)
    return {"v1": v1, "v2": v2}


def test_layer_repository_loads_over_http_and_reports_the_commit(hub, published):
    repo = LayerRepository(REPO, layer_name="RMSNorm", version=1)
    assert hub.requests == []  # constructing is free
    model = tiny_qwen3()
    x = tokens()
    with torch.no_grad():
        expected = model(x).logits
    register_kernel_mapping({"RMSNorm": {"cpu": repo}})
    kernelize(model, mode=Mode.INFERENCE)
    assert hub.requests  # it did talk to the Hub
    entry = last_report(model)["model.norm"]
    assert entry.kernel == f"{REPO}@{published['v1']}/torch-universal:RMSNorm"
    assert published["v1"][:12] in str(last_report(model))
    with torch.no_grad():
        got = model(x).logits
    assert calls_of(bound_layer(model.model.norm))["RMSNorm"] == NORMS
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ref", ["@v2", "@main", "commit"])
def test_spec_refs_pick_the_right_commit(hub, published, ref):
    spec = f"{REPO}@{published['v2']}:RMSNorm" if ref == "commit" else f"{REPO}{ref}:RMSNorm"
    report = apply_kernels(tiny_qwen3(), {"RMSNorm": spec})
    assert report["model.norm"].kernel == f"{REPO}@{published['v2']}/torch-universal:RMSNorm"


def test_plain_spec_means_version_1(hub, published):
    report = apply_kernels(tiny_qwen3(), {"RMSNorm": f"{REPO}:RMSNorm"})
    assert published["v1"] in report["model.norm"].kernel


def test_a_warm_rebind_makes_no_request(hub, published):
    model = tiny_qwen3()
    register_kernel_mapping(
        {"RMSNorm": {"cpu": LayerRepository(REPO, layer_name="RMSNorm", version=1)}}
    )
    kernelize(model, mode=Mode.INFERENCE)
    hub.reset_requests()
    kernelize(model.train(), mode=Mode.TRAINING)
    kernelize(model.eval(), mode=Mode.INFERENCE)
    assert [r for r in hub.requests if "/api/agent-harnesses" not in r[1]] == []
    assert len([e for e in last_report(model).bound if e.layer_name == "RMSNorm"]) == NORMS


def test_missing_repo_and_version_are_typed_and_can_fall_back(hub, published):
    model = tiny_qwen3()
    for repo, error in (
        (LayerRepository("kernels-test/nothing", layer_name="RMSNorm", version=1), KernelNotFound),
        (LayerRepository(REPO, layer_name="RMSNorm", version=7), RevisionNotFound),
    ):
        register_kernel_mapping({"RMSNorm": {"cpu": repo}})
        with pytest.raises(error):
            kernelize(model, mode=Mode.INFERENCE)
        kernelize(model, mode=Mode.INFERENCE, use_fallback=KernelizeFallback.ALL)
        entry = last_report(model)["model.norm"]
        assert entry.status == "original" and entry.fallback == KernelizeFallback.CANNOT_LOAD


def test_an_untrusted_publisher_is_never_swallowed(hub):
    hub.writer("strangers/norms").commit(kernel_files(salt=uuid.uuid4().hex), branch="v1")
    model = tiny_qwen3()
    register_kernel_mapping(
        {"RMSNorm": {"cpu": LayerRepository("strangers/norms", layer_name="RMSNorm", version=1)}}
    )
    with pytest.raises(UntrustedPublisher):
        kernelize(model, mode=Mode.INFERENCE, use_fallback=KernelizeFallback.ALL)
    report = apply_kernels(model, {"RMSNorm": "strangers/norms:RMSNorm"}, trust_remote_code=True)
    assert len(report.bound) == NORMS
