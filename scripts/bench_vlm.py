"""Vision-language training benchmark: one model shape per run, one GPU, three setups in one run
(each in its own process, same initial weights, same batches with images).

Families (--family): qwen2_5_vl (Qwen2.5-VL-3B: its text and vision towers' dimensions, 448 x 448
images: 1024 patches, 256 image tokens), gemma3 (Gemma 3 4B: SigLIP at 896 x 896, 4096 patches
pooled to 256 image tokens), internvl (InternVL3-2B: InternViT-300M at 448 x 448, pixel shuffle
to 256 tokens, Qwen2.5-1.5B text). Random init, bf16, SDPA attention, AdamW. ``--text-layers`` /
``--vision-layers`` take the first N layers of each tower (the header says so); by default all.

Setups:
  eager   transformers as is
  ours    ``kernels.apply_training_kernels(model)`` (kernels from a ``kernels serve`` mirror of
          hub_kernels/ that this script starts)
  liger   liger_kernel's ``_apply_liger_kernel_to_instance(model=model)`` (imported in its
          process only); where that raises (Liger 0.8.5's fused-loss forwards import output
          classes some transformers versions lack), the same without its fused loss, and the
          row says so

Reports step time (median after warm-up), tokens/s (every position of the text, image tokens
included), peak memory, both relative to Liger's, and the loss against eager; the table and
the JSON go to --out. The child processes, timeouts and table are scripts/bench_train.py's.

    python scripts/bench_vlm.py --family qwen2_5_vl --out docs/benchmarks/vlm     # GPU
    python scripts/bench_vlm.py --smoke --family gemma3                           # CPU plumbing
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_train  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Family:
    shape: str
    config: Callable  # (text_layers | None, vision_layers | None) -> config
    model_type: str
    batch: int  # samples per step, one image each
    text: int  # text tokens per sample, besides the image tokens
    side: int  # patches per image side for grid / patch-sequence inputs


def _layers(full: int, n: int | None) -> int:
    return full if n is None else max(1, min(n, full))


def qwen2_5_vl_config(text_layers=None, vision_layers=None):
    from transformers import Qwen2_5_VLConfig

    depth = _layers(32, vision_layers)
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=151936, hidden_size=2048, intermediate_size=11008,
            num_hidden_layers=_layers(36, text_layers), num_attention_heads=16,
            num_key_value_heads=2, max_position_embeddings=128000, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                             "mrope_section": [16, 24, 24]},
            tie_word_embeddings=True,
        ),
        vision_config=dict(
            depth=depth, hidden_size=1280, intermediate_size=3420, num_heads=16,
            out_hidden_size=2048, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
            window_size=112, fullatt_block_indexes=[i for i in (7, 15, 23, 31) if i < depth],
            hidden_act="silu",
        ),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
        vision_end_token_id=151653, tie_word_embeddings=True,
    )  # fmt: skip


def gemma3_config(text_layers=None, vision_layers=None):
    from transformers import Gemma3Config

    return Gemma3Config(
        text_config=dict(
            vocab_size=262208, hidden_size=2560, intermediate_size=10240,
            num_hidden_layers=_layers(34, text_layers), num_attention_heads=8,
            num_key_value_heads=4, head_dim=256, sliding_window=1024,
            query_pre_attn_scalar=256, rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
        vision_config=dict(
            hidden_size=1152, intermediate_size=4304, num_hidden_layers=_layers(27, vision_layers),
            num_attention_heads=16, image_size=896, patch_size=14, vision_use_head=False,
        ),
        mm_tokens_per_image=256, image_token_index=262144, boi_token_index=255999,
        eoi_token_index=256000,
    )  # fmt: skip


def internvl_config(text_layers=None, vision_layers=None):
    from transformers import InternVLConfig

    return InternVLConfig(
        vision_config=dict(
            hidden_size=1024, intermediate_size=4096, num_hidden_layers=_layers(24, vision_layers),
            num_attention_heads=16, image_size=[448, 448], patch_size=[14, 14],
            norm_type="layer_norm", use_qk_norm=False, layer_scale_init_value=0.1,
        ),
        text_config=dict(
            model_type="qwen2", vocab_size=151674, hidden_size=1536, intermediate_size=8960,
            num_hidden_layers=_layers(28, text_layers), num_attention_heads=12,
            num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            tie_word_embeddings=True,
        ),
        image_token_id=151667, downsample_ratio=0.5,
    )  # fmt: skip


FAMILIES = {
    "qwen2_5_vl": Family(
        "Qwen2.5-VL-3B shape (text: 36 layers, hidden 2048; vision: 32 layers, hidden 1280), "
        "448 x 448 images", qwen2_5_vl_config, "qwen2_5_vl", 8, 768, 32,
    ),
    "gemma3": Family(
        "Gemma-3-4B shape (text: 34 layers, hidden 2560; SigLIP: 27 layers, hidden 1152), "
        "896 x 896 images", gemma3_config, "gemma3", 4, 768, 64,
    ),
    "internvl": Family(
        "InternVL3-2B shape (InternViT-300M: 24 layers; Qwen2.5-1.5B text: 28 layers), "
        "448 x 448 images", internvl_config, "internvl", 8, 768, 32,
    ),
}  # fmt: skip


def save_model(path: Path, args) -> None:
    """The family's model, random init (seed 0), saved for every setup's process to load."""
    import torch
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    if args.smoke:
        from tests.models.vlm_registry import build_vlm

        model = build_vlm(FAMILIES[args.family].model_type)
    else:
        config = FAMILIES[args.family].config(args.text_layers, args.vision_layers)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)


def apply_liger(model) -> str:
    """Liger's instance patch; "" when it applied, else what failed and what ran instead."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    try:
        _apply_liger_kernel_to_instance(model=model)
        return ""
    except Exception as exc:  # noqa: BLE001 - the row says it, and what was applied instead
        why = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]}"
    _apply_liger_kernel_to_instance(model=model, fused_linear_cross_entropy=False)
    return f"its default patch raised ({why}); run without its fused loss"


def child(args) -> dict:
    """One setup in this process: load, patch, `args.steps` training steps, the RESULT row."""
    import bench_supervise

    watch = bench_supervise.Watchdog(args.child, args.heartbeat)
    watch.phase("import torch")
    import torch
    from transformers import AutoModelForImageTextToText

    from tests.models.vlm_registry import vlm_batches

    family, device = FAMILIES[args.family], args.device
    watch.phase("load")
    t0 = time.perf_counter()
    kwargs = {"dtype": torch.bfloat16, "attn_implementation": args.attn}
    model = AutoModelForImageTextToText.from_pretrained(args.model_dir, **kwargs).to(device)
    model.train()
    note = ""
    if args.child == "ours":
        import kernels

        kernels.apply_training_kernels(model)
    elif args.child == "liger":
        note = apply_liger(model)
        watch.say(f"Liger's picks: {bench_train.liger_backends(device)}")
    load_s = time.perf_counter() - t0
    watch.phase("batches")
    side = 0 if args.smoke else family.side  # the tiny model's own images when smoking
    batches = vlm_batches(
        model, device, max(args.steps, 1), batch=args.batch, text=args.text, side=side
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, times = bench_train.timed_steps(
        model, opt, lambda step: batches[step % len(batches)], args.steps, device, watch
    )
    step_s = statistics.median(times[args.warmup :] or times)
    tokens = batches[0]["input_ids"].numel()
    out = {
        "setup": args.child,
        "load_s": load_s,
        "step_ms": step_s * 1e3,
        "tokens_per_s": tokens / step_s,
        "tokens_per_step": tokens,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        "steps": args.steps,
        "warmup": args.warmup,
        "losses": losses,
        "note": note,
    }
    if args.child == "ours":
        out.update(bench_train.binding_summary(model))
    return out


def run_all(args) -> int:
    from bench_supervise import git_commit, log

    family = FAMILIES[args.family]
    setups = [s for s in args.setups.split(",") if s]
    commit = git_commit(ROOT)
    work = Path(tempfile.mkdtemp(prefix="bench-vlm-"))
    rows: list[dict] = []
    server = None
    try:
        log(f"{args.family}: saving the model (random init)")
        save_model(work / "model", args)
        server, env = bench_train.start_mirror(work)
        for setup in setups:
            cmd = [sys.executable, __file__, "--child", setup, "--model-dir", str(work / "model"),
                   "--family", args.family, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--batch", str(args.batch),
                   "--text", str(args.text), "--device", args.device, "--attn", args.attn,
                   "--heartbeat", str(args.heartbeat)] + (["--smoke"] if args.smoke else [])  # fmt: skip
            log(f"{setup}: start ({args.steps} steps)")
            t = time.perf_counter()
            rows.append(bench_train.run_setup(setup, cmd, env, args.setup_timeout))
            rows[-1]["wall_s"] = time.perf_counter() - t
            log(f"{setup}: done in {rows[-1]['wall_s']:.0f} s")
    finally:
        if server is not None:
            server.terminate()
        shutil.rmtree(work, ignore_errors=True)
    text = (
        header(args, family, commit, rows)
        + "\n\n"
        + bench_train.table(rows, args.steps, args.warmup)
    )
    notes = [f"{r['setup']}: {r['note']}." for r in rows if r.get("note")]
    text += ("\n\n" + "\n".join(notes)) if notes else ""
    print(text, flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"vlm-{args.family}.json").write_text(json.dumps(rows, indent=1))
        (out / f"vlm-{args.family}.md").write_text(text + "\n")
    return 0


def header(args, family: Family, commit: str, rows: list[dict]) -> str:
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    shape = (
        f"tiny {family.model_type} (tests/models/vlm_registry.py)" if args.smoke else family.shape
    )
    if not args.smoke and (args.text_layers or args.vision_layers):
        shape += (
            f", sliced: the first {args.text_layers or 'all'} text and "
            f"{args.vision_layers or 'all'} vision layers"
        )
    tokens = next((r["tokens_per_step"] for r in rows if "tokens_per_step" in r), None)
    return (
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {gpu}, host "
        f"{bench_train.cpu_model()} ({os.cpu_count()} CPUs), "
        + ", ".join(f"{k} {v}" for k, v in bench_train.versions().items())
        + f", commit {commit}. {shape}, random init, bf16, {args.attn} attention, "
        f"{args.batch} samples of one image and {args.text} text tokens"
        + (f" ({tokens} positions per step)" if tokens else "")
        + f", AdamW, {args.steps} steps."
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=sorted(FAMILIES), default="qwen2_5_vl")
    p.add_argument("--setups", default="eager,ours,liger")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, help="samples per step (default: the family's)")
    p.add_argument("--text", type=int, help="text tokens per sample (default: the family's)")
    p.add_argument("--text-layers", type=int, help="the first N text layers (default: all)")
    p.add_argument("--vision-layers", type=int, help="the first N vision layers (default: all)")
    p.add_argument("--attn", default="sdpa", help="attn_implementation")
    p.add_argument("--device", default="cuda")
    p.add_argument("--setup-timeout", type=float, help="seconds before a setup is killed")
    p.add_argument("--heartbeat", type=float, default=30.0)
    p.add_argument("--smoke", action="store_true", help="the tiny model on the CPU (plumbing)")
    p.add_argument("--out", help="folder for vlm-<family>.json and .md")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    family = FAMILIES[args.family]
    if args.smoke:
        args.device = "cpu"
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
        args.batch, args.text = args.batch or 2, args.text or 16
    args.batch = args.batch or family.batch
    args.text = args.text or family.text
    if args.child:
        bench_train.emit_result(child(args))
        return 0
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
