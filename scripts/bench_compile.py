"""torch.compile and the training kernels together: every setup of every model shape in one run.

Setups (each in its own process; the same random init and token batches within a shape):
  liger                      Liger's per-instance patch with its defaults (when importable)
  ours                       eager with this package's kernels: kernels.apply_training_kernels
  compile                    torch.compile(model), default mode, no kernels
  ours-compile               the kernels bound, then torch.compile(model) (default mode)
  ours-compile-max-autotune  the same with mode="max-autotune-no-cudagraphs"
  ours-compile-cudagraphs    the same with mode="reduce-overhead" (CUDA graphs)
  eager                      transformers as is (not in the default list: --setups adds it)

Shapes (--runs): Qwen3-0.6B (every layer) at 8 x 2048, 1 x 2048 and 32 x 512 tokens; Llama-3-8B
(4 of its layers, full width and vocabulary) at 4 x 2048; Gemma-3-1B text (every layer) at
4 x 2048; Qwen3-30B-A3B (4 layers: 128 experts, top 8) at 4 x 2048. Random init, bf16, sdpa,
AdamW(fused); --warmup steps, then the median step of the rest: tokens/s, peak memory over the
timed steps (and over the whole run, compiling and tuning included), the first step's time
(compile and tuning), the graphs Dynamo compiled and its graph breaks.

The kernels load offline from this checkout (LOCAL_KERNELS=kernels-lab/training=<variant>, as
scripts/bench_moe.py does): nothing is downloaded. Each run writes compile.json and compile.md
(date, GPU, host CPU, versions, commit, then one table per shape with every setup's tokens/s
and peak memory against eager + kernels and against torch.compile) after every setup.

    python scripts/bench_compile.py --out DIR                       # everything (GPU)
    python scripts/bench_compile.py --runs qwen3-8x2048,qwen3-1x2048 --setups ours,compile,ours-compile --out DIR
    python scripts/bench_compile.py --smoke                         # tiny shapes, CPU, seconds

--rounds N runs the setup list N times, each round in the reverse order of the one before
(ours, ours-compile, ... then ..., ours-compile, ours): an H200 held at its power cap runs its
clock 1.5-1.75 GHz from one minute to the next, so a setup that always runs after another can
look slower for its turn alone. Each shape's table then gives the median over the rounds (the
largest peak) and every round's tokens/s.

--smoke runs tiny models on the CPU with the aot_eager backend (Dynamo and AOTAutograd, no
Inductor build; the modes are labels there) to test the plumbing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parent.parent
VARIANT = ROOT / "hub_kernels/kernels-lab/training/build/torch-universal"
# setup -> (kernels bound, torch.compile mode or None for no compile)
SETUPS = {
    "eager": (False, None),
    "liger": (False, None),
    "ours": (True, None),
    "compile": (False, "default"),
    "ours-compile": (True, "default"),
    # the same without the residual-add fusion pass (compile_fusion.py): its A/B
    "ours-compile-nofuse": (True, "default"),
    "ours-compile-max-autotune": (True, "max-autotune-no-cudagraphs"),
    "ours-compile-cudagraphs": (True, "reduce-overhead"),
}
DEFAULT_SETUPS = [s for s in SETUPS if s not in ("eager", "ours-compile-nofuse")]


@dataclass(frozen=True)
class Run:
    """A model shape: transformers model type, config overrides, batch, sequence, layers kept
    (None: every layer)."""

    model_type: str
    config: dict
    batch: int
    seq: int
    shape: str


QWEN3_06B = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True,
)  # fmt: skip
LLAMA3_8B_4L = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=500_000.0, tie_word_embeddings=False,
)  # fmt: skip
GEMMA3_1B = dict(
    vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
    num_attention_heads=4, num_key_value_heads=1, head_dim=256,
    hidden_activation="gelu_pytorch_tanh", max_position_embeddings=32768, rms_norm_eps=1e-6,
    query_pre_attn_scalar=256, sliding_window=512, tie_word_embeddings=True,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
    },
)  # fmt: skip
QWEN3_30B_A3B_4L = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6,
    rope_theta=1_000_000.0, max_position_embeddings=40960, tie_word_embeddings=False,
)  # fmt: skip
RUNS = {
    "qwen3-8x2048": Run("qwen3", QWEN3_06B, 8, 2048, "Qwen3-0.6B (28 layers)"),
    "qwen3-1x2048": Run("qwen3", QWEN3_06B, 1, 2048, "Qwen3-0.6B (28 layers)"),
    "qwen3-32x512": Run("qwen3", QWEN3_06B, 32, 512, "Qwen3-0.6B (28 layers)"),
    "llama3-8b-4l": Run("llama", LLAMA3_8B_4L, 4, 2048, "Llama-3-8B (4 of 32 layers)"),
    "gemma3-1b": Run("gemma3_text", GEMMA3_1B, 4, 2048, "Gemma-3-1B text (26 layers)"),
    "qwen3-moe-4l": Run("qwen3_moe", QWEN3_30B_A3B_4L, 4, 2048, "Qwen3-30B-A3B (4 of 48 layers)"),
}
# --smoke: the same families, tiny, on the CPU
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
TINY_EXTRA = {
    "gemma3_text": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "qwen3_moe": dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2),
}


def config_of(run: Run, smoke: bool):
    """The run's config; with `smoke`, the family's tiny one (2 layers, hidden 64)."""
    from transformers import AutoConfig

    if smoke:
        return AutoConfig.for_model(run.model_type, **TINY, **TINY_EXTRA.get(run.model_type, {}))
    return AutoConfig.for_model(run.model_type, **run.config)


def build(setup: str, run: Run, device: str, smoke: bool):
    """The model of `setup` on `device`, random init (seed 0), bf16, train mode, patched the
    way that setup's users do it; (model, bound layer counts or None)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = config_of(run, smoke)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    model.train()
    bound = None
    if setup == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    elif SETUPS[setup][0]:
        import kernels

        if setup == "ours-compile-nofuse":  # read by the kernels when the first norm is traced
            os.environ["KERNELS_COMPILE_FUSION"] = "0"

        report = kernels.apply_training_kernels(model)
        bound = {}
        for e in report:
            if e.status == "bound":
                bound[e.layer_name] = bound.get(e.layer_name, 0) + 1
    return model, bound


def child(args) -> dict:
    """One setup at one shape in this process: the RESULT row."""
    import bench_supervise

    watch = bench_supervise.Watchdog(args.child, args.heartbeat)
    watch.phase("import torch")
    import torch
    from torch._dynamo.utils import counters

    run = RUNS[args.run]
    device = "cpu" if args.smoke else "cuda"
    batch, seq = (2, 16) if args.smoke else (run.batch, run.seq)
    watch.phase("build")
    t = time.perf_counter()
    model, bound = build(args.child, run, device, args.smoke)
    build_s = time.perf_counter() - t
    watch.say(f"built in {build_s:.1f} s" + (f", bound {bound}" if bound else ""))
    mode = SETUPS[args.child][1]
    step_model = model
    if mode is not None:
        if args.smoke:  # Dynamo and AOTAutograd only: Inductor's C++ build takes minutes here
            step_model = torch.compile(model, backend="aot_eager")
        else:
            step_model = torch.compile(model, mode=None if mode == "default" else mode)
    cudagraphs = mode == "reduce-overhead"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    gen = torch.Generator().manual_seed(1234)
    batches = torch.randint(0, model.config.vocab_size, (args.steps, batch, seq), generator=gen)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    steady_peak = None
    for step in range(args.steps):
        watch.phase(f"step {step + 1}" + (" (compiles)" if mode and step == 0 else ""))
        if step == args.warmup and cuda:  # the timed steps' own peak from here
            steady_peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        ids = batches[step].to(device, non_blocking=True)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        if cudagraphs:  # a new iteration: the graphs' outputs of the last one may be reused
            torch.compiler.cudagraph_mark_step_begin()
        loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        losses.append(float(loss.detach()))
        watch.say(f"step {step + 1}/{args.steps} {times[-1]:.2f} s, loss {losses[-1]:.4f}")
    watch.phase("")
    timed = times[args.warmup :] or times
    step_s = statistics.median(timed)
    peak = run_peak = None
    if cuda:
        peak = torch.cuda.max_memory_allocated() / 2**30
        run_peak = max(peak, (steady_peak or 0) / 2**30)
    return {
        "setup": args.child,
        "run": args.run,
        "shape": f"tiny {run.model_type} (2 layers, hidden 64)" if args.smoke else run.shape,
        "batch": batch,
        "seq": seq,
        "mode": mode,
        "build_s": build_s,
        "first_step_s": times[0],
        "warmup_s": sum(times[: args.warmup]),
        "step_ms": step_s * 1e3,
        "tokens_per_s": batch * seq / step_s,
        "peak_gib": peak,
        "run_peak_gib": run_peak,
        "losses": losses,
        "graphs": counters["stats"]["unique_graphs"] if mode else None,
        "graph_breaks": sum(counters["graph_break"].values()) if mode else None,
        "bound": bound,
    }


def verdict(row: dict, ours: dict | None, compiled: dict | None) -> str:
    """For a compile + kernels row: "met" when its tokens/s is at least eager + kernels' and
    torch.compile's and its timed peak (under reduce-overhead, its whole run's) at most
    eager + kernels' + 5 %; else what misses."""
    if not row["setup"].startswith("ours-compile") or ours is None or "error" in row:
        return ""
    miss = []
    best = max(r["tokens_per_s"] for r in (ours, compiled) if r is not None)
    if row["tokens_per_s"] < best:
        miss.append(f"tokens/s {row['tokens_per_s'] / best:.2f}x the better of ours, compile")
    # Under CUDA graphs the replays allocate nothing: their pool was allocated while recording,
    # in the warm-up, so only the whole run's peak counts the memory they use; it is then set
    # against eager + kernels' whole-run peak too.
    key = "run_peak_gib" if row.get("mode") == "reduce-overhead" else "peak_gib"
    peak, base = row.get(key) or row.get("peak_gib"), ours.get(key) or ours.get("peak_gib")
    if peak and base and peak > 1.05 * base:
        miss.append(f"peak {peak / base:.2f}x ours")
    return "; ".join(miss) or "met"


def merge_rounds(rows: list[dict]) -> list[dict]:
    """One row per setup, in first-seen order: over the rounds that measured it, the median
    tokens/s and step time and the largest peaks, with every round's tokens/s in `per_round`;
    an error row only where no round measured the setup."""
    by_setup: dict[str, list[dict]] = {}
    for r in rows:
        by_setup.setdefault(r["setup"], []).append(r)
    merged = []
    for tries in by_setup.values():
        ok = [r for r in tries if "error" not in r]
        if not ok:
            merged.append(tries[-1])
            continue
        row = dict(ok[0])
        if len(tries) > 1:
            row["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in ok)
            row["step_ms"] = statistics.median(r["step_ms"] for r in ok)
            for key in ("peak_gib", "run_peak_gib"):
                vals = [r[key] for r in ok if r.get(key) is not None]
                row[key] = max(vals) if vals else None
            row["per_round"] = [
                f"{r['tokens_per_s'] / 1e3:.1f} k" if "error" not in r else "error" for r in tries
            ]
        merged.append(row)
    return merged


def table(rows: list[dict], run: str) -> str:
    mine = merge_rounds([r for r in rows if r["run"] == run])
    rounds = any("per_round" in r for r in mine)
    ok = {r["setup"]: r for r in mine if "error" not in r}
    ours, compiled = ok.get("ours"), ok.get("compile")
    spec = next(iter(ok.values()), None) or vars(RUNS[run])  # the shape the children ran
    lines = [
        f"### {run}: {spec['shape']}, batch {spec['batch']} x {spec['seq']}",
        "",
        "| setup | tokens/s | step ms | peak GiB (timed / whole run) | first step s | graphs, "
        "breaks | tokens/s vs ours, vs compile | target (compile + kernels) |"
        + (" tokens/s per round |" if rounds else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|" if rounds else ""),
    ]
    for r in mine:
        if "error" in r:
            lines.append(f"| {r['setup']} | error: {str(r['error'])[:200]} |||||||")
            continue
        peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.1f} / {r['run_peak_gib']:.1f}"
        graphs = "" if r["graphs"] is None else f"{r['graphs']}, {r['graph_breaks']}"
        rel = " , ".join(
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
            for base in (ours, compiled)
        )
        lines.append(
            f"| {r['setup']} | {r['tokens_per_s'] / 1e3:.1f} k | {r['step_ms']:.0f} | {peak} | "
            f"{r['first_step_s']:.1f} | {graphs} | {rel} | {verdict(r, ours, compiled)} |"
            + (f" {', '.join(r.get('per_round', []))} |" if rounds else "")
        )
    return "\n".join(lines)


def header(args) -> str:
    from bench_supervise import run_environment

    return (
        run_environment(ROOT) + f". Random init, bf16, sdpa, AdamW(fused), {args.steps} "
        f"steps, median of steps {args.warmup + 1}-{args.steps}"
        + (" (--smoke: tiny models on the CPU, aot_eager)" if args.smoke else "")
        + "."
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--run", help=argparse.SUPPRESS)
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--setups", default=",".join(DEFAULT_SETUPS))
    p.add_argument("--steps", type=int, default=18)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--rounds", type=int, default=1, help="the setups N times, order alternating")
    p.add_argument("--setup-timeout", type=float, default=900.0, help="seconds per setup")
    p.add_argument(
        "--deadline",
        type=float,
        help="seconds for the whole run: each setup's timeout is cut to what is left, and "
        "setups that no longer fit are reported as not run (results are written as they come)",
    )
    p.add_argument("--heartbeat", type=float, default=30.0)
    p.add_argument("--smoke", action="store_true", help="tiny models on the CPU (plumbing test)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.smoke and args.runs == ",".join(RUNS):
        args.runs, args.steps, args.warmup = "qwen3-8x2048", 3, 1
    os.environ["LOCAL_KERNELS"] = f"kernels-lab/training={VARIANT}"
    if args.child:
        from bench_train import emit_result

        emit_result(child(args))
        return 0
    return run_all(args)


class _Terminated(Exception):
    """SIGTERM: stop, kill the running setup's process, keep what was measured."""


def _on_sigterm(signum, frame):  # noqa: ARG001
    raise _Terminated


def run_all(args) -> int:
    from bench_supervise import log
    from bench_train import run_setup

    runs = [r for r in args.runs.split(",") if r]
    setups = [s for s in args.setups.split(",") if s]
    for name in runs + setups:
        if name not in RUNS and name not in SETUPS:
            raise SystemExit(
                f"unknown run or setup {name!r}: runs {list(RUNS)}, setups {list(SETUPS)}"
            )
    try:
        import liger_kernel  # noqa: F401

        have_liger = True
    except ImportError:
        have_liger = False
    top = header(args)
    rows: list[dict] = []

    def write() -> str:
        text = top + "\n\n" + "\n\n".join(table(rows, r) for r in runs) + "\n"
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "compile.json").write_text(json.dumps(rows, indent=1))
            (args.out / "compile.md").write_text(text)
        return text

    env = dict(os.environ, LOCAL_KERNELS=f"kernels-lab/training={VARIANT}")
    started = time.monotonic()
    signal.signal(signal.SIGTERM, _on_sigterm)  # an outer `timeout`: the child is killed too
    turns = [(run, i, setup) for run in runs for i in range(args.rounds)
             for setup in (setups if i % 2 == 0 else setups[::-1])]  # fmt: skip
    for run, rnd, setup in turns:
        if setup == "liger" and not have_liger:
            rows.append({"setup": setup, "run": run, "error": "liger_kernel not importable"})
            continue
        timeout = args.setup_timeout
        if args.deadline is not None:
            timeout = min(timeout, args.deadline - (time.monotonic() - started) - 10)
            if timeout < 60:
                rows.append({"setup": setup, "run": run, "error": "not run: --deadline"})
                continue
        cmd = [sys.executable, __file__, "--child", setup, "--run", run,
               "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--heartbeat", str(args.heartbeat)] + (["--smoke"] if args.smoke else [])  # fmt: skip
        log(f"{run} / {setup}: start")
        try:
            row = run_setup(setup, cmd, env, timeout)
        except _Terminated:
            rows.append({"setup": setup, "run": run, "error": "terminated while it ran"})
            print(write())
            return 1
        row.setdefault("run", run)
        row["round"] = rnd + 1
        rows.append(row)
        log(f"{run} / {setup}: " + (row.get("error") or f"{row['tokens_per_s']:.0f} tokens/s"))
        write()
    print(write())
    return 0


if __name__ == "__main__":
    sys.exit(main())
