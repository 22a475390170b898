"""Training with this project's kernels on the CPU: the Liger-style switch, and transformers'
Trainer keeping the kernels bound through train() (the kernels come from `kernels serve`)."""

from __future__ import annotations

from pathlib import Path

import kernels
import pytest
import torch
from kernels import InvalidSpec, liger_kernel_mapping

ROOT = Path(__file__).resolve().parent.parent
REPO = "kernels-lab/training"


def tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=256, head_dim=16, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).float()


@pytest.fixture(autouse=True)
def _restore_layer_names(monkeypatch):
    """liger_kernel_mapping(model_class=...) names classes process-wide (as Liger patches them);
    undo it after each test so other tests see transformers' classes as they are."""
    from transformers.models.qwen3 import modeling_qwen3

    for cls in (modeling_qwen3.Qwen3MLP, modeling_qwen3.Qwen3ForCausalLM, torch.nn.LayerNorm):
        for attr in ("kernel_layer_name", "kernel_condition"):
            monkeypatch.setattr(cls, attr, cls.__dict__.get(attr), raising=False)
            if attr not in cls.__dict__:
                monkeypatch.delattr(cls, attr)


@pytest.fixture
def mirror(hub):
    hub.build(ROOT / "hub_kernels")
    return hub


def test_liger_defaults_map_to_our_layers():
    assert liger_kernel_mapping() == {
        "rotary_pos_emb": f"{REPO}:rotary_pos_emb",
        "RMSNorm": f"{REPO}:RMSNorm",
        "SwiGLUMLP": f"{REPO}:SwiGLUMLP",
        "ForCausalLM": f"{REPO}:ForCausalLM",
    }
    config = {
        "rope": True,
        "cross_entropy": True,
        "fused_linear_cross_entropy": False,
        "rms_norm": False,
    }
    assert liger_kernel_mapping(config) == {
        "rotary_pos_emb": f"{REPO}:rotary_pos_emb",
        "SwiGLUMLP": f"{REPO}:SwiGLUMLP",
        "ForCausalLM": f"{REPO}:ForCausalLMCrossEntropy",
    }
    assert liger_kernel_mapping({"swiglu": False}, version=2)["RMSNorm"] == (
        f"{REPO}:RMSNorm",
        {"version": 2},
    )


@pytest.mark.parametrize(
    "config, message",
    [
        ({"cross_entropy": True}, "both on"),  # FLCE is on by default, as in Liger
        ({"swiglu": True, "geglu": True}, "both on"),
        ({"rotary": True}, "unknown"),
        ({"rope": "yes"}, "True or False"),
    ],
)
def test_conflicts_and_bad_keys_are_clear_errors(config, message):
    with pytest.raises(InvalidSpec, match=message) as err:
        liger_kernel_mapping(config)
    assert err.value.hint or "supported" in str(err.value) or "both" in str(err.value)


@pytest.mark.parametrize("loss_key", ["fused_linear_cross_entropy", "cross_entropy"])
def test_liger_style_mapping_trains_a_tiny_qwen3_like_the_original(mirror, loss_key):
    from transformers import Qwen3ForCausalLM

    config = {
        "cross_entropy": loss_key == "cross_entropy",
        "fused_linear_cross_entropy": loss_key != "cross_entropy",
    }
    mapping = liger_kernel_mapping(config, model_class=Qwen3ForCausalLM)
    reference, model = tiny_qwen3(), tiny_qwen3()
    report = kernels.apply_kernels(model, mapping, mode=kernels.Mode.TRAINING)
    bound = [e for e in report if e.status == "bound"]
    # 2 layers x (4 norms + rotary + MLP) + the final norm + the causal-LM head
    assert len(bound) == 14, str(report)
    ids = torch.randint(0, 256, (2, 12))
    for m in (reference, model):
        m.train()
    out_ref = reference(input_ids=ids, labels=ids)
    out = model(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=1e-5, atol=1e-6)
    if loss_key == "fused_linear_cross_entropy":
        assert out.logits is None  # the fused loss never builds them in training
    else:
        torch.testing.assert_close(out.logits, out_ref.logits, rtol=1e-5, atol=1e-5)
    out.loss.backward()
    out_ref.loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def _trainer_run(model, tmp_path, name):
    """Three Trainer steps on fixed data; returns the loss of each step."""
    from transformers import Trainer, TrainingArguments

    gen = torch.Generator().manual_seed(5)
    data = [{"input_ids": torch.randint(0, 256, (16,), generator=gen)} for _ in range(8)]
    for row in data:
        row["labels"] = row["input_ids"].clone()
    args = TrainingArguments(
        output_dir=str(tmp_path / name), max_steps=3, per_device_train_batch_size=2,
        report_to=[], save_strategy="no", use_cpu=True, logging_steps=1, seed=0, data_seed=0,
        learning_rate=1e-3,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_keeps_the_kernels_through_train(mirror, tmp_path):
    """Trainer.train() (which calls model.train() itself) keeps the norms bound, and the run
    follows the same Trainer run without kernels, step by step."""
    from transformers import AutoModelForCausalLM

    tiny_qwen3().save_pretrained(tmp_path / "model")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    layer = kernels.LayerRepository(REPO, layer_name="RMSNorm", version=1)
    with kernels.use_kernel_mapping({"RMSNorm": {"cpu": layer}}):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", use_kernels=True)
        eval_report = kernels.last_report(model)
        assert sum(e.status == "bound" for e in eval_report) == 9  # 2 layers x 4 norms + final
        losses = _trainer_run(model, tmp_path, "kernels")
    ref_losses = _trainer_run(reference, tmp_path, "reference")
    train_report = kernels.last_report(model)
    assert train_report.mode & kernels.Mode.TRAINING
    assert all(e.status == "bound" for e in train_report if e.layer_name == "RMSNorm")
    norm_forward = model.model.norm.forward
    assert getattr(norm_forward, "__func__", None).__qualname__ == "RMSNorm.forward"
    assert type(model.model.norm).__name__ == "Qwen3RMSNorm"
    assert len(losses) == 3
    # fp32 on the CPU: the logged losses (rounded to 4 decimals by Trainer) agree to that. The
    # weights are not compared: AdamW's first steps move every weight by about lr whatever the
    # size of its gradient, so rounding-level gradient differences show as lr-sized ones.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=2e-4)


def test_fused_add_rms_norm_binds_from_the_hub_onto_a_users_module(mirror):
    """A model of the user's own with a (hidden_states, residual) norm declares the layer name;
    the Hub layer then trains it like its own forward."""

    @kernels.use_kernel_forward_from_hub("FusedAddRMSNorm")
    class AddNorm(torch.nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.rand(n) + 0.5)
            self.variance_epsilon = 1e-6

        def forward(self, hidden_states, residual):
            s = residual + hidden_states
            rstd = torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return self.weight * (s * rstd), s

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj, self.norm = torch.nn.Linear(48, 48), AddNorm(48)

        def forward(self, x):
            y, s = self.norm(self.proj(x), x)
            return (y * s).sum()

    torch.manual_seed(0)
    ours, ref = Block().train(), Block().train()
    ref.load_state_dict(ours.state_dict())
    report = kernels.apply_kernels(ours, {"FusedAddRMSNorm": f"{REPO}:FusedAddRMSNorm"})
    assert [e.status for e in report] == ["bound"]
    assert ours.norm.forward.__func__.__qualname__ == "FusedAddRMSNorm.forward"
    x = torch.randn(4, 7, 48)
    loss, loss_ref = ours(x), ref(x)
    loss.backward()
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-5)
    for (name, p), p_ref in zip(ours.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-5, msg=name)
