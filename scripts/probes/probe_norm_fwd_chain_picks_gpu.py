"""RMSNorm forward inside bench_graph_chain's own harness, at the shapes where the chain and the
one-process probes disagree (GPU): the compiled module, and for each kernel tree (this one, and
any --trees, copies of the training kernel folder) our layer as the chain runs it (its tuner's
pick) and every forward candidate forced. It tells a tuner pick that is off from a kernel that
runs slower in the chain's setting, where each call writes a new output (the one-process probes
reuse one), and compares kernel variants there.

    python scripts/probes/probe_norm_fwd_chain_picks_gpu.py [--shapes "x 1024x1024,..."]
        [--trees DIR,DIR]
"""

import argparse
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_cases_elementwise as cases  # noqa: E402
from bench_graph_chain import measure_case  # noqa: E402
from bench_harness import Impl, allow_many_compiles, load_training_kernels  # noqa: E402


def _case_inputs(m: int, n: int):
    return cases._llama_rms_norm(n), cases._randn(m, n, requires_grad=False)


def layer(tag: str, kt, m: int, n: int) -> Impl:
    """The tree's RMSNorm layer on a LlamaRMSNorm, as the chain's "ours" row (no grad)."""

    def make():
        mod, x = _case_inputs(m, n)
        mod.forward = types.MethodType(kt.layers.RMSNorm.forward, mod)

        def fwd():
            with torch.no_grad():
                return mod(x)

        return fwd, fwd

    return Impl(f"{tag} layer", make)


def forced(tag: str, rms, m: int, n: int, cfg: dict) -> Impl:
    """The tree's forward at one geometry, without stats, as the chain's no-grad forward."""

    def make():
        mod, x = _case_inputs(m, n)
        w = mod.weight.detach()

        def fwd():
            return rms.forward(x, w, 1e-6, False, cfg=cfg, stats=False)[0]

        return fwd, fwd

    even = (f" loop{cfg['LOOP']}" if cfg.get("LOOP") else "") + (" even" if cfg.get("EVEN") else "")
    return Impl(f"{tag} {cfg['BLOCK_M']}r{cfg['num_warps']}w{even}", make)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="x 1024x1024,x 4096x128,x 4096x8192")
    p.add_argument("--trees", default="", help="comma-separated kernel folders to add")
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    allow_many_compiles()  # one compiled module per shape and grad mode
    dirs = {"this": "this tree"}
    dirs.update({f"t{i + 1}": d for i, d in enumerate(t for t in args.trees.split(",") if t)})
    trees = {t: load_training_kernels(Path(d)) if t != "this" else load_training_kernels()
             for t, d in dirs.items()}  # fmt: skip
    lines = [
        "trees: " + ", ".join(f"{t} = {d}" for t, d in dirs.items()),
        "",
        "| shape | impl | fwd µs per op, wall [min-max] | / torch.compile |",
        "|---|---|---|---|",
    ]
    for shape in args.shapes.split(","):
        m, n = (int(v) for v in shape.split()[1].split("x"))
        case = cases.rms_norm_case(m, n)
        impls = [i for i in case.impls if i.name == "torch.compile"]
        for tag, kt in trees.items():
            rms = sys.modules[kt.__name__ + ".rms_norm"]
            impls.append(layer(tag, kt, m, n))
            impls += [forced(tag, rms, m, n, c) for c in rms.fwd_candidates(m, n)]
        case.impls = impls
        rows = measure_case(case, 32, 20, args.rounds)
        base = next(r for r in rows if r["impl"] == "torch.compile")["fwd_wall_us"]
        start = len(lines)
        for r in rows:
            if "error" in r:
                lines.append(f"| {shape} | {r['impl']} | {r['error']} | |")
                continue
            walls = r["fwd_wall"]
            lines.append(
                f"| {shape} | {r['impl']} | {r['fwd_wall_us']:.2f} [{min(walls):.2f}-"
                f"{max(walls):.2f}] | {r['fwd_wall_us'] / base:.3f}x |"
            )
        for tag, kt in trees.items():
            common = sys.modules[kt.__name__ + "._common"]
            pick = [v for k, v in common._CHOICES.items() if k[0] == "rms_fwd" and k[2] == n]
            lines.append(f"| {shape} | {tag}'s tuner picks (this width) | {pick} | |")
        print("\n".join(lines[start:]), flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
