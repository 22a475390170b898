"""Tiny random causal LMs for every model type transformers registers, and the 3-step AdamW
comparison of a plain model with the same model after `kernels.apply_training_kernels`.

Used by tests/models/test_registry_sweep.py and scripts/sweep_models.py. A tiny model is the
model type's default config with every size attribute shrunk (hidden 64, 2 layers, 4 heads,
vocab 256, 4 experts, ...), so one training step takes milliseconds on the CPU.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field

import torch

from .bf16_verdict import Run, Verdict, float64_copy, judge, model_inputs

VOCAB = 256
HIDDEN = 64
HEADS = 4
HEAD_DIM = 16
SEQ = 16  # tokens per sequence of the training batches

# Size attributes a config may carry -> the tiny value (only those the config already has).
_SHRINK = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "n_embd": HIDDEN,
    "d_model": HIDDEN,
    "embed_dim": HIDDEN,
    "dim": HIDDEN,
    "intermediate_size": 128,
    "ffn_dim": 128,
    "n_inner": 128,
    "decoder_ffn_dim": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_layers": 2,
    "decoder_layers": 2,
    "n_layers": 2,
    "num_attention_heads": HEADS,
    "n_head": HEADS,
    "n_heads": HEADS,
    "decoder_attention_heads": HEADS,
    "num_key_value_heads": 2,
    "num_kv_heads": 2,
    "head_dim": HEAD_DIM,
    "kv_channels": HEAD_DIM,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "top_k": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 128,
    "n_positions": 128,
    "sliding_window": 8,
    "num_nextn_predict_layers": 0,
    "rotary_dim": 8,
    # Gemma 4's per-layer input embeddings (a second vocab-sized table)
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 16,
    # multi-head latent attention: small ranks, head dims as in the real models' ratios
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
}


def tiny_config(model_type: str):
    """The model type's default config, shrunk; nested text configs are shrunk too."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    _shrink(config)
    for name in ("text_config", "decoder"):
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            _shrink(sub)
    return config


def _shrink(config) -> None:
    if hasattr(config, "allow_global_per_layer_attribute_access"):
        # heterogeneous configs (Gemma 4) refuse to read per-layer sizes globally; the tiny
        # model is shrunk uniformly, so every layer gets the same value
        config.allow_global_per_layer_attribute_access = True
    for key, value in _SHRINK.items():
        try:
            current = getattr(config, key, None)
            if current is not None and not isinstance(current, bool):
                setattr(config, key, value)
        except Exception:  # noqa: BLE001, S110 - a per-layer or derived attribute: leave it
            pass
    for key, value in (
        ("n_group", 1),
        ("topk_group", 1),
        ("num_experts_per_tok", 2),
        ("head_dim", HEAD_DIM),
        ("num_key_value_heads", 2),  # Nemotron's default is None, which its attention cannot take
    ):
        if hasattr(config, key):  # set even where the default is None (grouped MoE routing)
            setattr(config, key, value)
    # State-space mixers (Mamba 2 and its hybrids) pad the sequence up to their chunk (128 to
    # 256 by default) and build chunk x chunk matrices per head: a chunk of the tiny batches'
    # 16 tokens runs the same single-chunk scan, with no padding, many times faster.
    if getattr(config, "mamba_chunk_size", None):
        config.mamba_chunk_size = SEQ
    ssm = ("ssm_state_size", "state_size", "mamba_d_state", "mamba_expand")
    if getattr(config, "chunk_size", None) and any(hasattr(config, k) for k in ssm):
        config.chunk_size = SEQ
    if hasattr(config, "logits_scaling"):
        config.logits_scaling = 4.0  # granite's default is 1.0: a scale the sweep would not see
    if hasattr(config, "lm_head_multiplier"):
        config.lm_head_multiplier = 0.5  # Falcon-H1's muP scales default to 1.0 too
    if isinstance(getattr(config, "mlp_multipliers", None), list):
        config.mlp_multipliers = [0.7, 1.3]
    if all(
        getattr(config, k, None) for k in ("qk_head_dim", "qk_nope_head_dim", "qk_rope_head_dim")
    ):
        # derived once when the config is made (LongCat-Flash's attention reads it): follow the
        # shrunk parts, or q's width and its split disagree
        config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    if getattr(config, "kv_lora_rank", None) and hasattr(config, "num_key_value_heads"):
        config.num_key_value_heads = HEADS  # latent attention expands k/v to every head
    layers = getattr(config, "num_hidden_layers", None)
    for key in ("layer_types", "layers_block_type", "block_types", "mlp_layer_types"):
        kinds = getattr(config, key, None)
        if isinstance(kinds, list) and layers and len(kinds) != layers:
            # keep the first kind of each distinct block so a hybrid stays hybrid
            seen = list(dict.fromkeys(kinds))[:layers]
            setattr(config, key, (seen * layers)[:layers])
    for key in (
        "dropout",
        "attention_dropout",
        "hidden_dropout",
        "resid_pdrop",
        "embd_pdrop",
        "attn_pdrop",
        "hidden_dropout_prob",
        "attention_probs_dropout_prob",
        "activation_dropout",
        "router_aux_loss_coef",
        "ffn_dropout",
        "classifier_dropout",
        "router_jitter_noise",
        "input_jitter_noise",
    ):
        if isinstance(getattr(config, key, None), float):
            setattr(config, key, 0.0)  # training must be deterministic to compare
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value >= VOCAB:
            setattr(config, key, VOCAB - 1 - ("pad", "bos", "eos", "dec").index(key[:3]))
        elif isinstance(value, list):
            setattr(config, key, [v for v in value if v < VOCAB] or None)
    if hasattr(config, "output_router_logits"):
        config.output_router_logits = False
    config.use_cache = False


def causal_lm_class(model_type: str):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def build(model_type: str, seed: int = 0, overrides: dict | None = None):
    config = tiny_config(model_type)
    for key, value in (overrides or {}).items():
        if key == "rope_parameters":
            config.rope_parameters = {**(config.rope_parameters or {}), **value}
        else:  # "text_config.x" sets x on the nested config
            *path, name = key.split(".")
            holder = config
            for part in path:
                holder = getattr(holder, part)
            setattr(holder, name, value)
    cls = causal_lm_class(model_type)
    text = getattr(config, "text_config", None)
    if not isinstance(config, cls.config_class) and isinstance(text, cls.config_class):
        config = text  # a multimodal type whose causal LM takes the text config
    torch.manual_seed(seed)
    model = cls._from_config(config, attn_implementation="eager")
    return model


@dataclass
class Outcome:
    model_type: str
    status: str  # "match", "mismatch", "skipped", "error"
    bound: list[str] = field(default_factory=list)
    unbound: list[str] = field(default_factory=list)
    loss_diff: float = float("nan")
    grad_diff: float = float("nan")
    reason: str = ""
    seconds: float = 0.0
    # module class (or rotary function) name -> the layer bound to it
    classes: dict[str, str] = field(default_factory=dict)
    # module class (or rotary function) name -> why nothing is bound to it; every module class
    # of the model is a key of one of the two
    unbound_classes: dict[str, str] = field(default_factory=dict)
    # bf16: the distances of plain and ours to the float64 run (bf16_verdict.Verdict)
    verdict: Verdict | None = None
    # what compare's `describe` adds (the VLM sweep: the inputs, where each layer bound)
    details: dict = field(default_factory=dict)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def train_steps(model, batches, steps: int = 3, record=None) -> list[tuple[float, float]]:
    """(loss, grad norm) of each AdamW step; `record` (a bf16_verdict.Run) compares each step
    with float64 at the same weights. A batch is a token tensor or a dict of inputs."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    torch.manual_seed(0)  # whatever a model draws in training, both copies draw the same
    out = []
    for batch in batches[:steps]:
        loss = model(**model_inputs(batch)).loss
        loss.backward()
        grads = [p.grad.float().norm() for p in model.parameters() if p.grad is not None]
        norm = torch.stack(grads).norm().item()
        out.append((loss.item(), norm))
        if record is not None:
            record.record(model, batch, loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def first_line(exc: BaseException) -> str:
    text = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {text[0].strip()[:160] if text else ''}"


def run_one(
    model_type: str,
    *,
    device: str = "cpu",
    dtype=torch.float32,
    repo=None,
    overrides: dict | None = None,
) -> Outcome:
    """Build the tiny model, train a plain copy and a kernelized copy 3 steps, compare."""
    return compare(
        model_type,
        lambda: build(model_type, overrides=overrides),
        token_batches,
        device=device,
        dtype=dtype,
        repo=repo,
    )


def token_batches(model, device) -> list[torch.Tensor]:
    """Three [2, SEQ] batches of random tokens (each its own labels)."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2, SEQ), generator=gen).to(device) for _ in range(3)]


def compare(model_type: str, make, make_batches, *, device="cpu", dtype=torch.float32,
            repo=None, describe=None) -> Outcome:  # fmt: skip
    """The 3-step comparison of `make()` (a tiny model) as it is and after
    ``kernels.apply_training_kernels``, on ``make_batches(model, device)``; a model or batches
    that cannot be made, or a plain model that cannot train, is a "skipped" outcome.
    ``describe(kernelized model, report, batches)`` returns the outcome's ``details``."""
    import kernels

    start = time.perf_counter()

    def skipped(why: str) -> Outcome:
        return Outcome(model_type, "skipped", reason=why, seconds=time.perf_counter() - start)

    try:
        plain = make().to(device=device, dtype=dtype)
        ours = copy.deepcopy(plain)
        # bf16 is judged against the plain model in float64 at each step's weights
        # (bf16_verdict.py); fp32 against the plain model itself
        exact = float64_copy(plain) if dtype == torch.bfloat16 else None
    except Exception as exc:  # noqa: BLE001 - the plain model is what we cannot test
        return skipped(f"plain model: {first_line(exc)}")
    try:
        batches = make_batches(plain, device)
    except Exception as exc:  # noqa: BLE001 - inputs the model takes could not be made
        return skipped(f"inputs: {first_line(exc)}")
    try:
        plain_run, ours_run = Run(exact), Run(exact)
        ref = train_steps(plain, batches, record=plain_run)
    except Exception as exc:  # noqa: BLE001 - the plain model is what we cannot test
        return skipped(f"plain model: {first_line(exc)}")
    if not all(math.isfinite(v) for row in ref for v in row):
        return skipped("plain model: non-finite loss")
    try:
        kwargs = {} if repo is None else {"repo": repo}
        report = kernels.apply_training_kernels(ours, **kwargs)
        got = train_steps(ours, batches, record=ours_run)
    except Exception as exc:  # noqa: BLE001 - reported, the sweep goes on
        return Outcome(
            model_type, "error", reason=first_line(exc), seconds=time.perf_counter() - start
        )
    bound = sorted({f"{e.layer_name}" for e in report if e.status == "bound"})
    classes: dict[str, str] = {}
    why: dict[str, str] = {}
    for e in report:
        name = bound_name(ours, e.path)
        if e.status == "bound":
            classes[name] = e.layer_name
        else:
            why.setdefault(name, e.reason)
    for module in ours.modules():
        why.setdefault(type(module).__name__, "no training-kernel layer serves this kind of module")
    why = {name: reason for name, reason in why.items() if name not in classes}
    unbound = sorted({f"{e.layer_name}: {e.reason}" for e in report if e.status != "bound"})
    loss_diff = max(_rel(a[0], b[0]) for a, b in zip(got, ref, strict=True))
    grad_diff = max(_rel(a[1], b[1]) for a, b in zip(got, ref, strict=True))
    reason, verdict = "", None
    if exact is None:
        status = "match" if loss_diff <= 1e-4 and grad_diff <= 1e-4 else "mismatch"
    else:
        status, reason, verdict = _bf16_status(plain_run, ours_run, loss_diff, grad_diff)
    return Outcome(
        model_type,
        status,
        bound,
        unbound,
        loss_diff,
        grad_diff,
        reason=reason,
        seconds=time.perf_counter() - start,
        classes=classes,
        unbound_classes=why,
        verdict=verdict,
        details=describe(ours, report, batches) if describe is not None else {},
    )


# plain vs ours in bf16: the sweep's first criterion, kept as a number in its table
BF16_AGREE = 2e-2


def _bf16_status(plain_run, ours_run, loss_diff, grad_diff) -> tuple[str, str, Verdict | None]:
    """(status, note, verdict) of a bf16 comparison: ours no further from float64 than the plain
    model (bf16_verdict.judge); the note gives both distances where ours is the further one,
    where plain and ours differ by more than BF16_AGREE, or where steps were left out."""
    error = plain_run.error or ours_run.error
    if not error and None in (plain_run.distance(), ours_run.distance()):
        error = "float64 made other top-k picks (routing) in every step"
    if error:  # no float64 comparison: only the first criterion is left
        agree = loss_diff <= BF16_AGREE and grad_diff <= BF16_AGREE
        return ("match" if agree else "mismatch"), f"no float64 run ({error})", None
    verdict = judge(plain_run.distance(), ours_run.distance())
    note = verdict.note()
    if plain_run.rerouted or ours_run.rerouted:
        note += (
            f" (steps where float64 makes other top-k picks, left out: plain {plain_run.rerouted},"
            f" ours {ours_run.rerouted})"
        )
    if not verdict.match:
        return "mismatch", f"further from float64 than the plain model: {note}", verdict
    if loss_diff > BF16_AGREE or grad_diff > BF16_AGREE:
        return (
            "match",
            f"bf16 noise: plain and ours differ by over {BF16_AGREE:.0e}; {note}",
            verdict,
        )
    return "match", note if plain_run.rerouted or ours_run.rerouted else "", verdict


def bound_name(model, path: str) -> str:
    """The class name of the module at ``path``; for a function bound through its calling
    module (``owner.layer``), the function's name (``apply_rotary_pos_emb``)."""
    try:
        return type(model.get_submodule(path)).__name__
    except AttributeError:
        owner_path, _, key = path.rpartition(".")
        func = model.get_submodule(owner_path).__dict__.get("_kernel_funcs", {}).get(key)
        return getattr(func, "__wrapped__", func).__name__ if func is not None else key
