"""FSDP2 training with this project's kernels, one process per GPU (or per CPU rank with gloo).

    torchrun --nproc-per-node 2 scripts/train_fsdp.py --setup ours --steps 20 --out DIR

Every rank loads the kernels through the loader (HF_ENDPOINT must point at a Hub or a
`kernels serve` mirror; all ranks share KERNELS_CACHE: the first rank's download serves the
rest), shards each decoder layer and the root with `fully_shard`, and trains. Rank 0 prints one
JSON line with the step time, tokens/s, per-GPU peak memory and the losses.

Setups: eager (transformers as is), liger (Liger's instance patch), ours (this project's
kernels: KernelConfig on GPUs, kernels.apply_kernels on the CPU where KernelConfig refuses
"cpu"). `--tiny` uses a 2-layer model (CPU smoke test).
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
from bench_train import KERNEL_MAPPING, emit_result, mark_fused_layers, qwen3_config  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setup", default="ours", choices=["eager", "liger", "ours"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=8, help="per rank")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--model-dir", help="a saved model (rank 0 writes one when missing)")
    p.add_argument("--out", help="folder for fsdp-<setup>.json (rank 0)")
    args = p.parse_args()

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    cuda = torch.cuda.is_available() and not args.tiny
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)

    model_dir = Path(args.model_dir or Path(tempfile.gettempdir()) / "kernels-fsdp-model")
    if rank == 0 and not (model_dir / "config.json").exists():
        from transformers import Qwen3ForCausalLM

        torch.manual_seed(0)
        Qwen3ForCausalLM(qwen3_config(args.tiny)).to(torch.bfloat16).save_pretrained(model_dir)
    dist.barrier()

    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if cuda else torch.float32
    kwargs: dict = dict(dtype=dtype, attn_implementation="sdpa")
    t0 = time.perf_counter()
    if args.setup == "ours" and cuda:
        from transformers import KernelConfig

        mark_fused_layers()
        kwargs.update(
            device_map=str(device),
            use_kernels=True,
            kernel_config=KernelConfig(kernel_mapping=dict(KERNEL_MAPPING)),
        )
        model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs).to(device)
        if args.setup == "ours":  # the CPU: KernelConfig refuses "cpu", so bind through kernels
            import kernels

            mark_fused_layers()
            kernels.apply_kernels(model, dict(KERNEL_MAPPING))  # "org/repo:Layer" means v1
        elif args.setup == "liger":
            from liger_kernel.transformers import _apply_liger_kernel_to_instance

            _apply_liger_kernel_to_instance(model=model)
    load_s = time.perf_counter() - t0

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.train()
    bound = None
    if args.setup == "ours":
        import kernels

        report = kernels.last_report(model)
        bound = sum(e.status == "bound" for e in report) if report is not None else None

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    gen = torch.Generator().manual_seed(1234 + rank)
    vocab = model.config.vocab_size
    losses, times = [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.steps):
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(device)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        detached = loss.detach().clone()
        dist.all_reduce(detached)
        losses.append(float(detached) / world)
    step = statistics.median(times[args.warmup :] or times)
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        out = {
            "setup": args.setup,
            "world": world,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "load_s": load_s,
            "step_ms": step * 1e3,
            "tokens_per_s": world * args.batch * args.seq / step,
            "peak_gib_per_gpu": float(peak) if cuda else None,
            "losses": losses,
            "bound_modules": bound,
        }
        emit_result(out, args.out, f"fsdp-{args.setup}.json")
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without interpreter finalization: FSDP2's device mesh still holds the gloo group, and
    # tearing gloo down while modules are cleared can abort a rank (SIGABRT, "terminate called
    # without an active exception") after its work is done. Everything is written and flushed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
