"""The fused loss's training-step chunk policy (fused_linear_cross_entropy.row_cap): the logits
chunk is no larger than d(weight) above 1024 rows, so Phi-3-mini's head no longer holds one
501 MiB chunk while every layer's activations are alive; the op benchmarks' shapes keep the
rows they were measured at."""

from __future__ import annotations

import importlib

import pytest
import torch
from _training_refs import assert_close
from torch.utils._python_dispatch import TorchDispatchMode


@pytest.fixture(scope="module")
def fl(kt):
    return importlib.import_module(f"{kt.__name__}.fused_linear_cross_entropy")


@pytest.mark.parametrize(
    "n, hidden, vocab, rows",
    [
        (16384, 1024, 151936, 1024),  # the FLCE anchor (and Qwen3-0.6B's head): unchanged
        (16384, 4096, 128256, 2048),  # the H4096 op benchmark: unchanged (the byte budget's)
        (16384, 896, 151936, 1024),  # never under 1024 rows where the budget allows them
        (8192, 3072, 32064, 2048),  # Phi-3-mini's step: 125 MiB, not all 8192 rows (501 MiB)
        (65536, 64, 256, 65536),  # a small vocabulary keeps one chunk (32 MiB)
        (8192, 2048, 262144, 960),  # the byte budget's multiple of 64, under the row cap
    ],
)
def test_rows_per_chunk(fl, n, hidden, vocab, rows):
    assert min(fl.default_chunk_rows(n, vocab, 2), fl.row_cap(hidden, vocab, 2)) == rows


class _Buffers(TorchDispatchMode):
    """Row counts of every new [rows, vocab] tensor the ops allocate."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.rows = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.startswith("empty") and isinstance(out, torch.Tensor):
            if out.dim() == 2 and out.shape[1] == self.vocab:
                self.rows.append(out.shape[0])
        return out


def test_the_loss_takes_row_cap_rows_per_chunk(fl, monkeypatch):
    """At these sizes the cap is the hidden width (32 rows of 100): the logits buffer has 32
    rows, and the loss and gradients are those of one 100-row chunk."""
    monkeypatch.setattr(fl, "MIN_CAP_ROWS", 16)
    monkeypatch.setattr(fl, "SMALL_CHUNK_BYTES", 0)
    n, hidden, vocab = 100, 32, 64
    x = torch.randn(n, hidden, requires_grad=True)
    w = torch.randn(vocab, hidden, requires_grad=True)
    t = torch.randint(0, vocab, (n,))
    ref = fl.fused_linear_cross_entropy(x, w, t, chunk_rows=n)
    ref_grads = torch.autograd.grad(ref, [x, w])
    seen = _Buffers(vocab)
    with seen:
        loss = fl.fused_linear_cross_entropy(x, w, t)
    assert seen.rows == [32]
    grads = torch.autograd.grad(loss, [x, w])
    assert_close(loss, ref, torch.float32, "loss")
    for g, r, what in zip(grads, ref_grads, ("dx", "dw"), strict=True):
        assert_close(g, r, torch.float32, what)
