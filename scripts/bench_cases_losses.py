"""Benchmark cases for the losses: CrossEntropy and fused Linear + CrossEntropy (FLCE).

Peers per case: eager torch (F.cross_entropy on fp32-upcast logits, as transformers' loss does;
for FLCE the lm_head matmul first), torch.compile of that same eager code, Liger 0.8.5, Cut
Cross-Entropy 25.1.1 (FLCE only) and ours. Inputs are bf16 and random, about 5 % of the targets
are ignore_index, and the backward goes through torch.autograd.grad.

In-place peers (Liger's CE and ours) overwrite their logits buffer with the gradient on every
call, so later timed calls run on gradient-valued logits; the bytes and flops are the same.

``python scripts/bench_cases_losses.py`` runs these cases alone (scripts/bench_kernels.py picks
`cases` up as well); ``--tune`` first sweeps our launch shapes and FLCE chunk sizes, measures the
d(weight) accumulation error against an fp32 reference, and runs the cases with the best shape.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_harness import (  # noqa: E402
    TRAINING_VARIANT,
    Case,
    Impl,
    dump,
    format_table,
    measure_ceilings,
    run_case,
)

DT = torch.bfloat16


def set_dtype(dtype: torch.dtype) -> None:
    """Make the cases built from now on use `dtype` (bf16 unless set; bench_kernels --dtype)."""
    global DT
    DT = dtype


IGNORE_FRACTION = 0.05


def _ours(module: str):
    """One module of the training kernel folder, imported without running its __init__."""
    pkg = "_kernels_training_losses_bench"
    if pkg not in sys.modules:
        ns = types.ModuleType(pkg)
        ns.__path__ = [str(TRAINING_VARIANT)]
        sys.modules[pkg] = ns
    return importlib.import_module(f"{pkg}.{module}")


def _targets(n: int, vocab: int) -> torch.Tensor:
    t = torch.randint(0, vocab, (n,), device="cuda")
    t[torch.rand(n, device="cuda") < IGNORE_FRACTION] = -100
    return t


def _closures(fn: Callable[[], torch.Tensor], leaves: list[torch.Tensor]):
    """fwd() under no_grad, and fwd_bwd() = forward + autograd.grad of the loss w.r.t. leaves."""

    def fwd():
        with torch.no_grad():
            return fn()

    def fwd_bwd():
        return torch.autograd.grad(fn(), leaves)

    return fwd, fwd_bwd


_COMPILED: dict[str, Callable] = {}


def _compiled(key: str, fn: Callable) -> Callable:
    """One torch.compile per eager function, shared by every make() of the case."""
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, dynamic=False)
    return _COMPILED[key]


def _eager_ce(logits, target):
    return F.cross_entropy(logits.float(), target, ignore_index=-100)


def _eager_flce(hidden, weight, target):
    return F.cross_entropy((hidden @ weight.t()).float(), target, ignore_index=-100)


def ce_case(n: int, vocab: int, target_ms: float | None = None) -> Case:
    def inputs():
        logits = torch.randn(n, vocab, device="cuda", dtype=DT, requires_grad=True)
        return logits, _targets(n, vocab)

    def eager():
        x, t = inputs()
        return _closures(lambda: _eager_ce(x, t), [x])

    def compiled():
        x, t = inputs()
        fn = _compiled("ce", _eager_ce)
        return _closures(lambda: fn(x, t), [x])

    def liger():
        from liger_kernel.transformers.functional import liger_cross_entropy

        x, t = inputs()
        return _closures(lambda: liger_cross_entropy(x, t, ignore_index=-100), [x])

    def ours():
        ce = _ours("cross_entropy")
        x, t = inputs()
        return _closures(lambda: ce.cross_entropy(x, t), [x])

    nbytes = n * vocab * DT.itemsize
    return Case(
        op="CrossEntropy",
        shape=f"{n}x{vocab}",
        impls=[
            Impl("eager", eager),
            Impl("torch.compile", compiled),
            Impl("liger", liger),
            Impl("ours", ours),
        ],
        bytes_fwd=nbytes,  # loss only: read the logits once
        bytes_fwd_bwd=2 * nbytes,  # loss and gradient: read once, write the gradient once
        target_ms=target_ms,
    )


def flce_case(
    n: int, hdim: int, vocab: int, target_ms: float | None = None, chunk_rows: int | None = None
) -> Case:
    def inputs():
        hidden = torch.randn(n, hdim, device="cuda", dtype=DT, requires_grad=True)
        weight = (torch.randn(vocab, hdim, device="cuda", dtype=DT) * hdim**-0.5).requires_grad_()
        return hidden, weight, _targets(n, vocab)

    def eager():
        h, w, t = inputs()
        return _closures(lambda: _eager_flce(h, w, t), [h, w])

    def compiled():
        h, w, t = inputs()
        fn = _compiled("flce", _eager_flce)
        return _closures(lambda: fn(h, w, t), [h, w])

    def liger():
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        h, w, t = inputs()
        return _closures(lambda: liger_fused_linear_cross_entropy(h, w, t), [h, w])

    def cce():
        from cut_cross_entropy import linear_cross_entropy

        h, w, t = inputs()
        return _closures(lambda: linear_cross_entropy(h, w, t), [h, w])

    def ours():
        fl = _ours("fused_linear_cross_entropy")
        h, w, t = inputs()
        return _closures(
            lambda: fl.fused_linear_cross_entropy(h, w, t, chunk_rows=chunk_rows), [h, w]
        )

    return Case(
        op="Linear+CE",
        shape=f"N{n} H{hdim} V{vocab}",
        impls=[
            Impl("eager", eager),
            Impl("torch.compile", compiled),
            Impl("liger", liger),
            Impl("cut-cross-entropy", cce),
            Impl("ours", ours),
        ],
        flops_fwd_bwd=6 * n * hdim * vocab,
        target_ms=target_ms,
    )


def cases(small: bool) -> list[Case]:
    """The issue's anchors, plus small shapes; `small` keeps only the small ones."""
    out = [ce_case(2048, 32000), flce_case(2048, 1024, 32000)]
    if small:
        return out
    return out + [
        ce_case(8192, 151936, target_ms=1.4),
        flce_case(16384, 4096, 128256, target_ms=84.0),
        flce_case(16384, 1024, 151936, target_ms=27.0),
    ]


# --- tuning (GPU) ------------------------------------------------------------------------------


def _bench(fn: Callable[[], object], rep_ms: int = 200) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=50, rep=rep_ms, return_mode="median")


def tune_ce(n: int = 8192, vocab: int = 151936, spin: bool = True) -> tuple[object, list[dict]]:
    """Time the CE kernel (loss + in-place gradient) over launch shapes; return the fastest."""
    ce = _ours("cross_entropy")
    logits = torch.randn(n, vocab, device="cuda", dtype=DT)
    target = _targets(n, vocab)
    one = torch.ones(1, device="cuda")
    shapes = [
        # one pass: a chunk is one block held in registers; the row's programs wait for each
        # other, then each writes its own chunk of the gradient
        ce.CEConfig(4096, 4096, 4, spin=True, one_pass=True),
        ce.CEConfig(8192, 8192, 4, spin=True, one_pass=True),
        ce.CEConfig(8192, 8192, 8, spin=True, one_pass=True),
        ce.CEConfig(8192, 8192, 16, spin=True, one_pass=True),
        ce.CEConfig(16384, 16384, 8, spin=True, one_pass=True),
        ce.CEConfig(16384, 16384, 16, spin=True, one_pass=True),
        # for comparison: the best two-read shapes of the first sweep (the default is first)
        ce.CEConfig(8192, 2048, 4, spin=True),
        ce.CEConfig(16384, 4096, 8, evict=True),
    ]
    if not spin:
        shapes = [c for c in shapes if not c.spin]
    rows = []
    for cfg in shapes:
        row = {"config": repr(cfg)}
        try:
            ms = _bench(lambda c=cfg: ce.ce_rows(logits, target, logits, one, config=c))
            row["ms"] = ms
            row["GB/s"] = 2 * n * vocab * 2 / ms / 1e6
        except Exception as exc:  # report and go on: a shape the compiler rejects
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
        rows.append(row)
        print(row, flush=True)
    best = min((r for r in rows if "ms" in r), key=lambda r: r["ms"])
    cfg = shapes[rows.index(best)]
    fwd_ms = _bench(lambda: ce.ce_rows(logits, target, None, one, config=cfg))
    rows.append(
        {
            "config": "best, loss only (no gradient)",
            "ms": fwd_ms,
            "GB/s": n * vocab * 2 / fwd_ms / 1e6,
        }
    )
    print(rows[-1], flush=True)
    return cfg, rows


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def tune_flce(shapes=((16384, 4096, 128256), (16384, 1024, 151936))) -> tuple[dict, list[dict]]:
    """Time FLCE over chunk sizes, and measure d(weight) error vs fp32 per chunk count."""
    fl = _ours("fused_linear_cross_entropy")
    best: dict = {}
    rows = []
    for n, hdim, vocab in shapes:
        h = torch.randn(n, hdim, device="cuda", dtype=DT, requires_grad=True)
        w = (torch.randn(vocab, hdim, device="cuda", dtype=DT) * hdim**-0.5).requires_grad_()
        t = _targets(n, vocab)
        # fp32 reference (no TF32) of the loss and d(weight), and eager bf16's own error.
        prev_tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        h32 = h.detach().float().requires_grad_()
        w32 = w.detach().float().requires_grad_()
        ref = F.cross_entropy(h32 @ w32.t(), t)
        ref_dh, ref_dw = torch.autograd.grad(ref, [h32, w32])
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
        eager_dh, eager_dw = torch.autograd.grad(_eager_flce(h, w, t), [h, w])
        rows.append(
            {
                "shape": (n, hdim, vocab),
                "impl": "eager bf16",
                "dW err": _rel(eager_dw, ref_dw),
                "dX err": _rel(eager_dh, ref_dh),
            }
        )
        del eager_dh, eager_dw, h32, w32
        torch.cuda.empty_cache()
        cap = fl.default_chunk_rows(n, vocab, 2)
        for rows_per_chunk in sorted({512, 1024, cap, 2048}):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            loss = fl.fused_linear_cross_entropy(h, w, t, chunk_rows=rows_per_chunk)
            dh, dw = torch.autograd.grad(loss, [h, w])
            torch.cuda.synchronize()
            extra = (torch.cuda.max_memory_allocated() - base) / 2**20 - (
                dh.numel() + dw.numel()
            ) * 2 / 2**20
            row = {
                "shape": (n, hdim, vocab),
                "chunk_rows": rows_per_chunk,
                "chunks": -(-n // rows_per_chunk),
                "loss err": _rel(loss, ref),
                "dW err": _rel(dw, ref_dw),
                "dX err": _rel(dh, ref_dh),
                "extra MiB": round(extra),
            }
            del dh, dw, loss

            def step(r=rows_per_chunk, h=h, w=w, t=t):
                return torch.autograd.grad(
                    fl.fused_linear_cross_entropy(h, w, t, chunk_rows=r), [h, w]
                )

            row["ms"] = _bench(step, rep_ms=400)
            row["TFLOP/s"] = 6 * n * hdim * vocab / row["ms"] / 1e9
            rows.append(row)
            print(row, flush=True)
        within = [
            r
            for r in rows
            if r.get("shape") == (n, hdim, vocab) and "ms" in r and r["extra MiB"] <= 512
        ]
        best[(n, hdim, vocab)] = min(within, key=lambda r: r["ms"])["chunk_rows"]
        del h, w, t, ref, ref_dh, ref_dw
        torch.cuda.empty_cache()
    return best, rows


def spin_check() -> bool:
    """Does the spinning CE variant finish and agree with the default one at a real shape?"""
    ce = _ours("cross_entropy")
    logits = torch.randn(4096, 151936, device="cuda", dtype=DT)
    target = _targets(4096, 151936)
    one = torch.ones(1, device="cuda")
    g1, g2 = logits.clone(), logits.clone()
    l1, _ = ce.ce_rows(logits, target, g1, one, config=ce.CEConfig(16384, 4096, 8))
    l2, _ = ce.ce_rows(logits, target, g2, one, config=ce.CEConfig(16384, 4096, 8, spin=True))
    ok = torch.equal(l1, l2) and torch.equal(g1, g2)
    print("spin variant agrees:", ok, flush=True)
    return ok


def _with_deadline(impl: Impl, deadline: float) -> Impl:
    def make():
        if time.monotonic() > deadline:
            raise RuntimeError("skipped: the run's time budget was used up")
        return impl.make()

    return Impl(impl.name, make)


def _breakdown_one(n: int, hdim: int, vocab: int) -> dict:
    ce = _ours("cross_entropy")
    fl = _ours("fused_linear_cross_entropy")
    c = fl.default_chunk_rows(n, vocab, 2)
    x = torch.randn(c, hdim, device="cuda", dtype=DT)
    w = torch.randn(vocab, hdim, device="cuda", dtype=DT) * hdim**-0.5
    t = _targets(c, vocab)
    buf = torch.empty(c, vocab, device="cuda", dtype=DT)
    dx = torch.empty_like(x)
    dw = torch.zeros_like(w)
    one = torch.ones(1, device="cuda")
    torch.mm(x, w.t(), out=buf)
    parts = {
        "logits = x W^T": lambda: torch.mm(x, w.t(), out=buf),
        "CE kernel (in place)": lambda: ce.ce_rows(buf, t, buf, one),
        "dX = G W": lambda: torch.mm(buf, w, out=dx),
        "dW += G^T x": lambda: dw.addmm_(buf.t(), x),
    }
    chunks = -(-n // c)
    row = {"shape": (n, hdim, vocab), "chunk_rows": c, "chunks": chunks}
    for name, fn in parts.items():
        ms = _bench(fn)
        row[name + " ms"] = ms
        if name != "CE kernel (in place)":
            row[name + " TFLOP/s"] = 2 * c * hdim * vocab / ms / 1e9
    row["sum x chunks ms"] = chunks * sum(row[k + " ms"] for k in parts)
    return row


def breakdown(shapes=((16384, 4096, 128256), (16384, 1024, 151936))) -> list[dict]:
    """Where one FLCE chunk's time goes: the three matmuls and the CE kernel, timed apart."""
    rows = []
    for shape in shapes:
        rows.append(_breakdown_one(*shape))
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="only the small shapes")
    ap.add_argument("--anchors", action="store_true", help="only the issue's anchor shapes")
    ap.add_argument("--tune", action="store_true", help="sweep our launch shapes first")
    ap.add_argument("--no-spin", action="store_true", help="leave the spinning variant out")
    ap.add_argument("--spin-check", action="store_true", help="only check the spin variant")
    ap.add_argument("--skip", default="", help="comma-separated impl names to leave out")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip impls started later")
    ap.add_argument("--out", default="", help="folder for the JSON and Markdown results")
    args = ap.parse_args()
    deadline = time.monotonic() + args.budget_s
    if args.spin_check:
        sys.exit(0 if spin_check() else 1)
    out = Path(args.out) if args.out else None
    env = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": importlib.import_module("triton").__version__,
    }
    for pkg in ("liger_kernel", "cut_cross_entropy", "transformers"):
        try:
            from importlib.metadata import version

            env[pkg] = version(pkg.replace("_", "-"))
        except Exception:
            env[pkg] = "missing"
    print(env, flush=True)
    chunk_rows: dict = {}
    if args.tune:
        cfg, ce_rows = tune_ce(spin=not args.no_spin)
        ce = _ours("cross_entropy")
        ce.default_config = lambda vocab, device, c=cfg: c  # the cases below use the winner
        chunk_rows, fl_rows = tune_flce()
        parts = breakdown()
        print("tuned:", cfg, chunk_rows, flush=True)
        if out:
            (out / "tune.json").write_text(
                json.dumps(
                    {
                        "env": env,
                        "ce": ce_rows,
                        "flce": fl_rows,
                        "flce_breakdown": parts,
                        "chosen": {"ce": repr(cfg), "flce": repr(chunk_rows)},
                    },
                    indent=1,
                    default=str,
                )
            )
    skip = {s for s in args.skip.split(",") if s}
    ceil = measure_ceilings()
    rows = []
    todo = cases(args.small)
    if args.anchors:
        todo = [c for c in todo if c.target_ms is not None]
    for case in todo:
        key = tuple(int(p[1:]) for p in case.shape.split()) if case.op == "Linear+CE" else None
        if key in chunk_rows:
            case = flce_case(*key, target_ms=case.target_ms, chunk_rows=chunk_rows[key])
        # torch.compile last: its compile time is what a tight budget should cut first.
        impls = [i for i in case.impls if i.name not in skip]
        impls.sort(key=lambda i: i.name == "torch.compile")
        case.impls = [_with_deadline(i, deadline) for i in impls]
        rows += run_case(case, ceil)
        print(format_table(rows[-len(case.impls) :], ceil), flush=True)
        if out:
            dump(rows, ceil, str(out / "bench.json"))
    table = format_table(rows, ceil)
    print(json.dumps(env))
    print(table)
    if out:
        (out / "bench.md").write_text(json.dumps(env) + "\n\n" + table + "\n")


if __name__ == "__main__":
    main()
