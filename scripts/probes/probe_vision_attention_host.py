"""What the per-window attention calls of a Qwen2.5-VL vision tower cost the host (CPU).

Qwen2.5-VL-3B's vision tower layout (32 layers, full attention in 4 of them, windows of 112 px,
patches of 14, 2 x 2 merge) over 8 images of 448 x 448 (8192 patches), with the width cut to
`--hidden` so the arithmetic is negligible and the step is the host's work: transformers' own
forward (one attention call per window: 128 windows x 28 layers + 8 images x 4 layers), and the
same tower with only VisionVarlenAttention bound (one call per distinct segment length). Prints
the attention calls per forward and the median fwd+bwd wall time of each, in one process.

    python scripts/probes/probe_vision_attention_host.py [--hidden 64] [--images 8] [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


class _Count:
    def __init__(self, torch):
        self.torch, self.calls = torch, 0

    def __enter__(self):
        torch = self.torch
        self.real = torch.nn.functional.scaled_dot_product_attention

        def counted(*args, **kwargs):
            self.calls += 1
            return self.real(*args, **kwargs)

        torch.nn.functional.scaled_dot_product_attention = counted
        return self

    def __exit__(self, *exc):
        self.torch.nn.functional.scaled_dot_product_attention = self.real


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--images", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    import sweep_models
    import torch
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    sweep_models.start_mirror()
    import kernels
    from kernels.layers import apply_kernels

    config = Qwen2_5_VLVisionConfig(
        hidden_size=args.hidden, num_heads=args.heads, intermediate_size=2 * args.hidden,
        out_hidden_size=args.hidden,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    grid = torch.tensor([[1, 32, 32]] * args.images)  # 448 / 14 = 32 patches a side
    s = int(grid.prod(-1).sum())
    pixels = torch.randn(s, 3 * 2 * 14 * 14)

    def build(bind: bool):
        torch.manual_seed(0)
        tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(config)
        if bind:
            mapping = kernels.training_kernel_mapping(tower)
            apply_kernels(tower, {k: v for k, v in mapping.items() if k == "VisionVarlenAttention"})
        return tower

    rows = []
    outs = {}
    for label, bind in (
        ("transformers (per-window calls)", False),
        ("VisionVarlenAttention", True),
    ):
        tower = build(bind)
        times = []
        for step in range(args.steps + 1):
            with _Count(torch) as count:
                t = time.perf_counter()
                out = tower(pixels, grid_thw=grid)
                out = out.pooler_output if hasattr(out, "pooler_output") else out[0]
                out.float().square().mean().backward()
                times.append(time.perf_counter() - t)
            tower.zero_grad(set_to_none=True)
            if step == 0:
                calls = count.calls
        outs[label] = out.detach()
        rows.append((label, calls, statistics.median(times[1:]) * 1e3))
    same = torch.allclose(*outs.values(), rtol=1e-4, atol=1e-5)
    print(
        f"Qwen2.5-VL-3B vision layout, hidden cut to {args.hidden} ({args.heads} heads), "
        f"{args.images} images of 448 x 448 ({s} patches), CPU ({torch.get_num_threads()} "
        f"threads), torch {torch.__version__}; median of {args.steps} fwd+bwd"
    )
    print("| attention | SDPA calls per forward | fwd+bwd wall ms |")
    print("|---|---|---|")
    for label, calls, ms in rows:
        print(f"| {label} | {calls} | {ms:.0f} |")
    print(f"outputs equal (rtol 1e-4): {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
