"""ReLU² by structure: a non-gated MLP whose activation computes relu(x)^2 is served by
ReLUSquaredMLP whatever its projections are called, a parameter-free module computing relu(x)^2
by ReLUSquared whatever its class is called; anything else keeps what it had."""

from __future__ import annotations

import pytest
import torch
from kernels.training import classify
from kernels.training.classify import MLP_PROJECTIONS
from torch import nn

from .registry import run_one


class SquaredReLU(nn.Module):  # Primer's form, not transformers' class
    def forward(self, x):
        r = torch.relu(x)
        return r * r


class Square(nn.Module):  # no relu: negative inputs give it away
    def forward(self, x):
        return x * x


class PlainMLP(nn.Module):
    def __init__(self, act: nn.Module, residual: bool = False):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 96), nn.Linear(96, 32)
        self.activation_fn, self.residual = act, residual

    def forward(self, hidden_states):
        out = self.fc2(self.activation_fn(self.fc1(hidden_states)))
        return out + hidden_states if self.residual else out


def _verdicts(model):
    return {cls.__name__: v for cls, v in classify(model).classes.items()}


def test_a_relu_squared_mlp_binds_with_its_projection_names():
    verdicts = _verdicts(nn.Sequential(PlainMLP(SquaredReLU())))
    mlp = verdicts["PlainMLP"]
    assert mlp.layer == "ReLUSquaredMLP"
    assert dict(mlp.attributes) == {MLP_PROJECTIONS: ("fc1", "fc2")}
    assert verdicts["SquaredReLU"].layer == "ReLUSquared"


# (a GELU or a plain ReLU binds GELUMLP: tests/models/test_classify_vlm.py)
@pytest.mark.parametrize("act", [nn.SiLU(), Square()], ids=lambda a: type(a).__name__)
def test_other_activations_keep_the_non_gated_report(act):
    verdicts = _verdicts(nn.Sequential(PlainMLP(act)))
    assert verdicts["PlainMLP"].layer is None
    assert verdicts["PlainMLP"].reason.startswith("not gated")
    assert type(act).__name__ not in verdicts  # no activation verdict, no report line


class OutFirstMLP(nn.Module):  # declares the output projection first
    def __init__(self):
        super().__init__()
        self.w_out, self.w_in = nn.Linear(96, 32), nn.Linear(32, 96)
        self.act = SquaredReLU()

    def forward(self, x):
        return self.w_out(self.act(self.w_in(x)))


def test_the_projections_order_comes_from_the_forward_not_the_declaration():
    mlp = _verdicts(nn.Sequential(OutFirstMLP()))["OutFirstMLP"]
    assert mlp.layer == "ReLUSquaredMLP"
    assert dict(mlp.attributes) == {MLP_PROJECTIONS: ("w_in", "w_out")}


def test_a_relu_squared_mlp_that_computes_more_is_not_bound():
    verdicts = _verdicts(nn.Sequential(PlainMLP(SquaredReLU(), residual=True)))
    assert verdicts["PlainMLP"].layer is None
    assert verdicts["PlainMLP"].reason == "does not compute fc2(relu(fc1(x))^2)"


@pytest.fixture
def mirror(hub):
    from pathlib import Path

    hub.build(Path(__file__).resolve().parents[2] / "hub_kernels")
    return hub


# nanochat: fc1/fc2, no biases (the lean path); persimmon: dense_h_to_4h/dense_4h_to_h with
# biases (the composed path); nemotron_h: up/down next to Mamba mixers
@pytest.mark.parametrize("model_type", ["nanochat", "persimmon", "nemotron_h"])
def test_relu_squared_families_bind_and_train_as_before(mirror, model_type):
    outcome = run_one(model_type)
    assert outcome.status == "match", (outcome.loss_diff, outcome.grad_diff, outcome.reason)
    mlps = [n for n, layer in outcome.classes.items() if layer == "ReLUSquaredMLP"]
    assert len(mlps) == 1 and mlps[0].endswith("MLP"), outcome.classes
    assert outcome.classes.get("ReLUSquaredActivation") == "ReLUSquared", outcome.classes


def test_liger_style_relu_squared_key_maps_the_relu_squared_layers():
    """Liger's nemotron switch ``relu_squared`` (on by default) names ReLUSquared and
    ReLUSquaredMLP for a classified model class; without one it maps nothing new. (Arcee: the
    model_class path builds the default config, which Nemotron's cannot build with.)"""
    import kernels
    from transformers import ArceeForCausalLM

    on = kernels.liger_kernel_mapping(model_class=ArceeForCausalLM)
    assert {k: v.split(":")[-1] for k, v in on.items() if "ReLU" in k} == {
        "ReLUSquared": "ReLUSquared",
        "ReLUSquaredMLP": "ReLUSquaredMLP",
    }
    off = kernels.liger_kernel_mapping({"relu_squared": False}, model_class=ArceeForCausalLM)
    assert not any("ReLU" in k for k in off), off
    assert not any("ReLU" in k for k in kernels.liger_kernel_mapping())


def test_probing_an_activation_runs_none_of_its_hooks():
    calls = []
    act = SquaredReLU()
    act.register_forward_hook(lambda *a: calls.append("hook"))
    assert _verdicts(nn.Sequential(PlainMLP(act)))["SquaredReLU"].layer == "ReLUSquared"
    assert calls == []
