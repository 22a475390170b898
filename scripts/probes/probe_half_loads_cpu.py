"""Causal LMs loaded in a 16-bit dtype the way a checkpoint load builds them, fp32-kept modules
included (``_keep_in_fp32_modules(_strict)``: MoE routers, expert biases, attention sinks,
indexer projections, norms), bound to this tree's training kernels: does a forward + backward
with labels run, and does the loss match the unbound model's (CPU, tiny models from the test
registry's configs)?

Each model is built in fp32 from its tiny config (seed 0), saved to a temporary folder and
loaded back with ``from_pretrained(folder, dtype=...)`` (the seq2seq probe's ``_loaded``): in
transformers 5.24 only that load applies the dtype plan, which keeps ``_keep_in_fp32_modules``
in fp32 when the dtype is float16 and ``_keep_in_fp32_modules_strict`` in float16 and bfloat16;
``_from_config(config, dtype=...)`` keeps only what a module's ``__init__`` creates in fp32 (the
second count in the fp32-kept column).

A T5 loaded in fp16 kept ``wo`` in fp32, and its bound norms crashed the model until the norm
probe learned T5's casting (tests/kernels/test_t5_norms.py). This sweeps the same kind of load
over causal families; scripts/probes/probe_half_loads_seq2seq_cpu.py does the encoder-decoders.

    python scripts/probes/probe_half_loads_cpu.py --dtype float16
    python scripts/probes/probe_half_loads_cpu.py --dtype bfloat16 --types nemotron_h,afmoe

Columns: the parameters left in fp32 by the load (and by ``_from_config``); the losses and their
relative difference; the loss of a float64 copy of the loaded weights (no gradient), the
reference for a difference. ``--tracebacks`` prints each failure's traceback to stderr.
"""

import argparse
import copy
import os
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# afmoe, gpt_oss, axk2, deepseek_v32, deepseek_v4, glm_moe_dsa, longcat_flash and rwkv declare a
# non-strict ``_keep_in_fp32_modules`` (fp16 only); mistral_large4 does too, but has no causal
# LM class (only MistralLarge4ForConditionalGeneration), so the registry cannot build it.
DEFAULT_TYPES = (
    "llama,qwen3,gemma3_text,mistral,phi3,olmo2,qwen3_moe,gpt_oss,"
    "nemotron_h,afmoe,beam,hy_v3,axk1,flint,kimi_linear,dots1,"
    "axk2,deepseek_v32,deepseek_v4,glm_moe_dsa,longcat_flash,rwkv"
)
SEQ, BATCH = 16, 2


def _config(model_type: str):
    """The registry's tiny config; longcat_flash's ``qk_head_dim`` is derived from its default
    head dims when the config is made, and the registry's shrink leaves it at 192 (the model
    then fails in fp32 too), so it is derived again from the shrunk ones."""
    from tests.models.registry import tiny_config

    config = tiny_config(model_type)
    if model_type == "longcat_flash":
        config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--types", default=DEFAULT_TYPES, help="comma-separated model types")
    parser.add_argument(
        "--tracebacks", action="store_true", help="print each failure's traceback to stderr"
    )
    args = parser.parse_args(argv)
    variant = ROOT / "hub_kernels/kernels-lab/training/build/torch-universal"
    os.environ["LOCAL_KERNELS"] = f"kernels-lab/training={variant}"
    os.environ["HF_HUB_OFFLINE"] = "1"  # the tiny models are saved and loaded from a temp folder
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(Path(__file__).resolve().parent))

    import kernels
    import torch
    from probe_half_loads_seq2seq_cpu import _first_line, _float64_loss, _fp32, _loaded
    from transformers.utils import logging

    from tests.models.registry import causal_lm_class

    logging.disable_progress_bar()
    dtype = getattr(torch, args.dtype)
    columns = (
        "model type", "fp32-kept parameters (loaded / _from_config)", "loss, plain",
        "loss, bound", "rel. diff", "loss, float64", "result",
    )  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))

    def row(model_type: str, result: str, **cells: str) -> None:
        keys = ("kept", "plain", "bound", "rel", "float64")
        print("| " + " | ".join([model_type, *(cells.get(k, "") for k in keys), result]) + " |")

    def failed(where: str, exc: BaseException) -> str:
        if args.tracebacks:
            print(f"--- {model_type} ({args.dtype}), {where}:", file=sys.stderr)
            traceback.print_exception(exc, file=sys.stderr)
        return f"{where}: {_first_line(exc)}"

    for model_type in args.types.split(","):
        cells: dict[str, str] = {}
        try:
            cls = causal_lm_class(model_type)
            torch.manual_seed(0)
            direct = _fp32(cls._from_config(_config(model_type), dtype=dtype))
            built = _loaded(cls, _config(model_type), dtype).train()
        except Exception as exc:  # noqa: BLE001 - the unbound model itself does not build
            row(model_type, failed("does not build", exc))
            continue
        kept = _fp32(built)
        kept_text = f"{len(kept)} ({kept[0]}{', ...' if len(kept) > 1 else ''})" if kept else "0"
        cells["kept"] = f"{kept_text} / {len(direct)}"
        ids = torch.randint(
            0, built.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)
        )
        inputs = {"input_ids": ids, "labels": ids}
        loss64 = _float64_loss(built, inputs)
        cells["float64"] = "" if loss64 is None else f"{loss64:.4f}"
        plain, bound = copy.deepcopy(built), copy.deepcopy(built)
        del built
        try:
            out = plain(**inputs)
            out.loss.backward()
        except Exception as exc:  # noqa: BLE001 - reported in the table
            row(model_type, failed("plain fails", exc), **cells)
            continue
        loss_plain = out.loss.float().item()
        cells["plain"] = f"{loss_plain:.4f}"
        try:
            kernels.apply_training_kernels(bound)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            row(model_type, failed("bind", exc), **cells)
            continue
        try:
            out = bound(**inputs)
            out.loss.backward()
        except Exception as exc:  # noqa: BLE001 - reported in the table
            row(model_type, failed("bound fails", exc), **cells)
            continue
        loss_bound = out.loss.float().item()
        rel = abs(loss_bound - loss_plain) / abs(loss_plain)
        cells["bound"], cells["rel"] = f"{loss_bound:.4f}", f"{rel:.1e}"
        result = "ran"
        if rel > 1e-3:
            result += "; loss differs > 1e-3"
            if loss64 is not None:
                nearer = abs(loss_bound - loss64) < abs(loss_plain - loss64)
                result += f" ({'bound' if nearer else 'plain'} nearer float64)"
        row(model_type, result, **cells)
    return 0


if __name__ == "__main__":
    sys.exit(main())
