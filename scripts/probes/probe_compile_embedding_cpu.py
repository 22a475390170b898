"""Which causal LMs get the compiled input embedding (embedding.py), and whether their compiled
step still equals eager's (CPU, every type transformers lists).

For each type in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: a tiny random model (tests/models'
registry: 2 layers, the family's default attention), bound with ``kernels.apply_training_kernels``
(this tree's kernels, torch formulas inside the ops), and the kind the loader's probe set
(``kernels_input_embedding``: plain, scaled or none). For every type that has a kind: one training
step compiled with ``fullgraph=True`` and the aot_eager backend (Dynamo and AOTAutograd, no
Inductor build), against the same step eager with the kernels (same weights): whether the graph
calls ``embedding_fwd``, the loss and the largest relative gradient difference (the embedding
weight's included). Prints one table.

    python scripts/probes/probe_compile_embedding_cpu.py [--only llama,gemma2] [--jobs 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
VARIANT = ROOT / "hub_kernels/kernels-lab/training/build/torch-universal"


def compare(model, twin, ids, embed: bool) -> dict:
    """One step of `model` compiled (fullgraph, aot_eager) against `twin` eager, from fresh
    gradients; with `embed` False the loss layers leave the embedding to the decoder (the
    instance hides the probe's class attribute), as before embedding.py."""
    import torch
    from torch._dynamo.backends.debugging import aot_eager

    for m in (model, twin):
        m.zero_grad(set_to_none=True)
        if embed:
            m.__dict__.pop("kernels_input_embedding", None)
        else:
            m.kernels_input_embedding = None
    codes: list[str] = []

    def backend(gm, inputs):
        codes.append(gm.code)
        return aot_eager(gm, inputs)

    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        torch.manual_seed(1)  # the same dropout masks, where a family has dropout in training
        out = compiled(input_ids=ids, labels=ids).loss
        out.backward()
    except Exception as exc:  # noqa: BLE001 - the compile's failure is the answer
        torch._dynamo.reset()
        return {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:100]}
    torch.manual_seed(1)
    expected = twin(input_ids=ids, labels=ids).loss
    expected.backward()
    torch._dynamo.reset()
    loss, ref = out.item(), expected.item()
    worst, where, compared = 0.0, "-", 0
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        if p.grad is None or q.grad is None:
            if (p.grad is None) != (q.grad is None):
                worst, where = float("inf"), name
            continue
        compared += 1
        rel = float((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-12))
        if rel > worst:
            worst, where = rel, name
    return {
        "graphs": len(codes),
        "op in graph": any(".embedding_fwd." in c for c in codes),
        "loss rel diff": abs(loss - ref) / max(abs(ref), 1e-12),
        "gradients": compared,
        "worst grad rel diff": worst,
        "worst at": where,
    }


def off(r: dict) -> bool:
    """A compared step that is not one graph calling the op with eager's values."""
    return "error" in r or (
        r["graphs"] != 1
        or not r["op in graph"]
        or r["worst grad rel diff"] > 1e-4
        or r["loss rel diff"] > 1e-5
    )


def off_without(r: dict) -> bool:
    """Whether the step without the op is off too (no op in the graph is expected there)."""
    alone = r.get("without")
    if alone is None:
        return False
    return "error" in alone or alone["worst grad rel diff"] > 1e-4 or alone["loss rel diff"] > 1e-5


def one(model_type: str) -> dict:
    import kernels
    import torch

    from tests.models.registry import causal_lm_class, tiny_config

    config = tiny_config(model_type)  # 2 layers; the family's default attention
    torch.manual_seed(0)
    model = causal_lm_class(model_type)._from_config(config).train()
    twin = copy.deepcopy(model)
    kernels.apply_training_kernels(model)
    kernels.apply_training_kernels(twin)
    kind = getattr(model, "kernels_input_embedding", None)
    row = {"type": model_type, "kind": kind or "none"}
    if not kind:
        return row
    ids = torch.randint(3, model.config.vocab_size, (2, 12))
    row["with"] = compare(model, twin, ids, embed=True)
    if off(row["with"]):  # the same step without the op: is it the op's doing?
        row["without"] = compare(model, twin, ids, embed=False)
    return row


def child(types: list[str], rows_file: Path) -> None:
    """Measure `types` in this process, one JSON row per line appended to `rows_file`."""
    import torch

    torch.set_num_threads(1)
    for t in types:
        try:
            row = one(t)
        except Exception as exc:  # noqa: BLE001 - a type that cannot be built here is a row
            row = {"type": t, "kind": "?", "error": f"{type(exc).__name__}: {exc}"[:120]}
        with rows_file.open("a") as f:
            f.write(json.dumps(row) + "\n")


def _run_chunk(part: list[str], rows_file: Path, timeout: float) -> dict[str, dict]:
    """Rows of the types in `part`, measured by child processes (see run_all)."""
    rows: dict[str, dict] = {}
    todo = list(part)
    while todo:
        cmd = [sys.executable, __file__, "--child", ",".join(todo), "--rows", str(rows_file)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            why = f"child exited {done.returncode}: {done.stderr.strip()[-100:]}"
        except subprocess.TimeoutExpired:
            why = f"child ran past {timeout:.0f} s"
        if rows_file.exists():
            for line in rows_file.read_text().splitlines():
                row = json.loads(line)
                rows[row["type"]] = row
        left = [t for t in todo if t not in rows]
        if left:  # the first of them killed the child
            rows[left[0]] = {"type": left[0], "kind": "?", "error": why}
        todo = left[1:]
    return rows


def run_all(types: list[str], jobs: int, chunk: int = 20, timeout: float = 900.0) -> list[dict]:
    """Every type, `chunk` per child process, `jobs` children at a time; a child that dies (a
    crash, memory) costs the type it was on, which becomes an error row, and the rest of its
    chunk goes to a new child."""
    from concurrent.futures import ThreadPoolExecutor

    parts = [types[i : i + chunk] for i in range(0, len(types), chunk)]
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(jobs) as pool:
        files = [Path(tmp) / f"rows{i}.jsonl" for i in range(len(parts))]
        for found in pool.map(lambda pf: _run_chunk(*pf, timeout), zip(parts, files, strict=True)):
            rows |= found
    return [rows[t] for t in types]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="")
    p.add_argument("--out", type=Path)
    p.add_argument("--jobs", type=int, default=2, help="child processes at a time")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--rows", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    os.environ["LOCAL_KERNELS"] = f"kernels-lab/training={VARIANT}"
    if args.child:
        child(args.child.split(","), args.rows)
        return 0
    import torch
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = [t for t in args.only.split(",") if t] or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    started = time.time()
    rows = run_all(types, args.jobs)
    lines = [
        f"torch {torch.__version__}, transformers {transformers.__version__}, CPU, fp32, "
        f"{len(types)} types in {time.time() - started:.0f} s",
        "",
        "Per type with an embedding kind: one compiled step (fullgraph, aot_eager) against eager, "
        "both bound. Where that step is off, the same step without the op (the decoder embeds, "
        "as before embedding.py) says whether the op is the cause.",
        "",
        "| type | embedding kind | graphs | embedding_fwd in graph | loss rel diff "
        "| gradients compared | worst grad rel diff (parameter) | without the op |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def cells(r: dict) -> str:
        if "error" in r:
            return f"compile failed: {r['error']} | | | | |"
        return (f"{r['graphs']} | {r['op in graph']} | {r['loss rel diff']:.1e} | "
                f"{r['gradients']} | {r['worst grad rel diff']:.1e} ({r['worst at']})")  # fmt: skip

    for r in rows:
        if "error" in r:
            lines.append(f"| {r['type']} | not built: {r['error']} | | | | | | |")
        elif r["kind"] == "none":
            lines.append(f"| {r['type']} | none | | | | | | |")
        else:
            alone = r.get("without")
            if alone is None:
                other = ""
            elif "error" in alone:
                other = f"compile failed: {alone['error']}"
            else:
                other = (f"loss {alone['loss rel diff']:.1e}, grad "
                         f"{alone['worst grad rel diff']:.1e} ({alone['worst at']})")  # fmt: skip
            lines.append(f"| {r['type']} | {r['kind']} | {cells(r['with'])} | {other} |")
    kinds = [r for r in rows if r.get("kind") in ("plain", "scaled")]
    bad = [r["type"] for r in kinds if off(r["with"])]
    caused = [r["type"] for r in kinds if off(r["with"]) and not off_without(r)]
    lines += ["", f"{len(kinds)} of {len(rows)} types embed through the op. Off with the op: "
              f"{bad or 'none'}; of those, fine without it (the op's doing): {caused or 'none'}."]  # fmt: skip
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 1 if caused else 0


if __name__ == "__main__":
    raise SystemExit(main())
