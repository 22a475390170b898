"""Which of Liger's VLM patches work on this transformers: per type and configuration
(scripts/liger_vlm.py: default, no-flce, modules), does ``_apply_liger_kernel_to_instance``
(model=instance) apply, and does a tiny model (tests/models/vlm_registry.py, fp32) then run a
forward and backward on a batch with images whose loss and gradient norm match the plain model's?

Each (type, configuration) runs in its own process: Liger's patches are process-wide.

On the CPU the Triton interpreter runs Liger's RoPE, cross-entropy and fused linear
cross-entropy but not its RMSNorm, LayerNorm, SwiGLU or GeGLU kernels (triton 3.9's
interpreter fails inside them), so ``--device cpu`` turns those patches off (the table says
so) and checks what depends on transformers: the imports, the loss forward, the RoPE. On a GPU
everything Liger patches runs.

    TRITON_INTERPRET=1 python scripts/probes/probe_liger_vlm.py --device cpu --out OUT.md
    python scripts/probes/probe_liger_vlm.py --device cuda --jobs 8 --out OUT.md   # ~2 min, H200
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "glm4v_moe", "gemma3",
         "gemma4", "internvl", "llava", "paligemma", "mllama", "smolvlm", "qwen3_5",
         "qwen3_5_moe", "muse_glimmer", "llama4")  # fmt: skip
TOL = 1e-4  # fp32, relative: the sweep's match rule


def child(model_type: str, config: str, device: str) -> dict:
    import copy
    import warnings

    warnings.filterwarnings("ignore")
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
    import liger_vlm
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    from tests.models.vlm_registry import build_vlm, vlm_batches

    row = {"type": model_type, "config": config}
    try:
        plain = build_vlm(model_type).to(device).train()
    except Exception as exc:  # noqa: BLE001
        return {**row, "stage": "build", "error": liger_vlm.short_error(exc)}
    patched = copy.deepcopy(plain)
    batch = vlm_batches(plain, device, steps=1)[0]

    def step(model):
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters()
                              if p.grad is not None))  # fmt: skip
        return loss.item(), norm.item()

    try:
        ref = step(plain)
    except Exception as exc:  # noqa: BLE001 - the plain model itself fails here
        return {**row, "stage": "plain model", "error": liger_vlm.short_error(exc)}
    kwargs = liger_vlm.CPU_OFF if device == "cpu" else {}
    try:
        liger_vlm.apply(patched, config, **kwargs)
    except Exception as exc:  # noqa: BLE001
        return {**row, "stage": "patch", "error": liger_vlm.short_error(exc)}
    changed = sorted({type(m).__name__ for m in patched.modules() if "forward" in m.__dict__})
    try:
        got = step(patched)
    except Exception as exc:  # noqa: BLE001
        return {**row, "stage": "run", "error": liger_vlm.short_error(exc),
                "patched": changed}  # fmt: skip
    loss_rel = abs(got[0] - ref[0]) / abs(ref[0])
    grad_rel = abs(got[1] - ref[1]) / abs(ref[1])
    ok = loss_rel <= TOL and grad_rel <= TOL
    return {**row, "stage": "match" if ok else "mismatch", "loss_rel": loss_rel,
            "grad_rel": grad_rel, "patched": changed, "head": "forward" in patched.__dict__}  # fmt: skip


def run(types: list[str], configs: list[str], device: str, timeout: float, jobs: int) -> list:
    """Every (type, configuration) in its own process, `jobs` at a time; rows in input order."""
    from concurrent.futures import ThreadPoolExecutor

    def one(pair: tuple[str, str]) -> dict:
        model_type, config = pair
        t = time.perf_counter()
        cmd = [sys.executable, __file__, "--child", model_type, "--config", config,
               "--device", device]  # fmt: skip
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("ROW ")), None)
            if line is None:
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                tail = tail.replace(str(ROOT), "<repo>")
                row = {"type": model_type, "config": config, "stage": "crash", "error": tail[:200]}
            else:
                row = json.loads(line[4:])
        except subprocess.TimeoutExpired:
            row = {"type": model_type, "config": config, "stage": "timeout", "error": ""}
        row["wall_s"] = time.perf_counter() - t
        print(json.dumps(row), flush=True)
        return row

    pairs = [(t, c) for t in types for c in configs]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(one, pairs))


def table(rows: list[dict], device: str) -> str:
    from importlib.metadata import version

    import liger_kernel  # noqa: F401 - the version line
    import transformers

    off = (
        " Liger's RMSNorm, LayerNorm, SwiGLU and GeGLU patches off (the CPU's Triton "
        "interpreter cannot run those kernels): the rows check the imports, the loss forward "
        "and the RoPE."
        if device == "cpu"
        else ""
    )
    head = (
        f"Liger {version('liger_kernel')} VLM patches on transformers {transformers.__version__}, "
        f"{device}, tiny models (tests/models/vlm_registry.py), fp32, one forward and backward "
        f"on a batch with images; match: loss and gradient norm within {TOL:g} relative of the "
        f"plain model's.{off}\n\n"
        "| type | configuration | result | loss rel | grad rel | where it failed |\n"
        "|---|---|---|---|---|---|\n"
    )

    def fmt(r: dict, k: str) -> str:
        return f"{r[k]:.1e}" if k in r else ""

    lines = []
    for r in rows:
        where = "" if r["stage"] in ("match", "mismatch") else f"{r['stage']}: {r.get('error', '')}"
        result = r["stage"] if r["stage"] in ("match", "mismatch") else "fails"
        lines.append(f"| {r['type']} | {r['config']} | {result} | {fmt(r, 'loss_rel')} | "
                     f"{fmt(r, 'grad_rel')} | {where.replace('|', '/')} |")  # fmt: skip
    return head + "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default=",".join(TYPES))
    p.add_argument("--configs", default="default,no-flce,modules")
    p.add_argument("--device", default="cuda")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per (type, config)")
    p.add_argument("--jobs", type=int, default=1, help="processes at a time")
    p.add_argument("--out", help="markdown table (and .json next to it)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("ROW " + json.dumps(child(args.child, args.config, args.device)), flush=True)
        return 0
    rows = run(
        [t for t in args.types.split(",") if t],
        [c for c in args.configs.split(",") if c],
        args.device,
        args.timeout,
        args.jobs,
    )
    text = table(rows, args.device)
    print(text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
