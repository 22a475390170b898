"""kernelize on tiny Qwen3 and Llama models with local kernel repos: binding, numerics, gradients,
mode changes, restoring, the layer contract and the fallback flags."""

from __future__ import annotations

import copy
import logging
import uuid

import pytest
import torch
from kernels import InvalidSpec, LayerError, NoCompatibleVariant
from kernels.layers import (
    CUDAProperties,
    Device,
    KernelizeFallback,
    LocalLayerRepository,
    Mode,
    kernelize,
    last_report,
    register_kernel_mapping,
    replace_kernel_forward_from_hub,
    use_kernel_mapping,
)
from kernels.layers.binding import bound_layer
from torch import nn

from .helpers import NORMS, calls_of, kernel_files, tiny_llama, tiny_qwen3, tokens, write_repo

MODELS = [tiny_qwen3, tiny_llama]
TC = Mode.TORCH_COMPILE


def norms(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if getattr(type(m), "kernel_layer_name", None) == "RMSNorm"]


def rms(entries) -> list:
    """The RMSNorm entries of a report (or of its bound/kept subsets)."""
    return [e for e in entries if e.layer_name == "RMSNorm"]


def norm_repo(path, layer: str = "RMSNorm") -> LocalLayerRepository:
    return LocalLayerRepository(path, layer_name=layer)


@pytest.mark.parametrize("make_model", MODELS)
def test_bound_forward_is_the_kernels_and_matches_the_original(make_model, repo_path):
    model = make_model()
    x = tokens()
    with torch.no_grad():
        expected = model(x).logits
    register_kernel_mapping({"RMSNorm": {"cpu": norm_repo(repo_path)}})
    assert kernelize(model, mode=Mode.INFERENCE) is model

    layer = bound_layer(model.model.norm)
    assert layer is not None and layer.__name__ == "RMSNorm"
    assert model.model.norm.forward.__func__ is layer.forward
    assert type(model.model.norm).forward is not layer.forward  # the class is untouched
    calls = calls_of(layer)
    before = calls["RMSNorm"]
    with torch.no_grad():
        got = model(x).logits
    assert calls["RMSNorm"] - before == len(norms(model))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make_model", MODELS)
def test_gradients_flow_through_the_kernel(make_model, repo_path):
    reference, model = make_model(seed=3), make_model(seed=3)
    reference.train()
    model.train()
    register_kernel_mapping({"RMSNorm": {"cpu": norm_repo(repo_path)}})
    kernelize(model, mode=Mode.TRAINING)
    x = tokens(seed=5)
    reference(x, labels=x).loss.backward()
    model(x, labels=x).loss.backward()
    assert calls_of(bound_layer(model.model.norm))["RMSNorm"] == len(norms(model))
    for (name, p_ref), (_, p) in zip(
        reference.named_parameters(), model.named_parameters(), strict=True
    ):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert model.model.norm.weight.grad.abs().sum() > 0


def test_train_eval_round_trips_keep_the_binding(repo_path):
    model = tiny_qwen3()
    register_kernel_mapping({"RMSNorm": {"cpu": norm_repo(repo_path)}})
    x = tokens()
    for mode in (Mode.INFERENCE, Mode.TRAINING, Mode.INFERENCE, Mode.TRAINING):
        model.train(mode == Mode.TRAINING)
        kernelize(model, mode=mode)
        report = last_report(model)
        assert report.mode == mode and len(rms(report.bound)) == NORMS
        calls = calls_of(bound_layer(model.model.norm))
        before = calls["RMSNorm"]
        loss = model(x, labels=x).loss
        if mode == Mode.TRAINING:
            loss.backward()
        assert calls["RMSNorm"] - before == NORMS


def test_kernelize_restores_the_original_when_nothing_matches(repo_path):
    model = tiny_qwen3()
    register_kernel_mapping({"RMSNorm": {"cpu": norm_repo(repo_path)}})
    kernelize(model, mode=Mode.INFERENCE)
    calls = calls_of(bound_layer(model.model.norm))
    with use_kernel_mapping({}, inherit_mapping=False):
        kernelize(model, mode=Mode.INFERENCE)
    assert all("forward" not in vars(m) and bound_layer(m) is None for m in norms(model))
    before = calls["RMSNorm"]
    model(tokens())
    assert calls["RMSNorm"] == before
    assert {e.reason for e in last_report(model).kept} >= {"no mapping for layer 'RMSNorm'"}


def test_a_forward_patched_by_someone_else_is_kept_and_restored(repo_path):
    model = tiny_qwen3()
    norm = model.model.norm
    seen = []

    def patched(hidden_states):
        seen.append(1)
        return type(norm).forward(norm, hidden_states)

    norm.forward = patched  # e.g. another library's instance patch
    kernelize(model, mode=Mode.INFERENCE)  # empty mapping: not ours to undo
    assert norm.forward is patched
    register_kernel_mapping({"RMSNorm": {"cpu": norm_repo(repo_path)}})
    kernelize(model, mode=Mode.INFERENCE)
    assert bound_layer(norm) is not None
    with use_kernel_mapping({}, inherit_mapping=False):
        kernelize(model, mode=Mode.INFERENCE)
    assert norm.forward is patched
    model(tokens())
    assert seen == [1]


def test_kernel_condition_is_asked_per_instance(repo_path):
    class Norm(nn.Module):
        def __init__(self, use_kernel: bool):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(8))
            self.variance_epsilon = 1e-6
            self.use_kernel = use_kernel

        def forward(self, hidden_states):
            return hidden_states * self.weight

    replace_kernel_forward_from_hub(Norm, "RMSNorm", condition=lambda m: m.use_kernel)
    model = nn.Sequential(Norm(True), Norm(False))
    register_kernel_mapping({"RMSNorm": {"cpu": norm_repo(repo_path)}})
    kernelize(model, mode=Mode.INFERENCE)
    assert bound_layer(model[0]) is not None and bound_layer(model[1]) is None
    report = last_report(model)
    assert [(e.path, e.status) for e in report] == [("0", "bound"), ("1", "skipped")]


@pytest.mark.parametrize(
    ("layer", "message"),
    [
        ("WithInit", "defines __init__"),
        ("WithHelper", "helper"),
        ("WrongArity", "does not match"),
        ("WrongKind", "does not match"),
        ("Missing", "has no layer 'Missing'"),
    ],
)
def test_unfit_layers_raise_layer_error_or_fall_back_with_all(layer, message, repo_path, caplog):
    model = tiny_qwen3()
    register_kernel_mapping({"RMSNorm": {"cpu": norm_repo(repo_path, layer)}})
    with pytest.raises(LayerError, match=message):
        kernelize(model, mode=Mode.INFERENCE)
    with caplog.at_level(logging.WARNING, logger="kernels"):
        kernelize(model, mode=Mode.INFERENCE, use_fallback=KernelizeFallback.ALL)
    kept = rms(last_report(model).kept)
    assert len(kept) == NORMS
    assert all(e.fallback == KernelizeFallback.CANNOT_LOAD and message in e.reason for e in kept)
    assert all(bound_layer(m) is None for m in norms(model))
    assert sum("keeps its original forward" in r.getMessage() for r in caplog.records) == 1


def test_methods_added_to_nn_module_later_do_not_make_layers_unfit(repo_path, monkeypatch):
    """transformers adds nn.Module.smart_apply when it first initialises a model; layers checked
    before and after that are equally fit."""
    register_kernel_mapping({"RMSNorm": {"cpu": norm_repo(repo_path)}})
    kernelize(tiny_qwen3(), mode=Mode.INFERENCE)
    monkeypatch.setattr(nn.Module, "added_later_by_a_library", lambda self: None, raising=False)
    model = tiny_qwen3()
    kernelize(model, mode=Mode.INFERENCE)
    assert all(bound_layer(m) is not None for m in norms(model))


def test_no_compatible_variant_is_typed_and_can_fall_back(tmp_path):
    # An Ascend (NPU) build fits neither a CPU-only machine nor a CUDA one.
    path = write_repo(
        tmp_path / "npu-only",
        kernel_files("npu-only", salt=uuid.uuid4().hex, variant="torch-npu", backend="npu"),
    )
    model = tiny_qwen3()
    register_kernel_mapping({"RMSNorm": {"cpu": norm_repo(path)}})
    with pytest.raises(NoCompatibleVariant) as err:
        kernelize(model, mode=Mode.INFERENCE)
    assert err.value.trace and "torch-npu" in str(err.value)
    kernelize(model, mode=Mode.INFERENCE, use_fallback=KernelizeFallback.ALL)
    reasons = {e.reason for e in rms(last_report(model).kept)}
    assert len(reasons) == 1 and "no build variant" in reasons.pop()


def test_layer_without_backward_falls_back_in_training_with_one_notice(repo_path, caplog):
    model = tiny_qwen3().train()
    register_kernel_mapping({"RMSNorm": {"cpu": norm_repo(repo_path, "RMSNormNoBackward")}})
    with caplog.at_level(logging.WARNING, logger="kernels"):
        kernelize(model, mode=Mode.TRAINING)
        kernelize(model, mode=Mode.TRAINING)
    notices = [r for r in caplog.records if "has no backward" in r.getMessage()]
    assert len(notices) == 1
    kept = rms(last_report(model).kept)
    assert len(kept) == NORMS
    assert all(e.fallback == KernelizeFallback.NO_COMPATIBLE_MODE for e in kept)
    model(tokens(), labels=tokens()).loss.backward()  # the original forward has a backward
    kernelize(model.eval(), mode=Mode.INFERENCE)
    assert len(rms(last_report(model).bound)) == NORMS
    with pytest.raises(LayerError, match="no backward"):
        kernelize(model, mode=Mode.TRAINING, use_fallback=KernelizeFallback.NO_LAYER)


def test_registering_a_layer_for_a_mode_it_cannot_serve_is_an_error(repo_path):
    model = tiny_qwen3()
    register_kernel_mapping(
        {"RMSNorm": {"cpu": {Mode.TRAINING: norm_repo(repo_path, "TrainingNoBackward")}}}
    )
    with pytest.raises(LayerError, match="registered for TRAINING"):
        kernelize(model, mode=Mode.TRAINING)
    register_kernel_mapping(
        {"RMSNorm": {"cpu": {Mode.INFERENCE | TC: norm_repo(repo_path, "RMSNorm")}}}
    )
    with pytest.raises(LayerError, match="can_torch_compile"):
        kernelize(model, mode=Mode.INFERENCE | TC)


def test_torch_compile_needs_a_compilable_layer(repo_path):
    model = tiny_qwen3()
    register_kernel_mapping({"RMSNorm": {"cpu": norm_repo(repo_path, "RMSNorm")}})
    kernelize(model, mode=Mode.INFERENCE | TC)
    kept = rms(last_report(model).kept)
    assert len(kept) == NORMS and "torch.compile" in kept[0].reason
    register_kernel_mapping({"RMSNorm": {"cpu": norm_repo(repo_path, "RMSNormCompile")}})
    kernelize(model, mode=Mode.INFERENCE | TC)
    assert len(rms(last_report(model).bound)) == NORMS


def test_inference_entry_of_an_overlay_serves_training_when_it_has_a_backward(repo_path):
    # What transformers does with a KernelConfig: an INFERENCE-only overlay, then model.train().
    model = tiny_qwen3().train()
    overlay = {"RMSNorm": {"cpu": {Mode.INFERENCE: norm_repo(repo_path)}}}
    with use_kernel_mapping(overlay):
        kernelize(model, mode=Mode.TRAINING, use_fallback=KernelizeFallback.ALL)
    report = last_report(model)
    assert len(rms(report.bound)) == NORMS
    assert report.bound[0].mode == Mode.INFERENCE and "serves training" in report.bound[0].reason
    model(tokens(), labels=tokens()).loss.backward()
    assert calls_of(bound_layer(model.model.norm))["RMSNorm"] == NORMS

    no_backward = {"RMSNorm": {"cpu": {Mode.INFERENCE: norm_repo(repo_path, "RMSNormNoBackward")}}}
    with use_kernel_mapping(no_backward):
        kernelize(model, mode=Mode.TRAINING, use_fallback=KernelizeFallback.ALL)
    assert len(rms(last_report(model).kept)) == NORMS


@pytest.mark.parametrize(
    ("make_mapping", "mode", "case"),
    [
        (lambda repo: {}, Mode.INFERENCE, KernelizeFallback.NO_LAYER),
        (lambda repo: {"RMSNorm": {"cuda": repo}}, Mode.INFERENCE, KernelizeFallback.NO_DEVICE),
        # A TRAINING entry serves plain inference, but not inference under torch.compile.
        (
            lambda repo: {"RMSNorm": {"cpu": {Mode.TRAINING: repo}}},
            Mode.INFERENCE | TC,
            KernelizeFallback.NO_COMPATIBLE_MODE,
        ),
    ],
)
def test_fallback_flags_decide_between_keeping_and_raising(make_mapping, mode, case, repo_path):
    model = tiny_qwen3()
    register_kernel_mapping(make_mapping(norm_repo(repo_path)))
    kernelize(model, mode=mode)
    entry = last_report(model)["model.norm"]
    assert entry.status == "original" and entry.fallback == case
    with pytest.raises(LayerError) as err:
        kernelize(model, mode=mode, use_fallback=KernelizeFallback.ALL & ~case)
    assert f"KernelizeFallback.{case.name}" in str(err.value)
    with pytest.raises(LayerError):
        kernelize(model, mode=mode, use_fallback=False)


def test_gpu_capability_ranges_without_a_gpu(repo_path):
    model = tiny_qwen3()
    register_kernel_mapping(
        {"RMSNorm": {Device("cuda", CUDAProperties(80, 90)): norm_repo(repo_path)}}
    )
    kernelize(model, mode=Mode.INFERENCE, device="cuda" if not torch.cuda.is_available() else "cpu")
    entry = last_report(model)["model.norm"]
    assert entry.status == "original"
    assert entry.fallback in (
        KernelizeFallback.NO_COMPATIBLE_PROPERTIES,
        KernelizeFallback.NO_DEVICE,
    )


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), Device("cpu"), None])
def test_device_forms(device, repo_path):
    model = tiny_qwen3()
    register_kernel_mapping({"RMSNorm": {"cpu": norm_repo(repo_path)}})
    kernelize(model, mode=Mode.INFERENCE, device=device)
    assert last_report(model).device == "cpu" and len(rms(last_report(model).bound)) == NORMS


@pytest.mark.parametrize(
    ("kwargs", "model"),
    [
        ({"mode": Mode.INFERENCE, "device": "tpu:x"}, tiny_qwen3),
        ({"mode": Mode.INFERENCE, "device": "gpu"}, tiny_qwen3),
        ({"mode": Mode.INFERENCE, "device": 3}, tiny_qwen3),
        ({"mode": Mode.FALLBACK}, tiny_qwen3),
        ({"mode": Mode.TORCH_COMPILE}, tiny_qwen3),
        ({"mode": "inference"}, tiny_qwen3),
        ({"mode": Mode.INFERENCE, "use_fallback": "yes"}, tiny_qwen3),
        ({"mode": Mode.INFERENCE}, lambda: nn.Sequential(nn.ReLU())),
    ],
)
def test_bad_kernelize_arguments_raise_invalid_spec(kwargs, model):
    with pytest.raises(InvalidSpec):
        kernelize(model(), **kwargs)


def test_report_is_recorded_and_readable(repo_path):
    model = tiny_qwen3()
    assert last_report(model) is None
    register_kernel_mapping({"RMSNorm": {"cpu": norm_repo(repo_path)}})
    kernelize(model, mode=Mode.INFERENCE)
    report = last_report(model)
    text = str(report)
    assert text.splitlines()[0].startswith("kernelize Qwen3ForCausalLM  mode=INFERENCE  device=cpu")
    assert "model.layers.0.input_layernorm" in text and "bound" in text
    assert "no mapping for layer 'SiLU'" in text
    assert report["model.norm"].kernel.endswith("build/torch-universal:RMSNorm")
    paths = [e.path for e in report]
    assert paths.count("model.layers.0.self_attn.rotary_pos_emb") == 1
    # A deep copy carries the binding and the report along.
    clone = copy.deepcopy(model)
    assert bound_layer(clone.model.norm) is bound_layer(model.model.norm)
    assert last_report(clone) == report


def test_under_hip_cuda_means_rocm(monkeypatch):
    from kernels.layers.device import Target, resolve_target

    model = tiny_qwen3()
    assert resolve_target(model, "cuda") == Target("cuda")
    monkeypatch.setattr(torch.version, "hip", "6.2.0", raising=False)
    assert resolve_target(model, "cuda") == Target("rocm")
    assert resolve_target(model, "cuda:1") == Target("rocm", 1)
    assert resolve_target(model, torch.device("cuda", 2)) == Target("rocm", 2)
    assert resolve_target(model, Device("cuda")) == Target("rocm")
    assert resolve_target(model, "rocm") == Target("rocm")
    assert resolve_target(model, None) == Target("cpu")  # a CPU model stays on the CPU


def test_a_kernelize_that_raises_changes_nothing(repo_path):
    model = tiny_qwen3()
    register_kernel_mapping({"RMSNorm": {"cpu": norm_repo(repo_path)}})
    kernelize(model, mode=Mode.INFERENCE)
    before = last_report(model)
    broken = {
        "RMSNorm": {"cpu": norm_repo(repo_path, "RMSNormCompile")},
        "SiLU": {"cpu": norm_repo(repo_path, "Missing")},
    }
    with use_kernel_mapping(broken), pytest.raises(LayerError, match="Missing"):
        kernelize(model, mode=Mode.INFERENCE)
    assert {bound_layer(m).__name__ for m in norms(model)} == {"RMSNorm"}
    assert last_report(model) is before
