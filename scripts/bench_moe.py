"""MoE experts benchmark: transformers' experts paths, Liger, torch.compile and ours, one table.

Op level (default): one experts module (fused 3-D weights, bf16) at real shapes, fwd and fwd+bwd
device time, fwd+bwd wall time (triton.testing.do_bench, L2 flushed) and the peak memory of one
fwd+bwd above what its inputs and outputs hold, through scripts/bench_harness.py. Implementations:

  eager        transformers' default per-expert loop (experts_implementation="eager")
  grouped_mm   transformers' own grouped experts (experts_implementation="grouped_mm")
  compile      torch.compile of the grouped_mm module
  liger        Liger's fused MoE (LigerFusedMoEFunction, liger-kernel >= 0.8), if installed
  ours         MoEExperts from hub_kernels/kernels-lab/training bound onto the module

Shapes: Qwen3-30B-A3B experts (E=128, top-8, H=2048, I=768, bf16 routing weights) and
Mixtral-8x7B experts (E=8, top-2, H=4096, I=14336, fp32 routing weights), 8192 and 16384 tokens;
routing from a random router's softmax top-k. `--shapes gpt_oss` adds gpt-oss-20b's experts
(E=32, top-4, H=I=2880, biases, clamped SwiGLU).

End to end (--e2e): a Qwen3-30B-A3B-shaped causal LM with --layers decoder layers (random init,
bf16, sdpa), one process per setup, AdamW steps on random tokens: tokens/s and peak memory.
Setups: eager, grouped_mm, liger-experts (Liger's experts only), liger (Liger's defaults for
qwen3_moe), ours (MoEExperts on the grouped_mm model), ours-all (MoEExperts plus this repo's
RMSNorm and RoPE layers).

    python scripts/bench_moe.py [--tokens 8192,16384] [--shapes qwen3,mixtral] [--out DIR]
    python scripts/bench_moe.py --e2e [--layers 4] [--batch 4 --seq 4096] [--steps 20] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

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


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def experts_module(family: str, e: int, k: int, h: int, i: int, impl: str):
    """A transformers experts module of `family` on the GPU in bf16, random weights."""
    import torch

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
    torch.manual_seed(0)
    with torch.device(DEVICE):
        module = Experts(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02)
    return module


def routing(tokens: int, e: int, k: int, h: int, w_dtype):
    """Inputs of one call: hidden states [T, H] (requires grad), top-k ids and weights from a
    random router (softmax, top-k, renormalised), the weights requiring grad as in training."""
    import torch

    gen = torch.Generator(device=DEVICE).manual_seed(1)
    x = torch.randn(tokens, h, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    router = torch.randn(h, e, device=DEVICE, dtype=torch.bfloat16, generator=gen) * h**-0.5
    probs = torch.softmax((x @ router).float(), dim=-1)
    w, idx = torch.topk(probs, k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(w_dtype)
    return x.requires_grad_(), idx, w.requires_grad_()


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
        return torch.compile(module)
    if name == "liger":
        if family == "gpt_oss":
            raise RuntimeError("Liger's fused MoE has no expert biases or clamped gate")
        try:
            from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
        except ImportError:  # where a release exports it from the package only
            from liger_kernel.ops import LigerFusedMoEFunction

        def call(x, idx, w):
            return LigerFusedMoEFunction.apply(
                x, module.gate_up_proj, module.down_proj, idx.to(torch.int32), w
            )

        return call
    return module


def make_impl(name: str, shape: str, tokens: int):
    """`make()` for bench_harness.Impl: (fwd, fwd_bwd) closures over fresh inputs."""

    def make():
        import torch

        e, k, h, i, wd, family = SHAPES[shape]
        module = experts_module(family, e, k, h, i, name)
        x, idx, w = routing(tokens, e, k, h, getattr(torch, wd))
        call = bind(name, module, family)
        dy = torch.randn(tokens, h, device=DEVICE, dtype=torch.bfloat16)
        params = list(module.parameters())

        def fwd():
            return call(x, idx, w)

        def fwd_bwd():
            for t in (x, w, *params):
                t.grad = None
            out = call(x, idx, w)
            out.backward(dy)
            return out

        return fwd, fwd_bwd

    return make


def accuracy(shape: str, tokens: int, impls: list[str]) -> list[str]:
    """Markdown rows: each implementation's relative error (output and every gradient) against
    the same module run in fp32 by transformers' loop, on one set of inputs."""
    import torch

    e, k, h, i, wd, family = SHAPES[shape]

    ref = experts_module(family, e, k, h, i, "eager").float()
    x, idx, w = routing(tokens, e, k, h, getattr(torch, wd))
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    dy = torch.randn(tokens, h, device=DEVICE, dtype=torch.bfloat16)
    ref(x32, idx, w32).backward(dy.float())
    want = [x32.grad, w32.grad] + [p.grad for p in ref.parameters()]
    rows = []
    for name in impls:
        try:
            module = experts_module(family, e, k, h, i, name)
            call = bind(name, module, family)
            xb, wb = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
            out = call(xb, idx, wb)
            out.backward(dy)
            got = [xb.grad, wb.grad] + [p.grad for p in module.parameters()]
            out_ref = ref(x32.detach(), idx, w32.detach())
            errs = [(out.float() - out_ref).norm() / out_ref.norm()]
            errs += [(g.float() - r).norm() / r.norm() for g, r in zip(got, want, strict=True)]
            rows.append(
                f"| {shape} T{tokens} | {name} | " + " | ".join(f"{v:.1e}" for v in errs) + " |"
            )
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported
            rows.append(f"| {shape} T{tokens} | {name} | error: {type(exc).__name__}: {exc} |")
        torch.cuda.empty_cache()
    return rows


def op_level(args) -> int:
    import torch

    checks = [
        "Relative error against the module in fp32 (transformers' loop), one input set per shape:",
        "",
        "| case | impl | output | d x | d top_k_weights | d gate_up_proj | d down_proj | (biases) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for shape in args.shapes.split(","):
        tokens = min(int(t) for t in args.tokens.split(","))
        checks += accuracy(shape, tokens, args.impls.split(","))
    if args.check_only:
        print(header("accuracy") + "\n\n" + "\n".join(checks))
        return 0
    from bench_harness import Case, Impl, dump, format_table, measure_ceilings, run_case

    ceil = measure_ceilings()
    rows = []
    for shape in args.shapes.split(","):
        e, k, h, i, _, _ = SHAPES[shape]
        for tokens in (int(t) for t in args.tokens.split(",")):
            flops = 6 * tokens * k * h * 3 * i  # fwd+bwd of the three projections per pair
            case = Case(
                op=f"moe experts ({shape})",
                shape=f"T{tokens} E{e} top{k} H{h} I{i}",
                impls=[Impl(n, make_impl(n, shape, tokens)) for n in args.impls.split(",")],
                flops_fwd_bwd=flops,
            )
            rows += run_case(case, ceil)
            print(f"{case.op} {case.shape}: done", flush=True)
            torch.cuda.empty_cache()
    text = header("op level") + "\n\n" + format_table(rows, ceil) + "\n\n" + "\n".join(checks)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        dump(rows, ceil, str(out / "moe.json"))
        (out / "moe.md").write_text(text + "\n")
    return 0


def header(what: str) -> str:
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    versions = ", ".join(
        f"{d} {_version(d)}" for d in ("torch", "triton", "transformers", "liger-kernel")
    )
    return f"{datetime.date.today()}, {gpu}, {versions}. MoE experts, {what}."


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
    from transformers import Qwen3MoeForCausalLM

    config = qwen3_moe_config(layers, tiny)
    config._experts_implementation = "eager" if setup == "eager" else "grouped_mm"
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    if setup == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3_moe

        apply_liger_kernel_to_qwen3_moe(model=model)
    elif setup == "liger-experts":
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3_moe

        apply_liger_kernel_to_qwen3_moe(
            rope=False, rms_norm=False, fused_linear_cross_entropy=False, swiglu=True, model=model
        )
    elif setup in ("ours", "ours-all"):
        import kernels
        from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping
        from transformers.models.qwen3_moe import modeling_qwen3_moe

        variant = ROOT / "hub_kernels/kernels-lab/training/build/torch-universal"
        kernels.replace_kernel_forward_from_hub(modeling_qwen3_moe.Qwen3MoeExperts, "MoEExperts")
        layers_ = {"MoEExperts": "MoEExperts"}
        if setup == "ours-all":
            layers_.update(RMSNorm="MemoryEfficientRMSNorm", rotary_pos_emb="rotary_pos_emb")
        mapping = {
            name: {device: LocalLayerRepository(variant, layer_name=layer)}
            for name, layer in layers_.items()
        }
        with use_kernel_mapping(mapping):
            kernelize(model, mode=Mode.TRAINING, device=device)
        report = kernels.last_report(model)
        bound = sum(1 for e in report if e.status == "bound" and e.layer_name == "MoEExperts")
        if bound != layers:
            raise RuntimeError(f"MoEExperts bound on {bound} of {layers} layers:\n{report}")
    model.train()
    return model


def e2e_child(args) -> dict:
    import torch

    device = args.device
    model = build_setup(args.child, args.layers, args.tiny, device)
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
    step_s = statistics.median(times[args.warmup :] or times)
    return {
        "setup": args.child,
        "step_ms": step_s * 1e3,
        "tokens_per_s": args.batch * args.seq / step_s,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        "losses": losses,
    }


def e2e(args) -> int:
    rows = []
    for setup in args.setups.split(","):
        cmd = [sys.executable, __file__, "--e2e", "--child", setup] + [
            f"--{k}={v}" for k, v in (
                ("layers", args.layers), ("batch", args.batch), ("seq", args.seq),
                ("steps", args.steps), ("warmup", args.warmup), ("device", args.device),
            )
        ] + (["--tiny"] if args.tiny else [])  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            rows.append(
                {"setup": setup, "error": (proc.stderr.strip().splitlines() or ["?"])[-1][:200]}
            )
            print(proc.stderr[-3000:], file=sys.stderr)
        else:
            rows.append(json.loads(line[7:]))
        print(f"{setup}: done", flush=True)
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
        f"random init, bf16, sdpa, batch {args.batch}x{args.seq}, AdamW(fused), {args.steps} steps"
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
    p.add_argument("--e2e", action="store_true", help="the end-to-end training run instead")
    p.add_argument("--setups", default=",".join(E2E_SETUPS), help="--e2e setups")
    p.add_argument("--layers", type=int, default=4, help="--e2e decoder layers")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="--e2e with a tiny model (smoke test)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--out", help="folder for moe.json/moe.md (or moe_e2e.json/moe_e2e.md)")
    args = p.parse_args()
    global DEVICE
    DEVICE = args.device
    if args.e2e and args.child:
        print("RESULT " + json.dumps(e2e_child(args)), flush=True)
        return 0
    if args.e2e:
        return e2e(args)
    return op_level(args)


if __name__ == "__main__":
    sys.exit(main())
