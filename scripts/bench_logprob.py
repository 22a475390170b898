"""Op-level benchmark of the fused log-prob head and the distillation divergence (GPU only).

One table (scripts/bench_harness.py: device time with host work hidden, wall time from
do_bench, both with L2 flushed; extra peak memory of one fwd+bwd), bf16, random inputs:

- log-prob + entropy, N 16384 x H {1024, 4096} x V 151936, fwd+bwd with upstream gradients on
  both fields (the "fwd" columns: forward only under no_grad, a reference model's call):
  ours (`fused_linear_logprob`, lean, and with ``keep_logits=True``), TRL 1.16's `ChunkedLogProbFunction` (its in-tree fused head),
  TRL's `selective_log_softmax_and_entropy` on materialised logits (the lm_head matmul
  included), Liger's fused linear cross-entropy with reduction="none" (per-token -log p only:
  no entropy; its closest fused op) and eager torch on the full logits;
- distillation, student N 16384 x H 1024, teacher H 2048, V 151936, generalised JSD
  (beta 0.5) and forward KL (beta 0), fwd+bwd of the mean over tokens: ours
  (`fused_linear_divergence`), TRL's `ChunkedDivergenceFunction`, Liger's `LigerFusedLinearJSD`
  and eager torch.

A peer that is not installed (liger_kernel) or fails at a shape gets an error row, not a crash.
The divergence cases time each implementation for about DIVERGENCE_BUDGET's seconds (fewer
repetitions for the slow ones: eager holds ~12 [N, V] fp32 temporaries, 112 GiB, and takes a few
hundred ms a call) and stop one that runs past its limit with a "timeout" row; the whole
`--only divergence` run is meant to take about 90 s on an H200.

    python scripts/bench_logprob.py [--out results.json] [--quick] [--only logprob|divergence]
        [--skip eager]    (leave out the implementations whose name starts with these)
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import types
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_harness import (  # noqa: E402
    TRAINING_VARIANT,
    Budget,
    Case,
    Impl,
    dump,
    format_table,
    measure_ceilings,
    run_case,
)

DT = torch.bfloat16
VOCAB = 151936
IGNORE_FRACTION = 0.05
# Per implementation of a divergence case: ~3 s of timed calls (the repetitions scaled down from
# the harness's 30 x 3 rounds + 20 wall calls, which at 60-300 ms a call took minutes per case),
# and 25 s at most, Triton's first-call builds and config timing included.
DIVERGENCE_BUDGET = Budget(per_impl_s=3.0, limit_s=25.0)


def _ours(module: str):
    """One module of the training kernel folder, imported without running its __init__."""
    pkg = "_kernels_training_logprob_bench"
    if pkg not in sys.modules:
        ns = types.ModuleType(pkg)
        ns.__path__ = [str(TRAINING_VARIANT)]
        sys.modules[pkg] = ns
    return importlib.import_module(f"{pkg}.{module}")


def _head(n: int, hdim: int, vocab: int, grad: bool = True):
    hidden = torch.randn(n, hdim, device="cuda", dtype=DT).requires_grad_(grad)
    weight = (torch.randn(vocab, hdim, device="cuda", dtype=DT) * hdim**-0.5).requires_grad_(grad)
    return hidden, weight


def _labels(n: int, vocab: int) -> torch.Tensor:
    y = torch.randint(0, vocab, (n,), device="cuda")
    y[torch.rand(n, device="cuda") < IGNORE_FRACTION] = -100
    return y


def _closures(fn: Callable[[], tuple], leaves: list[torch.Tensor], grads: list[torch.Tensor]):
    """fwd() under no_grad; fwd_bwd() = forward, then autograd.grad of its outputs with the
    given upstream gradients (one per output) w.r.t. the leaves."""

    def fwd():
        with torch.no_grad():
            return fn()

    def fwd_bwd():
        outs = fn()
        return torch.autograd.grad(list(outs), leaves, grads[: len(outs)])

    return fwd, fwd_bwd


# --- log-prob + entropy ------------------------------------------------------------------------


def _eager_logprob(h, w, y):
    logp = torch.log_softmax((h @ w.t()).float(), -1)
    valid = y != -100
    lp = logp.gather(1, torch.where(valid, y, 0)[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)


def logprob_case(n: int, hdim: int, vocab: int = VOCAB) -> Case:
    def inputs():
        h, w = _head(n, hdim, vocab)
        y = _labels(n, vocab)
        g = [torch.randn(n, device="cuda"), torch.randn(n, device="cuda")]
        return h, w, y, g

    def ours(keep: bool = False):
        lpm = _ours("logprob")
        h, w, y, g = inputs()

        def fn():
            out = lpm.fused_linear_logprob(
                h, w, y, outputs=("log_probs", "entropy"), keep_logits=keep
            )
            return out.log_probs, out.entropy

        return _closures(fn, [h, w], g)

    def trl_chunked():
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

        h, w, y, g = inputs()
        y = y.clamp(min=0)  # TRL's caller clamps (or compacts) the masked labels

        def fn():
            out = ChunkedLogProbFunction.apply(
                h, w, None, y, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ("entropy",)
            )
            return out[0], out[1]

        return _closures(fn, [h, w], g)

    def trl_materialized():
        from trl.kernels.logprob_entropy import selective_log_softmax_and_entropy

        h, w, y, g = inputs()
        mask = y != -100
        y = y.clamp(min=0)
        return _closures(
            lambda: selective_log_softmax_and_entropy(h @ w.t(), y, 1.0, mask), [h, w], g
        )

    def liger():
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        h, w, y, g = inputs()

        def fn():  # -log p of the labels per token; Liger has no fused entropy
            return (-liger_fused_linear_cross_entropy(h, w, y, reduction="none"),)

        return _closures(fn, [h, w], g)

    def eager():
        h, w, y, g = inputs()
        return _closures(lambda: _eager_logprob(h, w, y), [h, w], g)

    return Case(
        op="LogProb+entropy",
        shape=f"N{n} H{hdim} V{vocab}",
        impls=[
            Impl("eager (full logits)", eager),
            Impl("trl ChunkedLogProbFunction", trl_chunked),
            Impl("trl mm+selective_log_softmax_and_entropy", trl_materialized),
            Impl("liger", liger),
            Impl("ours", ours),
            Impl("ours (keep_logits)", lambda: ours(keep=True)),
        ],
        # The matmul work of a head that keeps its logits (6·N·H·V); a head that never holds
        # them recomputes them in the backward (8·N·H·V), as ours and TRL's chunked one do.
        flops_fwd_bwd=6 * n * hdim * vocab,
        notes=[
            "liger = fused linear CE, reduction='none': log-probs only (no entropy)",
            "ours (keep_logits) = keep_logits=True (or KERNELS_LOGPROB_KEEP_BYTES): the forward "
            "keeps the [N, V] logits and the backward skips their recompute (3 matmuls, not 4)",
        ],
    )


# --- distillation divergence ------------------------------------------------------------------


def _eager_divergence(hs, ws, ht, wt, beta):
    lps = torch.log_softmax((hs @ ws.t()).float(), -1)
    with torch.no_grad():
        lpt = torch.log_softmax((ht @ wt.t()).float(), -1)
    ps, pt = lps.exp(), lpt.exp()
    if beta == 0.0:
        return (pt * (lpt - lps)).sum(-1)
    log_m = torch.log((1 - beta) * ps + beta * pt)
    return (beta * pt * (lpt - log_m) + (1 - beta) * ps * (lps - log_m)).sum(-1)


def divergence_case(n: int, h_student: int, h_teacher: int, beta: float, vocab: int = VOCAB):
    def inputs():
        hs, ws = _head(n, h_student, vocab)
        ht, wt = _head(n, h_teacher, vocab, grad=False)
        return hs, ws, ht, wt, [torch.ones((), device="cuda")]

    def mean(div):
        return (div.sum() / n,)

    def ours():
        dv = _ours("divergence")
        hs, ws, ht, wt, g = inputs()
        fn = lambda: mean(dv.fused_linear_divergence(hs, ws, ht, wt, kind="jsd", beta=beta))  # noqa: E731
        return _closures(fn, [hs, ws], g)

    def trl_chunked():
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

        hs, ws, ht, wt, g = inputs()
        fn = lambda: mean(ChunkedDivergenceFunction.apply(hs, ws, None, ht, wt, None, beta)[0])  # noqa: E731
        return _closures(fn, [hs, ws], g)

    def liger():  # its beta reads as TRL's (0 forward KL, 1 reverse KL); a mean over tokens
        from liger_kernel.transformers import LigerFusedLinearJSD

        hs, ws, ht, wt, g = inputs()
        jsd = LigerFusedLinearJSD(jsd_beta=beta, temperature=1.0)
        return _closures(lambda: (jsd(hs, ws, ht, wt, None),), [hs, ws], g)

    def eager():
        hs, ws, ht, wt, g = inputs()
        return _closures(lambda: mean(_eager_divergence(hs, ws, ht, wt, beta)), [hs, ws], g)

    kind = "forward KL (beta 0)" if beta == 0.0 else f"JSD (beta {beta})"
    # Matmul work with kept logits: student fwd + 2 for its gradients, teacher fwd.
    flops = 2 * n * vocab * (3 * h_student + h_teacher)
    return Case(
        op=f"Distill {kind}",
        shape=f"N{n} Hs{h_student} Ht{h_teacher} V{vocab}",
        impls=[
            Impl("eager (full logits)", eager),
            Impl("trl ChunkedDivergenceFunction", trl_chunked),
            Impl("liger", liger),
            Impl("ours", ours),
        ],
        flops_fwd_bwd=flops,
        budget=DIVERGENCE_BUDGET,
    )


def cases(quick: bool, only: str | None) -> list[Case]:
    n = 2048 if quick else 16384
    out = []
    if only in (None, "logprob"):
        out += [logprob_case(n, 1024), logprob_case(n, 4096)]
    if only in (None, "divergence"):
        out += [divergence_case(n, 1024, 2048, 0.5), divergence_case(n, 1024, 2048, 0.0)]
    return out


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "triton", "trl", "transformers", "liger-kernel"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "not installed"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the rows and ceilings as JSON here")
    parser.add_argument(
        "--quick", action="store_true", help="N 2048 instead of 16384 (a smoke run)"
    )
    parser.add_argument("--only", choices=["logprob", "divergence"], help="one group of cases")
    parser.add_argument(
        "--skip", default="", help="comma-separated implementation names to leave out (eager ...)"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_logprob: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    versions = _versions()
    print(
        f"{torch.cuda.get_device_name(0)}; " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        flush=True,
    )
    ceil = measure_ceilings()
    rows, notes = [], []
    skip = {name.strip() for name in args.skip.split(",") if name.strip()}
    for case in cases(args.quick, args.only):
        case.impls = [i for i in case.impls if i.name.split(" ")[0] not in skip]
        print(f"running {case.op} {case.shape} ...", file=sys.stderr, flush=True)
        rows += run_case(case, ceil)
        notes += case.notes
        torch.cuda.empty_cache()
    print(format_table(rows, ceil))
    for note in dict.fromkeys(notes):
        print(f"- {note}")
    if args.out:
        dump(rows, ceil, args.out)
        with open(args.out) as fh:
            data = json.load(fh)
        data["versions"] = versions
        with open(args.out, "w") as fh:
            json.dump(data, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
