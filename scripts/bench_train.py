"""End-to-end training benchmark: one model shape per run, one GPU, four setups in one run.

Families (--family): qwen3 (Qwen3-0.6B, the default), gemma2 (Gemma-2-2B), gemma3 (Gemma-3-1B
text), phi3 (Phi-3-mini-4k), each with its real dimensions and every layer, random init, bf16,
and a batch that fits eager on one H200 (FAMILIES; --estimate-memory shows the basis).

Setups (each in its own process, same initial weights, same token batches):
  eager    transformers as is
  compile  torch.compile of the whole model
  liger    liger_kernel's _apply_liger_kernel_to_instance (defaults: rope, rms_norm, swiglu or
           geglu, FLCE)
  ours     this project's kernels from a `kernels serve` mirror of hub_kernels/ started by this
           script: on Qwen3 the user's KernelConfig way with the hand mapping below (variants
           ours-rmsnorm, ours-compile); on the other families the one line for any model,
           kernels.apply_training_kernels(model)

Reports step time (median after warm-up), tokens/s, peak memory, both relative to Liger's, and
the loss curve against eager.

Each setup's progress (load, every step) is printed with a timestamp as it happens, and while
one phase lasts, every --heartbeat seconds with where the process is. A setup past its time
(--setup-timeout, or what --deadline leaves) has its stack taken and is killed: its row says the
phase and the place, and the other setups still run (put the risky ones last). --setup-steps
gives a slow-starting setup fewer steps (compile). The JSON and the table are rewritten after
every setup, and on SIGTERM (an outer `timeout`) the table of what ran is still written.
Usage (GPU): python scripts/bench_train.py [--family F] --out DIR [--steps 50] [--setups ...]
             [--setup-steps compile=6] [--deadline 540]
CPU smoke: TRITON_INTERPRET=1 python scripts/bench_train.py --family F --tiny --device cpu ...
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
REPO = "kernels-lab/training"
# The layers this project binds, by the layer names the model declares. Qwen3MLP and
# Qwen3ForCausalLM carry no layer name in transformers; `mark_fused_layers` gives them one.
# MemoryEfficientRMSNorm keeps the norm's output (which q/k/v and the MLP save anyway) instead of
# its input; "ours-rmsnorm" runs the plain RMSNorm layer to show what that saves; "ours-compile"
# also wraps the kernelized model in torch.compile (the kernels, the fused loss included, are
# custom ops inside the graph; scripts/bench_compile.py runs every compile mode).
KERNEL_MAPPING = {
    "RMSNorm": f"{REPO}:MemoryEfficientRMSNorm",
    "rotary_pos_emb": f"{REPO}:rotary_pos_emb",
    "SwiGLUMLP": f"{REPO}:SwiGLUMLP",
    "ForCausalLM": f"{REPO}:ForCausalLM",
}
SETUP_MAPPINGS = {
    "ours": KERNEL_MAPPING,
    "ours-rmsnorm": {**KERNEL_MAPPING, "RMSNorm": f"{REPO}:RMSNorm"},
    "ours-compile": KERNEL_MAPPING,
}
COMPILED = {"compile", "ours-compile"}


def qwen3_config(tiny: bool):
    from transformers import Qwen3Config

    if tiny:
        return Qwen3Config(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=True,
        )
    return Qwen3Config(  # Qwen3-0.6B's shape
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
    )


def gemma2_config(tiny: bool):
    from transformers import Gemma2Config

    if tiny:
        return Gemma2Config(**_TINY, sliding_window=16)  # softcapping as the real model
    # Gemma-2-2B: all 26 layers; attention and final logit softcapping 50 / 30, sliding window
    # 4096 on every other layer (the config's defaults are this model's)
    return Gemma2Config(
        vocab_size=256000,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=8192,
        rms_norm_eps=1e-6,
        query_pre_attn_scalar=256,
        sliding_window=4096,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
    )


def gemma3_config(tiny: bool):
    from transformers import Gemma3TextConfig

    if tiny:  # one sliding-window layer and one global one (their RoPE bases differ)
        return Gemma3TextConfig(
            **_TINY, sliding_window=8, layer_types=["sliding_attention", "full_attention"]
        )
    # Gemma-3-1B (text): all 26 layers, 5 sliding-window (512) layers to 1 global, local RoPE
    # base 10k and global 1M, no softcapping, tied embeddings
    return Gemma3TextConfig(
        vocab_size=262144,
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        query_pre_attn_scalar=256,
        sliding_window=512,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        },
        tie_word_embeddings=True,
    )


def phi3_config(tiny: bool):
    from transformers import Phi3Config

    if tiny:
        kw = {k: v for k, v in _TINY.items() if k != "head_dim"}
        return Phi3Config(**kw, pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=16)
    # Phi-3-mini-4k: all 32 layers, fused qkv_proj and gate_up_proj, 32 heads (no GQA),
    # sliding window 2047 as its released config, untied head
    return Phi3Config(
        vocab_size=32064,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
        original_max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        sliding_window=2047,
        pad_token_id=32000,
        bos_token_id=1,
        eos_token_id=32000,
        tie_word_embeddings=False,
    )


# The tiny (CPU smoke) models: small enough for a few seconds per setup in the Triton interpreter.
_TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


@dataclass(frozen=True)
class Family:
    """A benchmarked model shape: its config, the batch that fits eager on one H200 (141 GB)
    and the attention every setup runs."""

    shape: str
    config: Callable[[bool], Any]
    batch: int
    seq: int
    attn: str = "sdpa"


FAMILIES = {
    "qwen3": Family("Qwen3-0.6B shape (28 layers)", qwen3_config, 8, 2048),
    # Batches from what autograd saves in eager, counted on the CPU per sequence of 2048 (1- and
    # 2-layer models at full width and vocabulary), plus weights, gradients, AdamW state and the
    # loss's fp32 logit gradients; each leaves eager tens of GiB of the H200's 141 GB.
    # transformers refuses sdpa with attention softcapping (it allows eager or flex) and
    # recommends eager for training Gemma-2; its scores' softcap/softmax chain makes 743 MiB
    # per layer and sequence: batch 2 is ~71 GiB.
    "gemma2": Family("Gemma-2-2B shape (all 26 layers)", gemma2_config, 2, 2048, "eager"),
    # 278 MiB per layer, 2.6 GiB in the 262144-entry head per sequence: batch 6 is ~83 GiB
    "gemma3": Family("Gemma-3-1B text shape (all 26 layers)", gemma3_config, 6, 2048),
    # 508 MiB per layer per sequence and 28.5 GiB of weights, gradients and AdamW state:
    # batch 4 is ~96 GiB
    "phi3": Family("Phi-3-mini-4k shape (all 32 layers)", phi3_config, 4, 2048),
}


def save_model(path: Path, tiny: bool, family: str = "qwen3") -> None:
    import torch

    torch.manual_seed(0)
    if family == "qwen3":  # as before the other families, so Qwen3 numbers stay comparable
        from transformers import Qwen3ForCausalLM

        model = Qwen3ForCausalLM(qwen3_config(tiny)).to(torch.bfloat16)
    else:  # built in bf16 directly: a 3.8 B model in fp32 first costs the host ~15 GB and time
        from transformers import AutoModelForCausalLM

        config = FAMILIES[family].config(tiny)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)


def mark_fused_layers() -> None:
    """Give Qwen3MLP and Qwen3ForCausalLM the layer names our repo serves (the one extra line a
    user writes, as with Liger's apply function)."""
    import kernels
    from transformers.models.qwen3 import modeling_qwen3

    kernels.replace_kernel_forward_from_hub(modeling_qwen3.Qwen3MLP, "SwiGLUMLP")
    kernels.replace_kernel_forward_from_hub(modeling_qwen3.Qwen3ForCausalLM, "ForCausalLM")


def estimate_eager_gib(family: str, batch: int, seq: int) -> dict:
    """Eager's peak memory at `batch` x `seq`, estimated on the CPU: the bytes autograd saves in
    a forward of 1- and 2-layer models at full width and vocabulary (one sequence; their
    difference is one layer), scaled to every layer and the batch, plus bf16 weights, gradients
    and AdamW state and the loss's fp32 and bf16 logit gradients."""
    import torch
    from transformers import AutoModelForCausalLM

    spec = FAMILIES[family]
    full = spec.config(False)

    def saved_bytes(layers: int) -> tuple[int, int]:
        config = spec.config(False)
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = full.layer_types[:layers]
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation=spec.attn
        ).train()
        storages: dict[int, int] = {}  # by storage: views of one buffer count once

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        ids = torch.randint(0, config.vocab_size, (1, seq))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, labels=ids)
        return sum(storages.values()), sum(p.numel() for p in model.parameters())

    one, params_one = saved_bytes(1)
    two, params_two = saved_bytes(2)
    layer, head = two - one, 2 * one - two
    params = params_one + (full.num_hidden_layers - 1) * (params_two - params_one)
    gib = 2**30
    state = params * 8 / gib  # bf16 weights and gradients, AdamW's two bf16 moments
    saved = batch * (full.num_hidden_layers * layer + head) / gib
    loss_grad = batch * seq * full.vocab_size * 6 / gib
    return {
        "saved_per_layer_mib": layer / 2**20,
        "head_per_sequence_gib": head / gib,
        "weights_grads_adamw_gib": state,
        "eager_peak_gib": state + saved + loss_grad,
    }


def load_for_training(setup: str, model_dir, device: str, family: str = "qwen3", attn: str = ""):
    """The model of `setup`, loaded and patched the way that setup's users do it, in train mode;
    returns (model, load seconds, count of modules bound by this project or None).

    "ours" on Qwen3 is the hand-written KernelConfig mapping (the measurements so far); on the
    other families it is the one line for any model, ``kernels.apply_training_kernels(model)``,
    which classifies the modules by structure. KernelConfig binds on accelerators only, so on
    the CPU the Qwen3 mapping goes through ``kernels.apply_kernels`` instead."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = dict(dtype=torch.bfloat16, attn_implementation=attn or FAMILIES[family].attn)
    if device != "cpu":  # KernelConfig binds for the device the model is on at load time
        kwargs["device_map"] = device
    ours = setup in SETUP_MAPPINGS
    hand_mapping = ours and family == "qwen3"
    if hand_mapping:
        mark_fused_layers()
        if device != "cpu":
            from transformers import KernelConfig

            mapping = dict(SETUP_MAPPINGS[setup])
            kwargs.update(use_kernels=True, kernel_config=KernelConfig(kernel_mapping=mapping))
    elif ours and setup == "ours-rmsnorm":
        raise SystemExit("ours-rmsnorm is a variant of the Qwen3 hand mapping; use --family qwen3")
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    if ours:
        import kernels

        model.train()  # bind for training (apply_kernels picks the mode after model.training)
        if not hand_mapping:
            kernels.apply_training_kernels(model)
        elif device == "cpu":
            kernels.apply_kernels(model, dict(SETUP_MAPPINGS[setup]))
    load_s = time.perf_counter() - t0
    if setup == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    model.train()
    bound = None
    if ours:
        import kernels

        report = kernels.last_report(model)
        bound = sum(1 for e in report.entries if e.status == "bound") if report else None
    return model, load_s, bound


def binding_summary(model) -> dict:
    """What this project bound, by layer name ({"RMSNorm": 105, ...}), and what it left as it
    was with the reason, from the model's last bind report."""
    import kernels

    report = kernels.last_report(model)
    bound: dict[str, int] = {}
    kept: dict[str, str] = {}
    for e in report.entries if report else ():
        if e.status == "bound":
            layer = (e.kernel or e.layer_name).rsplit(":", 1)[-1]
            bound[layer] = bound.get(layer, 0) + 1
        else:
            kept.setdefault(e.layer_name, e.reason)
    return {"bound_layers": dict(sorted(bound.items())), "kept_layers": kept}


# The ops Liger's default patches for these families run through its dispatcher.
LIGER_OPS = ("rms_norm", "geglu", "swiglu", "rope", "fused_linear_cross_entropy",
             "cross_entropy_loss_and_grad")  # fmt: skip


def liger_backends(device: str) -> str:
    """Which implementation Liger's dispatcher (0.8.5+) picks per op on `device` ("triton",
    "nvidia-cutedsl", ...), best first: a CuTe DSL build JIT-compiles on first use, a cost the
    Triton path does not have. "n/a" on a Liger without the dispatcher."""
    try:
        from liger_kernel.backends import available_impls

        picks = []
        for op in LIGER_OPS:
            impls = available_impls(op, device if device != "cpu" else None)
            picks.append(f"{op} {'/'.join(impls) or '-'}")
        return ", ".join(picks)
    except Exception as exc:  # noqa: BLE001 - a diagnosis line, never a failure
        return f"n/a ({type(exc).__name__}: {str(exc)[:80]})"


def child(args) -> dict:
    """One setup's run in this process: load, `args.steps` training steps, the RESULT row.
    Progress goes to stderr as it happens (the parent echoes it with timestamps), and a
    watchdog says where the process is while one phase (load, a step) lasts long."""
    import bench_supervise

    watch = bench_supervise.Watchdog(args.child, args.heartbeat)
    watch.phase("import torch")
    import torch

    device = args.device
    ours = args.child in SETUP_MAPPINGS
    watch.phase("load")
    model, load_s, bound = load_for_training(
        args.child, args.model_dir, device, args.family, args.attn
    )
    watch.say(f"loaded in {load_s:.1f} s")
    if args.child == "liger":
        watch.phase("Liger backend discovery")
        watch.say(f"Liger's picks: {liger_backends(device)}")
    compiled = args.child in COMPILED
    step_model = torch.compile(model, backend=args.compile_backend) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    gen = torch.Generator().manual_seed(1234)
    vocab = model.config.vocab_size
    # the same token batches in every setup, whatever its number of steps (--setup-steps)
    data_steps = max(args.steps, args.data_steps or 0)
    batches = torch.randint(0, vocab, (data_steps, args.batch, args.seq), generator=gen)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def inputs(step: int) -> dict:
        ids = batches[step].to(device, non_blocking=True)
        return {"input_ids": ids, "labels": ids}

    first = " (compiles)" if compiled else ""
    losses, times = timed_steps(step_model, opt, inputs, args.steps, device, watch, first)
    warm = times[args.warmup :] or times
    step_s = statistics.median(warm)
    out = {
        "setup": args.child,
        "load_s": load_s,
        "first_step_s": times[0],
        "step_ms": step_s * 1e3,
        "tokens_per_s": args.batch * args.seq / step_s,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        "steps": args.steps,
        "warmup": args.warmup,
        "losses": losses,
        "bound_modules": bound,
        "training_after": model.training,
    }
    if compiled:  # graphs dynamo handed to the backend: 0 would mean nothing was compiled
        from torch._dynamo.utils import counters

        out["compiled_graphs"] = counters["stats"]["unique_graphs"]
    if ours:
        from kernels import get_loaded_kernels

        out.update(binding_summary(model))
        out["kernels"] = [k.describe() for k in get_loaded_kernels()]
    if args.profile and device == "cuda":
        watch.phase("profile")
        out["profile"] = profile_step(step_model, opt, batches[args.steps - 1].to(device))
    return out


def timed_steps(model, opt, inputs, steps: int, device: str, watch, first: str = "") -> tuple:
    """(losses, seconds) of `steps` optimizer steps on ``model(**inputs(step))``, each timed
    from a synchronized start to a synchronized end; `first` is added to step 1's phase name."""
    import torch

    losses, times = [], []
    for step in range(steps):
        watch.phase(f"step {step + 1}" + (first if step == 0 else ""))
        batch = inputs(step)
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        losses.append(float(loss.detach()))
        watch.say(f"step {step + 1}/{steps} {times[-1]:.2f} s, loss {losses[-1]:.4f}")
    watch.phase("")
    return losses, times


def versions() -> dict[str, str]:
    """The versions a benchmark header names (torch, transformers, triton, Liger, kernels)."""
    import torch

    found = {"torch": torch.__version__}
    for name in ("transformers", "triton", "liger_kernel", "kernels"):
        try:
            found[name] = __import__("importlib.metadata").metadata.version(name.replace("_", "-"))
        except Exception:  # noqa: BLE001 - a version line, never a failure
            found[name] = "n/a"
    return found


def emit_result(result: dict, out_dir: str | None = None, filename: str = "") -> None:
    """Print `result` as the RESULT line that parent processes parse; with `out_dir`, also save
    it there as `filename` (JSON)."""
    print("RESULT " + json.dumps(result), flush=True)
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / filename).write_text(json.dumps(result, indent=1))


def _category(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("flash", "fmha", "attention", "sdpa", "cudnn")):
        return "attention"
    if any(k in n for k in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm80_")):
        return "matmul"
    if any(k in n for k in ("adam", "multi_tensor")):
        return "optimizer"
    if n.startswith("triton") or n.startswith("_"):
        return "triton kernels"
    if "memcpy" in n or "memset" in n or "copy" in n or "fill" in n or "cat" in n:
        return "copies and fills"
    return "other elementwise/reductions"


def profile_step(model, opt, ids) -> dict:
    """One training step under torch.profiler: GPU time by kernel category and the top kernels;
    GPU idle time, attributed to the op whose launch the GPU was waiting for; and the memory
    held at the end of the forward (params, optimizer state, activations)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loss = model(input_ids=ids, labels=ids).loss
    torch.cuda.synchronize()
    after_forward = torch.cuda.memory_allocated()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        timeline = gpu_timeline(json.loads(trace.read_text()))
    return {
        "held_before_step_gib": before / 2**30,
        "activations_at_end_of_forward_gib": (after_forward - before) / 2**30,
        **timeline,
    }


def gpu_timeline(trace: dict, min_gap_us: float = 5.0) -> dict:
    """From a chrome trace of one step: GPU time by kernel category and the top kernels; the
    step's GPU span, busy and idle time; the host's span (first op to last launch); and the idle
    gaps summed by the CPU op that launched the kernel the GPU waited for (innermost op).

    CPU tracing slows the host, so idle and host span are larger than in an unprofiled step."""
    events = trace.get("traceEvents", [])
    kernels = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
        key=lambda e: e["ts"],
    )
    if not kernels:
        return {}
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver")
        and e.get("args", {}).get("correlation") is not None
    }
    ops_by_tid: dict = {}
    for e in events:
        if e.get("cat") == "cpu_op" and "dur" in e:
            ops_by_tid.setdefault(e["tid"], []).append(e)

    def launcher(kernel: dict) -> str:
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        if launch is None:
            return "?"
        inner = None
        for op in ops_by_tid.get(launch["tid"], []):
            if op["ts"] <= launch["ts"] <= op["ts"] + op["dur"]:
                if inner is None or op["dur"] <= inner["dur"]:
                    inner = op
        return inner["name"] if inner else launch["name"]

    by_cat: dict[str, float] = {}
    by_name: dict[str, list] = {}
    busy, idle, end = 0.0, 0.0, kernels[0]["ts"]
    by_op: dict[str, list] = {}
    for k in kernels:
        by_cat[_category(k["name"])] = by_cat.get(_category(k["name"]), 0.0) + k["dur"] / 1e3
        slot = by_name.setdefault(k["name"], [0.0, 0])
        slot[0] += k["dur"] / 1e3
        slot[1] += 1
        gap = k["ts"] - end
        if gap > min_gap_us:
            idle += gap
            slot = by_op.setdefault(launcher(k), [0.0, 0])
            slot[0] += gap
            slot[1] += 1
        busy += max(0.0, k["ts"] + k["dur"] - max(end, k["ts"]))
        end = max(end, k["ts"] + k["dur"])
    # The host's span ends at its last launch (the closing synchronize is waiting, not work).
    starts = [e["ts"] for e in events if e.get("cat") == "cpu_op"]
    last = [e["ts"] for e in launches.values() if "aunch" in e.get("name", "")]
    host_ms = (max(last) - min(starts)) / 1e3 if starts and last else None
    top = sorted(by_op.items(), key=lambda kv: -kv[1][0])[:20]
    top_kernels = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]
    return {
        "gpu_ms_by_category": {k: round(v, 2) for k, v in sorted(by_cat.items())},
        "gpu_ms_total": round(sum(by_cat.values()), 2),
        "top_kernels": [[round(ms, 2), n, name[:90]] for name, (ms, n) in top_kernels],
        "gpu_span_ms": round((end - kernels[0]["ts"]) / 1e3, 2),
        "gpu_busy_ms": round(busy / 1e3, 2),
        "gpu_idle_ms": round(idle / 1e3, 2),
        "host_span_ms": None if host_ms is None else round(host_ms, 2),
        "idle_before_op": [[round(ms / 1e3, 2), n, name[:80]] for name, (ms, n) in top],
    }


def start_mirror(work: Path) -> tuple[subprocess.Popen, dict[str, str]]:
    """Serve a mirror of hub_kernels/ on loopback; returns the server and the environment for
    setup processes (HF_ENDPOINT at the mirror, a fresh KERNELS_CACHE under `work`)."""
    from kernels.serve import build_mirror

    mirror = work / "mirror"
    build_mirror(ROOT / "hub_kernels", mirror, trusted_publishers=["kernels-lab"])
    proc = subprocess.Popen(
        [sys.executable, "-m", "kernels.cli.main", "serve", str(mirror), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    url = proc.stdout.readline().strip().rsplit(" ", 1)[-1]
    if not url.startswith("http"):  # it said nothing: its error went to stderr above
        proc.kill()
        raise SystemExit(f"kernels serve did not start (exit {proc.wait()})")
    env = dict(
        os.environ, HF_ENDPOINT=url, HF_HUB_DISABLE_TELEMETRY="1", KERNELS_CACHE=str(work / "cache")
    )
    return proc, env


def table(rows: list[dict], steps: int, warmup: int) -> str:
    """The markdown table of one family's run, with every setup's tokens/s and peak memory
    relative to Liger's (the bar: ours >= 1.1x Liger's tokens/s at <= Liger's memory). A setup
    run with its own --setup-steps gets a note; loss differences cover the steps both ran."""
    ok = [r for r in rows if "error" not in r]
    eager = next((r for r in ok if r["setup"] == "eager"), None)
    liger = next((r for r in ok if r["setup"] == "liger"), None)
    lines = [
        f"| setup | step (median of steps {warmup + 1}-{steps}) | tokens/s | peak memory | "
        "tokens/s vs Liger | peak vs Liger | max abs loss diff vs eager (steps both ran) | "
        "final loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for r in rows:
        name = r.get("label", r["setup"])  # a setup's configuration where it has several
        if "error" in r:
            lines.append(f"| {name} | error: {_cell(r['error'])} | | | | | | |")
            continue
        own = (r.get("steps", steps), r.get("warmup", warmup))
        if own != (steps, warmup):
            notes.append(f"{r['setup']}: {own[0]} steps, median of steps {own[1] + 1}-{own[0]}.")
        diff = ""
        if eager is not None and r is not eager:
            n = min(len(r["losses"]), len(eager["losses"]))  # the steps both ran
            pairs = zip(r["losses"][:n], eager["losses"][:n], strict=True)
            diff = f"{max(abs(a - b) for a, b in pairs):.4f}"
        peak = f"{r['peak_gib']:.1f} GiB" if r.get("peak_gib") is not None else "n/a"
        speed = f"{r['tokens_per_s'] / liger['tokens_per_s']:.2f}x" if liger else ""
        memory = ""
        if liger and r.get("peak_gib") is not None and liger.get("peak_gib"):
            memory = f"{r['peak_gib'] / liger['peak_gib']:.2f}x"
        lines.append(
            f"| {name} | {r['step_ms']:.0f} ms | {r['tokens_per_s'] / 1e3:.1f} k | {peak} "
            f"| {speed} | {memory} | {diff} | {r['losses'][-1]:.4f} |"
        )
    if notes:
        lines.append("\n" + " ".join(notes))
    bound = [r for r in ok if r.get("bound_layers")]
    for r in bound:
        layers = ", ".join(f"{k} x{v}" for k, v in r["bound_layers"].items())
        lines.append(f"\n{r['setup']} bound: {layers}.")
        for name, reason in r.get("kept_layers", {}).items():
            lines.append(f"{r['setup']} kept {name}: {reason}.")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    ok = [r for r in rows if "error" not in r]
    for r in ok:
        a.plot(r["losses"], label=r["setup"])
    a.set_xlabel("step")
    a.set_ylabel("loss")
    a.legend()
    a.set_title("training loss, same data and init")
    names = [r["setup"] for r in ok]
    b.bar(names, [r["tokens_per_s"] / 1e3 for r in ok])
    b.set_ylabel("k tokens/s")
    for i, r in enumerate(ok):
        if r.get("peak_gib"):
            b.text(i, r["tokens_per_s"] / 1e3, f"{r['peak_gib']:.1f} GiB", ha="center", va="bottom")
    b.set_title("throughput (label: peak memory)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def run_setup(setup: str, cmd: list[str], env: dict, timeout_s: float | None) -> dict:
    """Run one setup's process; its RESULT row, or {"setup", "error"} with a one-line reason
    when it failed or ran past `timeout_s`. Its progress lines are echoed as they come. On a
    timeout the child's stack is taken (SIGUSR1) before its whole process group is killed
    (compile workers too), and the reason says the phase it was in and where."""
    from bench_supervise import PROGRESS, Child, log, where_stuck

    result: list[str] = []
    progress: list[str] = []

    def on_stdout(line: str) -> None:
        if line.startswith("RESULT "):
            result.append(line[7:])

    def on_stderr(line: str) -> None:
        if line.startswith(PROGRESS):
            progress.append(line[len(PROGRESS) :])
            log(progress[-1])

    proc = Child(cmd, env, on_stdout, on_stderr)
    log(f"{setup}: pid {proc.proc.pid}")
    try:
        code = proc.wait(timeout_s)
    except BaseException:  # SIGTERM or Ctrl-C of the parent: the child must not outlive it
        proc.kill(dump_wait_s=0)
        raise
    if code is None:
        stack = proc.kill()
        last = progress[-1].split(": ", 1)[-1] if progress else "no progress line yet"
        reason = f"killed after {timeout_s:.0f} s (last progress: {last})"
        return {"setup": setup, "error": f"{reason}; {where_stuck(stack, proc)}"}
    if not result:
        print("\n".join(proc.tail), file=sys.stderr)
        lines = [x for x in proc.tail if x.strip() and not x.startswith(PROGRESS)]
        return {"setup": setup, "error": (lines or [f"exit {code}, no output"])[-1][:300]}
    return json.loads(result[-1])


def cpu_model() -> str:
    """The host CPU's model name (the step is host-bound: lent machines differ)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def output_names(family: str) -> tuple[str, str, str]:
    """(json, markdown, plot) file names under --out: Qwen3 keeps the names of earlier runs."""
    stem = "train" if family == "qwen3" else f"train-{family}"
    return f"{stem}.json", f"{stem}.md", f"{stem}_loss.png"


def parse_setup_steps(text: str, setups: list[str]) -> dict[str, int]:
    """--setup-steps "compile=6,liger=8" -> {"compile": 6, "liger": 8}; each name one of
    `setups` and each count at least 2 (one warm-up step, one measured)."""
    out: dict[str, int] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, sep, count = item.partition("=")
        if not sep or not count.isdigit() or int(count) < 2 or name not in setups:
            raise SystemExit(
                f"--setup-steps: {item!r} is not SETUP=N with SETUP in --setups and N >= 2"
            )
        out[name] = int(count)
    return out


def parse_setup_timeouts(text: str, setups: list[str]) -> dict[str, float]:
    """--setup-timeout "150,compile=300" -> {"": 150.0, "compile": 300.0}: a bare number is
    every setup's, SETUP=S one setup's (positive seconds)."""
    out: dict[str, float] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, sep, value = item.rpartition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = 0.0
        if seconds <= 0 or (sep and name not in setups):
            raise SystemExit(
                f"--setup-timeout: {item!r} is not S or SETUP=S with SETUP in --setups and S > 0"
            )
        out[name] = seconds
    return out


class _Terminated(Exception):
    """SIGTERM (an outer `timeout`): stop, but still write what was measured."""


def _on_sigterm(signum, frame):  # noqa: ARG001
    raise _Terminated


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child")
    p.add_argument("--model-dir")
    p.add_argument("--family", choices=sorted(FAMILIES), default="qwen3")
    p.add_argument("--setups", default="eager,ours,liger,compile")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument(
        "--setup-steps",
        default="",
        help='steps of some setups, e.g. "compile=6" (warm-up: at most --warmup, one less)',
    )
    p.add_argument("--data-steps", type=int, help=argparse.SUPPRESS)  # parent -> child
    p.add_argument("--batch", type=int, help="sequences per step (default: the family's)")
    p.add_argument("--seq", type=int, help="tokens per sequence (default: the family's)")
    p.add_argument("--attn", default="", help="attn_implementation (default: the family's)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend")
    p.add_argument(
        "--setup-timeout",
        default="",
        help='seconds before a setup is killed: "150", or per setup "150,compile=300"',
    )
    p.add_argument(
        "--deadline",
        type=float,
        help="seconds for the whole run: each setup's timeout is cut to what is left "
        "(less a margin for the table), and setups that no longer fit are reported, not run",
    )
    p.add_argument(
        "--heartbeat", type=float, default=30.0, help="seconds between a setup's progress lines"
    )
    p.add_argument(
        "--tiny", action="store_true", help="a model of a few tiny layers (CPU smoke test)"
    )
    p.add_argument(
        "--estimate-memory",
        action="store_true",
        help="print eager's estimated peak memory at the batch (CPU, no run) and exit",
    )
    p.add_argument("--profile", action="store_true", help="add a one-step GPU profile per setup")
    p.add_argument("--out", help="folder for train.json, train.md and train_loss.png")
    args = p.parse_args()
    family = FAMILIES[args.family]
    args.batch = args.batch or family.batch
    args.seq = args.seq or family.seq
    args.attn = args.attn or family.attn
    if args.child:
        emit_result(child(args))
        return 0
    if args.estimate_memory:
        estimate = estimate_eager_gib(args.family, args.batch, args.seq)
        print(json.dumps({"family": args.family, "batch": args.batch, "seq": args.seq, **estimate}))
        return 0
    return run_all(args, family)


# Seconds --deadline keeps back for killing the last setup and writing the table.
DEADLINE_MARGIN_S = 20.0
# A setup is not started with less than this left (it could not even load the model).
MIN_SETUP_S = 30.0


def run_all(args, family: Family) -> int:
    from bench_supervise import git_commit, log

    started = time.monotonic()
    signal.signal(signal.SIGTERM, _on_sigterm)
    setups = [x for x in args.setups.split(",") if x]
    steps_of = parse_setup_steps(args.setup_steps, setups)
    timeouts = parse_setup_timeouts(args.setup_timeout, setups)
    data_steps = max([args.steps, *steps_of.values()])
    json_name, md_name, png_name = output_names(args.family)
    out = Path(args.out) if args.out else None
    commit = git_commit(ROOT)
    log(f"{args.family}: setups {','.join(setups)} at commit {commit}")
    work = Path(tempfile.mkdtemp(prefix="bench-train-"))
    model_dir = work / "model"
    rows: list[dict] = []
    server = None
    header = ""
    setup = ""  # the setup running now

    def left() -> float:
        return (
            float("inf") if args.deadline is None else args.deadline - (time.monotonic() - started)
        )

    def write() -> None:
        if out is None:
            return
        out.mkdir(parents=True, exist_ok=True)
        (out / json_name).write_text(json.dumps(rows, indent=1))
        if header:
            text = header + "\n\n" + table(rows, args.steps, args.warmup)
            (out / md_name).write_text(text + "\n")

    try:
        log("saving the model (random init)")
        save_model(model_dir, args.tiny, args.family)
        log("starting the kernels mirror")
        server, env = start_mirror(work)
        header = run_header(args, family, commit)
        for setup in setups:
            steps = steps_of.get(setup, args.steps)
            warmup = min(args.warmup, steps - 1)
            budget = left() - DEADLINE_MARGIN_S
            timeout = min(timeouts.get(setup, timeouts.get("", float("inf"))), budget)
            if timeout < MIN_SETUP_S:
                rows.append({"setup": setup, "error": f"not run: --deadline {args.deadline:g} s "
                             f"left {max(budget, 0):.0f} s"})  # fmt: skip
                log(f"{setup}: {rows[-1]['error']}")
                write()
                continue
            cmd = [sys.executable, __file__, "--child", setup, "--model-dir", str(model_dir),
                   "--family", args.family, "--attn", args.attn,
                   "--compile-backend", args.compile_backend, "--steps", str(steps),
                   "--warmup", str(warmup), "--data-steps", str(data_steps),
                   "--batch", str(args.batch), "--seq", str(args.seq), "--device", args.device,
                   "--heartbeat", str(args.heartbeat)]  # fmt: skip
            cmd += ["--profile"] if args.profile else []
            limit = "" if timeout == float("inf") else f", killed after {timeout:.0f} s"
            log(f"{setup}: start ({steps} steps{limit})")
            t = time.perf_counter()
            rows.append(run_setup(setup, cmd, env, None if limit == "" else timeout))
            rows[-1]["wall_s"] = time.perf_counter() - t
            log(f"{setup}: done in {rows[-1]['wall_s']:.0f} s" + (
                f" - error: {rows[-1]['error']}" if "error" in rows[-1] else ""))  # fmt: skip
            write()
    except _Terminated:
        log("terminated (SIGTERM): writing what was measured")
        for s in setups[len(rows) :]:
            why = "terminated (SIGTERM) while it ran" if s == setup else "not run: terminated"
            rows.append({"setup": s, "error": why})
    finally:
        if server is not None:
            server.terminate()
        shutil.rmtree(work, ignore_errors=True)  # the saved model: up to 8 GB per family
    text = (header or run_header(args, family, commit)) + "\n\n"
    text += table(rows, args.steps, args.warmup)
    print(text, flush=True)
    write()
    if out is not None:
        plot(rows, out / png_name)
    return 0


def run_header(args, family: Family, commit: str) -> str:
    """The line above the table: when, where, versions, commit, model and run shape."""
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    shape = family.shape
    if args.tiny:
        tiny = family.config(True)
        shape = f"tiny {args.family} ({tiny.num_hidden_layers} layers, hidden {tiny.hidden_size})"
    return (
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {gpu}, host {cpu_model()} "
        f"({os.cpu_count()} CPUs), "
        + ", ".join(f"{k} {v}" for k, v in versions().items())
        + f", commit {commit}. {shape}, random init, bf16, {args.attn} attention, "
        f"batch {args.batch}x{args.seq}, AdamW{'(fused)' if args.device == 'cuda' else ''}, "
        f"{args.steps} steps."
    )


if __name__ == "__main__":
    sys.exit(main())
