"""Encoder-decoder and T5-norm families loaded in a 16-bit dtype the way transformers builds
them (``_keep_in_fp32_modules``: T5's ``wo`` and its copies), bound to this tree's training
kernels: does a forward + backward with labels run, does the loss match the unbound model's,
is every norm bound, and does the encoder output keep the unbound model's dtype (CPU, tiny
models from explicit configs, each family's default feed-forward; ``t5_gated`` is T5 with
Flan-T5's gated-gelu one; no downloads)?

Each model is built in fp32 from its config, saved to a temporary folder and loaded back with
``from_pretrained(folder, dtype=...)``: in transformers 5.24 only that load applies the dtype
plan that keeps ``_keep_in_fp32_modules`` in fp32; ``_from_config(config, dtype=...)`` leaves
every parameter in the 16-bit dtype (the second count in the fp32-kept column).

T5LayerNorm casts x̂ to its weight's dtype when that is 16-bit; an fp16 T5 keeps ``wo`` in
fp32, so its norms see fp32 inputs with fp16 weights (tests/kernels/test_t5_norms.py). This
sweeps the same kind of load over T5's copies (mt5, umt5, longt5, switch_transformers,
pix2struct, udop, idefics, kosmos2_5) and over bart, m2m_100 and pegasus as encoder-decoder
controls without T5's norm. scripts/probes/probe_half_loads_cpu.py does the causal LMs.

    python scripts/probes/probe_half_loads_seq2seq_cpu.py --dtype float16
    python scripts/probes/probe_half_loads_seq2seq_cpu.py --dtype bfloat16 --types t5,udop

Columns: the parameters left in fp32 by the load (and by ``_from_config``); norms bound
(modules whose class name ends with LayerNorm or RMSNorm that got a bound ``forward``; in
brackets how many of them the binder marked T5-style); the losses and their relative
difference; the loss of a float64 copy of the same weights (no gradient), the reference for a
difference; the encoder output's dtype, plain and bound (for idefics the vision output,
``image_hidden_states``; for kosmos2_5 the vision model's last hidden state). ``--tracebacks``
prints each failure's traceback to stderr.
"""

import argparse
import copy
import os
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TYPES = (
    "t5,t5_gated,mt5,umt5,longt5,switch_transformers,pix2struct,udop,idefics,kosmos2_5,"
    "bart,m2m_100,pegasus"
)
VOCAB = 128
D = 32  # model width
HEADS = 4
SRC, TGT, BATCH = 12, 8, 2  # source tokens (or patches), target tokens, sequences

# T5-style sizes shared by the T5 copies
T5_SIZES = dict(
    vocab_size=VOCAB, d_model=D, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
    num_heads=HEADS, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    eos_token_id=1, use_cache=False,
)  # fmt: skip
BART_SIZES = dict(
    vocab_size=VOCAB, d_model=D, encoder_layers=2, decoder_layers=2,
    encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=64,
    decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
    activation_dropout=0.0, use_cache=False,
)  # fmt: skip
PATCH = 4  # pixel side of a flattened patch (pix2struct, kosmos2_5), 3 channels


def _family(model_type: str):
    """(model class, config, inputs(generator, dtype) -> dict, encoder output(out) -> tensor)."""
    import torch
    import transformers as tf

    def ids(gen, n):
        return torch.randint(2, VOCAB, (BATCH, n), generator=gen)

    def seq2seq(gen, dtype):
        return {"input_ids": ids(gen, SRC), "labels": ids(gen, TGT)}

    def encoder(out):
        return out.encoder_last_hidden_state

    def patches(gen, dtype):  # rows, columns, then PATCH x PATCH x 3 pixel values
        rows = torch.arange(SRC) // 4 + 1
        cols = torch.arange(SRC) % 4 + 1
        pix = torch.randn(BATCH, SRC, PATCH * PATCH * 3, generator=gen)
        pos = torch.stack([rows, cols], -1).expand(BATCH, SRC, 2).float()
        return torch.cat([pos, pix], -1).to(dtype)

    if model_type == "t5_gated":  # T5 v1.1 / Flan-T5's feed-forward (T5's default is relu)
        config = tf.T5Config(**T5_SIZES, feed_forward_proj="gated-gelu")
        return tf.T5ForConditionalGeneration, config, seq2seq, encoder
    if model_type in ("t5", "mt5", "umt5"):
        prefix = {"t5": "T5", "mt5": "MT5", "umt5": "UMT5"}[model_type]
        config = getattr(tf, f"{prefix}Config")(**T5_SIZES)
        return getattr(tf, f"{prefix}ForConditionalGeneration"), config, seq2seq, encoder
    if model_type == "longt5":
        config = tf.LongT5Config(
            **T5_SIZES, encoder_attention_type="transient-global", local_radius=4,
            global_block_size=4,
        )  # fmt: skip
        return tf.LongT5ForConditionalGeneration, config, seq2seq, encoder
    if model_type == "switch_transformers":
        config = tf.SwitchTransformersConfig(
            **T5_SIZES, num_experts=4, expert_capacity=SRC * BATCH, num_sparse_encoder_layers=1,
            num_sparse_decoder_layers=1, router_jitter_noise=0.0,
        )  # fmt: skip
        return tf.SwitchTransformersForConditionalGeneration, config, seq2seq, encoder
    if model_type == "pix2struct":
        config = tf.Pix2StructConfig(
            text_config=dict(
                vocab_size=VOCAB, hidden_size=D, d_kv=8, d_ff=64, num_layers=2, num_heads=HEADS,
                dropout_rate=0.0, use_cache=False,
            ),
            vision_config=dict(
                hidden_size=D, patch_embed_hidden_size=PATCH * PATCH * 3, d_ff=64, d_kv=8,
                num_hidden_layers=2, num_attention_heads=HEADS, seq_len=16, dropout_rate=0.0,
            ),
        )  # fmt: skip

        def pix2struct_inputs(gen, dtype):
            return {
                "flattened_patches": patches(gen, dtype),
                "attention_mask": torch.ones(BATCH, SRC, dtype=torch.long),
                "labels": ids(gen, TGT),
            }

        return tf.Pix2StructForConditionalGeneration, config, pix2struct_inputs, encoder
    if model_type == "udop":
        config = tf.UdopConfig(**T5_SIZES, image_size=32, patch_size=8)

        def udop_inputs(gen, dtype):
            corners = torch.rand(BATCH, SRC, 2, 2, generator=gen).sort(dim=2).values
            bbox = corners.transpose(2, 3).reshape(BATCH, SRC, 4)  # x0, y0, x1, y1 in [0, 1]
            return {
                "input_ids": ids(gen, SRC),
                "bbox": bbox,
                "pixel_values": torch.randn(BATCH, 3, 32, 32, generator=gen).to(dtype),
                "labels": ids(gen, TGT),
            }

        return tf.UdopForConditionalGeneration, config, udop_inputs, encoder
    if model_type == "idefics":
        config = tf.IdeficsConfig(
            vocab_size=VOCAB, hidden_size=D, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=HEADS, max_position_embeddings=64, cross_layer_interval=1,
            freeze_text_layers=False, freeze_vision_layers=False, use_cache=False,
            vision_config=dict(
                embed_dim=D, image_size=16, patch_size=8, num_hidden_layers=2,
                num_attention_heads=HEADS, intermediate_size=64,
            ),
        )  # fmt: skip

        def idefics_inputs(gen, dtype):
            tokens = ids(gen, SRC)
            return {
                "input_ids": tokens,
                "attention_mask": torch.ones_like(tokens),
                "pixel_values": torch.randn(BATCH, 1, 3, 16, 16, generator=gen).to(dtype),
                "image_attention_mask": torch.ones(BATCH, SRC, 1, dtype=torch.long),
                "labels": tokens,
            }

        return tf.IdeficsForVisionText2Text, config, idefics_inputs, lambda o: o.image_hidden_states
    if model_type == "kosmos2_5":
        latents = 4
        config = tf.Kosmos2_5Config(
            text_config=dict(
                vocab_size=VOCAB, embed_dim=D, layers=2, ffn_dim=64, attention_heads=HEADS,
                max_position_embeddings=64, dropout=0.0, use_cache=False,
            ),
            vision_config=dict(
                hidden_size=D, patch_embed_hidden_size=PATCH * PATCH * 3, intermediate_size=64,
                head_dim=8, num_hidden_layers=2, num_attention_heads=HEADS, max_num_patches=16,
            ),
            latent_query_num=latents,
        )  # fmt: skip

        def kosmos_inputs(gen, dtype):
            tokens = ids(gen, SRC)
            where = torch.zeros(BATCH, SRC, dtype=torch.bool)
            where[:, 1 : 1 + latents] = True  # the image's latent queries after the first token
            return {
                "input_ids": tokens,
                "attention_mask": torch.ones_like(tokens),
                "flattened_patches": patches(gen, dtype),
                "image_embeds_position_mask": where,
                "labels": tokens,
            }

        return (
            tf.Kosmos2_5ForConditionalGeneration,
            config,
            kosmos_inputs,
            lambda o: o.vision_model_output.last_hidden_state,
        )
    if model_type in ("bart", "m2m_100", "pegasus"):
        prefix = {"bart": "Bart", "m2m_100": "M2M100", "pegasus": "Pegasus"}[model_type]
        config = getattr(tf, f"{prefix}Config")(**BART_SIZES)
        return getattr(tf, f"{prefix}ForConditionalGeneration"), config, seq2seq, encoder
    raise ValueError(f"no tiny model for {model_type!r}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".replace("|", "\\|")


def _norms(model) -> list:
    return [m for m in model.modules() if type(m).__name__.endswith(("LayerNorm", "RMSNorm"))]


def _fp32(model) -> list[str]:
    import torch

    return [n for n, p in model.named_parameters() if p.dtype == torch.float32]


def _loaded(cls, config, dtype):
    """The tiny model as ``from_pretrained(..., dtype=dtype)`` loads it: built in fp32 (seed 0),
    saved to a temporary folder and loaded back, so that transformers' dtype plan keeps its
    ``_keep_in_fp32_modules`` in fp32 as it does for a checkpoint (``_from_config`` does not
    apply that plan in transformers 5.24)."""
    import torch

    torch.manual_seed(0)
    model = cls._from_config(copy.deepcopy(config))
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        return cls.from_pretrained(folder, dtype=dtype)


def _float64_loss(model, inputs) -> float | None:
    """The loss of a float64 copy of the model (no gradient), on the same inputs in float64."""
    import torch

    try:
        ref = copy.deepcopy(model).double()
        wide = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
        with torch.no_grad():
            return ref(**wide).loss.item()
    except Exception:  # noqa: BLE001 - the column stays empty
        return None


def _run(model, inputs):
    out = model(**inputs)
    out.loss.backward()
    return out


def sweep_main(argv, doc: str, default_types: str, family, structure: bool) -> int:
    """The sweep both 16-bit load probes run: for each model type, `family(model_type)` gives
    (model class, config, inputs(generator, dtype) -> dict, encoder output(out) -> tensor or
    None); one table row per type. With `structure`, the table also has the norms bound and
    the encoder output's dtype."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--types", default=default_types, help="comma-separated model types")
    parser.add_argument(
        "--tracebacks", action="store_true", help="print each failure's traceback to stderr"
    )
    args = parser.parse_args(argv)
    variant = ROOT / "hub_kernels/kernels-lab/training/build/torch-universal"
    os.environ["LOCAL_KERNELS"] = f"kernels-lab/training={variant}"
    os.environ["HF_HUB_OFFLINE"] = "1"  # the tiny models are saved and loaded from a temp folder
    sys.path.insert(0, str(ROOT))

    import kernels
    import torch
    from transformers.utils import logging

    logging.disable_progress_bar()
    dtype = getattr(torch, args.dtype)
    keys = ("kept", "norms", "plain", "bound", "rel", "float64", "encoder")
    names = (
        "fp32-kept parameters (loaded / _from_config)", "norms bound (T5-style)", "loss, plain",
        "loss, bound", "rel. diff", "loss, float64", "encoder output, plain / bound",
    )  # fmt: skip
    if not structure:
        keys, names = keys[:1] + keys[2:6], names[:1] + names[2:6]
    columns = ("model type", *names, "result")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))

    def row(model_type: str, result: str, **cells: str) -> None:
        print("| " + " | ".join([model_type, *(cells.get(k, "") for k in keys), result]) + " |")

    def failed(where: str, exc: BaseException) -> str:
        if args.tracebacks:
            print(f"--- {model_type} ({args.dtype}), {where}:", file=sys.stderr)
            traceback.print_exception(exc, file=sys.stderr)
        return f"{where}: {_first_line(exc)}"

    for model_type in args.types.split(","):
        cells: dict[str, str] = {}
        try:
            cls, config, make_inputs, encoder_output = family(model_type)
            direct = _fp32(cls._from_config(copy.deepcopy(config), dtype=dtype))
            built = _loaded(cls, config, dtype).train()
        except Exception as exc:  # noqa: BLE001 - the unbound model itself does not build
            row(model_type, failed("does not build", exc))
            continue
        kept = _fp32(built)
        kept_text = f"{len(kept)} ({kept[0]}{', ...' if len(kept) > 1 else ''})" if kept else "0"
        cells["kept"] = f"{kept_text} / {len(direct)}"
        inputs = make_inputs(torch.Generator().manual_seed(1), dtype)
        loss64 = _float64_loss(built, inputs)
        cells["float64"] = "" if loss64 is None else f"{loss64:.4f}"
        plain, bound = copy.deepcopy(built), copy.deepcopy(built)
        del built
        try:
            out_plain = _run(plain, inputs)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            row(model_type, failed("plain fails", exc), **cells)
            continue
        loss_plain = out_plain.loss.float().item()
        cells["plain"] = f"{loss_plain:.4f}"
        try:
            kernels.apply_training_kernels(bound)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            row(model_type, failed("bind", exc), **cells)
            continue
        norms = _norms(bound)
        done = [m for m in norms if "forward" in vars(m)]
        t5_style = sum(bool(getattr(type(m), "kernels_norm_casts_to_weight", False)) for m in done)
        cells["norms"] = f"{len(done)}/{len(norms)} ({t5_style})"
        missed = sorted({type(m).__name__ for m in norms if "forward" not in vars(m)})
        if missed:
            cells["norms"] += f"; unbound: {', '.join(missed)}"
        try:
            out_bound = _run(bound, inputs)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            row(model_type, failed("bound fails", exc), **cells)
            continue
        loss_bound = out_bound.loss.float().item()
        rel = abs(loss_bound - loss_plain) / abs(loss_plain)
        cells["bound"], cells["rel"] = f"{loss_bound:.4f}", f"{rel:.1e}"
        result = "ran"
        if encoder_output is not None:
            enc = [encoder_output(o).dtype for o in (out_plain, out_bound)]
            cells["encoder"] = " / ".join(str(d).removeprefix("torch.") for d in enc)
            if enc[0] != enc[1]:
                result += "; encoder output dtype differs"
        if rel > 1e-3:
            result += "; loss differs > 1e-3"
            if loss64 is not None:
                nearer = abs(loss_bound - loss64) < abs(loss_plain - loss64)
                result += f" ({'bound' if nearer else 'plain'} nearer float64)"
        row(model_type, result, **cells)
    return 0


def main(argv: list[str] | None = None) -> int:
    return sweep_main(argv, __doc__, DEFAULT_TYPES, _family, structure=True)


if __name__ == "__main__":
    sys.exit(main())
