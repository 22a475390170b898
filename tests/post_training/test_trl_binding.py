"""Where this package's loss head meets TRL 1.16's fused head (``add_fused_lm_head``): in each
order of patching exactly one fused path serves each call, TRL's wrapper (and the trainer's
configuration in it) stays outermost, and ``kernels.last_report`` says which kernel serves.

Tiny models on the CPU; the training kernels come from this checkout (LOCAL_KERNELS) or, for the
transformers switch, from `kernels serve` over HTTP."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import kernels
import pytest
import torch
from kernels.layers.binding import bound_layer
from kernels.layers.wrappers import trl_fused_head_cell
from kernels.training import trl_head

from .trl_runs import cpu_mapping, save_checkpoint, tiny_config

trl_utils = pytest.importorskip("trl.trainer.utils")
TRL_LOGPROB = trl_utils._ChunkedLogProbFunction  # TRL's own (the fixture puts it back)
LOGPROB_CALLS = ("_ChunkedLogProbFunction", "kernels")
TRL_CALLS = ("_ChunkedLogProbFunction", "trl")
OUTPUTS = ("log_probs", "entropy")


def tiny(family: str = "qwen3"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(family)).float().train()


def pair(family: str = "qwen3"):
    """Two copies of one tiny model: the plain one and the one to kernelize."""
    plain = tiny(family)
    ours = tiny(family)
    ours.load_state_dict(plain.state_dict())
    return plain, ours


def batch():
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 254, (2, 10), generator=gen)
    labels = ids.clone()
    labels[:, :4] = -100  # a prompt
    return ids, labels


def served(key) -> int:
    return trl_head.served_calls().get(key, 0)


def fused_entry(model):
    entries = [e for e in kernels.last_report(model) if e.layer_name == "fused_lm_head"]
    assert len(entries) == 1, str(kernels.last_report(model))
    return entries[0]


def check_fused_call(ours, plain, *, via_kernels: bool = True) -> None:
    """A fused call of each model (TRL's wrapper on both): one kernel served ours, TRL's
    served the plain one; per-token fields, loss and every gradient agree in fp32."""
    ids, labels = batch()
    before_k, before_t = served(LOGPROB_CALLS), served(TRL_CALLS)
    out = ours(input_ids=ids, labels=labels, fused_lm_head=True)
    after_ours = served(LOGPROB_CALLS), served(TRL_CALLS)
    ref = plain(input_ids=ids, labels=labels, fused_lm_head=True)
    assert type(out).__name__ == type(ref).__name__ == "FusedCausalLMOutput"
    if via_kernels:
        assert after_ours == (before_k + 1, before_t), "our model's call is not ours alone"
    else:
        assert after_ours[0] == before_k
    for name in ("log_probs", "entropy", "label_mask"):
        torch.testing.assert_close(out[name], ref[name], rtol=1e-5, atol=1e-5, msg=name)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    (out.loss + out.entropy.sum() * 1e-2).backward()
    (ref.loss + ref.entropy.sum() * 1e-2).backward()
    for (name, p), q in zip(ours.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_kernels_then_trl_one_path_per_call(local_kernels):
    """apply_training_kernels, then TRL's add_fused_lm_head (what every TRL trainer does with a
    model handed to it): TRL's wrapper is outermost and its fused calls run our log-prob head;
    its other calls run our ForCausalLM (no logits in training)."""
    plain, ours = pair()
    kernels.apply_training_kernels(ours)
    for m in (ours, plain):
        trl_utils.add_fused_lm_head(m, outputs=OUTPUTS)
    assert trl_fused_head_cell(ours.forward) is not None
    assert bound_layer(ours).__name__ == "ForCausalLM"
    entry = fused_entry(ours)
    assert entry.status == "routed" and entry.kernel.endswith(":trl_chunked_logprob"), entry
    ids, labels = batch()
    assert ours(input_ids=ids, labels=labels).logits is None  # our fused CE, beneath TRL
    assert plain(input_ids=ids, labels=labels).logits is not None
    check_fused_call(ours, plain)


def test_trl_then_kernels_binds_beneath_the_wrapper(local_kernels):
    """TRL wrapped first (a model from a trainer, or the reference model it loaded), then the
    kernels: the wrapper keeps serving fused calls with the outputs the trainer configured
    (entropy here), instead of being replaced by our layer."""
    plain, ours = pair()
    for m in (ours, plain):
        trl_utils.add_fused_lm_head(m, outputs=OUTPUTS)
    wrapper = ours.__dict__["forward"]
    kernels.apply_training_kernels(ours)
    assert ours.__dict__["forward"] is wrapper
    assert bound_layer(ours).__name__ == "ForCausalLM"
    assert "beneath TRL's fused-head wrapper" in fused_entry(ours).reason
    ids, labels = batch()
    assert ours(input_ids=ids, labels=labels).logits is None
    check_fused_call(ours, plain)


def test_use_kernels_train_keeps_trl_and_accelerate_wrappers(mirror, tmp_path):
    """transformers re-kernelizes on every train()/eval(); TRL's trainers call train() after
    wrapping the model with the fused head, and accelerate wraps it again for mixed precision.
    Both wrappers stay, and our head is bound beneath TRL's (before: train() replaced them with
    our layer, and TRL's first fused call failed)."""
    from accelerate.utils import convert_outputs_to_fp32
    from transformers import AutoModelForCausalLM

    ckpt = save_checkpoint(tmp_path / "ckpt", "qwen3")
    plain = AutoModelForCausalLM.from_pretrained(ckpt).train()
    with kernels.use_kernel_mapping(cpu_mapping(ckpt)):
        ours = AutoModelForCausalLM.from_pretrained(ckpt, use_kernels=True)
        assert not ours.training
        for m in (ours, plain):
            trl_utils.add_fused_lm_head(m, outputs=OUTPUTS)
            # accelerate's prepare_model, mixed precision: autocast and fp32 outputs around it
            autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=False)
            m.forward = type(m.forward)(autocast(m.forward.__func__), m)
            m.forward = type(m.forward)(convert_outputs_to_fp32(m.forward.__func__), m)
        outer = ours.__dict__["forward"]
        ours.train()  # transformers kernelizes again, in TRAINING mode
    assert ours.__dict__["forward"] is outer
    assert bound_layer(ours).__name__ == "ForCausalLM"
    assert kernels.last_report(ours).mode & kernels.Mode.TRAINING
    assert fused_entry(ours).status == "routed"
    check_fused_call(ours, plain)


def test_accelerate_wrapper_around_our_layer_survives_train(local_kernels):
    """Without TRL: accelerate's autocast wrapper set around our bound forward is kept when
    kernelize binds the same layer again (it used to be replaced, dropping autocast)."""
    from accelerate.utils import convert_outputs_to_fp32

    model = tiny()
    kernels.apply_training_kernels(model)
    model.forward = type(model.forward)(convert_outputs_to_fp32(model.forward.__func__), model)
    outer = model.__dict__["forward"]
    kernels.apply_training_kernels(model)
    assert model.__dict__["forward"] is outer
    assert bound_layer(model).__name__ == "ForCausalLM"


def test_unbinding_puts_the_class_forward_beneath_trl_and_trl_kernels_back(local_kernels):
    plain, ours = pair()
    kernels.apply_training_kernels(ours)
    for m in (ours, plain):
        trl_utils.add_fused_lm_head(m, outputs=OUTPUTS)
    assert isinstance(trl_utils._ChunkedLogProbFunction, trl_head.StandIn)
    with kernels.use_kernel_mapping({}, inherit_mapping=False):
        kernels.kernelize(ours, mode=kernels.Mode.TRAINING)
    assert bound_layer(ours) is None
    assert trl_fused_head_cell(ours.forward) is not None  # TRL's wrapper is still there
    assert trl_utils._ChunkedLogProbFunction is TRL_LOGPROB  # the last head went: TRL's back
    assert not [e for e in kernels.last_report(ours) if e.layer_name == "fused_lm_head"]
    ids, labels = batch()
    assert ours(input_ids=ids, labels=labels).logits is not None  # the class forward
    check_fused_call(ours, plain, via_kernels=False)


def test_models_without_our_head_keep_trl_kernels(local_kernels):
    """The stand-in routes by the head weight: a plain model in the same process (a reference
    model nobody kernelized) runs TRL's own function, untouched."""
    plain, ours = pair()
    kernels.apply_training_kernels(ours)
    trl_utils.add_fused_lm_head(plain, outputs=OUTPUTS)
    ids, labels = batch()
    before = served(LOGPROB_CALLS), served(TRL_CALLS)
    plain(input_ids=ids, labels=labels, fused_lm_head=True)
    assert (served(LOGPROB_CALLS), served(TRL_CALLS)) == (before[0], before[1] + 1)


def test_opt_out_keeps_trl_kernels_and_says_so(local_kernels, monkeypatch):
    monkeypatch.setenv("KERNELS_TRL_HEAD", "trl")
    plain, ours = pair()
    kernels.apply_training_kernels(ours)
    entry = fused_entry(ours)
    assert entry.status == "original" and "KERNELS_TRL_HEAD=trl" in entry.reason
    assert trl_utils._ChunkedLogProbFunction is TRL_LOGPROB
    for m in (ours, plain):
        trl_utils.add_fused_lm_head(m, outputs=OUTPUTS)
    check_fused_call(ours, plain, via_kernels=False)


def test_bad_opt_out_value_is_a_typed_error_before_the_model_changes(local_kernels, monkeypatch):
    model = tiny()
    monkeypatch.setenv("KERNELS_TRL_HEAD", "liger")
    with pytest.raises(kernels.InvalidSpec, match="KERNELS_TRL_HEAD") as err:
        kernels.apply_training_kernels(model)
    assert "unset it" in err.value.hint
    assert bound_layer(model) is None and "forward" not in vars(model.model.norm)


def test_another_trl_signature_keeps_trl_kernels(local_kernels, monkeypatch):
    """A TRL whose ChunkedLogProbFunction takes other arguments is left alone, and the report
    says TRL's own serves."""

    class Other(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, targets):  # noqa: ANN001, ANN205
            return hidden

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", Other)
    model = tiny()
    kernels.apply_training_kernels(model)
    entry = fused_entry(model)
    assert entry.status == "original" and "not TRL 1.16's arguments" in entry.reason, entry
    assert trl_utils._ChunkedLogProbFunction is Other


def test_trl_imported_after_binding_is_patched_on_import(tmp_path):
    """A process that binds the kernels before it imports TRL: TRL's modules get the stand-ins
    as they finish importing (nothing imports TRL early)."""
    script = textwrap.dedent(
        """
        import sys, torch, kernels
        from transformers import Qwen3Config, Qwen3ForCausalLM
        config = Qwen3Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                             head_dim=16)
        model = Qwen3ForCausalLM(config)
        kernels.apply_training_kernels(model)
        assert "trl" not in sys.modules
        import trl.trainer.utils as u
        from trl.trainer import distillation_trainer as d
        print(type(u._ChunkedLogProbFunction).__name__, type(d.ChunkedDivergenceFunction).__name__)
        """
    )
    root = Path(__file__).resolve().parents[2]
    env = dict(
        os.environ, LOCAL_KERNELS=f"kernels-lab/training={root}/hub_kernels/kernels-lab/training"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["StandIn", "StandIn"], out.stdout


def test_apply_training_kernels_leaves_the_random_stream_alone(local_kernels):
    """The structure probes build small modules; a trainer's seeded sampling (GRPO, RLOO,
    distillation generate completions) must not depend on whether kernels were applied."""
    model = tiny("gemma2")
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    kernels.apply_training_kernels(model)
    assert torch.equal(torch.random.get_rng_state(), state)
