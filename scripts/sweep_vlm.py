"""Sweep every image-text-to-text model type transformers registers through the training
kernels, with images in the batches.

For each type in ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``: a tiny random VLM (text and
vision towers shrunk: tests/models/vlm_registry.py), three batches with images as the family's
processor makes them (pixels, the image token once per image feature, grids and position inputs),
3 AdamW steps of a plain copy and of a copy after ``kernels.apply_training_kernels(model)``,
compared as the causal-LM sweep compares them (fp32: 1e-4 relative; bf16: against float64).
The workers, time limits and deadline are scripts/sweep_models.py's (``--kind vlm``).

Runs in pieces: each type's row is appended to ``--out-jsonl`` as it finishes, ``--resume``
skips the types already there, ``--types`` picks some, and the table (``--out``) is written from
every row of the JSONL (the last per type), so pieces run at different times make one table.

    python scripts/sweep_vlm.py                               # CPU fp32, every type
    nice -n 10 python scripts/sweep_vlm.py --types qwen2_5_vl,llava --resume
    python scripts/sweep_vlm.py --table-only                  # the table from the JSONL alone
    python scripts/sweep_vlm.py --device cuda --dtype bf16 --jobs 8 \\
        --out docs/models-vlm-h200.md --out-jsonl docs/models-vlm-h200.jsonl
    PYTHONPATH=<liger> python scripts/sweep_vlm.py --liger-probe   # what Liger patches, per type
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import sweep_models  # noqa: E402

LIGER_JSON = ROOT / "tests" / "models" / "liger_vlm_patches.json"
NORMS = sweep_models.NORMS
HEADS = sweep_models.HEADS
MLPS = {"SwiGLUMLP", "GeGLUMLP", "FusedSwiGLUMLP", "FusedGeGLUMLP", "ScaledSwiGLUMLP",
        "ReLUSquaredMLP", "GELUMLP", "GELUNormMLP", "MoEExperts"}  # fmt: skip


def vlm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return list(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def read_jsonl(path: Path) -> dict:
    """The last row per model type of a sweep's JSONL: {type: (Outcome, commit)}."""
    from tests.models.registry import Outcome

    rows: dict = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                commit = row.pop("commit", "")
                rows[row["model_type"]] = (Outcome(**row), commit)
    return rows


def binds_text(o) -> bool:
    """The type's text model binds a norm and an MLP (or experts), and the loss head binds."""
    d = o.details
    text, head = set(d.get("text_bound", ())), set(d.get("head_bound", ()))
    return bool(NORMS & text) and bool(MLPS & text) and bool(HEADS & head)


# Where Liger 0.8.5's apply function raises on transformers 5.24 before it patches anything (its
# loss forward imports an output class this transformers does not have), what its source would
# patch on the model instance with its defaults (monkey_patch.py, apply_liger_kernel_to_*): the
# rows compare our binding with that.
LIGER_INTENDED = {
    # rms_norm: text norms and (instance) the vision blocks' norm1/norm2 (LayerNorm); swiglu:
    # Qwen2MLP; rope: assigns apply_multimodal_rotary_pos_emb, which 5.24's modeling file no
    # longer calls (its text rotary is apply_rotary_pos_emb)
    "qwen2_vl": {"classes": ["LayerNorm", "Qwen2MLP", "Qwen2VLRMSNorm"], "head": True},
    # rms_norm: text norms and the vision blocks' norm1/norm2; swiglu: Qwen2MLP (text only)
    "qwen2_5_vl": {"classes": ["Qwen2MLP", "Qwen2_5_VLRMSNorm"], "head": True},
    # rms_norm: text norms and q/k norms; rope: both rotary functions; swiglu defaults to False
    "qwen3_vl": {
        "classes": ["Qwen3VLTextRMSNorm"],
        "functions": ["apply_rotary_pos_emb", "apply_rotary_pos_emb_vision"],
        "head": True,
    },
    # rms_norm: vision and text norms; swiglu: experts, shared and dense MLPs, the vision MLP
    "glm4v_moe": {
        "classes": [
            "Glm4vMoeRMSNorm", "Glm4vMoeTextExperts", "Glm4vMoeTextMLP", "Glm4vMoeTextRMSNorm",
            "Glm4vMoeisionMlp",
        ],
        "head": True,
    },
}  # fmt: skip


def liger_row(o, patches: dict | None) -> tuple[str, bool | None]:
    """(the Liger column's text, whether we bind at least what Liger patches; None when Liger
    does not know the type). Where Liger's patch raises here, its source's intended patch
    (LIGER_INTENDED) is what we are compared with."""
    if patches is None:
        return "", None
    prefix = ""
    if patches.get("error") and not (patches.get("classes") or patches.get("functions")):
        intended = LIGER_INTENDED.get(o.model_type)
        prefix = f"raises on this transformers ({patches['error'][:90]})"
        if intended is None:
            return prefix, True
        patches, prefix = intended, prefix + "; by its source it would patch: "
    named = [*patches.get("classes", []), *patches.get("functions", [])]
    gaps = []
    for name in named:
        if o.status == "skipped":
            continue
        if name not in o.classes:
            gaps.append(f"{name} ({o.unbound_classes.get(name, 'not bound')})")
    head = patches.get("head")
    if head and not (HEADS & set(o.details.get("head_bound", ()))):
        gaps.append("loss head")
    text = prefix + (", ".join(named + (["loss head"] if head else [])) or "nothing")
    if gaps:
        text += "; **not bound here**: " + "; ".join(gaps)
    return text, not gaps and o.status == "match"


def _shortfall(built: list, good: list) -> str:
    """What keeps the built types that are not `good` out, by kind."""
    rest = [o for o in built if o not in good]
    if not rest:
        return ""
    wrong = [o.model_type for o in rest if o.status != "match"]
    head = [o.model_type for o in rest if o.status == "match" and not HEADS & set(
        o.details.get("head_bound", ()))]  # fmt: skip
    text = [o.model_type for o in rest if o.model_type not in wrong + head]
    parts = [
        f"{len(head)} keep their loss head's forward (its loss is not one the loss layers "
        f"reproduce, or their head not one they read: {', '.join(head)})"
        if head
        else "",
        f"{len(text)} bind their head but not their text MLP or norms ({', '.join(text)})"
        if text
        else "",
        f"{len(wrong)} do not match ({', '.join(wrong)})" if wrong else "",
    ]
    return f"Of the other {len(rest)}: " + "; ".join(x for x in parts if x) + "."


def _images(o) -> str:
    d = o.details
    if not d:
        return ""
    inputs = ", ".join(d.get("inputs", ())) or "none"
    tokens = d.get("image_tokens", 0)
    where = (
        f"{tokens} image token{'s' * (tokens != 1)}"
        if tokens
        else "no image tokens (image prefixed or encoded)"
    )
    return f"{where}; {inputs}"


def _join(items) -> str:
    return ", ".join(items)


def table(outcomes: list, device: str, dtype_name: str, commit: str, liger: dict) -> str:
    import torch
    import transformers

    cell = sweep_models._cell
    built = [o for o in outcomes if o.status != "skipped"]
    with_images = [o for o in built if o.details.get("inputs")]
    good = [o for o in built if o.status == "match" and binds_text(o)]
    vision = [o for o in built if o.details.get("vision_bound")]
    liger_rows = {o.model_type: liger_row(o, liger.get(o.model_type)) for o in outcomes}
    liger_types = [o for o in outcomes if liger_rows[o.model_type][1] is not None]
    liger_built = [o for o in liger_types if o.status != "skipped"]
    liger_ok = [o for o in liger_built if liger_rows[o.model_type][1]]
    liger_bad = sorted(o.model_type for o in liger_built if not liger_rows[o.model_type][1])
    pct = 100.0 * len(good) / max(len(built), 1)
    absent = [t for t in vlm_types() if t not in {o.model_type for o in outcomes}]
    where = device
    if device.startswith("cuda") and torch.cuda.is_available():
        where = f"{device}: {torch.cuda.get_device_name()}"
    lines = [
        "# Training kernels across transformers' image-text-to-text models",
        "",
        f"Generated by `python scripts/sweep_vlm.py` on {datetime.date.today()} "
        f"({platform.machine()}, {where}, {dtype_name}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}"
        + (f"; commit {commit}" if commit else "")
        + ").",
        "",
        "Each model type in `MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES` is built as a tiny random "
        "model (text model: hidden 64, 2 layers, 4 heads, vocab 256; vision tower: hidden 64, 2 "
        "layers, 4 heads, 8 x 8 patches per image; tests/models/vlm_registry.py) and trained 3 "
        "AdamW steps on batches of 2 samples with one image each, as it is and after "
        "`kernels.apply_training_kernels(model)` (one line, no family table). The batches are what "
        "the family's processor would make, derived from the model: pixels in the layout its "
        "`get_image_features` takes, the image token as many times as that function makes "
        "features per image, grids (`image_grid_thw`) and `mm_token_type_ids` for the multimodal "
        "RoPE's positions, sizes and masks where its signature asks; a per-family adapter only "
        "where structure cannot tell (Mllama's tiles and cross-attention mask). Labels ignore the "
        f"image tokens. {sweep_models.match_criterion(dtype_name)} *Text model*, *vision tower* and "
        "*head*: the layers bound there (the text model is the model's `get_decoder()`; the "
        "vision tower is everything else below the head, projector included). Unbound modules "
        "keep their own forward; the reason is the one `kernels.last_report(model)` gives.",
        "",
        f"- {len(outcomes)} model types"
        + (
            f" ({len(absent)} of the mapping's not run yet, e.g. past a --deadline: "
            f"{', '.join(absent[:8])}{' ...' if len(absent) > 8 else ''}; `--resume` runs them)"
            if absent
            else ""
        )
        + f"; {len(built)} build and train here with images "
        f"({len(with_images)} with pixel inputs); {len(good)} of those ({pct:.0f} %) bind their "
        "text model's norms and MLP and their loss head, and match. " + _shortfall(built, good),
        f"- {len(vision)} of the {len(built)} bind layers in their vision tower too (norms, GELU "
        "or gated MLPs, the vision rotary).",
        f"- Liger 0.8.5's image-text types ({len(liger_types)} in this mapping; what each patches "
        "read from Liger's own `_apply_liger_kernel_to_instance` on the same tiny model, "
        "tests/models/liger_vlm_patches.json; where that raises on this transformers, what its "
        "source would patch, LIGER_INTENDED in scripts/sweep_vlm.py): "
        f"{len(liger_ok)} of the {len(liger_built)} that build here bind at least what Liger "
        f"patches and match ({', '.join(liger_bad) or 'no exceptions'}).",
        "",
        "| model type | status | images | text model | vision tower | head | not bound (why) "
        "| Liger 0.8.5 patches | loss rel diff | grad-norm rel diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        d = o.details
        why = sorted({*d.get("text_unbound", ()), *d.get("vision_unbound", ()),
                      *d.get("head_unbound", ())})  # fmt: skip
        if o.status == "skipped" or not d:
            why = sorted(o.unbound) if o.status != "skipped" else []
        if o.reason:
            why.append(o.reason)
        loss = "" if o.loss_diff != o.loss_diff else f"{o.loss_diff:.1e}"
        grad = "" if o.grad_diff != o.grad_diff else f"{o.grad_diff:.1e}"
        cells = [
            o.model_type, o.status, _images(o), _join(d.get("text_bound", ())),
            _join(d.get("vision_bound", ())), _join(d.get("head_bound", ())), "; ".join(why),
            liger_rows[o.model_type][0], loss, grad,
        ]  # fmt: skip
        lines.append("| " + " | ".join(cell(str(c)) for c in cells) + " |")
    return "\n".join(lines) + "\n"


# -- what Liger patches -----------------------------------------------------------------------

_LIGER_CHILD = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, sys.argv[1])
import transformers
transformers.logging.set_verbosity_error()
from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance
from tests.models.vlm_registry import build_vlm

model = build_vlm(sys.argv[2])
kwargs = json.loads(sys.argv[3])
holders = {sys.modules[type(m).__module__] for m in model.modules()}

def state():
    modules = {n: (type(m), m.__dict__.get("forward"), type(m).forward)
               for n, m in model.named_modules()}
    funcs = {(h.__name__, k): v for h in holders for k, v in vars(h).items()
             if callable(v) and not isinstance(v, type)}
    return modules, funcs

before, before_funcs = state()
error = ""
try:
    _apply_liger_kernel_to_instance(model=model, **kwargs)
except Exception as exc:
    error = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
after, after_funcs = state()
print("LIGER " + json.dumps({
    "classes": sorted({type(m).__name__ for n, m in model.named_modules()
                       if n and before[n] != after[n]}),
    "functions": sorted({k for _, k in before_funcs if after_funcs.get((_, k)) is not before_funcs[(_, k)]}),
    "head": before[""] != after[""],
    "error": error,
}))
"""


def liger_probe(types: list[str]) -> dict:
    """Per Liger type: the module classes and functions Liger's instance patch changes on the
    tiny model, whether it replaces the head's forward, and its error, each in a fresh process
    (Liger's patches are process-wide). Where the default patch raises, the patch without the
    fused loss is asked for the rest."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    found = {}
    for model_type in types:
        if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
            continue
        row = _liger_child(model_type, {})
        if row.get("error"):
            rest = _liger_child(model_type, {"fused_linear_cross_entropy": False})
            row = {**rest, "head": False, "error": row["error"]}
        found[model_type] = row
        print(f"liger {model_type}: {row}", flush=True)
    return found


def _liger_child(model_type: str, kwargs: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _LIGER_CHILD, str(ROOT), model_type, json.dumps(kwargs)],
        capture_output=True, text=True, timeout=600, env=dict(os.environ),
    )  # fmt: skip
    line = next((x for x in proc.stdout.splitlines() if x.startswith("LIGER ")), None)
    if line is None:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"classes": [], "functions": [], "head": False, "error": tail[:200]}
    return json.loads(line[len("LIGER ") :])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--types", default="", help="comma-separated model types (default: all)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "models-vlm.md"))
    parser.add_argument("--out-jsonl", default=str(ROOT / "docs" / "models-vlm.jsonl"))
    parser.add_argument("--resume", action="store_true", help="skip types already in the JSONL")
    parser.add_argument("--table-only", action="store_true", help="write --out from the JSONL")
    parser.add_argument("--limit-s", type=int, default=240, help="seconds per model type")
    parser.add_argument("--grace-s", type=float, default=30.0)
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--deadline", type=float, help="seconds for the whole run")
    parser.add_argument(
        "--liger-probe", action="store_true", help=f"write {LIGER_JSON.name} (needs liger-kernel)"
    )
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    from bench_supervise import git_commit, log

    types = [t for t in args.types.split(",") if t] or vlm_types()
    jsonl = Path(args.out_jsonl)
    if args.liger_probe:
        found = liger_probe(types)
        known = json.loads(LIGER_JSON.read_text()) if LIGER_JSON.exists() else {}
        known.update(found)
        LIGER_JSON.write_text(json.dumps(dict(sorted(known.items())), indent=1) + "\n")
        print(f"wrote {LIGER_JSON}")
        return 0
    commit = git_commit(ROOT)
    if not args.table_only:
        done = read_jsonl(jsonl) if args.resume else {}
        todo = [t for t in types if t not in done]
        log(f"VLM sweep at commit {commit}: {args.device}, {args.dtype}, {len(todo)} types")
        sweep_models.start_mirror()
        jsonl.parent.mkdir(parents=True, exist_ok=True)

        def append(outcome) -> None:
            row = dataclasses.asdict(outcome)
            row["commit"] = commit
            with jsonl.open("a") as f:
                f.write(json.dumps(row) + "\n")

        sweep_models.sweep(
            todo, args.device, args.dtype, args.limit_s, args.jobs, args.deadline,
            args.grace_s, kind="vlm", on_outcome=append,
        )  # fmt: skip
    rows = read_jsonl(jsonl)
    order = [t for t in vlm_types() if t in rows] + [t for t in rows if t not in vlm_types()]
    outcomes = [rows[t][0] for t in order]
    liger = json.loads(LIGER_JSON.read_text()) if LIGER_JSON.exists() else {}
    commits = ", ".join(sorted({rows[t][1] for t in order if rows[t][1]})) or commit
    Path(args.out).write_text(table(outcomes, args.device, args.dtype, commits, liger))
    print(f"wrote {args.out} ({len(outcomes)} types)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
