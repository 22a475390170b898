"""Vision-language training benchmark: one model shape per run, one GPU, three setups in one run
(each in its own process, same initial weights, same batches with images).

Families (--family): qwen2_5_vl (Qwen2.5-VL-3B: its text and vision towers' dimensions, 448 x 448
images: 1024 patches, 256 image tokens), gemma3 (Gemma 3 4B: SigLIP at 896 x 896, 4096 patches
pooled to 256 image tokens), internvl (InternVL3-2B: InternViT-300M at 448 x 448, pixel shuffle
to 256 tokens, Qwen2.5-1.5B text). Random init, bf16, SDPA attention, AdamW. ``--text-layers`` /
``--vision-layers`` take the first N layers of each tower (the header says so); by default all.

Setups (each in its own process; every process builds the model from the config with seed 0 on
the device, so all start from the same weights without a checkpoint on disk; each row records a
checksum of its initial weights and the table says if they differ):
  eager   transformers as is
  ours    ``kernels.apply_training_kernels(model)`` (kernels from a ``kernels serve`` mirror of
          hub_kernels/ that this script starts)
  liger   Liger in the strongest configuration that runs on the installed transformers
          (scripts/liger_vlm.py: its default with the fused linear cross-entropy forward, else
          without that forward, else its norm/MLP/RoPE patches alone where its fused-loss module
          does not even import); ``--liger-config auto`` tries them in that order, a process
          per try where one fails while training; the table names the one that ran

Reports step time (median after warm-up), tokens/s (every position of the text, image tokens
included), peak memory, both relative to Liger's, and the loss against eager; the table and
the JSON go to --out. The child processes, timeouts and table are scripts/bench_train.py's.
Defaults fit one family's whole run in ~4 min on an H200: 10 steps, the median of steps 4-10,
180 s per setup.

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
from liger_vlm import CONFIGS as LIGER_CONFIGS  # noqa: E402


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


def build_model(args, device: str):
    """The family's model, random init with seed 0, built on ``device`` in bf16 (the smoke run:
    the tiny model, fp32, on the CPU)."""
    import torch
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    if args.smoke:
        from tests.models.vlm_registry import build_vlm

        return build_vlm(FAMILIES[args.family].model_type).to(torch.bfloat16)
    config = FAMILIES[args.family].config(args.text_layers, args.vision_layers)
    with torch.device(device):
        return AutoModelForImageTextToText.from_config(
            config, dtype=torch.bfloat16, attn_implementation=args.attn
        )


def weights_checksum(model) -> float:
    """A sum over every initial weight: equal across setups when they start from one model."""
    import torch

    with torch.no_grad():
        return float(sum(p.double().sum() for p in model.parameters()))


def apply_liger(model, config: str, device: str) -> tuple[str, str]:
    """Liger's patch in ``config`` (auto: the strongest that applies); (configuration, note).
    On the CPU (plumbing) the patches whose kernels the Triton interpreter cannot run are off."""
    import liger_vlm

    kwargs = liger_vlm.CPU_OFF if device == "cpu" else {}
    if config == "auto":
        config, why = liger_vlm.apply_strongest(model, **kwargs)
    else:
        liger_vlm.apply(model, config, **kwargs)
        why = ""
    note = liger_vlm.describe(config, why)
    if kwargs:
        note += "; CPU: its norm and MLP patches off (the Triton interpreter cannot run them)"
    return config, note


def child(args) -> dict:
    """One setup in this process: load, patch, `args.steps` training steps, the RESULT row."""
    import bench_supervise

    watch = bench_supervise.Watchdog(args.child, args.heartbeat)
    watch.phase("import torch")
    import torch

    from tests.models.vlm_registry import vlm_batches

    family, device = FAMILIES[args.family], args.device
    watch.phase("build")
    t0 = time.perf_counter()
    model = build_model(args, device).to(device)
    model.train()
    checksum = weights_checksum(model)
    note, liger_config = "", None
    if args.child == "ours":
        import kernels

        kernels.apply_training_kernels(model)
    elif args.child == "liger":
        liger_config, note = apply_liger(model, args.liger_config, device)
        watch.say(f"Liger {liger_config}; its picks: {bench_train.liger_backends(device)}")
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
        "init_checksum": checksum,
    }
    if liger_config is not None:
        out["liger_config"] = liger_config
        out["label"] = f"liger ({liger_config})"
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
        server, env = bench_train.start_mirror(work)
        for setup in setups:
            configs = [args.liger_config] if setup == "liger" else [None]
            if setup == "liger" and args.liger_config == "auto":
                configs = ["auto", *LIGER_CONFIGS[1:]]
            for config in configs:
                cmd = [sys.executable, __file__, "--child", setup, "--family", args.family,
                       "--steps", str(args.steps), "--warmup", str(args.warmup),
                       "--batch", str(args.batch), "--text", str(args.text),
                       "--device", args.device, "--attn", args.attn,
                       "--heartbeat", str(args.heartbeat)] + (["--smoke"] if args.smoke else [])  # fmt: skip
                if args.text_layers:
                    cmd += ["--text-layers", str(args.text_layers)]
                if args.vision_layers:
                    cmd += ["--vision-layers", str(args.vision_layers)]
                if config is not None:
                    cmd += ["--liger-config", config]
                log(f"{setup}: start ({args.steps} steps{f', Liger {config}' if config else ''})")
                t = time.perf_counter()
                # Liger's Triton kernels run on the CPU only under the interpreter
                child_env = {**env, "TRITON_INTERPRET": "1"} if liger_on_cpu(args, setup) else env
                row = bench_train.run_setup(setup, cmd, child_env, args.setup_timeout)
                row["wall_s"] = time.perf_counter() - t
                if config is not None and "error" in row:
                    row["label"] = f"liger ({config})"
                rows.append(row)
                log(f"{setup}: done in {row['wall_s']:.0f} s")
                error = row.get("error", "")
                if not error or "killed after" in error or "No module named 'liger" in error:
                    break  # ran; or ran out of time, or no Liger: a weaker patch would not help
    finally:
        if server is not None:
            server.terminate()
        shutil.rmtree(work, ignore_errors=True)
    text = (
        header(args, family, commit, rows)
        + "\n\n"
        + bench_train.table(rows, args.steps, args.warmup)
    )
    notes = [f"{r.get('label', r['setup'])}: {r['note']}." for r in rows if r.get("note")]
    sums = {r["setup"]: r["init_checksum"] for r in rows if "init_checksum" in r}
    if len(set(sums.values())) > 1:
        notes.append(f"The setups did not start from the same weights (checksums {sums}).")
    text += ("\n\n" + "\n".join(notes)) if notes else ""
    print(text, flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"vlm-{args.family}.json").write_text(json.dumps(rows, indent=1))
        (out / f"vlm-{args.family}.md").write_text(text + "\n")
    return 0


def liger_on_cpu(args, setup: str) -> bool:
    return setup == "liger" and args.device == "cpu"


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
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, help="samples per step (default: the family's)")
    p.add_argument("--text", type=int, help="text tokens per sample (default: the family's)")
    p.add_argument("--text-layers", type=int, help="the first N text layers (default: all)")
    p.add_argument("--vision-layers", type=int, help="the first N vision layers (default: all)")
    p.add_argument("--attn", default="sdpa", help="attn_implementation")
    p.add_argument("--device", default="cuda")
    p.add_argument("--liger-config", default="auto", choices=["auto", *LIGER_CONFIGS],
                   help="Liger's configuration (scripts/liger_vlm.py); auto: the strongest "
                   "that runs")  # fmt: skip
    p.add_argument("--setup-timeout", type=float,
                   help="seconds before a setup is killed (default 180; none with --smoke)")  # fmt: skip
    p.add_argument("--heartbeat", type=float, default=30.0)
    p.add_argument("--smoke", action="store_true", help="the tiny model on the CPU (plumbing)")
    p.add_argument("--out", help="folder for vlm-<family>.json and .md")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    family = FAMILIES[args.family]
    if args.smoke:
        args.device = "cpu"
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
        args.batch, args.text = args.batch or 2, args.text or 16
    elif args.setup_timeout is None:
        args.setup_timeout = 180.0
    args.batch = args.batch or family.batch
    args.text = args.text or family.text
    if args.child:
        bench_train.emit_result(child(args))
        return 0
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
