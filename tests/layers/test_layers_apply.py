"""apply_kernels: spec strings in, a report out; dry runs; bad input."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from kernels import InvalidSpec, LayerError
from kernels.layers import (
    BindReport,
    LayerRepository,
    LocalLayerRepository,
    Mode,
    apply_kernels,
    last_report,
    plan_kernels,
    register_kernel_mapping,
)
from kernels.layers.apply import as_repository, declared_layer_names
from kernels.layers.binding import bound_layer

from .helpers import ACTIVATIONS, NORMS, calls_of, tiny_qwen3, tokens

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("org/repo:RMSNorm", LayerRepository("org/repo", layer_name="RMSNorm", version=1)),
        ("org/repo@v2:RMSNorm", LayerRepository("org/repo", layer_name="RMSNorm", version=2)),
        (
            "org/repo@main:RMSNorm",
            LayerRepository("org/repo", layer_name="RMSNorm", revision="main"),
        ),
        (
            "org/repo@v1.0.0:RMSNorm",
            LayerRepository("org/repo", layer_name="RMSNorm", revision="v1.0.0"),
        ),
        (
            f"org/repo@{COMMIT}:RMSNorm",
            LayerRepository("org/repo", layer_name="RMSNorm", revision=COMMIT),
        ),
        ("/abs/path:RMSNorm", LocalLayerRepository(Path("/abs/path"), layer_name="RMSNorm")),
    ],
)
def test_spec_strings(spec, expected):
    assert as_repository(spec) == expected


@pytest.mark.parametrize(
    "spec",
    ["org/repo", "repo:RMSNorm", "org/repo@:RMSNorm", "org/repo:Bad-Name", "rel/../x", 3, ""],
)
def test_bad_specs_are_invalid_spec(spec):
    with pytest.raises(InvalidSpec):
        as_repository(spec)


def test_unknown_layer_names_are_refused_with_what_the_model_declares(repo_path):
    model = tiny_qwen3()
    assert declared_layer_names(model) == {"RMSNorm", "SiLU", "rotary_pos_emb"}
    with pytest.raises(LayerError) as err:
        apply_kernels(model, {"LayerNorm": f"{repo_path}:RMSNorm"})
    assert "'LayerNorm'" in str(err.value) and "RMSNorm, SiLU, rotary_pos_emb" in str(err.value)
    with pytest.raises(InvalidSpec):
        apply_kernels(model, [("RMSNorm", f"{repo_path}:RMSNorm")])


def test_apply_binds_only_the_named_layers_and_reports(repo_path):
    model = tiny_qwen3()
    x = tokens()
    with torch.no_grad():
        expected = model(x).logits
    report = apply_kernels(
        model,
        {
            "RMSNorm": f"{repo_path}:RMSNorm",
            "SiLU": LocalLayerRepository(repo_path, layer_name="SiLU"),
        },
    )
    assert isinstance(report, BindReport) and last_report(model) == report
    assert report.mode == Mode.INFERENCE and report.device == "cpu" and not report.dry_run
    assert {e.layer_name for e in report} == {"RMSNorm", "SiLU"}  # the rotary is not touched
    assert len(report.bound) == NORMS + ACTIVATIONS and report.kept == ()
    calls = calls_of(bound_layer(model.model.norm))
    with torch.no_grad():
        got = model(x).logits
    assert calls["RMSNorm"] == NORMS and calls["SiLU"] == ACTIVATIONS
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    text = str(report)
    assert "model.layers.1.mlp.act_fn" in text and f"{NORMS + ACTIVATIONS} bound" in text


def test_apply_leaves_other_layers_bindings_alone(repo_path):
    model = tiny_qwen3()
    register_kernel_mapping({"SiLU": {"cpu": LocalLayerRepository(repo_path, layer_name="SiLU")}})
    from kernels.layers import kernelize

    kernelize(model, mode=Mode.INFERENCE)
    apply_kernels(model, {"RMSNorm": f"{repo_path}:RMSNorm"})
    assert bound_layer(model.model.layers[0].mlp.act_fn) is not None
    assert bound_layer(model.model.norm) is not None


def test_mode_follows_the_model_and_no_backward_keeps_the_original_in_training(repo_path):
    model = tiny_qwen3().train()
    report = apply_kernels(model, {"RMSNorm": f"{repo_path}:RMSNormNoBackward"})
    assert report.mode == Mode.TRAINING and report.bound == ()
    assert all("no backward" in e.reason for e in report.kept)
    report = apply_kernels(
        model, {"RMSNorm": f"{repo_path}:RMSNormNoBackward"}, mode=Mode.INFERENCE
    )
    assert len(report.bound) == NORMS


def test_dry_run_plans_without_importing_or_touching_the_model(repo_path):
    model = tiny_qwen3()
    modules_before = set(sys.modules)
    report = apply_kernels(
        model, {"RMSNorm": f"{repo_path}:RMSNorm", "SiLU": f"{repo_path}:Nope"}, dry_run=True
    )
    assert report.dry_run and last_report(model) is None
    assert set(sys.modules) == modules_before  # nothing imported
    assert all("forward" not in vars(m) for m in model.modules())
    assert {e.status for e in report} == {"would bind"}
    assert report["model.norm"].kernel == f"{repo_path}:RMSNorm"
    assert str(report).startswith("plan (dry run) Qwen3ForCausalLM")


def test_dry_run_against_the_hub_makes_no_request(hub):
    model = tiny_qwen3()
    report = apply_kernels(model, {"RMSNorm": "org/norms@v3:RMSNorm"}, dry_run=True)
    assert report["model.norm"].kernel == "org/norms@v3:RMSNorm"
    assert hub.requests == []


def test_plan_kernels_shows_what_kernelize_would_do_and_what_would_raise(repo_path):
    model = tiny_qwen3().train()
    register_kernel_mapping(
        {
            "RMSNorm": {
                "cpu": {Mode.INFERENCE: LocalLayerRepository(repo_path, layer_name="RMSNorm")}
            }
        }
    )
    modules_before = set(sys.modules)
    report = plan_kernels(model, mode=Mode.TRAINING, use_fallback=False)
    assert set(sys.modules) == modules_before and last_report(model) is None
    statuses = {e.layer_name: e.status for e in report}
    assert statuses == {
        "RMSNorm": "would raise",
        "SiLU": "would raise",
        "rotary_pos_emb": "would raise",
    }
    assert "no entry for mode TRAINING (registered: INFERENCE)" in report["model.norm"].reason
    report = plan_kernels(model, mode=Mode.INFERENCE)
    assert (
        report["model.norm"].status == "would bind" and report["model.norm"].mode == Mode.INFERENCE
    )
    assert report["model.layers.0.mlp.act_fn"].status == "original"
