"""TRL 1.16 trainers on tiny models, on the CPU, with and without this package's kernels.

`run(trainer, family, switch, ckpt)` trains 3 steps and returns a `Run`: the loss each
`compute_loss` returned and every parameter's gradient just before each optimizer step. The
switches are the two a user has:

- ``"apply"``: ``kernels.apply_training_kernels(model)`` on the model handed to the trainer
  (and on the reference / teacher model the trainer built, after the trainer wrapped it: the
  other order of patching);
- ``"use_kernels"``: ``model_init_kwargs={"use_kernels": True}`` with the training mapping
  registered for the CPU (transformers refuses ``KernelConfig`` on the CPU; the mapping is
  what ``training_kernel_config`` would carry), so transformers kernelizes each model it loads
  and again on every ``train()``;
- ``"plain"``: neither.

Datasets are built in memory; the tokenizer is a word-level one over ``w0 .. w253`` plus pad
and eos (vocabulary 256, the tiny models' size).
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kernels
import torch

VOCAB = 256
REPO = "kernels-lab/training"
TRAINERS = ("sft", "dpo", "kto", "reward", "grpo", "rloo", "distillation")
FUSED_HEAD_TRAINERS = ("sft", "dpo", "kto", "grpo", "rloo")  # add_fused_lm_head users


def tiny_config(family: str):
    from transformers import Gemma2Config, Qwen3Config

    common = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=VOCAB, head_dim=16, pad_token_id=VOCAB - 2,
        eos_token_id=VOCAB - 1, bos_token_id=None,
    )  # fmt: skip
    if family == "qwen3":
        return Qwen3Config(**common, tie_word_embeddings=True)
    if family == "gemma2":
        # soft-capped logits (final_logit_softcapping 30), GeGLU MLP, Gemma norms
        return Gemma2Config(**common, final_logit_softcapping=5.0, attn_logit_softcapping=None)
    raise ValueError(family)


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(VOCAB - 2)} | {"<pad>": VOCAB - 2, "<eos>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="w0"
    )


def save_checkpoint(path: Path, family: str, seed: int = 0) -> Path:
    """A tiny causal LM of `family` and the tokenizer, saved where TRL can load them by path."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(tiny_config(family)).float().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def reward_checkpoint(ckpt: Path) -> Path:
    """The reward model of `ckpt` (a sequence classifier with one label), saved with its score
    head so that every run loads the same weights, however the trainer builds it."""
    from transformers import AutoModelForSequenceClassification

    path = ckpt.with_name(ckpt.name + "-reward")
    if not path.exists():
        torch.manual_seed(0)
        AutoModelForSequenceClassification.from_pretrained(ckpt, num_labels=1).save_pretrained(path)
        tiny_tokenizer().save_pretrained(path)
    return path


def _words(gen: torch.Generator, n: int) -> str:
    return " ".join(f"w{i}" for i in torch.randint(1, VOCAB - 2, (n,), generator=gen).tolist())


def dataset(trainer: str):
    from datasets import Dataset

    gen = torch.Generator().manual_seed(7)
    rows = 4
    if trainer == "sft":
        return Dataset.from_dict({"text": [_words(gen, 10) for _ in range(rows)]})
    if trainer in ("dpo", "reward"):
        data = {
            "chosen": [" " + _words(gen, 4) for _ in range(rows)],
            "rejected": [" " + _words(gen, 5) for _ in range(rows)],
        }
        if trainer == "dpo":
            data["prompt"] = [_words(gen, 5) for _ in range(rows)]
        else:  # the reward trainer's implicit-prompt format: whole texts
            data = {k: [_words(gen, 5) + v for v in vals] for k, vals in data.items()}
        return Dataset.from_dict(data)
    if trainer == "kto":
        return Dataset.from_dict(
            {
                "prompt": [_words(gen, 5) for _ in range(rows)],
                "completion": [" " + _words(gen, 4) for _ in range(rows)],
                "label": [True, False, True, False],
            }
        )
    return Dataset.from_dict({"prompt": [_words(gen, 5) for _ in range(rows)]})


def reward(completions, **kwargs) -> list[float]:
    """A deterministic reward that differs between completions (so advantages are not zero)."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


def _config(trainer: str, out: Path, model_init_kwargs: dict | None):
    import trl

    common = dict(
        output_dir=str(out), max_steps=3, report_to=[], save_strategy="no", use_cpu=True,
        bf16=False, logging_steps=1, seed=0, data_seed=0, learning_rate=1e-3,
        per_device_train_batch_size=2, gradient_checkpointing=False, dataloader_num_workers=0,
    )  # fmt: skip
    if model_init_kwargs is not None:
        common["model_init_kwargs"] = model_init_kwargs
    if trainer == "sft":
        return trl.SFTConfig(**common, max_length=16)
    if trainer == "dpo":
        return trl.DPOConfig(**common, max_length=16)
    if trainer == "kto":
        return trl.KTOConfig(**common, max_length=16)
    if trainer == "reward":
        return trl.RewardConfig(**common, max_length=16)
    gen = dict(num_generations=2, max_completion_length=4, temperature=1.0)
    if trainer == "grpo":
        return trl.GRPOConfig(**common, **gen, beta=0.1)
    if trainer == "rloo":
        return trl.RLOOConfig(**common, **gen, beta=0.05)
    if trainer == "distillation":
        teacher = dict(model_init_kwargs or {})
        return trl.DistillationConfig(
            **common, max_completion_length=4, teacher_model_init_kwargs=teacher or None
        )
    raise ValueError(trainer)


@dataclass
class Run:
    losses: list[float] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    models: dict[str, Any] = field(default_factory=dict)  # "policy", "ref", "teacher"


def _grad_recorder(run: Run):
    from transformers import TrainerCallback

    class Record(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):  # noqa: ANN001
            run.grads.append(
                {
                    n: p.grad.detach().clone()
                    for n, p in model.named_parameters()
                    if p.grad is not None
                }
            )

    return Record()


def cpu_mapping(ckpt: Path) -> dict:
    """The training kernels' mapping for this checkpoint, registered for the CPU (what
    ``training_kernel_config`` carries on a GPU)."""
    names = kernels.training_kernel_mapping(str(ckpt))
    return {
        name: {"cpu": kernels.LayerRepository(REPO, layer_name=name, version=1)} for name in names
    }


def _teacher_or_ref(trainer_obj) -> dict[str, Any]:
    found = {}
    for key, attr in (("ref", "ref_model"), ("teacher", "teacher_model")):
        model = getattr(trainer_obj, attr, None)
        if model is not None:
            found[key] = model
    return found


def run(
    trainer: str,
    family: str,
    switch: str,
    ckpt: Path,
    out: Path,
    teacher_ckpt=None,
    peft: bool = False,
) -> Run:
    """3 steps of `trainer` on the checkpoint; see the module docstring for `switch`. With
    `peft`, the trainer wraps the policy with a LoRA adapter on every Linear (TRL then takes the
    reference log-probs with the adapter switched off)."""
    import trl
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    result = Run()
    if trainer == "reward":
        ckpt = reward_checkpoint(ckpt)
    with ExitStack() as stack:
        mik = None
        if switch == "use_kernels":
            stack.enter_context(kernels.use_kernel_mapping(cpu_mapping(ckpt)))
            mik = {"use_kernels": True}
        args = _config(trainer, out, mik)
        tokenizer = tiny_tokenizer()
        if switch == "use_kernels":
            model: Any = str(ckpt)
        elif trainer == "reward":
            model = AutoModelForSequenceClassification.from_pretrained(ckpt)
        else:
            model = AutoModelForCausalLM.from_pretrained(ckpt)
        if switch == "apply":
            kernels.apply_training_kernels(model)
        kwargs: dict[str, Any] = dict(
            model=model, args=args, train_dataset=dataset(trainer), processing_class=tokenizer
        )
        if peft:
            from peft import LoraConfig

            kwargs["peft_config"] = LoraConfig(
                r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False
            )
        if trainer in ("grpo", "rloo"):
            kwargs["reward_funcs"] = reward
        if trainer == "distillation":
            kwargs["teacher_model"] = str(teacher_ckpt)
        cls = {
            "sft": trl.SFTTrainer, "dpo": trl.DPOTrainer, "kto": trl.KTOTrainer,
            "reward": trl.RewardTrainer, "grpo": trl.GRPOTrainer, "rloo": trl.RLOOTrainer,
            "distillation": trl.DistillationTrainer,
        }[trainer]  # fmt: skip
        obj = cls(**kwargs, callbacks=[_grad_recorder(result)])
        result.models = {"policy": obj.model, **_teacher_or_ref(obj)}
        if switch == "apply":
            # the trainer built (and wrapped) these itself: kernels bound after TRL's patching
            for key in ("ref", "teacher"):
                if key in result.models:
                    kernels.apply_training_kernels(result.models[key])
        compute_loss = obj.compute_loss

        def recording(*a, **k):
            out_ = compute_loss(*a, **k)
            loss = out_[0] if isinstance(out_, tuple) else out_
            result.losses.append(loss.detach().float().item())
            return out_

        obj.compute_loss = recording
        obj.train()
    return result


def compare(ours: Run, plain: Run, rtol: float = 1e-4) -> None:
    """Every step's loss and every parameter's gradient within fp32 tolerance: each gradient
    tensor's relative Frobenius distance at most `rtol` (the model sweep's fp32 rule)."""
    assert len(ours.losses) == len(plain.losses) >= 3, (ours.losses, plain.losses)
    torch.testing.assert_close(
        torch.tensor(ours.losses), torch.tensor(plain.losses), rtol=rtol, atol=1e-6
    )
    assert len(ours.grads) == len(plain.grads) == 3
    for step, (g, g_ref) in enumerate(zip(ours.grads, plain.grads, strict=True)):
        assert g.keys() == g_ref.keys(), (step, set(g) ^ set(g_ref))
        for name, ref in g_ref.items():
            dist = (g[name] - ref).norm() / ref.norm().clamp_min(1e-12)
            assert dist <= rtol or (g[name] - ref).abs().max() <= 1e-7, (step, name, dist.item())


def report_entries(model, layer_name: str) -> list:
    report = kernels.last_report(model)
    return [] if report is None else [e for e in report if e.layer_name == layer_name]
