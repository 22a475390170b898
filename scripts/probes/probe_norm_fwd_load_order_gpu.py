"""RMSNorm and LayerNorm forward: another tree's kernels (--baseline DIR, a copy of the training
kernel folder) against this tree's, and Inductor's compiled module, in alternating turns inside
CUDA graphs of 32 calls, one process (GPU). bf16, a weight (and LayerNorm's bias), no grad.

For RMSNorm every forward candidate of both trees is forced in turn; the best of each tree, and
this tree's tuner pick, are reported against Inductor. LayerNorm has one geometry per shape.
Both trees' outputs are checked equal at each geometry (bit for bit: a change of load order or
of how the weight multiply is compiled must not change a value).

    git archive REV hub_kernels/kernels-lab/training/build/torch-universal | tar -x -C OLD
    python scripts/probes/probe_norm_fwd_load_order_gpu.py \
        --baseline OLD/hub_kernels/kernels-lab/training/build/torch-universal
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_harness import load_training_kernels  # noqa: E402
from probe_norm_fwd_ab_gpu import SHAPES, llama_norm_case  # noqa: E402
from probe_norm_fwd_tuner_gpu import name  # noqa: E402
from probe_norm_fwd_wide_gpu import round_times  # noqa: E402

LN_SHAPES = [(1024, 1024), (4096, 1024), (1024, 4096), (4096, 4096), (1024, 8192)]


def tuner_choices(rms) -> dict:
    """The configs picked so far by the tuner of `rms`'s tree."""
    return sys.modules[rms.__name__.rsplit(".", 1)[0] + "._common"]._CHOICES


def modules(path: Path | None):
    kt = load_training_kernels(path) if path else load_training_kernels()
    return sys.modules[kt.__name__ + ".rms_norm"], sys.modules[kt.__name__ + ".layer_norm"]


def alternate(impls: dict, x: torch.Tensor, rounds: int) -> dict:
    """Median per-op µs of each implementation on x (see round_times)."""
    return {k: statistics.median(v) for k, v in round_times(impls, x, rounds).items()}


def rms_rows(old, new, rounds: int, old_kw: dict, new_kw: dict, shapes: list) -> list[str]:
    """`old_kw`, `new_kw`: extra keyword arguments of each tree's forward (e.g. stats=False)."""
    rows = []
    for m, n in shapes:
        x, mod, w = llama_norm_case(m, n)
        impls = {}
        with torch.no_grad():
            compiled = torch.compile(mod)
            compiled(x)
            impls["inductor"] = compiled
            for tag, rms, kw in (("old", old, old_kw), ("new", new, new_kw)):
                for c in rms.fwd_candidates(m, n):
                    impls[f"{tag} {name(c)}"] = lambda x, c=c, r=rms, w=w, kw=kw: r.forward(
                        x, w, 1e-6, False, cfg=c, **kw
                    )[0]
            same = all(  # geometry by geometry: a row's sum order depends on the warps
                torch.equal(old.forward(x, w, 1e-6, False, cfg=c, **old_kw)[0],
                            new.forward(x, w, 1e-6, False, cfg=c, **new_kw)[0])
                for c in new.fwd_candidates(m, n)
            )  # fmt: skip
            new.forward(x, w, 1e-6, False, **new_kw)  # the tuner's pick
            pick = [v for k, v in tuner_choices(new).items() if k[0] == "rms_fwd"][-1]
            med = alternate(impls, x, rounds)
        ind = med.pop("inductor")
        best = {t: min((k for k in med if k.startswith(t)), key=med.get) for t in ("old", "new")}
        cells = " ".join(f"{k} {v:.2f}" for k, v in med.items())
        rows.append(
            f"| RMSNorm {m}x{n} | {ind:.2f} | {best['old']} {med[best['old']] / ind:.3f}x "
            f"| {best['new']} {med[best['new']] / ind:.3f}x | new {name(pick)} "
            f"{med['new ' + name(pick)] / ind:.3f}x | {same} | {cells} |"
        )
        print(rows[-1], flush=True)
        tuner_choices(new).clear()
    return rows


def ln_rows(old, new, rounds: int) -> list[str]:
    rows = []
    for m, n in LN_SHAPES:
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        mod = torch.nn.LayerNorm(n, eps=1e-5).to("cuda", torch.bfloat16)
        with torch.no_grad():
            mod.weight.normal_(1.0, 0.1)
            mod.bias.normal_(0.0, 0.1)
            w, b = mod.weight.detach(), mod.bias.detach()
            compiled = torch.compile(mod)
            compiled(x)
            impls = {
                "inductor": compiled,
                "old": lambda x, w=w, b=b: old.forward(x, w, b, 1e-5)[0],
                "new": lambda x, w=w, b=b: new.forward(x, w, b, 1e-5)[0],
            }
            same = torch.equal(impls["old"](x), impls["new"](x))
            med = alternate(impls, x, rounds)
        ind = med["inductor"]
        rows.append(
            f"| LayerNorm {m}x{n} | {ind:.2f} | {med['old']:.2f} ({med['old'] / ind:.3f}x) "
            f"| {med['new']:.2f} ({med['new'] / ind:.3f}x) | {same} |"
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", type=Path, required=True)
    p.add_argument(
        "--tree", type=Path, help="the kernel folder to time against it (default: this tree's)"
    )
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument(
        "--no-stats",
        choices=("new", "both"),
        help="the RMSNorm forward without rstd: this tree's, or both trees'",
    )
    p.add_argument("--shapes", help='RMSNorm shapes, e.g. "1024x1024,4096x128" (default: all)')
    p.add_argument("--rms-only", action="store_true", help="skip the LayerNorm rows")
    args = p.parse_args()
    (old_rms, old_ln), (new_rms, new_ln) = modules(args.baseline), modules(args.tree)
    torch.manual_seed(0)
    off = {"stats": False}
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    old_kw = off if args.no_stats == "both" else {}
    rms = rms_rows(old_rms, new_rms, args.rounds, old_kw, off if args.no_stats else {}, shapes)
    ln = [] if args.rms_only else ln_rows(old_ln, new_ln, args.rounds)
    print("\n| shape | Inductor µs | old best / Inductor | new best / Inductor "
          "| new tuner pick / Inductor | old == new | every candidate µs |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rms))
    print("\n| shape | Inductor µs | old µs | new µs | old == new |")
    print("|---|---|---|---|---|")
    print("\n".join(ln))


if __name__ == "__main__":
    main()
