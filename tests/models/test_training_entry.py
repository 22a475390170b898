"""The one-line entry points: ``training_kernel_config(path)`` for ``from_pretrained``,
``apply_training_kernels(model)`` for a built model (kernels from `kernels serve` on loopback),
and the Liger-style dict for families it used to refuse."""

from __future__ import annotations

from pathlib import Path

import kernels
import pytest
import torch

from .registry import VOCAB, bound_name, build, train_steps

ROOT = Path(__file__).resolve().parents[2]
REPO = "kernels-lab/training"


@pytest.fixture
def mirror(hub):
    hub.build(ROOT / "hub_kernels")
    return hub


def test_kernel_config_from_a_checkpoint_path_is_accepted_by_transformers(mirror, tmp_path):
    """gemma2 used to fail with `Layer RMSNorm is not registered in the model`: the config is
    built from the path alone (a meta model), and transformers' own check of the mapping
    against the loaded model passes."""
    from transformers import AutoModelForCausalLM

    build("gemma2").save_pretrained(tmp_path / "ckpt")
    config = kernels.training_kernel_config(str(tmp_path / "ckpt"))
    assert config.kernel_mapping == {
        "ForCausalLM": f"{REPO}:ForCausalLM",
        "GeGLUMLP": f"{REPO}:GeGLUMLP",
        "GemmaRMSNorm": f"{REPO}:GemmaRMSNorm",
        "rotary_pos_emb": f"{REPO}:rotary_pos_emb",
    }
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    config.sanitize_kernel_mapping(model)  # raises "Layer ... is not registered" otherwise


def test_version_goes_in_transformers_tuple_form(mirror):
    from tests.models.registry import tiny_config

    config = kernels.training_kernel_config(tiny_config("llama"), version=1, revision="v1")
    assert config.kernel_mapping["RMSNorm"] == (f"{REPO}:RMSNorm", {"revision": "v1"})


def test_apply_training_kernels_reports_bound_and_unserved_modules(mirror):
    model = build("gptj")
    report = kernels.apply_training_kernels(model)
    assert kernels.last_report(model) is report
    bound = {e.layer_name for e in report if e.status == "bound"}
    assert {"LayerNorm", "CausalLMHead"} <= bound
    rotary = [e for e in report if e.layer_name == "rotary"]
    assert len(rotary) == 2 and all(e.status == "original" for e in rotary)
    assert all(e.path.endswith(".attn") for e in rotary)
    assert rotary[0].reason.startswith("takes (tensor, sin, cos)")
    assert "rotary" in str(report)


def test_trainer_trains_a_model_after_one_line(mirror, tmp_path):
    from transformers import Trainer, TrainingArguments

    model = build("qwen2")
    kernels.apply_training_kernels(model)
    data = [{"input_ids": torch.randint(0, VOCAB, (16,))} for _ in range(4)]
    for row in data:
        row["labels"] = row["input_ids"].clone()
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2,
        report_to=[], save_strategy="no", use_cpu=True,
    )  # fmt: skip
    result = Trainer(model=model, args=args, train_dataset=data).train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    assert model.lm_head.__class__ is torch.nn.Linear
    assert model.forward.__func__.__qualname__ == "ForCausalLM.forward"


def test_bad_source_is_a_typed_error():
    with pytest.raises(kernels.InvalidSpec, match="need a model, a config"):
        kernels.training_kernel_mapping(42)


def test_liger_mapping_for_mixtral_no_longer_refused(monkeypatch):
    """mixtral had no MixtralMLP to bind swiglu to (InvalidSpec with an irrelevant hint); now
    its classes are classified: the MoE head and norms bind, swiglu maps nothing."""
    from transformers import MixtralForCausalLM

    mapping = kernels.liger_kernel_mapping(model_class=MixtralForCausalLM)
    assert mapping == {
        "RMSNorm": f"{REPO}:RMSNorm",
        "rotary_pos_emb": f"{REPO}:rotary_pos_emb",
        "MoEForCausalLM": f"{REPO}:MoEForCausalLM",
    }


def test_moe_head_falls_back_to_the_family_forward_for_router_logits(mirror):
    """With output_router_logits=True the family adds the load-balancing loss; the MoE head
    then runs the family's own forward, so the loss still matches."""
    router = {"output_router_logits": True, "router_aux_loss_coef": 0.5}
    plain, ours = build("mixtral", overrides=router), build("mixtral", overrides=router)
    ours.load_state_dict(plain.state_dict())
    report = kernels.apply_training_kernels(ours)
    assert any(e.layer_name == "MoEForCausalLM" and e.status == "bound" for e in report)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (2, 12), generator=gen) for _ in range(2)]
    for a, b in zip(train_steps(ours, batches, 2), train_steps(plain, batches, 2), strict=True):
        assert a == pytest.approx(b, rel=1e-4)


def test_torch_compile_of_a_one_line_model(mirror):
    """phi3 (an undecorated rotary function routed per caller, a fused gate_up MLP) compiles
    and matches the plain model's loss and gradients."""
    plain = build("phi3", overrides={"rope_parameters": {"partial_rotary_factor": 0.5}})
    ours = build("phi3", overrides={"rope_parameters": {"partial_rotary_factor": 0.5}})
    kernels.apply_training_kernels(ours)
    torch._dynamo.reset()
    compiled = torch.compile(ours, backend="aot_eager")
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    for m in (plain, compiled):
        m.train()
        m(input_ids=ids, labels=ids).loss.backward()
    loss = compiled(input_ids=ids, labels=ids).loss
    assert loss.item() == pytest.approx(plain(input_ids=ids, labels=ids).loss.item(), rel=1e-5)
    for (name, p), q in zip(ours.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_generic_head_adds_the_familys_aux_loss(mirror):
    """GraniteMoE adds `router_aux_loss_coef * aux_loss` to its loss (with router logits on);
    the generic head runs its forward without labels, so it adds the same term itself."""
    from .registry import run_one

    router = {"output_router_logits": True, "router_aux_loss_coef": 0.5}
    outcome = run_one("granitemoe", overrides=router)
    assert outcome.status == "match", outcome
    assert "CausalLMHead" in outcome.bound, outcome


def test_llama4_experts_with_their_own_forward_stay_unbound_and_the_rest_binds(mirror):
    """Llama4's experts hold 3-D gate_up_proj/down_proj like transformers' routed experts, but
    their forward takes tokens already sorted per expert (hidden_states only): MoEExperts cannot
    replace it. They are reported unbound with why; the norms, MLP and head still bind and the
    model trains as the family's own does."""
    plain, ours = build("llama4_text"), build("llama4_text")
    ours.load_state_dict(plain.state_dict())
    report = kernels.apply_training_kernels(ours)
    experts = [e for e in report if bound_name(ours, e.path).endswith("Experts")]
    assert experts and all(e.status == "original" for e in experts)
    assert "top_k_index" in experts[0].reason
    bound = {e.layer_name for e in report if e.status == "bound"}
    assert {"RMSNorm", "SwiGLUMLP", "complex_rotary_emb"} <= bound
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (2, 12), generator=gen) for _ in range(2)]
    for a, b in zip(train_steps(ours, batches, 2), train_steps(plain, batches, 2), strict=True):
        assert a == pytest.approx(b, rel=1e-4)


def test_liger_mapping_names_the_layers_liger_patches_on_falcon_h1_and_llama4():
    """Liger's swiglu patches Falcon-H1's muP-scaled MLP and its rope Llama 4's complex
    rotary: the Liger-style mapping names the layers that serve them."""
    from transformers import FalconH1ForCausalLM, Llama4ForCausalLM

    falcon = kernels.liger_kernel_mapping(model_class=FalconH1ForCausalLM)
    assert falcon["ScaledSwiGLUMLP"] == f"{REPO}:ScaledSwiGLUMLP"
    llama4 = kernels.liger_kernel_mapping({"rope": True}, model_class=Llama4ForCausalLM)
    assert llama4["complex_rotary_emb"] == f"{REPO}:complex_rotary_emb"
    assert "complex_rotary_emb" not in kernels.liger_kernel_mapping(
        {"rope": False}, model_class=Llama4ForCausalLM
    )
