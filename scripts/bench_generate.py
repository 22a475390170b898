"""Greedy `generate` with the training kernels bound: what a rollout (TRL's GRPO, evaluation)
pays or gains from them.

Setups (each in its own process; the same random init, prompts and greedy settings):
  eager   transformers as is
  ours    kernels.apply_training_kernels(model): under no_grad every bound layer launches its
          kernel without an autograd Function
  liger   Liger's per-instance patch with its defaults (when importable)

Qwen3-0.6B (28 layers, random init, bf16, sdpa, eval mode), prompts of --prompt random tokens,
--new tokens generated (EOS off, so every run makes all of them), at each --batches. Per setup
and batch: --warmup generates, then --runs timed ones; wall ms per generated token (the median
run, synchronised before and after), and the GPU's busy time per token in one more run under
torch.profiler (the sum of its kernels' durations; what the GPU did, not what the host waited).
Agreement: the share of generated tokens equal to eager's (bf16 kernels round differently, and
a random-init model's logits are close together, so a flip early in a sequence changes the
rest; reported, not asserted).

    python scripts/bench_generate.py --out DIR
    python scripts/bench_generate.py --smoke          # tiny model on the CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parent.parent
VARIANT = ROOT / "hub_kernels/kernels-lab/training/build/torch-universal"
SETUPS = ("eager", "ours", "liger")
QWEN3_06B = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True,
)  # fmt: skip
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip


def build(setup: str, device: str, smoke: bool):
    """Qwen3 of `setup` on `device`, seed 0, bf16 (fp32 with `smoke`), eval mode."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3", **(TINY if smoke else QWEN3_06B))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32 if smoke else torch.bfloat16, attn_implementation="sdpa"
        )
    model.eval()
    if setup == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    elif setup == "ours":
        import kernels

        kernels.apply_training_kernels(model)
    return model


def busy_ms(fn) -> float:
    """Milliseconds of GPU kernel time in one call of `fn` (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
    return sum(e.device_time_total for e in prof.key_averages() if e.device_time_total) / 1e3


def child(args) -> list[dict]:
    """Every batch of one setup in this process: one row per batch."""
    import torch

    device = "cpu" if args.smoke else "cuda"
    model = build(args.child, device, args.smoke)
    gen = torch.Generator().manual_seed(1234)
    rows = []
    for batch in args.batches:
        prompt = torch.randint(0, model.config.vocab_size, (batch, args.prompt), generator=gen)
        prompt = prompt.to(device)

        def once(prompt=prompt):
            return model.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new,
                min_new_tokens=args.new, do_sample=False, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip

        def sync():
            if device == "cuda":
                torch.cuda.synchronize()

        t = time.perf_counter()
        out = once()
        sync()
        first_s = time.perf_counter() - t
        for _ in range(args.warmup):
            once()
        times = []
        for _ in range(args.runs):
            sync()
            t = time.perf_counter()
            once()
            sync()
            times.append(time.perf_counter() - t)
        wall = statistics.median(times) * 1e3 / args.new
        busy = busy_ms(once) / args.new if device == "cuda" else None
        rows.append({
            "setup": args.child, "batch": batch, "wall_ms_per_token": wall,
            "busy_ms_per_token": busy, "first_s": first_s,
            "spread": [round(min(times) * 1e3 / args.new, 3), round(max(times) * 1e3 / args.new, 3)],
            "tokens": out[:, args.prompt:].tolist(),
        })  # fmt: skip
    return rows


def table(rows: list[dict], batches: list[int]) -> str:
    lines = [
        "| batch | setup | wall ms / token (min-max of runs) | GPU busy ms / token | wall vs eager "
        "| tokens equal to eager's | first generate s |",
        "|---|---|---|---|---|---|---|",
    ]
    for batch in batches:
        mine = [r for r in rows if r.get("batch") == batch]
        base = next((r for r in mine if r["setup"] == "eager"), None)
        for r in mine:
            busy = "n/a" if r["busy_ms_per_token"] is None else f"{r['busy_ms_per_token']:.3f}"
            rel = f"{r['wall_ms_per_token'] / base['wall_ms_per_token']:.3f}x" if base else "-"
            agree = "-"
            if base:
                pairs = [
                    (a, b)
                    for s, t in zip(r["tokens"], base["tokens"], strict=True)
                    for a, b in zip(s, t, strict=True)
                ]
                agree = f"{sum(a == b for a, b in pairs) / len(pairs):.0%}"
            lines.append(
                f"| {batch} | {r['setup']} | {r['wall_ms_per_token']:.3f} "
                f"({r['spread'][0]:.3f}-{r['spread'][1]:.3f}) | {busy} | {rel} | {agree} "
                f"| {r['first_s']:.1f} |"
            )
    return "\n".join(lines)


def header(args) -> str:
    from bench_supervise import run_environment

    shape = "tiny Qwen3 (2 layers, hidden 64), fp32" if args.smoke else "Qwen3-0.6B, bf16"
    return (
        run_environment(ROOT) + f". {shape}, random init, sdpa, greedy, prompt {args.prompt} "
        f"tokens, {args.new} new; median of {args.runs} runs after {args.warmup}."
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--setup-timeout", type=int, default=300)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    unknown = set(args.setups.split(",")) - set(SETUPS)
    if unknown:
        p.error(f"unknown setups {sorted(unknown)}; choose from {', '.join(SETUPS)}")
    if args.smoke:
        args.prompt, args.new, args.warmup, args.runs = 8, 4, 0, 2
    os.environ["LOCAL_KERNELS"] = f"kernels-lab/training={VARIANT}"
    from bench_train import emit_result, run_setup

    if args.child:
        emit_result({"setup": args.child, "rows": child(args)})
        return 0
    rows = []
    for setup in args.setups.split(","):
        if setup == "liger" and not _importable("liger_kernel"):
            print(f"{setup}: not installed, skipped", flush=True)
            continue
        cmd = [sys.executable, __file__, "--child", setup, "--batches",
               ",".join(map(str, args.batches)), "--prompt", str(args.prompt), "--new",
               str(args.new), "--warmup", str(args.warmup), "--runs", str(args.runs)]  # fmt: skip
        cmd += ["--smoke"] if args.smoke else []
        result = run_setup(setup, cmd, dict(os.environ), args.setup_timeout)
        rows += result.get("rows", [])
        print(f"{setup}: {result.get('error', 'done')}", flush=True)
    text = header(args) + "\n\n" + table(rows, args.batches) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "generate.md").write_text(text)
        (args.out / "generate.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


if __name__ == "__main__":
    raise SystemExit(main())
