"""Phi-3-mini-4k's peak memory on one GPU: ours and its parts next to Liger.

The CPU accounting (probe_phi3_memory.py, docs/benchmarks/training-h200-2026-12-01/phi3-memory.md)
put ours' 3.4 GiB above Liger in two places: v, a slice of qkv_proj's output, kept the whole
[tokens, 3 x hidden] buffer alive for sdpa's backward (96 MiB a layer at 4x2048 tokens: ~3.0 GiB),
and the loss head's one-chunk logits buffer (501 MiB against Liger's 63 MiB). Ours now binds
FusedQKVAttention (q, k, v in buffers of their own, qkv freed after the split; d(qkv) written
once; one additive sdpa mask for all layers instead of sdpa's copy per layer, 32 MiB a layer
here) and caps the loss head's chunks (fused_linear_cross_entropy.row_cap: 2048 rows, 125 MiB).
This measures each part on the real shape, all 32 layers, batch 4x2048, bf16, sdpa, AdamW
(fused). A setup is "ours" plus suffixes, each taking one part out or adding a candidate:

  ours                  kernels.apply_training_kernels(model), as bench_train.py's "ours"
  -noqkv                the family's own attention forward (FusedQKVAttention unbound)
  -permask              FusedQKVAttention without the shared mask (sdpa converts it per layer)
  -onechunk             the loss head without row_cap (one 501 MiB chunk, the old policy)
  -chunk                the loss head's logits budget at 64 MiB (1024 rows here, as Liger's)
  -vcopy                sdpa gets a contiguous copy of v when v is a slice (with -noqkv)
  -menorm               + MemoryEfficientRMSNorm (the norms keep their output, not their input)
  -cache                transformers' KV cache left on (use_cache=True), as eager and Liger run
  liger                 liger_kernel's _apply_liger_kernel_to_instance (defaults)

ours-noqkv-onechunk is the code the 2026-12-01 H200 run measured as "ours" (50.3 GiB, 419 ms).

Per setup (own process): peak memory of a step (max_memory_allocated, steps after the first),
the memory held at the end of the forward and the step time (median), the number of attention
modules FusedQKVAttention serves. With --snapshot-dir, a torch.cuda.memory snapshot of the
last step per setup (open it at pytorch.org/memory_viz).

Usage (GPU): python scripts/probes/probe_phi3_memory_gpu.py [--setups ...] [--snapshot-dir DIR]
(the default setups take ~1 min each). On a machine without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VARIANT = ROOT / "hub_kernels/kernels-lab/training/build/torch-universal"
REPO = "kernels-lab/training"
SETUPS = (
    "ours,ours-noqkv-onechunk,ours-noqkv,ours-permask,ours-onechunk,ours-chunk,ours-menorm,liger"
)
CHUNK_BYTES = 64 * 2**20


def build(layers: int):
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_train import phi3_config

    config = phi3_config(False)
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    return model.train()


def smaller_loss_chunks() -> None:
    """The loaded loss head picks its rows per chunk under CHUNK_BYTES instead of 504 MiB."""
    mods = [
        m
        for name, m in list(sys.modules.items())
        if name.endswith(".fused_linear_cross_entropy") and hasattr(m, "default_chunk_rows")
    ]
    if not mods:
        raise SystemExit("no loaded fused_linear_cross_entropy module to patch")
    for m in mods:
        original = m.default_chunk_rows
        m.default_chunk_rows = lambda n, v, size, _b=None, f=original: f(n, v, size, CHUNK_BYTES)


def _loaded(suffix: str) -> list:
    """The loaded kernel variant's modules whose name ends with ``suffix``."""
    mods = [m for name, m in list(sys.modules.items()) if name.endswith(suffix)]
    if not mods:
        raise SystemExit(f"no loaded {suffix} module to patch")
    return mods


def unbind_qkv_attention(model) -> None:
    """The attention modules run their own forward again (ours before FusedQKVAttention)."""
    from kernels.layers.binding import restore_forward

    for m in model.modules():
        if type(m).__name__ == "Phi3Attention":
            restore_forward(m)


def mask_per_layer() -> None:
    """FusedQKVAttention hands sdpa the model's bool mask, which sdpa converts per layer."""
    for m in _loaded(".qkv_attention"):
        m._sdpa_mask = lambda module, mask, dtype: mask


def one_loss_chunk() -> None:
    """The loss head's rows per chunk by the byte budget alone (no row_cap): the old policy."""
    for m in _loaded(".fused_linear_cross_entropy"):
        m.row_cap = lambda hidden, vocab, itemsize: 1 << 62


def fused_qkv_modules(model) -> int:
    from kernels.layers.binding import bound_layer

    return sum(
        1
        for m in model.modules()
        if getattr(bound_layer(m), "__name__", None) == "FusedQKVAttention"
    )


def bind(model, setup: str) -> None:
    if setup == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
        return
    os.environ["LOCAL_KERNELS"] = f"{REPO}={VARIANT}"
    import kernels

    kernels.apply_training_kernels(model)
    if "-noqkv" in setup:
        unbind_qkv_attention(model)
    if "-permask" in setup:
        mask_per_layer()
    if "-onechunk" in setup:
        one_loss_chunk()
    if "-menorm" in setup:
        kernels.apply_kernels(model, {"RMSNorm": f"{REPO}:MemoryEfficientRMSNorm"})
    if "-vcopy" in setup:
        sys.path.insert(0, str(Path(__file__).parent))
        from probe_phi3_memory import copy_sliced_value

        copy_sliced_value()
    if "-chunk" in setup:
        smaller_loss_chunks()


def child(setup: str, steps: int, batch: int, seq: int, layers: int, snapshot: str | None):
    import torch

    model = build(layers)
    bind(model, setup)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator().manual_seed(1234)
    data = torch.randint(0, model.config.vocab_size, (steps, batch, seq), generator=gen)
    peaks, held, times, losses = [], [], [], []
    kw = {"use_cache": True} if "-cache" in setup else {}
    for step in range(steps):
        ids = data[step].cuda()
        last = step == steps - 1
        if snapshot and last:
            torch.cuda.memory._record_memory_history(max_entries=500_000)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, **kw).loss
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        peaks.append(torch.cuda.max_memory_allocated())
        losses.append(float(loss.detach()))
        if snapshot and last:
            Path(snapshot).mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(Path(snapshot) / f"{setup}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
    later = slice(1, None) if steps > 1 else slice(None)
    return {
        "setup": setup,
        "peak_gib": max(peaks[later]) / 2**30,
        "end_of_forward_gib": max(held[later]) / 2**30,
        "step_ms": statistics.median(times[later]) * 1e3,
        "losses": losses,
        "fused_qkv_modules": fused_qkv_modules(model),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--setups", default=SETUPS)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--snapshot-dir")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("probe_phi3_memory_gpu needs a CUDA GPU; nothing to measure here")
        return
    if args.child:
        result = child(args.child, args.steps, args.batch, args.seq, args.layers, args.snapshot_dir)
        print("RESULT " + json.dumps(result), flush=True)
        return
    rows = []
    for setup in args.setups.split(","):
        cmd = [sys.executable, __file__, "--child", setup]
        for flag in ("steps", "batch", "seq", "layers"):
            cmd += [f"--{flag}", str(getattr(args, flag))]
        if args.snapshot_dir:
            cmd += ["--snapshot-dir", args.snapshot_dir]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rows.append({"setup": setup, "error": f"timed out after {args.timeout:.0f} s"})
            continue
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            rows.append({"setup": setup, "error": out.stderr.strip().splitlines()[-1:]})
        else:
            rows.append(json.loads(line[len("RESULT ") :]))
        print(json.dumps(rows[-1]), flush=True)
    liger = next((r for r in rows if r["setup"] == "liger" and "error" not in r), None)
    print(f"\n{torch.cuda.get_device_name()}, batch {args.batch}x{args.seq}, {args.layers} layers")
    print(
        "| setup | peak GiB | end of forward GiB | step ms | peak vs Liger | tokens/s vs Liger "
        "| final loss | FusedQKVAttention modules |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['setup']} | error: {r['error']} | | | | | | |")
            continue
        rel = f"{r['peak_gib'] / liger['peak_gib']:.3f}x" if liger else ""
        speed = f"{liger['step_ms'] / r['step_ms']:.3f}x" if liger else ""
        print(
            f"| {r['setup']} | {r['peak_gib']:.2f} | {r['end_of_forward_gib']:.2f} "
            f"| {r['step_ms']:.0f} | {rel} | {speed} | {r['losses'][-1]:.4f} "
            f"| {r.get('fused_qkv_modules', '')} |"
        )


if __name__ == "__main__":
    main()
