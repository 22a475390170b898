"""Which bound layer moves a VLM's bf16 run away from float64 (the sweep's bf16 verdict, per
layer and per seed; GPU or CPU).

For one image-text type of the VLM sweep, each seed builds the tiny model (seed s, batches as
the sweep makes them) and runs registry.compare three ways: every layer the training kernels
bind, every layer but one (for each bound layer), and that layer alone. Each row gives the
plain model's and ours' (loss, gradient) distances to float64, as the sweep's verdict reads
them. A layer whose absence brings ours back to plain's distance in every seed is the one; a
ratio that moves with the seed is the run's bf16 noise.

    python scripts/probes/probe_vlm_bf16_layers.py --type gemma4 --device cuda --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--type", default="gemma4")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seeds", default="0,1,2")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    import sweep_models
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    sweep_models.start_mirror()
    import kernels
    from kernels.layers import apply_kernels

    from tests.models import vlm_registry
    from tests.models.registry import compare

    real_apply = kernels.apply_training_kernels
    keep = {"only": None, "drop": None}

    def apply(model, **kw):
        mapping = kernels.training_kernel_mapping(model, **kw)
        if keep["only"] is not None:
            mapping = {k: v for k, v in mapping.items() if k == keep["only"]}
        if keep["drop"] is not None:
            mapping = {k: v for k, v in mapping.items() if k != keep["drop"]}
        return apply_kernels(model, mapping)

    def run(seed: int):
        return compare(
            args.type,
            lambda: vlm_registry.build_vlm(args.type, seed=seed),
            lambda model, to: vlm_registry.vlm_batches(vlm_registry._on_cpu(model), to),
            device=args.device,
            dtype=torch.bfloat16,
        )

    print(f"{args.type}, {args.device}, bf16; torch {torch.__version__}")
    print("| seed | bound | plain (loss, grads) to float64 | ours | ours / plain, grads | status |")
    print("|---|---|---|---|---|---|")
    for seed in [int(s) for s in args.seeds.split(",")]:
        kernels.apply_training_kernels = real_apply
        layers = sorted(run(seed).bound)
        kernels.apply_training_kernels = apply
        variants = [("all", None, None)]
        variants += [(f"all but {x}", None, x) for x in layers]
        variants += [(f"{x} alone", x, None) for x in layers]
        for label, only, drop in variants:
            keep.update(only=only, drop=drop)
            o = run(seed)
            v = o.verdict
            if v is None:
                print(f"| {seed} | {label} | no float64 run: {o.reason[:80]} | | | {o.status} |")
                continue
            plain, ours = v.plain, v.ours
            ratio = ours[1] / plain[1] if plain[1] else float("nan")
            print(
                f"| {seed} | {label} | {plain[0]:.1e}, {plain[1]:.1e} | {ours[0]:.1e}, "
                f"{ours[1]:.1e} | {ratio:.2f} | {o.status} |",
                flush=True,
            )
    kernels.apply_training_kernels = real_apply
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
