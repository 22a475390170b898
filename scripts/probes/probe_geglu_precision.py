"""Which bf16 GeGLU MLP is closer to float64: transformers' plain one or ours (`GeGLUMLP`)?

    python scripts/probes/probe_geglu_precision.py                 # CUDA: the issue's two shapes
    python scripts/probes/probe_geglu_precision.py --json out.json
    python scripts/probes/probe_geglu_precision.py --dry-run       # CPU, one small shape, torch paths

A Llama-style MLP (`LlamaMLP`, hidden_act "gelu_pytorch_tanh") with unscaled N(0, 1) weights in
bf16, run three ways on the same weights, input and output gradient: plain (transformers' own
forward, autograd through nn.Linear), ours (the module's forward replaced by the training
kernels' `GeGLUMLP.forward`) and a float64 copy of the same bf16 weights and input (the
reference). For the output, dx and each weight gradient it prints the max-abs error and the
relative Frobenius error ||a - ref|| / ||ref|| of plain and of ours against float64, their
ratio (ours / plain: <= 1 means ours is as close or closer), and whether plain and ours pass
torch.allclose(atol = rtol = 1e-2) against each other (the check the issue saw fail).

A fourth run, "composed", is ours with a no-op forward hook on each projection: `GeGLUMLP` then
takes its composed path (the three nn.Linear calls eager makes, our fused gated product between
them) instead of the one-function MLP (gate and up into one buffer, one weight-gradient matmul
for both, d(x) as two rounded products added, as eager's two Linears). The "differ" columns are the fraction of elements
not bit-equal to plain's: they separate what the gated product's rounding does from what the
matmuls' decomposition does.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: bench_harness

# (batch, seq, hidden, intermediate): the shapes; the dry run's small one.
SHAPES = [(2, 2048, 2048, 4096), (9, 41, 341, 4231)]
DRY_SHAPES = [(2, 16, 64, 96)]
NAMES = ["out", "dx", "gate_proj.weight", "up_proj.weight", "down_proj.weight"]


def build_mlp(hidden: int, inter: int, dtype: torch.dtype, device: str):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    # One head: the MLP ignores attention, but the config checks hidden % heads (341 is odd).
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        hidden_act="gelu_pytorch_tanh",
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
    )
    mlp = LlamaMLP(cfg)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0.0, 1.0)  # unscaled, as in the report
    return mlp.to(device=device, dtype=dtype)


def run(mlp, x, dy) -> dict[str, torch.Tensor]:
    """Output, dx and every weight gradient of one forward + backward."""
    mlp.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = mlp(x)
    out.backward(dy)
    res = {"out": out.detach(), "dx": x.grad}
    for name in NAMES[2:]:
        res[name] = mlp.get_submodule(name.split(".")[0]).weight.grad
    return res


def errors(a: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = a.double() - ref
    return diff.abs().max().item(), (diff.norm() / ref.norm()).item()


def probe(shape, kt, device: str, seed: int = 0) -> list[dict]:
    batch, seq, hidden, inter = shape
    torch.manual_seed(seed)
    plain = build_mlp(hidden, inter, torch.bfloat16, device)
    ours = build_mlp(hidden, inter, torch.bfloat16, device)
    ours.load_state_dict(plain.state_dict())
    ours.forward = types.MethodType(kt.layers.GeGLUMLP.forward, ours)
    composed = build_mlp(hidden, inter, torch.bfloat16, device)
    composed.load_state_dict(plain.state_dict())
    composed.forward = types.MethodType(kt.layers.GeGLUMLP.forward, composed)
    for name in ("gate_proj", "up_proj", "down_proj"):  # hooks: the composed path
        composed.get_submodule(name).register_forward_hook(lambda *_: None)
    ref = build_mlp(hidden, inter, torch.float64, device)
    ref.load_state_dict({k: v.double() for k, v in plain.state_dict().items()})

    x = torch.randn(batch, seq, hidden, device=device, dtype=torch.bfloat16)
    dy = torch.randn(batch, seq, hidden, device=device, dtype=torch.bfloat16)
    r64 = run(ref, x.double(), dy.double())
    rp = run(plain, x, dy)
    del plain
    ro = run(ours, x, dy)
    rc = run(composed, x, dy)
    rows = []
    for name in NAMES:
        p_max, p_rel = errors(rp[name], r64[name])
        o_max, o_rel = errors(ro[name], r64[name])
        c_rel = errors(rc[name], r64[name])[1]
        rows.append({
            "shape": list(shape), "tensor": name,
            "plain_max_abs": p_max, "plain_rel_fro": p_rel,
            "ours_max_abs": o_max, "ours_rel_fro": o_rel,
            "ratio_rel_fro": o_rel / p_rel if p_rel else float("nan"),
            "allclose_1e-2": bool(torch.allclose(ro[name], rp[name], atol=1e-2, rtol=1e-2)),
            "ours_differ": (ro[name] != rp[name]).float().mean().item(),
            "composed_rel_fro": c_rel,
            "composed_allclose_1e-2": bool(
                torch.allclose(rc[name], rp[name], atol=1e-2, rtol=1e-2)
            ),
            "composed_differ": (rc[name] != rp[name]).float().mean().item(),
        })  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    head = (
        f"{'shape (B, T, H, I)':<22} {'tensor':<17} {'plain max':>10} {'plain rel':>10} "
        f"{'ours max':>10} {'ours rel':>10} {'ours/plain':>10} {'allclose':>8} "
        f"{'differ':>8} | {'composed rel':>12} {'allclose':>8} {'differ':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{str(tuple(r['shape'])):<22} {r['tensor']:<17} {r['plain_max_abs']:>10.3e} "
            f"{r['plain_rel_fro']:>10.3e} {r['ours_max_abs']:>10.3e} {r['ours_rel_fro']:>10.3e} "
            f"{r['ratio_rel_fro']:>10.3f} {str(r['allclose_1e-2']):>8} {r['ours_differ']:>8.2e} | "
            f"{r['composed_rel_fro']:>12.3e} {str(r['composed_allclose_1e-2']):>8} "
            f"{r['composed_differ']:>8.2e}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, one small shape (torch paths)")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.dry_run:
        device, shapes = "cpu", DRY_SHAPES
    elif torch.cuda.is_available():
        device, shapes = "cuda", SHAPES
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp64 reference is what it says
    else:
        ap.error("no CUDA device: pass --dry-run for the CPU check")
    from bench_harness import load_training_kernels

    kt = load_training_kernels()
    rows = [r for s in shapes for r in probe(s, kt, device, args.seed)]
    print(f"bf16 GeGLU MLP (gelu tanh), N(0, 1) weights, seed {args.seed}, on {device}")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
