"""The DPO verdict of tests/gpu/test_post_training_gpu.py, on the CPU: bf16 TRL DPO steps against
float64 TRL at the same weights (tests/post_training/dpo_verdict.py).

Three bf16 runs that are as accurate as plain TRL must pass it: plain TRL on the same network
with its MLP units permuted (another summation order, the kind of difference another GEMM
kernel makes) and this package's kernels. One with a real error must fail: our head handing
the reference model (its no-grad calls) log-probs rounded to bf16, a reference computed at
another precision than the policy.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from tests.post_training import dpo_verdict  # noqa: E402

pytest.importorskip("trl")

DIMS = dict(vocab_size=1024, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
STEPS = 3


def _steps(setup, path, work, shape):
    exact = dpo_verdict.Exact(dpo_verdict.cpu_trainer("trl", path, work, shape, torch.float64))
    trainer = dpo_verdict.cpu_trainer(setup, path, work, shape, "bfloat16")
    import bench_post_training as bench

    inputs, _ = bench.step_inputs("dpo", trainer, shape, "cpu")
    return dpo_verdict.run_steps(trainer, exact, STEPS, inputs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """plain, plain on the permuted network, ours, and ours with the bf16-rounded reference."""
    import bench_post_training as bench
    from kernels.training import trl_head

    work = tmp_path_factory.mktemp("dpo-verdict")
    shape = bench.Shape(4, 48, 48)
    plain_path = dpo_verdict.save_checkpoint(work / "plain", 0, DIMS)
    perm_path = dpo_verdict.save_checkpoint(work / "perm", 0, DIMS, permute=True)
    mp = pytest.MonkeyPatch()
    # the kernels' CPU path, as a user's: a worker that ran tests/kernels has Triton's
    # interpreter switched on (its conftest), whose bf16 gradients here are 2x farther from
    # float64 than torch's (1.5e-2 against 7.2e-3; the H200's Triton matches plain TRL's)
    mp.setenv("TRITON_INTERPRET", "0")
    training = Path(__file__).resolve().parents[2] / "hub_kernels" / "kernels-lab" / "training"
    mp.setenv("LOCAL_KERNELS", f"kernels-lab/training={training}")
    try:
        out = {
            "plain": _steps("trl", plain_path, work, shape),
            "plain-perm": _steps("trl", perm_path, work, shape),
            "ours": _steps("ours", plain_path, work, shape),
        }
        kernel_for = trl_head._function_for

        def reference_in_bf16(weight, attr):
            fn = kernel_for(weight, attr)
            if fn is None or attr != trl_head.LOGPROB.attr:
                return fn

            def rounded(*args):
                out = fn(*args)
                if torch.is_grad_enabled():  # the policy's call
                    return out
                return (out[0].to(torch.bfloat16).float(), *out[1:])

            return rounded

        mp.setattr(trl_head, "_function_for", reference_in_bf16)
        out["ours-ref-bf16"] = _steps("ours", plain_path, work, shape)
    finally:
        mp.undo()
        trl_head.release_all()
    return out


def test_step_one_is_exact_and_later_margins_are_noise_dominated(runs):
    """What makes the loss distance ill-conditioned: policy = reference at step 1 (every run's
    loss is log 2 to the bit), and after one step the bf16 margin error is as large as the
    margin itself."""
    for name in ("plain", "plain-perm", "ours"):
        first, *later = runs[name]
        assert first.loss == first.loss_exact == pytest.approx(0.6931471805599453, abs=1e-7)
        assert dpo_verdict.loss_noise(first) == 0.0
        for step in later:
            err = (step.margins() - step.margins(exact=True)).abs().max()
            assert err > 0.1 * step.margins(exact=True).abs().max(), name


def test_equally_accurate_runs_pass_the_verdict(runs):
    for name in ("plain-perm", "ours"):
        assert dpo_verdict.verdict(runs["plain"], runs[name]) == "", (
            name,
            [s.describe() for s in runs[name]],
        )


def test_a_reference_at_another_precision_fails_the_verdict(runs):
    problem = dpo_verdict.verdict(runs["plain"], runs["ours-ref-bf16"])
    assert "ref log-probs" in problem, problem
    # the policy's own log-probs were untouched (step 1: the same weights): the error is the
    # reference's alone
    assert torch.equal(runs["ours"][0].policy, runs["ours-ref-bf16"][0].policy)
