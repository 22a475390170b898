"""The registry sweep's bf16 verdict (bf16_verdict.py): the kernelized model is judged by its
distance to the float64 model against the plain bf16 model's own distance, not by its distance
to the plain bf16 model."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.sweep import sweep_param

from .bf16_verdict import FACTOR, FLOOR, Run, float64_copy, judge
from .registry import BF16_AGREE, VOCAB, build, run_one, train_steps

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def mirror(hub):
    hub.build(ROOT / "hub_kernels")
    return hub


def test_gemma4_bf16_gap_to_the_plain_model_is_bf16_noise(mirror):
    """Gemma 4's plain and kernelized bf16 models differ by about 4e-2 in gradient norm after
    3 AdamW steps, but both gradients lie about 1.4e-1 from float64's at the same weights, ours
    no further: a match, with the plain-vs-ours number kept and the reason giving both
    distances."""
    outcome = run_one("gemma4_text", dtype=torch.bfloat16)
    assert {"GeGLUMLP", "RMSNormFloatWeight"} <= set(outcome.bound), outcome
    assert outcome.grad_diff > BF16_AGREE, outcome  # the gap the first criterion refused
    assert outcome.status == "match", outcome
    assert outcome.reason.startswith("bf16 noise"), outcome.reason
    assert outcome.verdict.plain[1] > BF16_AGREE, outcome.verdict  # plain's own bf16 noise


def _coarse_norms(model: torch.nn.Module) -> None:
    """Round every RMSNorm's output to float8_e4m3 (3 mantissa bits, bf16 has 7); the gradient
    passes through as it is."""

    def hook(module, args, out):
        with torch.no_grad():
            coarse = out.to(torch.float8_e4m3fn).to(out.dtype)
        return out + (coarse - out).detach()

    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.register_forward_hook(hook)


def _batches():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2, 16), generator=gen) for _ in range(3)]


def test_a_model_coarser_than_bf16_is_a_mismatch():
    """Llama whose norms round to 3 mantissa bits: within 2e-3 of the plain bf16 model in loss
    and gradient norm (the first criterion's 2e-2 lets it through), but about 5x further from
    float64 than the plain model in its gradients: a mismatch."""
    plain = build("llama").to(torch.bfloat16)
    coarse = copy.deepcopy(plain)
    _coarse_norms(coarse)
    exact = float64_copy(plain)
    plain_run, coarse_run = Run(exact), Run(exact)
    want = train_steps(plain, _batches(), record=plain_run)
    got = train_steps(coarse, _batches(), record=coarse_run)
    for (loss, norm), (loss0, norm0) in zip(got, want, strict=True):
        assert abs(loss - loss0) / loss0 < BF16_AGREE and abs(norm - norm0) / norm0 < BF16_AGREE
    verdict = judge(plain_run.distance(), coarse_run.distance())
    assert not verdict.match, verdict
    assert verdict.ours[1] > 3 * verdict.plain[1], verdict


def test_float64_is_taken_at_each_steps_weights():
    """An fp32 model's distances stay at fp32 rounding (1e-5) in every step: the float64 copy
    takes the weights the step was computed at, not the first step's."""
    model = build("llama")
    run = Run(float64_copy(model))
    train_steps(model, _batches(), record=run)
    assert len(run.grads) == 3 and not run.error
    assert max(run.grads) < 1e-5 and max(run.losses) < 1e-6, (run.losses, run.grads)


def test_the_rule_factor_and_floor():
    """Ours within FACTOR times plain's distance, or within one bf16 rounding, matches."""
    assert judge((1e-3, 1e-1), (1e-3, FACTOR * 1e-1)).match
    assert not judge((1e-3, 1e-1), (1e-3, FACTOR * 1.01e-1)).match
    # both below 2^-8: a ratio of 20 says nothing
    assert judge((1e-5, 1e-4), (1e-5, 2e-3)).match
    assert not judge((1e-5, 1e-4), (1e-5, 2 * FLOOR)).match
    assert not judge((1e-2, 1e-1), (2e-2, 1e-1)).match  # the loss is judged too


class _Router(torch.nn.Module):
    """A one-weight router: two experts' scores 1 and 1 + `gap`; the loss uses the top one."""

    def __init__(self, gap: float) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(2))
        self.gap = gap
        self.config = SimpleNamespace()

    def forward(self, input_ids, labels=None):
        scores = self.w + torch.tensor([0.0, self.gap], dtype=self.w.dtype)
        top = torch.topk(scores, 1).indices
        return SimpleNamespace(loss=(self.w[top] * self.w.sum()).sum())


@pytest.mark.parametrize("gap, rerouted", [(1e-3, 1), (1e-2, 0)])
def test_a_step_routed_otherwise_in_float64_is_left_out(gap, rerouted):
    """A gap of 1e-3 vanishes in bf16 (1 + 1e-3 rounds to 1: a tie, expert 0) but not in
    float64 (expert 1): the two compute different functions, so that step is left out and
    counted rather than judged. A gap bf16 keeps (1e-2) routes alike and is judged."""
    model = _Router(gap).to(torch.bfloat16)
    run = Run(exact=float64_copy(model))
    ids = torch.zeros(1, 1, dtype=torch.long)
    loss = model(input_ids=ids).loss
    loss.backward()
    run.record(model, ids, loss.item())
    assert not run.error, run.error
    assert run.rerouted == rerouted
    assert len(run.losses) == len(run.grads) == 1 - rerouted


@pytest.mark.parametrize(
    "model_type", ["olmo2", sweep_param("olmo3", what="OLMo 3: the same rotary path as OLMo 2")]
)
def test_olmo_rotary_keeps_the_bf16_dtype_on_the_torch_path(mirror, model_type, monkeypatch):
    """OLMo 2/3 keep cos/sin in fp32 and cast the rotated q/k back to bf16; the rotary layer's
    torch path (the CPU's) returned the fp32 products and the attention's next matmul refused
    them (the Triton kernel already wrote q's dtype). The three steps run and are judged; the
    verdict itself is not asserted here: under the interpreter, whose fp32-to-bf16 casts
    truncate where a GPU rounds, ours sits near 2x plain's distance to float64 for these two
    (on the H200 both match: docs/models-h200.md). The torch path is forced: in a run that also
    collects tests/kernels the interpreter is on, and the Triton path never reaches the bug."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    outcome = run_one(model_type, dtype=torch.bfloat16)
    assert "rotary_pos_emb" in outcome.bound, outcome
    assert outcome.status in ("match", "mismatch"), outcome
    assert outcome.verdict is not None and outcome.verdict.ours[1] < 0.1, outcome
