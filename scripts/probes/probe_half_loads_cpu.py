"""Causal LMs loaded in a 16-bit dtype the way transformers builds them, fp32-kept modules
included (``_keep_in_fp32_modules(_strict)``: MoE routers, expert biases, attention sinks), bound
to this tree's training kernels: does a forward + backward with labels run, and does the loss
match the unbound model's (CPU, tiny models from the test registry's configs)?

A T5 loaded in fp16 kept ``wo`` in fp32, and its bound norms crashed the model until the norm
probe learned T5's casting (tests/kernels/test_t5_norms.py). This sweeps the same kind of load
over other families.

    python scripts/probes/probe_half_loads_cpu.py --dtype float16
    python scripts/probes/probe_half_loads_cpu.py --dtype bfloat16 --types nemotron_h,afmoe
"""

import argparse
import copy
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TYPES = (
    "llama,qwen3,gemma3_text,mistral,phi3,olmo2,qwen3_moe,gpt_oss,"
    "nemotron_h,afmoe,beam,hy_v3,axk1,flint,kimi_linear,dots1"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--types", default=DEFAULT_TYPES, help="comma-separated model types")
    args = parser.parse_args(argv)
    variant = ROOT / "hub_kernels/kernels-lab/training/build/torch-universal"
    os.environ["LOCAL_KERNELS"] = f"kernels-lab/training={variant}"
    sys.path.insert(0, str(ROOT))

    import kernels
    import torch

    from tests.models.registry import causal_lm_class, tiny_config

    dtype = getattr(torch, args.dtype)
    print("| model type | fp32-kept parameters | loss, plain | loss, bound | result |")
    print("|---|---|---|---|---|")
    for model_type in args.types.split(","):
        try:
            torch.manual_seed(0)
            plain = (
                causal_lm_class(model_type)
                ._from_config(tiny_config(model_type), dtype=dtype)
                .train()
            )
        except Exception as exc:  # noqa: BLE001 - the unbound model itself does not build
            print(f"| {model_type} | | | | plain model fails to build: {type(exc).__name__} |")
            continue
        kept = [n for n, p in plain.named_parameters() if p.dtype == torch.float32]
        bound = copy.deepcopy(plain)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, plain.config.vocab_size, (2, 16), generator=gen)
        losses = []
        try:
            kernels.apply_training_kernels(bound)
            for model in (plain, bound):
                out = model(input_ids=ids, labels=ids)
                out.loss.backward()
                losses.append(out.loss.float().item())
        except Exception as exc:  # noqa: BLE001 - reported in the table
            print(f"| {model_type} | {len(kept)} | | | failed: {type(exc).__name__}: {exc} |")
            continue
        rel = abs(losses[1] - losses[0]) / abs(losses[0])
        kept_text = f"{len(kept)} ({kept[0]}{', ...' if len(kept) > 1 else ''})" if kept else "0"
        print(
            f"| {model_type} | {kept_text} | {losses[0]:.4f} | {losses[1]:.4f} | ran; rel. diff {rel:.1e} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
