"""kernelize under transformers' tensor-parallel forward wrappers: the kernel becomes the forward
the wrapper calls, so the plan's collectives (here: q_norm/k_norm's gradient all-reduce hook)
keep running around it; restoring puts the class forward back under the wrapper."""

from __future__ import annotations

import torch
from kernels.layers import (
    LocalLayerRepository,
    Mode,
    kernelize,
    register_kernel_mapping,
    use_kernel_mapping,
)
from kernels.layers.binding import bound_layer

from .helpers import calls_of, tiny_qwen3, tokens


def _wrap_head_norms(model) -> dict:
    """Qwen3's plan puts "replicated_with_grad_allreduce" on every q_norm and k_norm; its wrapper
    needs the mesh only when a gradient arrives, which these tests never send."""
    from transformers.distributed.tensor_parallel import ReplicatedWithGradAllReduce

    wrapped = {}
    for layer in model.model.layers:
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            ReplicatedWithGradAllReduce().install_forward(norm, None)
            wrapped[norm] = norm.forward
    return wrapped


def test_a_kernel_binds_under_a_tp_wrapper_which_stays_outermost(repo_path):
    model = tiny_qwen3()
    model.train()
    wrapped = _wrap_head_norms(model)
    register_kernel_mapping(
        {"RMSNorm": {"cpu": LocalLayerRepository(repo_path, layer_name="RMSNorm")}}
    )
    for mode in (Mode.TRAINING, Mode.INFERENCE, Mode.TRAINING):  # rebinding is idempotent
        kernelize(model, mode=mode)
    for norm, wrapper in wrapped.items():
        assert norm.forward is wrapper  # the plan's wrapper still runs first
        assert bound_layer(norm) is not None and bound_layer(norm).__name__ == "RMSNorm"
    calls = calls_of(bound_layer(model.model.norm))
    before = calls["RMSNorm"]
    with torch.no_grad():
        expected = model(tokens()).logits
    model(tokens())  # with grad: the wrapper registers its gradient hook, once per weight
    # 2 layers x 4 norms + the final norm, twice
    assert calls["RMSNorm"] - before == 2 * 9
    for norm in wrapped:
        assert len(norm.weight._post_accumulate_grad_hooks) == 1

    with use_kernel_mapping({}, inherit_mapping=False):
        kernelize(model, mode=Mode.TRAINING)  # nothing maps: the original forwards come back
    for norm, wrapper in wrapped.items():
        assert norm.forward is wrapper and bound_layer(norm) is None
    before = calls["RMSNorm"]
    with torch.no_grad():
        got = model(tokens()).logits
    assert calls["RMSNorm"] == before  # the class forward runs under the wrapper again
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
