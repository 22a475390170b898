"""MoE experts benchmark: transformers' experts paths, Liger, torch.compile and ours, one table.

Op level (default): one experts module (fused 3-D weights, bf16) at real shapes, fwd and fwd+bwd
device time, fwd+bwd wall time (triton.testing.do_bench, L2 flushed) and the peak memory of one
fwd+bwd above what its inputs and outputs hold, through scripts/bench_harness.py. Implementations:

  eager        transformers' default per-expert loop (experts_implementation="eager")
  grouped_mm   transformers' own grouped experts (experts_implementation="grouped_mm")
  compile      torch.compile of the grouped_mm module (static shapes)
  liger        Liger's fused MoE (LigerFusedMoEFunction, liger-kernel >= 0.8), if installed;
               its GEMMs on one fixed config unless --liger-autotune (tuning compiles tens of
               configs per kernel and shape: minutes)
  ours         MoEExperts from hub_kernels/kernels-lab/training bound onto the module

One set of bf16 weights per shape is drawn on the GPU and shared (the same Parameters) by every
implementation's module. Each implementation's first fwd+bwd (compile, JIT, autotune) is checked
against transformers' loop run once in fp32 on the same inputs (--no-accuracy skips it), and a
progress line on stderr reports it; each case's timings follow as it ends.

Shapes: Qwen3-30B-A3B experts (E=128, top-8, H=2048, I=768, bf16 routing weights) and
Mixtral-8x7B experts (E=8, top-2, H=4096, I=14336, fp32 routing weights), 8192 and 16384 tokens;
routing from a random router's softmax top-k. `--shapes gpt_oss` adds gpt-oss-20b's experts
(E=32, top-4, H=I=2880, biases, clamped SwiGLU).

End to end (--e2e): a Qwen3-30B-A3B-shaped causal LM with --layers decoder layers (random init,
bf16, sdpa), one process per setup, AdamW steps on random tokens: tokens/s and peak memory.
Setups: eager, grouped_mm, liger-experts (Liger's experts only), liger (Liger's defaults for
qwen3_moe), ours (MoEExperts on the grouped_mm model), ours-all (`kernels.apply_training_kernels`,
the one-line way: experts, norms, rotary and the fused loss head, from this checkout). The model is built on the GPU in bf16; each setup's progress lines
pass through, and one that runs past --setup-timeout is killed and reported.

    python scripts/bench_moe.py [--tokens 8192,16384] [--shapes qwen3,mixtral] [--out DIR]
    python scripts/bench_moe.py --e2e [--layers 4] [--batch 4 --seq 4096] [--steps 20] [--out DIR]
    python scripts/bench_moe.py --check-only --device cpu --shapes tiny --tokens 64   # smoke
    python scripts/bench_moe.py --e2e --tiny --device cpu                              # smoke
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

T0 = time.perf_counter()
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

SHAPES = {
    # name: (experts, top_k, hidden, intermediate, routing-weight dtype name, family)
    "qwen3": (128, 8, 2048, 768, "bfloat16", "qwen3_moe"),
    "mixtral": (8, 2, 4096, 14336, "float32", "mixtral"),
    # gpt-oss-20b: transposed weights, biases, clamped SwiGLU (Liger has no path for it)
    "gpt_oss": (32, 4, 2880, 2880, "bfloat16", "gpt_oss"),
    "tiny": (8, 2, 64, 32, "float32", "qwen3_moe"),  # smoke test
}
DEVICE = "cuda"  # --device cpu with --check-only --shapes tiny: a smoke test of this script
IMPLS = ["eager", "grouped_mm", "compile", "liger", "ours"]
E2E_SETUPS = ["eager", "grouped_mm", "liger-experts", "liger", "ours", "ours-all"]
# Liger's fused MoE autotunes each GEMM kernel over up to 32 configs per shape (minutes of
# compiling per shape, and a working set per candidate); 0 pins one config. Read at its import.
LIGER_TUNE_ENV = "LIGER_FUSED_MOE_AUTOTUNE"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _log(msg: str) -> None:
    """A progress line, seconds since the process started, flushed at once (a run killed by a
    time limit still shows how far it got)."""
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def _experts(family: str, e: int, k: int, h: int, i: int, impl: str):
    """transformers' experts class of `family` and a config for `impl`'s path."""
    if family == "qwen3_moe":
        from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig as Config
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as Experts

        config = Config(
            hidden_size=h, moe_intermediate_size=i, num_experts=e, num_experts_per_tok=k
        )
    elif family == "gpt_oss":
        from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig as Config
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as Experts

        config = Config(
            hidden_size=h, intermediate_size=i, num_local_experts=e, num_experts_per_tok=k
        )
    else:
        from transformers.models.mixtral.configuration_mixtral import MixtralConfig as Config
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts as Experts

        config = Config(
            hidden_size=h, intermediate_size=i, num_local_experts=e, num_experts_per_tok=k
        )
    config._experts_implementation = "eager" if impl == "eager" else "grouped_mm"
    return Experts, config


def shared_weights(family: str, e: int, k: int, h: int, i: int) -> dict:
    """One set of random bf16 expert parameters, drawn on DEVICE (never on the host: Mixtral's
    experts hold 1.4 B values), that every implementation's module of this shape shares."""
    import torch

    experts, config = _experts(family, e, k, h, i, "grouped_mm")
    with torch.device("meta"):  # names and shapes only, no storage, no init
        skeleton = experts(config)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    return {
        name: torch.nn.Parameter(
            torch.empty(p.shape, dtype=torch.bfloat16, device=DEVICE).normal_(
                0.0, 0.02, generator=gen
            )
        )
        for name, p in skeleton.named_parameters()
    }


def experts_module(family: str, e: int, k: int, h: int, i: int, impl: str, weights: dict):
    """A transformers experts module of `family` for `impl` holding `weights` (the Parameter
    objects themselves, so implementations share storage and gradients)."""
    import torch

    experts, config = _experts(family, e, k, h, i, impl)
    with torch.device("meta"):
        module = experts(config)
    for name, _ in list(module.named_parameters()):
        setattr(module, name, weights[name])
    left = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if left:  # a transformers release that adds state this script does not fill
        raise RuntimeError(f"{type(module).__name__}: no values for {left}")
    return module


def routing(tokens: int, e: int, k: int, h: int, w_dtype):
    """Inputs of one call: hidden states [T, H], top-k ids and weights from a random router
    (softmax, top-k, renormalised)."""
    import torch

    gen = torch.Generator(device=DEVICE).manual_seed(1)
    x = torch.randn(tokens, h, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    router = torch.randn(h, e, device=DEVICE, dtype=torch.bfloat16, generator=gen) * h**-0.5
    probs = torch.softmax((x @ router).float(), dim=-1)
    w, idx = torch.topk(probs, k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(w_dtype)
    dy = torch.randn(tokens, h, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    return x, idx, w, dy


def bind(name: str, module, family: str):
    """What to call for implementation `name` on `module`: f(x, top_k_index, top_k_weights)."""
    import torch

    if name == "ours":
        from bench_harness import load_training_kernels

        kt = load_training_kernels()
        reason = kt.moe.experts_supported(module)
        if reason:
            raise RuntimeError(reason)
        module.forward = kt.layers.MoEExperts.forward.__get__(module)
        return module
    if name == "compile":
        # static shapes: one compile per case, and no dynamic-shape recompile on the second shape;
        # every experts class shares transformers' forward wrapper, so the cases' compiles all
        # count against one code object's recompile limit (8 by default)
        if hasattr(torch._dynamo.config, "recompile_limit"):
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        return torch.compile(module, dynamic=False)
    if name == "liger":
        if family == "gpt_oss":
            raise RuntimeError("Liger's fused MoE has no expert biases or clamped gate")
        try:
            from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
        except ImportError:  # where a release exports it from the package only
            from liger_kernel.ops import LigerFusedMoEFunction

        _check_liger_autotune_switch()

        def call(x, idx, w):
            return LigerFusedMoEFunction.apply(
                x, module.gate_up_proj, module.down_proj, idx.to(torch.int32), w
            )

        return call
    return module


def reference(shape: str, weights: dict, x, idx, w, dy) -> list:
    """transformers' loop in fp32 on fp32 copies of `weights` and the inputs: [output, d x,
    d top_k_weights, d <each parameter>]. Run once per case; its weights are dropped after."""
    import torch

    e, k, h, i, _, family = SHAPES[shape]
    w32s = {n: type(p)(p.detach().float()) for n, p in weights.items()}
    ref = experts_module(family, e, k, h, i, "eager", w32s)
    x32 = x.detach().to(torch.float32, copy=True).requires_grad_()
    w32 = w.detach().to(torch.float32, copy=True).requires_grad_()
    out = ref(x32, idx, w32)
    out.backward(dy.float())
    return [out.detach(), x32.grad, w32.grad] + [p.grad for p in ref.parameters()]


def _rel_errors(got: list, want: list) -> list[float]:
    return [float((g.float() - r).norm() / r.norm()) for g, r in zip(got, want, strict=True)]


def make_impl(name: str, shape: str, tokens: int, state: dict, acc_rows: list[str]):
    """`make()` for bench_harness.Impl: (fwd, fwd_bwd) closures over this case's shared weights
    and inputs. make() itself runs the first fwd+bwd (compile / JIT / autotune happen there),
    checks it against the fp32 reference when the case has one, and prints a progress line."""

    def make():
        import torch

        e, k, h, i, _, family = SHAPES[shape]
        case = f"{shape} T{tokens}"
        t = time.perf_counter()
        try:
            module = experts_module(family, e, k, h, i, name, state["weights"])
            call = bind(name, module, family)
            x = state["x"].detach().clone().requires_grad_()
            w = state["w"].detach().clone().requires_grad_()
            idx, dy = state["idx"], state["dy"]
            params = list(module.parameters())

            def fwd():
                return call(x, idx, w)

            def fwd_bwd():
                for p in (x, w, *params):
                    p.grad = None
                out = call(x, idx, w)
                out.backward(dy)
                return out

            out = fwd_bwd()
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            msg = f"{case} {name}: first fwd+bwd {time.perf_counter() - t:.1f} s"
            if state.get("want") is not None:
                errs = _rel_errors([out, x.grad, w.grad] + [p.grad for p in params], state["want"])
                acc_rows.append(
                    f"| {case} | {name} | " + " | ".join(f"{v:.1e}" for v in errs) + " |"
                )
                msg += ", rel. errors " + " ".join(f"{v:.1e}" for v in errs)
            _log(msg)
            return fwd, fwd_bwd
        except Exception as exc:
            acc_rows.append(f"| {case} | {name} | error: {type(exc).__name__}: {exc} |")
            _log(f"{case} {name}: error after {time.perf_counter() - t:.1f} s: {exc!r:.200}")
            raise

    return make


def op_level(args) -> int:
    import torch

    impls = args.impls.split(",")
    acc_rows = [
        "Relative error against the module in fp32 (transformers' loop), same inputs as timed:",
        "",
        "| case | impl | output | d x | d top_k_weights | d gate_up_proj | d down_proj | (biases) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    what = "accuracy" if args.check_only else "op level"
    _log(header(what))
    if not args.check_only:
        from bench_harness import Case, Impl, dump, format_table, measure_ceilings, run_case

        ceil = measure_ceilings()
        _log(f"ceilings: copy {ceil.copy_gbps:.0f} GB/s, matmul {ceil.matmul_tflops:.0f} TFLOP/s")
    rows = []
    for shape in args.shapes.split(","):
        e, k, h, i, wd, family = SHAPES[shape]
        weights = shared_weights(family, e, k, h, i)
        for tokens in (int(t) for t in args.tokens.split(",")):
            x, idx, w, dy = routing(tokens, e, k, h, getattr(torch, wd))
            state = {"weights": weights, "x": x, "idx": idx, "w": w, "dy": dy, "want": None}
            if args.accuracy:
                t = time.perf_counter()
                state["want"] = reference(shape, weights, x, idx, w, dy)
                _log(f"{shape} T{tokens}: fp32 reference {time.perf_counter() - t:.1f} s")
            makes = {n: make_impl(n, shape, tokens, state, acc_rows) for n in impls}
            if args.check_only:
                for make in makes.values():
                    try:
                        make()
                    except Exception:  # noqa: BLE001, S110 - make() printed and recorded it
                        pass
            else:
                case = Case(
                    op=f"moe experts ({shape})",
                    shape=f"T{tokens} E{e} top{k} H{h} I{i}",
                    impls=[Impl(n, m) for n, m in makes.items()],
                    # fwd+bwd of the three projections per (token, expert) pair
                    flops_fwd_bwd=6 * tokens * k * h * 3 * i,
                )
                t = time.perf_counter()
                case_rows = run_case(case, ceil, rounds=args.rounds)
                rows += case_rows
                for r in case_rows:
                    _log(
                        f"{shape} T{tokens} {r['impl']}: "
                        + (
                            f"error {r['error']}"
                            if "error" in r
                            else f"fwd {r['fwd_ms']:.3f} ms, fwd+bwd {r['fwd_bwd_ms']:.3f} ms"
                        )
                    )
                _log(f"{shape} T{tokens}: timed in {time.perf_counter() - t:.1f} s")
                if args.out:  # what is done so far survives a run that is cut short
                    Path(args.out).mkdir(parents=True, exist_ok=True)
                    dump(rows, ceil, str(Path(args.out) / "moe.json"))
            state.clear()
            del x, idx, w, dy, makes
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
        del weights
    if not args.accuracy:
        acc_rows = ["(accuracy not checked: --no-accuracy)"]
    if args.check_only:
        print(header(what) + "\n\n" + "\n".join(acc_rows), flush=True)
        return 0
    text = header(what) + "\n\n" + format_table(rows, ceil) + "\n\n" + "\n".join(acc_rows)
    print(text, flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        dump(rows, ceil, str(out / "moe.json"))
        (out / "moe.md").write_text(text + "\n")
    _log("done")
    return 0


def header(what: str) -> str:
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    versions = ", ".join(
        f"{d} {_version(d)}" for d in ("torch", "triton", "transformers", "liger-kernel")
    )
    tune = os.environ.get(LIGER_TUNE_ENV, "1") not in ("0", "false", "no")
    liger = "autotuned" if tune else f"one fixed config per kernel ({LIGER_TUNE_ENV}=0)"
    return (
        f"{datetime.date.today()}, {gpu}, {versions}. MoE experts, {what}. "
        f"Liger's fused MoE GEMMs: {liger}."
    )


def _check_liger_autotune_switch() -> None:
    """Say so where the installed Liger predates its autotune switch: its fused MoE then tunes
    every GEMM kernel over tens of configs per shape (minutes), whatever the environment says."""
    import importlib

    try:
        kernels = importlib.import_module("liger_kernel.ops.fused_moe_kernels")
    except ImportError:
        return
    if os.environ.get(LIGER_TUNE_ENV) == "0" and not getattr(kernels, "_AUTOTUNE_DISABLED", False):
        _log(f"warning: this Liger ignores {LIGER_TUNE_ENV}=0; its autotune runs")


# --------------------------------------------------------------------------- end to end


def qwen3_moe_config(layers: int, tiny: bool):
    from transformers import Qwen3MoeConfig

    if tiny:
        return Qwen3MoeConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_experts=8, num_experts_per_tok=2,
        )  # fmt: skip
    return Qwen3MoeConfig(  # Qwen3-30B-A3B's shape, fewer layers
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, max_position_embeddings=40960, tie_word_embeddings=False,
    )  # fmt: skip


def build_setup(setup: str, layers: int, tiny: bool, device: str):
    """The model of `setup` in train mode, patched the way that setup's users do it."""
    import torch
    from bench_harness import TRAINING_VARIANT
    from transformers import AutoModelForCausalLM

    config = qwen3_moe_config(layers, tiny)
    config._experts_implementation = "eager" if setup == "eager" else "grouped_mm"
    torch.manual_seed(0)
    # built and initialised on the device, in bf16 from the start: no host copy and no fp32
    # intermediate of the ~3 B parameters (4 layers of 128 experts plus the 152k vocabulary)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    if setup == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3_moe

        apply_liger_kernel_to_qwen3_moe(model=model)
    elif setup == "liger-experts":
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3_moe

        apply_liger_kernel_to_qwen3_moe(
            rope=False, rms_norm=False, fused_linear_cross_entropy=False, swiglu=True, model=model
        )
    elif setup == "ours":
        import kernels
        from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping
        from transformers.models.qwen3_moe import modeling_qwen3_moe

        kernels.replace_kernel_forward_from_hub(modeling_qwen3_moe.Qwen3MoeExperts, "MoEExperts")
        mapping = {
            "MoEExperts": {device: LocalLayerRepository(TRAINING_VARIANT, layer_name="MoEExperts")}
        }
        with use_kernel_mapping(mapping):
            kernelize(model, mode=Mode.TRAINING, device=device)
        _check_bound(kernels.last_report(model), {"MoEExperts": layers})
    elif setup == "ours-all":
        # The one-line way a user binds every training kernel the model can take (experts,
        # norms, rotary, the fused loss head), served from this checkout's variant folder.
        import kernels

        os.environ["LOCAL_KERNELS"] = f"kernels-lab/training={TRAINING_VARIANT}"
        report = kernels.apply_training_kernels(model)
        _check_bound(report, {"MoEExperts": layers, "MoEForCausalLM": 1})
    model.train()
    return model


def _check_bound(report, want: dict[str, int]) -> None:
    """Refuse a run where a layer of `want` did not bind as many times as it says."""
    for name, count in want.items():
        bound = sum(1 for e in report if e.status == "bound" and e.layer_name == name)
        if bound != count:
            raise RuntimeError(f"{name} bound {bound} times, expected {count}:\n{report}")
    print("bound: " + ", ".join(sorted({e.layer_name for e in report if e.status == "bound"})),
          file=sys.stderr, flush=True)  # fmt: skip


def e2e_child(args) -> dict:
    import torch

    device = args.device
    t = time.perf_counter()
    model = build_setup(args.child, args.layers, args.tiny, device)
    if device == "cuda":
        torch.cuda.synchronize()
    _log(f"built in {time.perf_counter() - t:.1f} s")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    gen = torch.Generator().manual_seed(1234)
    vocab = model.config.vocab_size
    batches = torch.randint(0, vocab, (args.steps, args.batch, args.seq), generator=gen)
    losses, times = [], []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.steps):
        ids = batches[step].to(device)
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        losses.append(float(loss.detach()))
        if step == 0 or step == args.steps - 1:
            _log(f"step {step + 1}/{args.steps}: {times[-1] * 1e3:.0f} ms, loss {losses[-1]:.4f}")
    step_s = statistics.median(times[args.warmup :] or times)
    return {
        "setup": args.child,
        "step_ms": step_s * 1e3,
        "tokens_per_s": args.batch * args.seq / step_s,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        "losses": losses,
    }


def run_child(setup: str, cmd: list[str], timeout_s: float) -> dict:
    """Run one setup's process, passing its output lines through as they come, and
    return its RESULT, or an error row with the last line it wrote (a crash, or the timeout)."""
    t = time.perf_counter()
    # one pipe for both streams: a child that fills an unread pipe would block
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    result = None
    killed = threading.Event()

    def kill() -> None:  # a hung or endlessly tuning setup
        killed.set()
        proc.kill()

    timer = threading.Timer(timeout_s, kill)
    timer.start()
    try:
        for line in proc.stdout:
            if "RESULT " in line:  # after a partial line (a progress bar) too
                result = line[line.index("RESULT ") + 7 :]
                continue
            tail = (tail + [line.rstrip()])[-40:]
            print(f"  {setup}: {line.rstrip()}", file=sys.stderr, flush=True)
        proc.wait()
    finally:
        timer.cancel()
    if result is not None:
        row = json.loads(result)
    elif killed.is_set():
        row = {"setup": setup, "error": f"killed after --setup-timeout {timeout_s:.0f} s"}
    else:
        row = {"setup": setup, "error": (tail or ["?"])[-1][:200]}
    _log(f"{setup}: done in {time.perf_counter() - t:.0f} s" + (
        f" ({row['error']})" if "error" in row else f", {row['step_ms']:.0f} ms/step"
    ))  # fmt: skip
    return row


def e2e(args) -> int:
    _log(header("end to end") + f" Setups: {args.setups}.")
    rows = []
    for setup in args.setups.split(","):
        cmd = [sys.executable, __file__, "--e2e", "--child", setup] + [
            f"--{k}={v}" for k, v in (
                ("layers", args.layers), ("batch", args.batch), ("seq", args.seq),
                ("steps", args.steps), ("warmup", args.warmup), ("device", args.device),
            )
        ] + (["--tiny"] if args.tiny else [])  # fmt: skip
        rows.append(run_child(setup, cmd, args.setup_timeout))
        if args.out:  # what is done so far survives a run that is cut short
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "moe_e2e.json").write_text(json.dumps(rows, indent=1))
    ref = next((r for r in rows if r["setup"] == "grouped_mm" and "error" not in r), None)
    lines = [
        f"| setup | step (median of steps {args.warmup + 1}-{args.steps}) | tokens/s | peak memory "
        "| max abs loss diff vs grouped_mm | final loss |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['setup']} | error: {r['error']} | | | | |")
            continue
        diff = ""
        if ref is not None and r is not ref:
            diff = f"{max(abs(a - b) for a, b in zip(r['losses'], ref['losses'], strict=True)):.4f}"
        peak = f"{r['peak_gib']:.1f} GiB" if r.get("peak_gib") is not None else "n/a"
        lines.append(
            f"| {r['setup']} | {r['step_ms']:.0f} ms | {r['tokens_per_s'] / 1e3:.1f} k | {peak} "
            f"| {diff} | {r['losses'][-1]:.4f} |"
        )
    what = (
        f"end to end: Qwen3-30B-A3B shape{' (tiny)' if args.tiny else ''}, {args.layers} layers, "
        f"random init, bf16, sdpa, batch {args.batch}x{args.seq}, "
        f"AdamW{'(fused)' if args.device == 'cuda' else ''}, {args.steps} steps"
    )
    text = header(what) + "\n\n" + "\n".join(lines)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "moe_e2e.json").write_text(json.dumps(rows, indent=1))
        (out / "moe_e2e.md").write_text(text + "\n")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="qwen3,mixtral", help="of: " + ",".join(SHAPES))
    p.add_argument("--tokens", default="8192,16384")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--check-only", action="store_true", help="only the accuracy table")
    p.add_argument(
        "--no-accuracy", dest="accuracy", action="store_false",
        help="skip the fp32 reference (one fp32 run of transformers' loop per case)",
    )  # fmt: skip
    p.add_argument("--rounds", type=int, default=3, help="timing rounds per case")
    p.add_argument(
        "--liger-autotune", action="store_true",
        help=f"let Liger's fused MoE autotune (minutes per shape); default {LIGER_TUNE_ENV}=0",
    )  # fmt: skip
    p.add_argument("--e2e", action="store_true", help="the end-to-end training run instead")
    p.add_argument("--setups", default=",".join(E2E_SETUPS), help="--e2e setups")
    p.add_argument("--layers", type=int, default=4, help="--e2e decoder layers")
    p.add_argument("--batch", type=int, help="--e2e: default 4 (--tiny: 2)")
    p.add_argument("--seq", type=int, help="--e2e: default 4096 (--tiny: 128)")
    p.add_argument("--steps", type=int, help="--e2e: default 20 (--tiny: 4)")
    p.add_argument(
        "--warmup", type=int, help="--e2e: steps left out of the median, default 5 (--tiny: 1)"
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="--e2e with a tiny model (smoke test)")
    p.add_argument("--setup-timeout", type=float, default=300, help="--e2e: seconds per setup")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--out", help="folder for moe.json/moe.md (or moe_e2e.json/moe_e2e.md)")
    args = p.parse_args()
    global DEVICE
    DEVICE = args.device
    # before anything imports Liger (the e2e children inherit it); an explicit value is kept
    if args.liger_autotune:
        os.environ[LIGER_TUNE_ENV] = "1"
    else:
        os.environ.setdefault(LIGER_TUNE_ENV, "0")
    # --tiny is a smoke test of the script (a CPU run through Triton's interpreter): small batch
    for name, full, tiny in (
        ("batch", 4, 2),
        ("seq", 4096, 128),
        ("steps", 20, 4),
        ("warmup", 5, 1),
    ):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    if args.e2e and args.child:
        print("RESULT " + json.dumps(e2e_child(args)), flush=True)
        return 0
    if args.e2e:
        return e2e(args)
    return op_level(args)


if __name__ == "__main__":
    sys.exit(main())
