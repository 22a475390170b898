"""Cross-entropy options (Liger's surface): class weights, z-loss returned separately, token
accuracy and predicted tokens, out-of-range targets. Interpreter and torch path, against float64."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from _training_refs import assert_close

from tests.sweep import sweep_param

IGNORE = -100


def make(n, vocab, dtype=torch.float32, ignored=3):
    logits = (torch.randn(n, vocab) * 3).to(dtype)
    target = torch.randint(0, vocab, (n,))
    target[torch.randperm(n)[:ignored]] = IGNORE
    return logits, target


def ce64(logits, target, weight, smoothing, lam, softcap, reduction):
    """torch's weighted, smoothed cross-entropy in float64, plus Liger's unweighted z-loss
    (mean over the kept rows). Returns (loss, z_loss)."""
    x = logits.double()
    z = softcap * torch.tanh(x / softcap) if softcap else x
    w = None if weight is None else weight.double()
    ce = F.cross_entropy(
        z, target, weight=w, ignore_index=IGNORE, label_smoothing=smoothing, reduction=reduction
    )
    keep = target != IGNORE
    zrows = lam * torch.logsumexp(z, -1) ** 2 * keep
    zl = {"mean": zrows.sum() / keep.sum(), "sum": zrows.sum(), "none": zrows}[reduction]
    return ce + zl, zl


OPTION_CASES = [  # (weighted, label smoothing, z-loss scale, softcap)
    (True, 0.0, 0.0, None),
    (True, 0.1, 0.0, None),
    (True, 0.0, 1e-3, None),
    (True, 0.1, 1e-3, 20.0),
    (False, 0.1, 1e-3, None),
]


# Each option case with both vocab sizes on both paths, under one reduction of its own (a
# weighted "mean" divides by the kept rows' weights, so the weighted cases start there); the
# case with every option under all three. The rest of the grid runs under KERNELS_SWEEP=1.
_OWN_REDUCTION = ["mean", "sum", "none", None, "mean"]  # None: all three


def _option_params() -> list:
    params = []
    for case, own in zip(OPTION_CASES, _OWN_REDUCTION, strict=True):
        for vocab, vocab_id in ((300, "one-chunk"), (2500, "chunked")):
            for reduction in ("mean", "sum", "none"):
                for path in ("triton", "torch"):
                    values, pid = (
                        (case, vocab, reduction, path),
                        f"{case}-{vocab_id}-{reduction}-{path}",
                    )
                    if own is None or reduction == own:
                        params.append(pytest.param(*values, id=pid))
                    else:
                        what = "the option case under its other reductions"
                        params.append(sweep_param(*values, what=what, id=pid))
    return params


@pytest.mark.parametrize("case,vocab,reduction,path", _option_params())
def test_weight_smoothing_zloss_match_float64(kt, monkeypatch, case, vocab, reduction, path):
    if path == "torch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    weighted, smoothing, lam, softcap = case
    logits, target = make(16, vocab)
    weight = torch.rand(vocab) * 2 if weighted else None
    x = logits.clone().requires_grad_()
    out = kt.cross_entropy(
        x, target, weight=weight, label_smoothing=smoothing, lse_square_scale=lam,
        softcap=softcap, reduction=reduction, return_z_loss=True,
    )  # fmt: skip
    x64 = logits.double().requires_grad_()
    loss64, z64 = ce64(x64, target, weight, smoothing, lam, softcap, reduction)
    dy = torch.randn(16) if reduction == "none" else torch.tensor(1.7)
    out.loss.backward(dy)
    loss64.backward(dy.double())
    assert_close(out.loss, loss64, torch.float32, "loss")
    assert_close(x.grad, x64.grad, torch.float32, "dlogits")
    if lam:
        assert_close(out.z_loss, z64, torch.float32, "z_loss")
    assert out.z_loss.grad_fn is None and out.token_accuracy is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_weighted_half_logits(kt, dtype):
    logits, target = make(12, 2500, dtype)
    weight = torch.rand(2500) + 0.5
    x = logits.clone().requires_grad_()
    kt.cross_entropy(x, target, weight=weight, lse_square_scale=1e-4).backward()
    x64 = logits.double().requires_grad_()
    ce64(x64, target, weight, 0.0, 1e-4, None, "mean")[0].backward()
    assert_close(x.grad, x64.grad, dtype, "dlogits")


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("vocab", [300, 2500], ids=["one-chunk", "chunked"])
def test_predicted_tokens_and_accuracy(kt, monkeypatch, vocab, path):
    """argmax per row (first of ties, -1 where ignored) and the kept rows' hit rate, with
    targets set to the argmax for about half of the rows and ties planted across chunks."""
    if path == "torch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    logits, target = make(20, vocab)
    top = logits.max(-1).values
    logits[0, [5, vocab - 7]] = top[0] + 1.0  # a tie: the first one wins
    logits[1, vocab - 1] = top[1] + 1.0  # the max in the last column
    logits[2, [10, min(600, vocab - 3)]] = top[2] + 1.0  # a tie in one chunk, two blocks
    expect = logits.argmax(-1)  # torch's argmax returns the first of equal maxima
    assert expect[0] == 5 and expect[2] == 10
    hit = torch.rand(20) < 0.5
    target = torch.where(hit & (target != IGNORE), expect, target)
    out = kt.cross_entropy(
        logits.clone().requires_grad_(), target, return_predicted_tokens=True,
        return_token_accuracy=True,
    )  # fmt: skip
    keep = target != IGNORE
    assert torch.equal(out.predicted_tokens, torch.where(keep, expect, -1))
    acc = ((expect == target) & keep).sum() / keep.sum()
    torch.testing.assert_close(out.token_accuracy, acc.float())
    rows = kt.cross_entropy(
        logits, target, reduction="none", return_token_accuracy=True
    ).token_accuracy
    assert torch.equal(rows, ((expect == target) & keep).float())


def test_extras_do_not_change_the_loss_or_gradient(kt):
    logits, target = make(10, 700)
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    plain = kt.cross_entropy(a, target, lse_square_scale=1e-3)
    out = kt.cross_entropy(
        b, target, lse_square_scale=1e-3, return_z_loss=True, return_token_accuracy=True,
        return_predicted_tokens=True,
    )  # fmt: skip
    plain.backward()
    out.loss.backward()
    # Predicted tokens take the full kernel, the plain call the lean one (the default): the
    # same loss, and the same gradient up to fp32 rounding (their exponentials differ).
    assert torch.equal(plain, out.loss)
    assert_close(b.grad, a.grad, torch.float32, "dlogits")


def test_out_of_range_target_is_nan_or_a_typed_error(kt):
    logits, target = make(6, 300, ignored=1)
    target[2] = 300
    rows = kt.cross_entropy(logits.clone(), target, reduction="none")
    assert torch.isnan(rows[2]) and torch.isfinite(rows[torch.arange(6) != 2]).all()
    error = sys.modules[kt.__name__ + ".cross_entropy"].TargetOutOfRange
    with pytest.raises(error) as info:
        kt.cross_entropy(logits.clone(), target, check_targets=True)
    assert "\n" not in str(info.value) and "300" in str(info.value)
    target[2] = -5
    with pytest.raises(ValueError, match="-5"):
        kt.cross_entropy(logits.clone(), target, check_targets=True)


def test_check_targets_passes_ignore_index(kt):
    logits, target = make(6, 300, ignored=2)
    loss = kt.cross_entropy(logits, target, check_targets=True)
    assert torch.isfinite(loss)


def test_bad_weight_raises_one_line(kt):
    logits, target = make(4, 50)
    for weight in (torch.ones(49), torch.ones(50, dtype=torch.int64)):
        with pytest.raises(ValueError) as info:
            kt.cross_entropy(logits, target, weight=weight)
        assert "\n" not in str(info.value)
