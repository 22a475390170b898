"""Post-training benchmark: TRL 1.16's DPO, GRPO and distillation training steps, every peer in
one run, one table.

Workloads (Qwen3 dimensions, random init, bf16, sdpa attention, fused AdamW, TRL's defaults
otherwise: gradient checkpointing on):
  dpo           DPOTrainer step: 4 pairs, prompt + completion = 1024 tokens on each side
                (chosen, rejected), reference model forward included; Qwen3-0.6B dims
  grpo          GRPOTrainer training step (loss forward + backward + optimizer step) on
                pre-generated completions: 8 x (64 prompt + 1024 completion) tokens; generation
                is not timed (nor run); Qwen3-0.6B dims, beta 0 (TRL's default: no reference)
  distillation  DistillationTrainer step on pre-generated completions, 8 x (64 + 1024) tokens:
                Qwen3-0.6B-dims student, Qwen3-1.7B-dims teacher (its forward included)

Setups (every workload x setup in its own process, so each peak memory is its own):
  trl            TRL as is: transformers' eager layers, TRL's own fused LM head
  trl-liger      TRL with use_liger_kernel=True: Liger's layer kernels (TRL refuses its fused
                 linear cross-entropy), TRL's fused head
  ours           model_init_kwargs={"use_kernels": True, "kernel_config":
                 kernels.training_kernel_config(model)} for every model TRL loads: this
                 project's layer kernels, and its log-prob head serving TRL's fused-head calls
                 (its divergence kernel for distillation)
  ours-trl-head  ours with KERNELS_TRL_HEAD=trl: the layer kernels, TRL's own head (what the
                 head alone adds)

The kernels come from a `kernels serve` mirror of hub_kernels/ this script starts (offline), or
from LOCAL_KERNELS when that is set. Every process gets the same weights and the same batch.

Usage (GPU): python scripts/bench_post_training.py --out DIR [--steps 20] [--workloads ...]
             [--setups ...] [--deadline 1500]
CPU smoke (tiny shapes, seconds): python scripts/bench_post_training.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

WORKLOADS = ("dpo", "grpo", "distillation")
SETUPS = ("trl", "trl-liger", "ours", "ours-trl-head")


@dataclass(frozen=True)
class Shape:
    """Token counts of one workload's batch."""

    rows: int  # DPO: pairs; GRPO and distillation: completions
    prompt: int
    completion: int


SHAPES = {
    "dpo": Shape(4, 512, 512),  # each side: 512 prompt + 511 completion + EOS = 1024 tokens
    "grpo": Shape(8, 64, 1024),
    "distillation": Shape(8, 64, 1024),
}
SMOKE_SHAPES = {"dpo": Shape(2, 8, 8), "grpo": Shape(4, 4, 8), "distillation": Shape(4, 4, 8)}


def qwen3_config(size: str):
    from transformers import Qwen3Config

    if size == "tiny":
        return Qwen3Config(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
            pad_token_id=510, eos_token_id=511, bos_token_id=None,
        )  # fmt: skip
    if size == "tiny-teacher":
        config = qwen3_config("tiny")
        config.hidden_size, config.intermediate_size = 96, 192
        return config
    dims = {  # (hidden, intermediate, layers, heads, kv heads)
        "0.6B": (1024, 3072, 28, 16, 8),
        "1.7B": (2048, 6144, 28, 16, 8),
    }[size]
    hidden, inter, layers, heads, kv = dims
    return Qwen3Config(
        vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
        tie_word_embeddings=True, pad_token_id=151643, eos_token_id=151645, bos_token_id=None,
    )  # fmt: skip


def word_tokenizer(vocab: int, pad: int, eos: int):
    """A word-level tokenizer over "w0 .. w{vocab-1}" (the benchmark needs token ids, not text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab)}
    words["<pad>"], words["<eos>"] = pad, eos
    del words[f"w{pad}"], words[f"w{eos}"]
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="w0"
    )


def save_models(work: Path, smoke: bool) -> dict[str, Path]:
    """The student (0.6B dims) and teacher (1.7B dims) checkpoints with the tokenizer, bf16."""
    import torch
    from transformers import AutoModelForCausalLM

    paths = {}
    for name, size in (("student", "0.6B"), ("teacher", "1.7B")):
        size = ("tiny" if name == "student" else "tiny-teacher") if smoke else size
        config = qwen3_config(size)
        torch.manual_seed(0 if name == "student" else 1)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        path = work / name
        model.save_pretrained(path)
        word_tokenizer(config.vocab_size, config.pad_token_id, config.eos_token_id).save_pretrained(
            path
        )
        paths[name] = path
    return paths


def _words(gen, n: int, vocab: int) -> str:
    import torch

    ids = torch.randint(1, vocab - 2000 if vocab > 4000 else vocab - 4, (n,), generator=gen)
    return " ".join(f"w{i}" for i in ids.tolist())


# -- the child: one workload, one setup -------------------------------------------------------


def _model_kwargs(setup: str, path: Path, device: str, dtype: str = "bfloat16") -> dict:
    kwargs = {"dtype": dtype, "attn_implementation": "sdpa"}
    if setup.startswith("ours"):
        import kernels

        kwargs["use_kernels"] = True
        if device == "cpu":  # transformers refuses a KernelConfig on the CPU: register instead
            mapping = kernels.training_kernel_mapping(str(path))
            kernels.register_kernel_mapping(
                {
                    n: {
                        "cpu": kernels.LayerRepository(
                            "kernels-lab/training", layer_name=n, version=1
                        )
                    }
                    for n in mapping
                }
            )
        else:
            kwargs["kernel_config"] = kernels.training_kernel_config(str(path))
    return kwargs


def _dtype(args) -> str:
    return getattr(args, "dtype", "bfloat16")


def build_trainer(workload: str, setup: str, paths: dict, shape: Shape, args):
    """The TRL trainer of `workload` as `setup` builds it (the models loaded from `paths` by
    TRL itself, with the setup's model_init_kwargs); `args` gives device, work dir, dtype."""
    import trl
    from datasets import Dataset

    student, teacher = paths["student"], paths["teacher"]
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(student)
    common = dict(
        output_dir=str(Path(args.work) / f"out-{workload}-{setup}"), report_to=[],
        save_strategy="no", logging_steps=10**9, bf16=_dtype(args) == "bfloat16",
        use_cpu=args.device == "cpu",
        per_device_train_batch_size=shape.rows, learning_rate=1e-6, seed=0,
        optim="adamw_torch_fused" if args.device == "cuda" else "adamw_torch",
        gradient_checkpointing=not args.no_gradient_checkpointing,
        use_liger_kernel=setup == "trl-liger",
        model_init_kwargs=_model_kwargs(setup, student, args.device, _dtype(args)),
    )  # fmt: skip
    import torch

    gen = torch.Generator().manual_seed(1)
    vocab = tokenizer.vocab_size
    rows = shape.rows
    if workload == "dpo":
        data = Dataset.from_dict(
            {
                "prompt": [_words(gen, shape.prompt, vocab) for _ in range(rows)],
                "chosen": [" " + _words(gen, shape.completion - 1, vocab) for _ in range(rows)],
                "rejected": [" " + _words(gen, shape.completion - 1, vocab) for _ in range(rows)],
            }
        )
        config = trl.DPOConfig(**common, max_length=shape.prompt + shape.completion)
        return trl.DPOTrainer(str(student), args=config, train_dataset=data,
                              processing_class=tokenizer)  # fmt: skip
    prompts = Dataset.from_dict({"prompt": [_words(gen, shape.prompt, vocab) for _ in range(rows)]})
    if workload == "grpo":
        config = trl.GRPOConfig(
            **common, num_generations=rows, max_completion_length=shape.completion
        )
        return trl.GRPOTrainer(
            str(student), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=config, train_dataset=prompts, processing_class=tokenizer,
        )  # fmt: skip
    config = trl.DistillationConfig(
        **common, max_completion_length=shape.completion,
        teacher_model_init_kwargs=_model_kwargs(setup, teacher, args.device, _dtype(args)),
    )  # fmt: skip
    return trl.DistillationTrainer(
        str(student), teacher_model=str(teacher), args=config, train_dataset=prompts,
        processing_class=tokenizer,
    )  # fmt: skip


def step_inputs(workload: str, trainer, shape: Shape, device: str) -> tuple[dict, int]:
    """One batch as the trainer's loss takes it, on `device`, and its token count: DPO's from
    its own collator; GRPO's and distillation's as their generation step hands them over (the
    completions random, the advantages of 8 completions of one prompt)."""
    import torch

    if workload == "dpo":
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(shape.rows)])
        batch = {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}
        mask = batch.get("attention_mask")
        tokens = int(mask.sum()) if mask is not None else 0
        return batch, tokens
    gen = torch.Generator().manual_seed(2)
    vocab = trainer.processing_class.vocab_size
    prompt = torch.randint(0, vocab, (1, shape.prompt), generator=gen).expand(shape.rows, -1)
    completion = torch.randint(0, vocab, (shape.rows, shape.completion), generator=gen)
    inputs = {
        "prompt_ids": prompt.contiguous(),
        "prompt_mask": torch.ones_like(prompt),
        "completion_ids": completion,
        "completion_mask": torch.ones_like(completion),
    }
    if workload == "grpo":
        adv = torch.randn(shape.rows, generator=gen)
        inputs["advantages"] = (adv - adv.mean()) / adv.std()
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum().float()
    inputs = {k: v.to(device) for k, v in inputs.items()}
    return inputs, shape.rows * (shape.prompt + shape.completion)


def which_head(trainer) -> str:
    """Which kernel served the fused head / divergence calls, from the served-call counts and
    the policy's bind report."""
    import kernels

    try:
        from kernels.training.trl_head import served_calls
    except ImportError:
        return "n/a"
    calls = {f"{attr}:{path}": n for (attr, path), n in served_calls().items() if n}
    report = kernels.last_report(trainer.model)
    entry = next((e for e in report or () if e.layer_name == "fused_lm_head"), None)
    status = f"{entry.status} ({entry.kernel or entry.reason[:60]})" if entry else "no entry"
    return f"report: {status}; calls: {calls or 'none through the stand-ins'}"


def child(args) -> dict:
    import bench_supervise

    watch = bench_supervise.Watchdog(f"{args.child_workload}/{args.child}", args.heartbeat)
    watch.phase("import torch, trl")
    import torch

    paths = {"student": Path(args.work) / "student", "teacher": Path(args.work) / "teacher"}
    shape = (SMOKE_SHAPES if args.smoke else SHAPES)[args.child_workload]
    watch.phase("build the trainer (loads the models)")
    t0 = time.perf_counter()
    trainer = build_trainer(args.child_workload, args.child, paths, shape, args)
    load_s = time.perf_counter() - t0
    model = trainer.model
    if args.child == "trl-liger":  # what Trainer.train() does first with use_liger_kernel
        from transformers.integrations.liger import apply_liger_kernel

        apply_liger_kernel(model, trainer.args.liger_kernel_config)
    if trainer.args.gradient_checkpointing:
        model.gradient_checkpointing_enable(trainer.args.gradient_checkpointing_kwargs)
    model.train()  # with use_kernels, transformers binds for training here
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(), read by the losses
    opt = trainer.create_optimizer()
    inputs, tokens = step_inputs(args.child_workload, trainer, shape, args.device)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for step in range(args.steps):
        watch.phase(f"step {step + 1}")
        t = time.perf_counter()
        loss = trainer.compute_loss(model, dict(inputs))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        losses.append(float(loss.detach()))
        watch.say(f"step {step + 1}/{args.steps} {times[-1] * 1e3:.0f} ms, loss {losses[-1]:.4f}")
    watch.phase("")
    step_s = statistics.median(times[args.warmup :] or times)
    return {
        "workload": args.child_workload,
        "setup": args.child,
        "load_s": load_s,
        "step_ms": step_s * 1e3,
        "tokens": tokens,
        "tokens_per_s": tokens / step_s,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "losses": losses,
        "head": which_head(trainer),
    }


# -- the parent: every workload x setup, one table --------------------------------------------


def table(rows: list[dict], steps: int, warmup: int) -> str:
    """One markdown table: every workload's setups, step time, tokens/s, peak memory, and the
    step time and memory relative to plain TRL's for that workload."""
    lines = [
        f"| workload | setup | step (median of steps {warmup + 1}-{steps}) | tokens/s | "
        "peak memory | speed vs trl | peak vs trl | first loss | fused head |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = {r["workload"]: r for r in rows if r.get("setup") == "trl" and "error" not in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['workload']} | {r['setup']} | error: {_cell(r['error'])} |"
                         " | | | | | |")  # fmt: skip
            continue
        ref = base.get(r["workload"])
        speed = f"{ref['step_ms'] / r['step_ms']:.2f}x" if ref else ""
        peak = f"{r['peak_gib']:.2f} GiB" if r.get("peak_gib") is not None else "n/a"
        mem = ""
        if ref and r.get("peak_gib") and ref.get("peak_gib"):
            mem = f"{r['peak_gib'] / ref['peak_gib']:.2f}x"
        lines.append(
            f"| {r['workload']} | {r['setup']} | {r['step_ms']:.1f} ms | "
            f"{r['tokens_per_s'] / 1e3:.1f} k | {peak} | {speed} | {mem} | "
            f"{r['losses'][0]:.4f} | {_cell(r.get('head', ''))} |"
        )
    return "\n".join(lines)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def header(args, commit: str) -> str:
    import torch
    from bench_train import cpu_model

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    versions = {"torch": torch.__version__}
    for name in ("transformers", "trl", "triton", "liger_kernel", "kernels"):
        try:
            versions[name] = __import__("importlib.metadata").metadata.version(
                name.replace("_", "-")
            )
        except Exception:  # noqa: BLE001 - a version line, never a failure
            versions[name] = "n/a"
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    dims = "tiny Qwen3 (smoke)" if args.smoke else "Qwen3-0.6B dims (teacher: Qwen3-1.7B dims)"
    what = "; ".join(f"{w}: {s.rows} x ({s.prompt} + {s.completion})" for w, s in shapes.items())
    return (
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {gpu}, host {cpu_model()}, "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
        + f", commit {commit}. {dims}, random init, bf16, sdpa, "
        f"{'fused ' if args.device == 'cuda' else ''}AdamW, gradient checkpointing "
        f"{'off' if args.no_gradient_checkpointing else 'on'}, {args.steps} steps "
        f"({args.warmup} warm-up). Tokens per step: {what}."
    )


class _Terminated(Exception):
    pass


def _on_sigterm(signum, frame):  # noqa: ARG001
    raise _Terminated


def run_all(args) -> int:
    from bench_supervise import git_commit, log
    from bench_train import run_setup, start_mirror

    started = time.monotonic()
    signal.signal(signal.SIGTERM, _on_sigterm)
    workloads = [w for w in args.workloads.split(",") if w]
    setups = [s for s in args.setups.split(",") if s]
    for name in workloads + setups:
        if name not in WORKLOADS + SETUPS:
            raise SystemExit(f"unknown workload or setup {name!r}: {WORKLOADS} / {SETUPS}")
    commit = git_commit(ROOT)
    work = Path(tempfile.mkdtemp(prefix="bench-post-training-"))
    rows: list[dict] = []
    server = None
    out = Path(args.out) if args.out else None

    def write(text: str = "") -> None:
        if out is None:
            return
        out.mkdir(parents=True, exist_ok=True)
        (out / "post_training.json").write_text(json.dumps(rows, indent=1))
        if text:
            (out / "post_training.md").write_text(text + "\n")

    try:
        log("saving the models (random init)")
        save_models(work, args.smoke)
        env = dict(os.environ, HF_HUB_DISABLE_TELEMETRY="1")
        if not os.environ.get("LOCAL_KERNELS"):
            log("starting the kernels mirror")
            server, env = start_mirror(work)
        for workload in workloads:
            for setup in setups:
                left = (args.deadline or float("inf")) - (time.monotonic() - started)
                timeout = min(args.setup_timeout or float("inf"), left - 20)
                if timeout < 30:
                    rows.append(
                        {"workload": workload, "setup": setup, "error": "not run: deadline"}
                    )
                    continue
                cmd = [sys.executable, __file__, "--child", setup, "--child-workload", workload,
                       "--work", str(work), "--steps", str(args.steps),
                       "--warmup", str(args.warmup), "--device", args.device,
                       "--heartbeat", str(args.heartbeat)]  # fmt: skip
                cmd += ["--smoke"] if args.smoke else []
                cmd += ["--no-gradient-checkpointing"] if args.no_gradient_checkpointing else []
                child_env = dict(env)
                if setup == "ours-trl-head":
                    child_env["KERNELS_TRL_HEAD"] = "trl"
                log(f"{workload}/{setup}: start")
                row = run_setup(setup, cmd, child_env,
                                None if timeout == float("inf") else timeout)  # fmt: skip
                row.setdefault("workload", workload)
                rows.append(row)
                log(f"{workload}/{setup}: " + (row.get("error") or f"{row['step_ms']:.1f} ms"))
                write()
    except _Terminated:
        log("terminated (SIGTERM): writing what was measured")
    finally:
        if server is not None:
            server.terminate()
        shutil.rmtree(work, ignore_errors=True)
    text = header(args, commit) + "\n\n" + table(rows, args.steps, args.warmup)
    print(text, flush=True)
    write(text)
    return 1 if any("error" in r for r in rows) and args.smoke else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--setup-timeout", type=float, help="seconds before one process is killed")
    p.add_argument("--deadline", type=float, help="seconds for the whole run")
    p.add_argument("--heartbeat", type=float, default=30.0)
    p.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU in seconds (plumbing check)"
    )
    p.add_argument("--out", help="folder for post_training.md and post_training.json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-workload", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.device = "cpu"
        args.steps = min(args.steps, 3)
        args.warmup = min(args.warmup, 1)
    if args.child:
        from bench_train import emit_result

        emit_result(child(args))
        return 0
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
