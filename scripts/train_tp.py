"""Tensor-parallel training with this project's kernels, one process per GPU (or CPU rank).

    torchrun --nproc-per-node 2 scripts/train_tp.py --setup ours --steps 20 --out DIR

The model is loaded with transformers' ``DistributedConfig(tp_plan="auto")`` (its
``base_model_tp_plan``: q/k/v, gate and up colwise, o and down rowwise, lm_head colwise), so
every rank holds 1/N of each of those weights and all ranks train on the same batch. Rank 0
prints one JSON line: step time, tokens/s (one batch per step: TP ranks share it), per-GPU peak
memory, the losses and what was bound.

Setups: eager (transformers as is), liger (Liger's instance patch with its cross-entropy
instead of its fused linear cross-entropy, which reads lm_head.weight as a plain tensor and
cannot take the plan's DTensor; the logits are then gathered by the plan's colwise_gather_output
head), ours (this project's kernels, bound after the plan is applied: KernelConfig on GPUs,
kernels.apply_kernels on the CPU; the loss is the vocab-parallel fused linear cross-entropy).
`--tiny` is a 2-layer model on CPU ranks (gloo): a smoke test of the script itself.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import KERNEL_MAPPING, emit_result, mark_fused_layers, qwen3_config  # noqa: E402


def load(setup: str, model_dir: Path, cuda: bool):
    """The TP model of `setup`; (model, load seconds, modules bound by this project or None)."""
    import torch
    from transformers import AutoModelForCausalLM, DistributedConfig

    kwargs: dict = dict(
        dtype=torch.bfloat16 if cuda else torch.float32,
        attn_implementation="sdpa",
        distributed_config=DistributedConfig(tp_plan="auto"),
    )
    if setup == "ours":
        mark_fused_layers()
        if cuda:
            from transformers import KernelConfig

            kwargs.update(
                use_kernels=True, kernel_config=KernelConfig(kernel_mapping=dict(KERNEL_MAPPING))
            )
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    model.train()
    if setup == "ours" and not cuda:  # KernelConfig refuses "cpu": bind through kernels
        import kernels

        kernels.apply_kernels(model, dict(KERNEL_MAPPING))
    elif setup == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(
            model=model, fused_linear_cross_entropy=False, cross_entropy=True
        )
    load_s = time.perf_counter() - t0
    bound = None
    if setup == "ours":
        import kernels

        report = kernels.last_report(model)
        bound = sum(e.status == "bound" for e in report) if report is not None else None
    return model, load_s, bound


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setup", default="ours", choices=["eager", "liger", "ours"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=8, help="per step (shared by the TP ranks)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--model-dir", help="a saved model (rank 0 writes one when missing)")
    p.add_argument("--out", help="folder for tp-<setup>.json (rank 0)")
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and not args.tiny
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    model_dir = Path(args.model_dir or Path(tempfile.gettempdir()) / "kernels-tp-model")
    if rank == 0 and not (model_dir / "config.json").exists():
        from transformers import Qwen3ForCausalLM

        torch.manual_seed(0)
        Qwen3ForCausalLM(qwen3_config(args.tiny)).to(torch.bfloat16).save_pretrained(model_dir)
    dist.barrier()

    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    result: dict = {"setup": args.setup, "world": world, "tp": world}
    try:
        model, load_s, bound = load(args.setup, model_dir, cuda)
    except Exception as exc:  # a setup that cannot run under TP: say so in the result
        if rank == 0:
            traceback.print_exc()
            emit_result(
                {**result, "error": f"{type(exc).__name__}: {exc}"},
                args.out,
                f"tp-{args.setup}.json",
            )
        dist.barrier()
        dist.destroy_process_group()
        return 1
    # per-parameter steps: foreach kernels refuse lists mixing DTensor and plain parameters
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    gen = torch.Generator().manual_seed(1234)  # the same batch on every TP rank
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
        losses.append(float(loss.detach()))
    step = statistics.median(times[args.warmup :] or times)
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        head = model.lm_head.weight
        result.update(
            device=torch.cuda.get_device_name() if cuda else "cpu",
            load_s=load_s,
            step_ms=step * 1e3,
            tokens_per_s=args.batch * args.seq / step,
            peak_gib_per_gpu=float(peak) if cuda else None,
            losses=losses,
            bound_modules=bound,
            lm_head_rows_per_rank=(head.to_local() if hasattr(head, "to_local") else head).shape[0],
        )
        emit_result(result, args.out, f"tp-{args.setup}.json")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # see train_fsdp.py: no gloo teardown while meshes still hold the group
