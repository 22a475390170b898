"""Rows per chunk of our fused linear cross-entropy, against torch.compile: a diagnosis.

    python scripts/probes/probe_flce_chunks.py [--shapes N8192H2048V262144,...] [--rounds 3]
    python scripts/probes/probe_flce_chunks.py --grid [--shapes ...]

The chunk used to be the largest power of two whose [rows, V] bf16 logits fit the 504 MiB budget:
512 rows at V 262144, where the byte budget holds 1008 (`default_chunk_rows` now takes the
budget's largest multiple of 64 where the power of two fills under 55 % of it; this probe
times both). Fewer,
larger chunks mean fewer read-modify-write passes of d(weight) and longer matmuls; rows that are
not a power of two may tile the matmuls worse. For each shape this times fwd+bwd of
torch.compile (the eager formula, compiled) and of ours at the default and at other row counts
that fit the budget, device time (host hidden behind a queued sleep kernel) and wall time
(do_bench), implementations taking turns over `--rounds`, with the extra peak memory, and prints
one table. ``--grid`` times ours alone (device time) at every multiple of 128 rows from the power of two
up to what the budget holds, plus the default, the largest multiple of 64 and the even split.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
from bench_cases_losses import _eager_flce, _ours  # noqa: E402
from bench_harness import _device_ms, _extra_peak_mib, _wall_ms  # noqa: E402

SHAPES = {"N8192H2048V262144": (8192, 2048, 262144), "N8192H2048V151936": (8192, 2048, 151936),
          "N16384H1024V151936": (16384, 1024, 151936), "N8192H2048V131072": (8192, 2048, 131072),
          "N8192H2048V202048": (8192, 2048, 202048)}  # fmt: skip


def _ceil_to(a: int, m: int) -> int:
    return -(-a // m) * m


def _row_counts(n: int, vocab: int, budget: int) -> list[int | None]:
    """None (the default) and row counts that fit the budget: the largest power of two, the
    largest multiple of 128, and n split into equal chunks (rounded up to 64 rows) where that
    fits."""
    cap = budget // (_ceil_to(vocab, 64) * 2)
    out: list[int | None] = [None, 1 << (cap.bit_length() - 1), cap // 128 * 128]
    even = _ceil_to(-(-n // -(-n // cap)), 64)
    if even <= cap:
        out.append(even)
    return [r for i, r in enumerate(out) if r not in out[:i]]


def _grid_rows(n: int, vocab: int, budget: int, default: int) -> list[int]:
    """The default, the largest power of two that fits the budget, every multiple of 128 above
    it that fits, the largest multiple of 64 that does, and the even split (see _row_counts)."""
    cap = min(n, budget // (_ceil_to(vocab, 64) * 2))
    low = min(default, 1 << (cap.bit_length() - 1))
    rows = [default, low, *range(_ceil_to(low + 1, 128), cap + 1, 128), cap // 64 * 64]
    rows += [r for r in _row_counts(n, vocab, budget) if r is not None]
    return sorted({r for r in rows if low <= r <= cap})


def _inputs(n: int, h: int, v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16) * h**-0.5).requires_grad_()
    return x, w, torch.randint(0, v, (n,), device="cuda")


def _device_medians(fns: dict, rounds: int) -> dict:
    """Median device ms of each fn after a first (compiling, tuning) call; the fns take turns
    over `rounds`, so a drift of the GPU favours none."""
    for f in fns.values():
        f()
    dev: dict = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            dev[k].append(_device_ms(f, reps=10))
    return {k: statistics.median(v) for k, v in dev.items()}


def _grid(name: str, n: int, h: int, v: int, module, rounds: int) -> list[tuple]:
    x, w, t = _inputs(n, h, v)
    flce, budget = module.fused_linear_cross_entropy, module.MAX_CHUNK_BYTES
    vpad = _ceil_to(v, 64)
    default = min(module.default_chunk_rows(n, vpad, 2), module.row_cap(h, vpad, 2))
    fns = {
        r: (lambda r=r: torch.autograd.grad(flce(x, w, t, chunk_rows=r), [x, w]))
        for r in _grid_rows(n, v, budget, default)
    }
    out = []
    for r, ms in _device_medians(fns, rounds).items():
        label = f"ours chunk {r}" + (" (default)" if r == default else "")
        out.append((name, label, ms, float("nan"), float("nan")))
        print(out[-1], flush=True)
    return out


def _one_shape(name: str, n: int, h: int, v: int, flce, budget: int, rounds: int) -> list[tuple]:
    x, w, t = _inputs(n, h, v)
    compiled = torch.compile(_eager_flce)
    impls = {"torch.compile": lambda: compiled(x, w, t)}
    for rows in _row_counts(n, v, budget):
        label = "ours default" if rows is None else f"ours chunk {rows}"
        impls[label] = lambda rows=rows: flce(x, w, t, chunk_rows=rows)
    fwd_bwd = {k: (lambda f=f: torch.autograd.grad(f(), [x, w])) for k, f in impls.items()}
    rows_out = []
    for k, ms in _device_medians(fwd_bwd, rounds).items():
        f = fwd_bwd[k]
        rows_out.append((name, k, ms, _wall_ms(f), _extra_peak_mib(f)))
        print(rows_out[-1], flush=True)
    return rows_out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--grid", action="store_true", help="ours alone over many row counts")
    args = parser.parse_args()
    module = _ours("fused_linear_cross_entropy")
    flce, budget = module.fused_linear_cross_entropy, module.MAX_CHUNK_BYTES
    print({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__})  # fmt: skip
    table = []
    for name in args.shapes.split(","):
        if args.grid:
            table += _grid(name, *SHAPES[name], module, args.rounds)
        else:
            table += _one_shape(name, *SHAPES[name], flce, budget, args.rounds)
        torch.cuda.empty_cache()
    print("| shape | impl | fwd+bwd device ms | fwd+bwd wall ms | extra MiB |")
    print("|---|---|---|---|---|")
    for name, k, d, wall, mib in table:
        print(f"| {name} | {k} | {d:.3f} | {wall:.3f} | {mib:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
