"""Sweep every causal-LM model type transformers registers through the training kernels.

For each type in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: build a tiny random model, train a plain
copy and a copy after ``kernels.apply_training_kernels(model)`` 3 AdamW steps on the same
batches, and compare losses and gradient norms (fp32: 1e-4 relative, bf16: 2e-2). The kernels
come from a ``kernels serve`` mirror of hub_kernels/ on loopback. Writes the table to
docs/models.md (``--out``).

    python scripts/sweep_models.py                                  # CPU, fp32
    python scripts/sweep_models.py --device cuda --dtype bf16 --out docs/models-h200.md
    python scripts/sweep_models.py --only llama,gemma2,phi3         # a few types
    python scripts/sweep_models.py --liger    # Liger's types: their rows, and docs/models-liger.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import signal
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.models.liger_patches import KINDS, LIGER_PATCHES, LIGER_VERSION  # noqa: E402

# Model types Liger patches (MODEL_TYPE_TO_APPLY_LIGER_FN) that transformers 5.24 ships as
# causal LMs: each must bind at least what Liger patches (norms, rotary, MLP/experts, loss).
LIGER_TYPES = frozenset(LIGER_PATCHES)
NORMS = {"RMSNorm", "GemmaRMSNorm", "RMSNormFloatWeight", "WeightlessRMSNorm", "LayerNorm"}
HEADS = {"ForCausalLM", "MoEForCausalLM", "CausalLMHead"}


def start_mirror() -> None:
    """Serve hub_kernels/ on loopback and point huggingface_hub and the cache at it."""
    from kernels.serve import MirrorServer, build_mirror

    work = Path(tempfile.mkdtemp(prefix="sweep-models-"))
    build_mirror(ROOT / "hub_kernels", work / "mirror")
    server = MirrorServer(work / "mirror").start()
    os.environ.update(
        HF_ENDPOINT=server.url,
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HOME=str(work / "hf"),
        KERNELS_CACHE=str(work / "cache"),
        NO_PROXY="127.0.0.1,localhost",
    )


def _alarm(signum, frame):  # noqa: ARG001
    raise TimeoutError("over the per-type time limit")


def sweep(types: list[str], device: str, dtype, limit_s: int) -> list:
    from tests.models.registry import Outcome, run_one

    signal.signal(signal.SIGALRM, _alarm)
    outcomes = []
    for model_type in types:
        signal.alarm(limit_s)
        try:
            outcome = run_one(model_type, device=device, dtype=dtype)
        except TimeoutError:
            outcome = Outcome(model_type, "skipped", reason=f"took over {limit_s} s here")
        finally:
            signal.alarm(0)
        outcomes.append(outcome)
        print(
            f"{model_type:28s} {outcome.status:8s} loss {outcome.loss_diff:.1e} "
            f"grad {outcome.grad_diff:.1e}  {outcome.seconds:5.1f}s  {outcome.reason}",
            flush=True,
        )
    return outcomes


def read_table(path: Path) -> list:
    """The outcomes of an earlier run's table (for --update)."""
    from tests.models.registry import Outcome

    outcomes = []
    for line in path.read_text().splitlines():
        cells = [c.strip().replace("\\|", "|") for c in line.strip().strip("|").split(" | ")]
        if len(cells) != 6 or cells[0] in ("model type", "---|---|---|---|---|---"):
            continue
        model_type, status, bound, unbound, loss, grad = cells
        if status not in ("match", "mismatch", "skipped", "error"):
            continue
        outcome = Outcome(
            model_type,
            status,
            [b for b in bound.split(", ") if b],
            [],
            float(loss) if loss else float("nan"),
            float(grad) if grad else float("nan"),
        )
        if status in ("skipped", "error"):
            outcome.reason = unbound
        else:
            outcome.unbound = [u for u in unbound.split("; ") if u]
        outcomes.append(outcome)
    return outcomes


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(outcomes: list, device: str, dtype_name: str) -> str:
    import torch
    import transformers

    built = [o for o in outcomes if o.status != "skipped"]
    good = [
        o for o in built if o.status == "match" and NORMS & set(o.bound) and HEADS & set(o.bound)
    ]
    liger = [o for o in outcomes if o.model_type in LIGER_TYPES]
    liger_built = [o for o in liger if o.status != "skipped"]
    liger_good = [o for o in liger_built if o.status == "match"]
    pct = 100.0 * len(good) / max(len(built), 1)
    from tests.models.bf16_verdict import FACTOR

    criterion = (
        "`match`: every step's loss and gradient norm agree within 1e-4 relative."
        if dtype_name == "fp32"
        else "`match`: in every step, the kernelized model's loss and whole gradient are no "
        f"further from float64 than {FACTOR}x the plain bf16 model's are, or within one bf16 "
        "rounding (2^-8); float64 is the plain model cast to float64 and loaded with each bf16 "
        "model's weights of that step (tests/models/bf16_verdict.py: two bf16 models can be "
        "further apart than either is from float64); a step where float64 makes other top-k "
        "picks (MoE routing) is left out and counted. The diff columns are plain vs ours; where "
        "they exceed 2e-2 the reason gives both distances to float64."
    )
    lines = [
        "# Training kernels across transformers' causal LMs",
        "",
        f"Generated by `python scripts/sweep_models.py` on {datetime.date.today()} "
        f"({platform.machine()}, {device}, {dtype_name}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}).",
        "",
        "Each model type in `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` is built as a tiny random model "
        "(hidden 64, 2 layers, 4 heads, vocab 256, 4 experts), then trained 3 AdamW steps as it "
        "is and after `kernels.apply_training_kernels(model)` (one line, no family table). "
        f"{criterion} Unbound modules keep their own forward; the reason is the one "
        "`kernels.last_report(model)` gives.",
        "",
        f"- {len(outcomes)} model types; {len(built)} build and train here; "
        f"{len(good)} of those ({pct:.0f} %) bind their norms and their loss head and match.",
        f"- Liger {LIGER_VERSION}'s causal-LM types: {len(liger_good)} of {len(liger_built)} that build here match "
        f"({', '.join(sorted(o.model_type for o in liger_built if o.status != 'match')) or 'no exceptions'}); "
        "what each binds next to what Liger patches: [models-liger.md](models-liger.md).",
        "",
        "| model type | status | bound | not bound (why) | loss rel diff | grad-norm rel diff |",
        "|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        bound = ", ".join(o.bound)
        unbound = "; ".join(o.unbound) if o.status != "skipped" else ""
        if o.reason:
            unbound = f"{unbound}; {o.reason}" if unbound else o.reason
        loss = "" if o.loss_diff != o.loss_diff else f"{o.loss_diff:.1e}"
        grad = "" if o.grad_diff != o.grad_diff else f"{o.grad_diff:.1e}"
        lines.append(
            f"| {o.model_type} | {o.status} | {_cell(bound)} | {_cell(unbound)} | {loss} | {grad} |"
        )
    return "\n".join(lines) + "\n"


def liger_table(outcomes: list) -> str:
    """docs/models-liger.md: per Liger model type, what Liger patches by default, what the
    training kernels bind on the same classes, and what Liger patches that they leave alone."""
    import transformers

    rows, gaps = [], 0
    for o in sorted(outcomes, key=lambda o: o.model_type):
        patches = LIGER_PATCHES.get(o.model_type)
        if patches is None:
            continue
        liger, ours, missing = [], [], []
        for kind in KINDS:
            for name in patches[kind]:
                liger.append(f"{kind}: {name}")
                if o.status == "skipped":
                    continue
                if name in o.classes:
                    ours.append(f"{name} → {o.classes[name]}")
                elif name in o.unbound_classes:
                    missing.append(f"{name}: {o.unbound_classes[name]}")
                else:
                    ours.append(f"{name}: not in this model")
        liger_names = {n for kind in KINDS for n in patches[kind]}
        beyond = sorted(f"{n} → {layer}" for n, layer in o.classes.items() if n not in liger_names)
        gaps += bool(missing) or o.status != "match"
        gap = "; ".join(missing) or ("none" if o.status == "match" else o.reason or o.status)
        if patches["note"]:
            liger.append(f"({patches['note']})")
        cells = [o.model_type, o.status, "; ".join(liger), "; ".join(ours), gap, "; ".join(beyond)]
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return (
        "\n".join(
            [
                f"# Training kernels vs Liger {LIGER_VERSION}, per model type",
                "",
                f"Generated by `python scripts/sweep_models.py --liger` on {datetime.date.today()} "
                f"(transformers {transformers.__version__}). One row per causal-LM model type that "
                f"Liger {LIGER_VERSION} patches (`MODEL_TYPE_TO_APPLY_LIGER_FN`) and transformers ships. "
                "*Liger patches*: the classes and functions its `apply_liger_kernel_to_*` replaces "
                "with its defaults (tests/models/liger_patches.py, checked against Liger's source "
                "by tests/models/test_liger_parity.py). *We bind*: the training-kernel layer that "
                "`kernels.apply_training_kernels(model)` binds to each of them in the tiny model of "
                "docs/models.md (`sweep`: that model's 3-step comparison). *Gap*: what Liger patches "
                "that stays unbound, with the report's reason. *Beyond Liger*: what we bind that "
                "Liger leaves alone.",
                "",
                f"- {len(rows)} model types; {len(rows) - gaps} bind everything Liger patches and match.",
                "",
                "| model type | sweep | Liger patches | we bind | gap | beyond Liger |",
                "|---|---|---|---|---|---|",
                *rows,
            ]
        )
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--only", default="", help="comma-separated model types")
    parser.add_argument("--out", default=str(ROOT / "docs" / "models.md"))
    parser.add_argument("--limit-s", type=int, default=180, help="per model type")
    parser.add_argument(
        "--update", action="store_true", help="replace only the rows of the types run in --out"
    )
    parser.add_argument(
        "--liger",
        action="store_true",
        help="run Liger's model types, update their rows in --out, write --liger-out",
    )
    parser.add_argument("--liger-out", default=str(ROOT / "docs" / "models-liger.md"))
    args = parser.parse_args(argv)
    if args.liger:
        args.only, args.update = ",".join(sorted(LIGER_TYPES)), True

    warnings.filterwarnings("ignore")
    start_mirror()
    import torch
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    transformers.logging.set_verbosity_error()
    types = [t for t in args.only.split(",") if t] or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    outcomes = sweep(types, args.device, dtype, args.limit_s)
    if args.liger:
        Path(args.liger_out).write_text(liger_table(outcomes))
        print(f"wrote {args.liger_out}")
    if args.update:
        fresh = {o.model_type: o for o in outcomes}
        outcomes = [fresh.pop(o.model_type, o) for o in read_table(Path(args.out))]
        outcomes += fresh.values()
    Path(args.out).write_text(table(outcomes, args.device, args.dtype))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
