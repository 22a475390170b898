"""DeepSpeed ZeRO-3 training with this project's kernels, one process per GPU.

    torchrun --nproc-per-node 2 scripts/train_deepspeed.py --setup ours --steps 10 --out DIR

The model is loaded as in scripts/bench_train.py (for "ours": from_pretrained with use_kernels
and a KernelConfig; HF_ENDPOINT must point at a Hub or a `kernels serve` mirror; "liger": Liger's
instance patch), then handed to `deepspeed.initialize` with ZeRO stage 3, bf16 and a plain
torch AdamW (no DeepSpeed ops are built or needed). The fused loss layer reads
``lm_head.weight`` inside the head's own forward hooks, which is where ZeRO-3 gathers the
partitioned weight. Rank 0 prints one JSON line: step time, tokens/s, per-GPU peak memory, the
losses, and the modules this project bound. `--tiny` runs a 2-layer model on CPU ranks (gloo,
DeepSpeed's CPU accelerator, fp32): a smoke test of the script.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import emit_result, load_for_training, qwen3_config  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setup", default="ours", choices=["eager", "liger", "ours"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=4, help="per GPU")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--tiny", action="store_true", help="2 layers on CPU ranks (gloo)")
    p.add_argument("--model-dir", help="a saved model (rank 0 writes one when missing)")
    p.add_argument("--out", help="folder for deepspeed-<setup>.json (rank 0)")
    args = p.parse_args()

    if args.tiny:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo" if args.tiny else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = "cpu" if args.tiny else f"cuda:{local}"
    if not args.tiny:
        torch.cuda.set_device(local)
    model_dir = Path(args.model_dir or Path(tempfile.gettempdir()) / "kernels-ds-model")
    if rank == 0 and not (model_dir / "config.json").exists():
        from transformers import Qwen3ForCausalLM

        torch.manual_seed(0)
        Qwen3ForCausalLM(qwen3_config(args.tiny)).to(torch.bfloat16).save_pretrained(model_dir)
    dist.barrier()

    model, load_s, bound = load_for_training(args.setup, model_dir, device)
    if args.tiny:
        model.float()
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": not args.tiny},
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    engine.train()
    gen = torch.Generator().manual_seed(1234 + rank)
    vocab = model.config.vocab_size
    losses, times = [], []
    sync = torch.cuda.synchronize if not args.tiny else (lambda: None)
    if not args.tiny:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.steps):
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(device)
        sync()
        t = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        sync()
        times.append(time.perf_counter() - t)
        detached = loss.detach().float().clone()
        dist.all_reduce(detached)
        losses.append(float(detached) / world)
    step = statistics.median(times[args.warmup :] or times)
    peak = torch.tensor(
        [0.0 if args.tiny else torch.cuda.max_memory_allocated() / 2**30], device=device
    )
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        out = {
            "setup": args.setup,
            "world": world,
            "deepspeed": deepspeed.__version__,
            "device": "cpu" if args.tiny else torch.cuda.get_device_name(),
            "load_s": load_s,
            "step_ms": step * 1e3,
            "tokens_per_s": world * args.batch * args.seq / step,
            "peak_gib_per_gpu": None if args.tiny else float(peak),
            "losses": losses,
            "bound_modules": bound,
            "training_after": model.training,
        }
        emit_result(out, args.out, f"deepspeed-{args.setup}.json")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
