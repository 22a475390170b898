"""Every TRL 1.16 trainer (SFT, DPO, KTO, Reward, GRPO, RLOO, Distillation) with this package's
kernels, switched on both ways a user would (trl_runs.py): 3 steps on a tiny model on the CPU,
each step's loss and every parameter's gradient against the same trainer without kernels
(fp32: 1e-4 relative per gradient tensor), and which fused path served TRL's fused-head calls.

The default run keeps SFT, DPO and GRPO with ``apply_training_kernels`` and DPO with
``use_kernels``; the rest of the matrix (and Gemma-2, soft-capped logits) runs under
``KERNELS_SWEEP=1``.
"""

from __future__ import annotations

import pytest
from kernels.training import trl_head

from tests.sweep import sweep_param

from . import trl_runs

pytest.importorskip("trl")
pytest.importorskip("datasets")

_PLAIN: dict[tuple[str, str], trl_runs.Run] = {}  # plain runs, shared by the switches


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl-ckpts")
    return {
        family: (
            trl_runs.save_checkpoint(root / family, family),
            trl_runs.save_checkpoint(root / f"{family}-teacher", family, seed=1),
        )
        for family in ("qwen3", "gemma2")
    }


def _plain(trainer, family, checkpoints, tmp_path):
    key = (trainer, family)
    if key not in _PLAIN:
        ckpt, teacher = checkpoints[family]
        _PLAIN[key] = trl_runs.run(trainer, family, "plain", ckpt, tmp_path / "plain", teacher)
    return _PLAIN[key]


def _matrix():
    fast = {("sft", "apply"), ("dpo", "apply"), ("grpo", "apply"), ("dpo", "use_kernels")}
    cases = []
    for trainer in trl_runs.TRAINERS:
        for switch in ("apply", "use_kernels"):
            case = (trainer, "qwen3", switch)
            if (trainer, switch) in fast:
                cases.append(pytest.param(*case, id="-".join(case)))
            else:
                cases.append(sweep_param(*case, what="the TRL trainer matrix", id="-".join(case)))
    for trainer in ("sft", "dpo", "grpo", "distillation"):
        case = (trainer, "gemma2", "apply")
        cases.append(sweep_param(*case, what="the TRL trainer matrix", id="-".join(case)))
    return cases


@pytest.mark.parametrize("trainer, family, switch", _matrix())
def test_trainer_matches_the_plain_trainer(
    local_kernels, checkpoints, tmp_path, trainer, family, switch
):
    plain = _plain(trainer, family, checkpoints, tmp_path)
    before = trl_head.served_calls()
    ckpt, teacher = checkpoints[family]
    ours = trl_runs.run(trainer, family, switch, ckpt, tmp_path / "ours", teacher)
    after = trl_head.served_calls()
    trl_runs.compare(ours, plain)

    def delta(key):
        return after.get(key, 0) - before.get(key, 0)

    models = ours.models
    assert all(trl_runs.report_entries(m, "RMSNorm" if family == "qwen3" else "GemmaRMSNorm")
               for m in models.values()), "the layer kernels are not bound"  # fmt: skip
    if trainer in trl_runs.FUSED_HEAD_TRAINERS:
        # every model (policy, reference) has our head: each fused call ran our kernel only
        assert delta(("_ChunkedLogProbFunction", "kernels")) > 0
        assert delta(("_ChunkedLogProbFunction", "trl")) == 0
        for name, model in models.items():
            (entry,) = trl_runs.report_entries(model, "fused_lm_head")
            assert entry.status == "routed", (name, entry)
    if trainer == "distillation":
        assert delta(("ChunkedDivergenceFunction", "kernels")) > 0
        assert delta(("ChunkedDivergenceFunction", "trl")) == 0
    if trainer == "reward":  # a sequence classifier: no causal-LM head to serve
        assert not trl_runs.report_entries(models["policy"], "fused_lm_head")


def test_dpo_with_a_lora_adapter(local_kernels, checkpoints, tmp_path):
    """DPO with peft_config: TRL wraps the base model (our kernels bound beneath) with its fused
    head, trains the adapter, and takes the reference log-probs with the adapter off; every call
    runs our log-prob head and the LoRA gradients match the plain trainer's."""
    ckpt, _ = checkpoints["qwen3"]
    plain = trl_runs.run("dpo", "qwen3", "plain", ckpt, tmp_path / "plain", peft=True)
    before = trl_head.served_calls()
    ours = trl_runs.run("dpo", "qwen3", "apply", ckpt, tmp_path / "ours", peft=True)
    after = trl_head.served_calls()
    trl_runs.compare(ours, plain)
    assert all("lora_" in name for name in ours.grads[0]) and ours.grads[0]
    calls = {side: after.get(("_ChunkedLogProbFunction", side), 0)
             - before.get(("_ChunkedLogProbFunction", side), 0) for side in ("kernels", "trl")}  # fmt: skip
    # policy and adapter-off reference passes, 3 steps
    assert calls["kernels"] >= 6 and calls["trl"] == 0, calls


def test_kernel_config_is_refused_on_the_cpu_by_transformers(local_kernels, checkpoints):
    """transformers 5.24 refuses a KernelConfig for a CPU model, so the CPU runs above register
    the same mapping for the CPU instead; tests/gpu/test_post_training_gpu.py passes
    ``training_kernel_config`` itself. If this starts passing, run the matrix with it here."""
    import kernels
    from transformers import AutoModelForCausalLM

    ckpt, _ = checkpoints["qwen3"]
    config = kernels.training_kernel_config(str(ckpt))
    with pytest.raises(ValueError, match="cpu"):
        AutoModelForCausalLM.from_pretrained(ckpt, use_kernels=True, kernel_config=config)
