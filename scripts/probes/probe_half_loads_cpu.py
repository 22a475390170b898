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

import sys
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


def _family(model_type: str):
    """(causal LM class, tiny config, inputs(generator, dtype) -> dict, no encoder output)."""
    import torch

    from tests.models.registry import causal_lm_class, tiny_config

    config = tiny_config(model_type)

    def inputs(gen, dtype):
        ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=gen)
        return {"input_ids": ids, "labels": ids}

    return causal_lm_class(model_type), config, inputs, None


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from probe_half_loads_seq2seq_cpu import sweep_main

    return sweep_main(argv, __doc__, DEFAULT_TYPES, _family, structure=False)


if __name__ == "__main__":
    sys.exit(main())
