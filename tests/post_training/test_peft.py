"""PEFT (peft 0.21) on a model the training kernels are bound to: every LoRA adapter is
trained, never silently dropped.

The kernels are bound first and PEFT wraps after (what from_pretrained(use_kernels=True) then
get_peft_model, or a TRL trainer with a peft_config, does). The layers that read a projection's
weight directly take their fused path only for plain nn.Linear modules; a LoRA-wrapped
projection runs its own forward inside the layer. The loss head folds a LoRA adapter on lm_head
into the fused kernels (x @ W.T + s * B(A(x)) as one Linear over [x, s * A(x)] and [W, B]);
an adapter it cannot fold (DoRA) makes the head build its logits through the module, with a
warning. Each case: loss and every LoRA gradient against the same PEFT model without kernels.
"""

from __future__ import annotations

import copy
import warnings

import kernels
import pytest
import torch

from tests.models.registry import VOCAB, build

peft = pytest.importorskip("peft")

SEQ = 12


def _pair(model_type: str, targets, **lora):
    plain = build(model_type).float().train()
    ours = copy.deepcopy(plain)
    report = kernels.apply_training_kernels(ours)
    config = dict(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False)
    config.update(lora)
    models = []
    for m in (plain, ours):
        torch.manual_seed(1)  # the same adapter weights on both
        models.append(peft.get_peft_model(m, peft.LoraConfig(target_modules=targets, **config)))
    return models[0], models[1], report


def _step(model, ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out


def _check_lora_grads(ours, plain, rtol=1e-4):
    lora = [(n, p) for n, p in ours.named_parameters() if p.requires_grad]
    ref = dict(plain.named_parameters())
    assert lora and all("lora_" in n for n, _ in lora), [n for n, _ in lora]
    for name, p in lora:
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name} got no gradient"
        q = ref[name].grad
        dist = (p.grad - q).norm() / q.norm()
        assert dist <= rtol, (name, dist.item())
    return [n for n, _ in lora]


@pytest.mark.parametrize(
    "model_type, bound",
    [
        ("qwen3", {"SwiGLUMLP", "ForCausalLM"}),  # separate gate/up/down, Llama-style head
        ("phi3", {"FusedSwiGLUMLP", "FusedQKVAttention"}),  # fused qkv and gate_up projections
    ],
)
def test_all_linear_adapters_train_through_the_bound_layers(local_kernels, model_type, bound):
    plain, ours, report = _pair(model_type, "all-linear")
    assert bound <= {e.layer_name for e in report.bound}, str(report)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    out, ref = _step(ours, ids), _step(plain, ids)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    names = _check_lora_grads(ours, plain)
    assert any("mlp" in n for n in names) and any("attn" in n for n in names), names


@pytest.mark.parametrize("model_type", ["qwen3", "gemma2", "gpt2"])
def test_lora_on_lm_head_is_folded_into_the_fused_loss(local_kernels, model_type):
    """qwen3: ForCausalLM with a tied head; gemma2: soft-capped logits; gpt2: CausalLMHead.
    The loss stays fused (no logits in training) and lm_head's adapter is trained."""
    plain, ours, report = _pair(model_type, ["lm_head"], lora_dropout=0.0)
    head = {"gpt2": "CausalLMHead"}.get(model_type, "ForCausalLM")
    assert head in {e.layer_name for e in report.bound}, str(report)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the unfused fallback warns
        out = _step(ours, ids)
    ref = _step(plain, ids)
    assert out.logits is None and ref.logits is not None
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    names = _check_lora_grads(ours, plain)
    assert any("lm_head.lora_A" in n for n in names) and any("lm_head.lora_B" in n for n in names)


def test_lm_head_adapters_off_use_the_base_weight(local_kernels):
    """DPO with PEFT takes the reference log-probs with the adapters disabled."""
    plain, ours, _ = _pair("qwen3", ["lm_head"])
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with ours.disable_adapter(), plain.disable_adapter(), torch.no_grad():
        off, off_ref = ours(input_ids=ids, labels=ids), plain(input_ids=ids, labels=ids)
    on = ours(input_ids=ids, labels=ids)
    torch.testing.assert_close(off.loss, off_ref.loss, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(on.loss, off.loss)  # the adapter does change the loss


def test_an_adapter_the_head_cannot_fold_runs_the_head_module(local_kernels):
    """DoRA on lm_head: the head's own forward makes the logits (said in a warning) and the
    adapter is trained exactly as without kernels."""
    plain, ours, _ = _pair("qwen3", ["lm_head"], use_dora=True)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="cannot fold lm_head"):
        out = _step(ours, ids)
    ref = _step(plain, ids)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    names = _check_lora_grads(ours, plain)
    assert any("lora_magnitude_vector" in n for n in names)
