"""Functions as kernel layers: bound per calling module, so models stay independent."""

from __future__ import annotations

import copy
import inspect
import pickle
import threading

import pytest
import torch
from kernels import LayerError
from kernels.layers import (
    KernelFunction,
    LocalLayerRepository,
    Mode,
    kernelize,
    last_report,
    register_kernel_mapping,
    use_kernel_forward_from_hub,
    use_kernelized_func,
)
from kernels.layers.funcs import _ACTIVE_OWNERS, function_binding
from torch import nn

from .helpers import ROTARIES, calls_of, tiny_llama, tiny_qwen3, tokens


@use_kernel_forward_from_hub("SiLU")
def silu(input):
    """Plain SiLU."""
    return nn.functional.silu(input)


@use_kernelized_func(silu)
class Block(nn.Module):
    def __init__(self, fail: bool = False):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.fail = fail

    def forward(self, x):
        if self.fail:
            raise RuntimeError("inside the owner's forward")
        return silu(self.proj(x))


def rotary_repo(path):
    return LocalLayerRepository(path, layer_name="Rotary")


def test_a_decorated_function_is_a_module_called_like_the_function():
    assert isinstance(silu, KernelFunction) and isinstance(silu, nn.Module)
    assert type(silu).kernel_layer_name == silu.kernel_layer_name == "SiLU"
    x = torch.randn(5)
    torch.testing.assert_close(silu(x), nn.functional.silu(x))
    assert str(inspect.signature(silu)) == "(input)"
    assert list(inspect.signature(type(silu).forward).parameters) == ["self", "input"]
    assert silu.__doc__ == "Plain SiLU."
    assert Block().__dict__["_kernel_funcs"] == {"SiLU": silu}  # keyed by the layer name


def test_shared_function_modules_survive_copy_and_pickle():
    assert copy.deepcopy(silu) is silu
    assert pickle.loads(pickle.dumps(silu)) is silu


def test_use_kernelized_func_needs_decorated_functions():
    def plain(x):
        return x

    with pytest.raises(LayerError, match="use_kernel_forward_from_hub"):
        use_kernelized_func(plain)
    with pytest.raises(LayerError):
        use_kernel_forward_from_hub("X")(42)
    with pytest.raises(LayerError):
        use_kernel_forward_from_hub("")


def test_transformers_rotary_is_a_kernel_function():
    from transformers.models.qwen3 import modeling_qwen3

    rotary = modeling_qwen3.apply_rotary_pos_emb
    assert isinstance(rotary, KernelFunction) and rotary.kernel_layer_name == "rotary_pos_emb"
    assert str(inspect.signature(rotary)) == "(q, k, cos, sin, unsqueeze_dim=1)"
    attention = tiny_qwen3().model.layers[0].self_attn
    assert attention.__dict__["_kernel_funcs"] == {"rotary_pos_emb": rotary}


@pytest.mark.parametrize("make_model", [tiny_qwen3, tiny_llama])
def test_kernelizing_one_model_leaves_another_alone(make_model, repo_path):
    kernelized, other = make_model(seed=1), make_model(seed=1)
    x = tokens()
    with torch.no_grad():
        expected = other(x).logits
    register_kernel_mapping({"rotary_pos_emb": {"cpu": rotary_repo(repo_path)}})
    kernelize(kernelized, mode=Mode.INFERENCE)
    report = last_report(kernelized)
    assert [e.path for e in report.bound] == [
        f"model.layers.{i}.self_attn.rotary_pos_emb" for i in range(ROTARIES)
    ]
    layer = function_binding(kernelized.model.layers[0].self_attn, _rotary_of(kernelized))
    calls = calls_of(layer)
    with torch.no_grad():
        got = kernelized(x).logits
    assert calls["Rotary"] == ROTARIES
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        again = other(x).logits  # the shared function, called by the other model
    assert calls["Rotary"] == ROTARIES
    torch.testing.assert_close(again, expected, rtol=0, atol=0)
    # Called outside any owner, it is the plain function.
    q = k = torch.randn(1, 2, 3, 4)
    cos = sin = torch.randn(1, 3, 4)
    _rotary_of(kernelized)(q, k, cos, sin)
    assert calls["Rotary"] == ROTARIES


def _rotary_of(model):
    return model.model.layers[0].self_attn.__dict__["_kernel_funcs"]["rotary_pos_emb"]


def test_rotary_kernel_has_gradients(repo_path):
    """The bound rotary runs in the training forward (counted: gradients equal to the reference's
    prove nothing if the plain function ran) and its gradients match the plain function's."""
    reference, model = tiny_qwen3(seed=2).train(), tiny_qwen3(seed=2).train()
    register_kernel_mapping({"rotary_pos_emb": {"cpu": rotary_repo(repo_path)}})
    kernelize(model, mode=Mode.TRAINING)
    assert len(last_report(model).bound) == ROTARIES
    layer = function_binding(model.model.layers[0].self_attn, _rotary_of(model))
    calls = calls_of(layer)
    before = calls["Rotary"]
    x = tokens(seed=4)
    reference(x, labels=x).loss.backward()
    model(x, labels=x).loss.backward()
    assert calls["Rotary"] - before == ROTARIES
    for (name, a), (_, b) in zip(
        reference.named_parameters(), model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_unbinding_removes_the_owner_hooks(repo_path):
    model = tiny_qwen3()
    attention = model.model.layers[0].self_attn
    register_kernel_mapping({"rotary_pos_emb": {"cpu": rotary_repo(repo_path)}})
    kernelize(model, mode=Mode.INFERENCE)
    assert len(attention._forward_pre_hooks) == 1 and len(attention._forward_hooks) == 1
    register_kernel_mapping({}, inherit_mapping=False)
    kernelize(model, mode=Mode.INFERENCE)
    assert len(attention._forward_pre_hooks) == 0 and len(attention._forward_hooks) == 0
    assert len(attention._forward_hooks_always_called) == 0
    assert "_kernels_func_bindings" not in attention.__dict__


def test_a_deep_copy_is_bound_on_its_own(repo_path):
    model = tiny_qwen3()
    register_kernel_mapping({"rotary_pos_emb": {"cpu": rotary_repo(repo_path)}})
    kernelize(model, mode=Mode.INFERENCE)
    clone = copy.deepcopy(model)
    register_kernel_mapping({}, inherit_mapping=False)
    kernelize(model, mode=Mode.INFERENCE)  # unbinds the original only
    layer = function_binding(clone.model.layers[0].self_attn, _rotary_of(clone))
    assert layer is not None
    before = calls_of(layer)["Rotary"]
    clone(tokens())
    model(tokens())
    assert calls_of(layer)["Rotary"] - before == ROTARIES


def test_owner_leaves_the_stack_when_its_forward_raises(tmp_path):
    from .helpers import kernel_files, write_repo

    path = write_repo(tmp_path / "k", kernel_files(salt="owner-stack"))
    model = nn.Sequential(Block(), Block(fail=True))
    register_kernel_mapping({"SiLU": {"cpu": LocalLayerRepository(path, layer_name="SiLU")}})
    kernelize(model, mode=Mode.INFERENCE)
    assert len(last_report(model).bound) == 2
    with pytest.raises(RuntimeError, match="inside the owner"):
        model(torch.randn(2, 4))
    assert _ACTIVE_OWNERS.get() == ()
    layer = function_binding(model[0], silu)
    before = calls_of(layer)["SiLU"]
    model[0](torch.randn(2, 4))
    assert calls_of(layer)["SiLU"] - before == 1
    assert _ACTIVE_OWNERS.get() == ()


def test_owners_are_tracked_per_thread(tmp_path):
    from .helpers import kernel_files, write_repo

    path = write_repo(tmp_path / "k", kernel_files(salt="threads"))
    bound, plain = Block(), Block()
    register_kernel_mapping({"SiLU": {"cpu": LocalLayerRepository(path, layer_name="SiLU")}})
    kernelize(bound, mode=Mode.INFERENCE)
    layer = function_binding(bound, silu)
    errors = []

    def run(block, n):
        try:
            for _ in range(n):
                block(torch.randn(2, 4))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(b, 50)) for b in (bound, plain, bound, plain)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert calls_of(layer)["SiLU"] == 100


def test_a_function_module_held_as_a_child_is_bound_through_its_parent(tmp_path):
    from .helpers import kernel_files, write_repo

    path = write_repo(tmp_path / "k", kernel_files(salt="child"))

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.act = silu  # registered as a submodule

        def forward(self, x):
            return self.act(x)

    model, other = Holder(), Holder()
    register_kernel_mapping({"SiLU": {"cpu": LocalLayerRepository(path, layer_name="SiLU")}})
    kernelize(model, mode=Mode.INFERENCE, device="cpu")  # no parameters to tell the device
    assert [e.path for e in last_report(model).bound] == ["act"]
    assert "forward" not in silu.__dict__  # the shared module itself is never rebound
    layer = function_binding(model, silu)
    model(torch.randn(3))
    other(torch.randn(3))
    assert calls_of(layer)["SiLU"] == 1
