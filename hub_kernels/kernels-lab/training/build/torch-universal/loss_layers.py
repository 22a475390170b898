"""Loss layers: the causal-LM head with a fused linear cross-entropy, and drop-in CE losses.

``ForCausalLM`` replaces the forward of transformers' ``*ForCausalLM`` classes that follow the
Llama/Qwen3 pattern (``self.model`` returns ``last_hidden_state``, ``self.lm_head`` is a Linear,
``self.loss_function`` is ``ForCausalLMLoss``). With ``labels`` it computes the loss straight from
the hidden states and ``lm_head.weight`` (``fused_linear_cross_entropy``), never building the
[tokens, vocab] logits:

- training (``model.training``): ``logits`` is None, unless the call passes ``return_logits=True``;
- eval: logits are computed as usual next to the fused loss (``return_logits=False`` skips them);
- without ``labels`` it is the original forward, logits included;
- a training call with labels that leaves ``use_cache`` unset returns no KV cache (transformers
  would build one from ``config.use_cache`` and copy every layer's keys and values into it:
  ~4 % of a Qwen3-0.6B training step, and memory held until the output is dropped); the
  decoder gets ``step_cache``'s, which copies nothing and keeps the causal mask implicit.
  Pass ``use_cache=True`` to get a cache anyway.

``ForCausalLMLoss`` is a drop-in for ``transformers.loss.loss_utils.ForCausalLMLoss``
(``model.loss_function = ForCausalLMLoss``) and ``CrossEntropyLoss`` a layer for
``nn.CrossEntropyLoss`` modules; both use the CE kernel and leave the logits they are given intact.
"""

from __future__ import annotations

import inspect
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from ._common import has_hooks
from .cross_entropy import cross_entropy
from .embedding import token_embedding
from .fused_linear_cross_entropy import fused_linear_cross_entropy
from .logprob import fused_linear_logprob
from .step_cache import step_cache


class ForCausalLM(nn.Module):
    """``XForCausalLM.forward`` (transformers 5.x) with the fused linear cross-entropy loss."""

    has_backward = True
    # Traced whole under torch.compile: the loss head is the flce_fwd op (docs/compile.md).
    can_torch_compile = True

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ):
        return causal_lm_forward(
            self,
            input_ids,
            attention_mask,
            position_ids,
            cache,
            inputs_embeds,
            labels,
            use_cache,
            logits_to_keep,
            kwargs,
        )


class ForCausalLMCrossEntropy(nn.Module):
    """``XForCausalLM.forward`` that builds the logits as usual and computes the loss on the CE
    kernel (for ``cross_entropy=True`` in a Liger-style config; ``ForCausalLM`` is leaner)."""

    has_backward = True
    can_torch_compile = True

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ):
        return causal_lm_forward(
            self,
            input_ids,
            attention_mask,
            position_ids,
            cache,
            inputs_embeds,
            labels,
            use_cache,
            logits_to_keep,
            kwargs,
            fused=False,
        )


class MoEForCausalLM(nn.Module):
    """``ForCausalLM`` for the MoE heads whose forward also takes ``output_router_logits``
    (Mixtral, Qwen3-MoE, ...). Without router logits (the default of their configs) the loss is
    the fused one; a call that asks for them runs the family's own forward, which adds the
    router's load-balancing loss."""

    has_backward = True
    can_torch_compile = True

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ):
        wanted = output_router_logits
        if wanted is None:
            wanted = getattr(self.config, "output_router_logits", False)
        if wanted and not kwargs.get("fused_lm_head"):
            return type(self).forward(
                self, input_ids, attention_mask, position_ids, cache, inputs_embeds, labels,
                use_cache, output_router_logits, logits_to_keep, **kwargs,
            )  # fmt: skip
        if wanted:  # a fused_lm_head call: the aux loss is added there, as TRL does
            kwargs["output_router_logits"] = True
        return causal_lm_forward(
            self,
            input_ids,
            attention_mask,
            position_ids,
            cache,
            inputs_embeds,
            labels,
            use_cache,
            logits_to_keep,
            kwargs,
            moe=True,
        )


class CausalLMHead(nn.Module):
    """Any causal-LM forward that ends in ``self.lm_head(hidden)`` and a causal-LM loss, whatever
    its arguments and its decoder's name (GPT-2, Bloom, Falcon, OPT, GPT-NeoX, ...): with labels,
    the family's own forward runs without them while ``lm_head`` hands back its input instead of
    the logits, and the loss is the fused linear cross-entropy of that input. Logits as in
    ``ForCausalLM`` (None in training unless ``return_logits=True``). The forward takes any
    arguments and binds them to the family's signature itself."""

    has_backward = True
    # The capture swaps lm_head's forward for one call: a compiled model graph-breaks there.
    can_torch_compile = True

    def forward(self, *args, **kwargs):
        return any_causal_lm_forward(self, args, kwargs)


class CrossEntropyLoss(nn.Module):
    """``nn.CrossEntropyLoss.forward`` on the CE kernel for [N, C] logits and class targets.

    Class weights, probability targets and [N, C, d...] inputs take torch's own path.
    """

    has_backward = True
    can_torch_compile = True

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy_module_forward(self, input, target)


def ForCausalLMLoss(  # noqa: N802 - the name transformers gives this loss
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """transformers' causal-LM loss (labels shifted left, mean over non-ignored tokens or
    ``/ num_items_in_batch``) on the CE kernel; an fp32 loss, and ``logits`` are left intact."""
    target = _labels_on(logits.device, labels, shift_labels, ignore_index)
    return cross_entropy(
        logits.reshape(-1, vocab_size),
        target,
        ignore_index=ignore_index,
        num_items=num_items_in_batch,
        inplace=False,  # the model also returns these logits to its caller
    )


def shift_left(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Token t predicts label t + 1; the last position gets ignore_index (as transformers does)."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _labels_on(
    device: torch.device,
    labels: torch.Tensor,
    shift_labels: torch.Tensor | None,
    ignore_index: int,
) -> torch.Tensor:
    """The flat targets on `device`: `labels` shifted left, or the caller's `shift_labels`.

    Labels held on the host are shifted there and copied without blocking: a blocking copy from
    pageable host memory waits for the device's whole queue (a sync per step). The shifted
    tensor is this function's own, so nobody can change it while the copy is in flight; the
    caller's `shift_labels` are copied the ordinary way.
    """
    if shift_labels is not None:
        return shift_labels.reshape(-1).to(device)
    return shift_left(labels, ignore_index).reshape(-1).to(device, non_blocking=True)


def cross_entropy_module_forward(module: nn.Module, input: torch.Tensor, target: torch.Tensor):
    """What an ``nn.CrossEntropyLoss`` instance computes, with its own settings."""
    if module.weight is not None or input.dim() != 2 or target.is_floating_point():
        return F.cross_entropy(
            input,
            target,
            weight=module.weight,
            ignore_index=module.ignore_index,
            reduction=module.reduction,
            label_smoothing=module.label_smoothing,
        )
    loss = cross_entropy(
        input,
        target,
        ignore_index=module.ignore_index,
        label_smoothing=module.label_smoothing,
        reduction=module.reduction,
        inplace=False,
    )
    return loss.to(input.dtype)  # nn.CrossEntropyLoss returns the logits' dtype


def keep_positions(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The hidden states whose logits transformers' forward would compute (``logits_to_keep``)."""
    if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.ndim == 2:
        if logits_to_keep.dtype == torch.bool:
            return hidden[logits_to_keep]
        return torch.take_along_dim(hidden, logits_to_keep[..., None], dim=1)
    if isinstance(logits_to_keep, int):
        logits_to_keep = slice(-logits_to_keep, None)
    return hidden[:, logits_to_keep, :]


_CACHE_ARGS: dict[type, str] = {}


def _cache_arg(model_cls: type) -> str:
    """The decoder's name for the KV cache: ``cache`` (transformers >= 5.2x) or the older one."""
    if torch.compiler.is_compiling():
        # Read, not kept: Dynamo guards on the dict it reads, so filling it under a trace
        # would make the next call recompile.
        return _read_cache_arg(model_cls)
    name = _CACHE_ARGS.get(model_cls)
    if name is None:
        name = _CACHE_ARGS[model_cls] = _read_cache_arg(model_cls)
    return name


def _read_cache_arg(model_cls: type) -> str:
    params = inspect.signature(model_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def logit_softcap(model: nn.Module) -> float | None:
    """The family's ``final_logit_softcapping``: on its config, or on its text config when the
    config has no such attribute (Gemma 4's multimodal head reads it there)."""
    config = model.config
    if not hasattr(config, "final_logit_softcapping") and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return getattr(config, "final_logit_softcapping", None)


def logit_scale(model: nn.Module) -> float:
    """The factor a family's forward applies to ``lm_head``'s output. The loader's structure
    probe reads it from the forward and sets ``kernels_logit_ops`` on the class: (holder,
    attribute, "*" or "/") in order (Cohere multiplies by ``self.logit_scale``, Granite divides
    by ``config.logits_scaling``, HyperCLOVA X multiplies by it, Falcon-H1 by
    ``self.model.lm_head_multiplier``). Without that attribute:
    Cohere's and Granite's conventions."""
    ops = getattr(model, "kernels_logit_ops", None)
    if ops is None:
        ops = (("model", "logit_scale", "*"), ("config", "logits_scaling", "/"))
    scale = 1.0
    for holder, attr, op in ops:
        value = model if holder == "model" else model.config
        for part in attr.split("."):  # a dotted path: Falcon-H1's model.lm_head_multiplier
            value = getattr(value, part, None)
        if value is not None:
            scale = scale * float(value) if op == "*" else scale / float(value)
    return scale


def _head_logits(
    model: nn.Module,
    hidden: torch.Tensor,
    softcap: float | None,
    scale: float = 1.0,
    head: nn.Module | None = None,
) -> torch.Tensor:
    logits = (model.lm_head if head is None else head)(hidden)
    if scale != 1.0:
        logits = logits * scale
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def _through_module(module: nn.Module, fn, *args):
    """Run ``fn(*args)`` as ``module``'s forward, so that its hooks run around it: FSDP2 and
    ZeRO-3 gather a sharded ``lm_head.weight`` in a pre-forward hook and reduce its gradient
    after the backward, exactly as for ``module(*args)``. A module without hooks is not
    touched: ``fn`` runs directly."""
    if not has_hooks(module):
        return fn(*args)
    return _as_forward(module, fn, *args)


@torch.compiler.disable  # swaps an attribute on the module: not for Dynamo to trace
def _as_forward(module: nn.Module, fn, *args):
    own = module.__dict__.get("forward")
    module.forward = fn
    try:
        return module(*args)
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def fused_causal_lm_loss(
    model: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    softcap: float | None,
    kwargs: dict,
    scale: float = 1.0,
    head: nn.Module | None = None,
) -> torch.Tensor:
    """``ForCausalLMLoss`` of ``softcap(scale * lm_head(hidden))`` without materialising the
    logits. The scale multiplies the hidden states (one [tokens, hidden] product, not a
    [tokens, vocab] one), or the weight and bias when the head has a bias."""
    ignore_index = kwargs.get("ignore_index", -100)
    target = _labels_on(hidden.device, labels, kwargs.get("shift_labels"), ignore_index)
    rows = hidden.reshape(-1, hidden.shape[-1])
    if rows.shape[0] != target.shape[0]:
        raise ValueError(
            f"{rows.shape[0]} positions of hidden states but {target.shape[0]} labels; "
            "with labels, pass logits_to_keep=0 (or matching shift_labels)"
        )
    head = model.lm_head if head is None else head
    linear = linear_head(model, head)
    if head_terms(head, linear) is None:
        # an adapter the fused loss cannot fold in (DoRA, a quantized or custom head): the
        # head's own forward builds the logits, said once
        _warn_unfused(head)
        logits = _head_logits(model, rows, softcap, scale, head)
        return cross_entropy(
            logits,
            target,
            ignore_index=ignore_index,
            num_items=kwargs.get("num_items_in_batch"),
            inplace=False,
        )

    def loss_fn(x: torch.Tensor) -> torch.Tensor:
        x, weight, bias = head_operands(head, x, linear)
        if scale != 1.0:
            if bias is None:
                x = x * scale
            else:
                weight, bias = weight * scale, bias * scale
        return fused_linear_cross_entropy(
            x,
            weight,
            target,
            bias,
            ignore_index=ignore_index,
            softcap=softcap,
            num_items=kwargs.get("num_items_in_batch"),
        )

    return _through_module(head, loss_fn, rows)


def _plain_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def linear_head(model: nn.Module, head: nn.Module) -> bool:
    """Whether ``head`` is the model's output head and an ``nn.Linear`` subclass the loader's
    probe found computing ``F.linear(x, weight, bias)`` (``kernels_linear_head``: Idefics'
    decoupled head without extra vocabulary rows)."""
    return (
        getattr(model, "kernels_linear_head", False)
        and isinstance(head, nn.Linear)
        and head is output_head(model)
    )


def head_terms(head: nn.Module, linear: bool = False) -> list | None:
    """How the fused paths compute ``head(x)``: [] for a plain Linear (its weight and bias, or
    a PEFT LoRA Linear whose adapters are off or merged); for a PEFT LoRA Linear over a plain
    Linear, its active plain LoRA adapters as (lora_A, lora_B, dropout, scaling); None when the
    head computes something else (DoRA and other variants, other tuners, quantized layers).
    ``linear``: ``head`` is a Linear subclass known to compute the Linear (``linear_head``)."""
    if _plain_linear(head) or linear:
        return []
    base, adapters_a = getattr(head, "base_layer", None), getattr(head, "lora_A", None)
    if base is None or not isinstance(adapters_a, nn.ModuleDict) or not _plain_linear(base):
        return None
    merged, disabled = getattr(head, "merged", False), getattr(head, "disable_adapters", False)
    if disabled or merged:
        # disabled and merged: PEFT's forward unmerges first, so the weight is not the base one
        return None if disabled and merged else []
    terms = []
    for name in getattr(head, "active_adapters", ()):
        if name not in adapters_a:
            continue
        if name in getattr(head, "lora_variant", {}):
            return None
        a, b = adapters_a[name], head.lora_B[name]
        if not (_plain_linear(a) and _plain_linear(b)) or a.bias is not None:
            return None
        terms.append((a, b, head.lora_dropout[name], head.scaling[name]))
    return terms


def head_operands(head: nn.Module, x: torch.Tensor, linear: bool = False):
    """(x', W', b') with ``x' @ W'.T + b' == head(x)`` for the heads ``head_terms`` serves.

    A LoRA head adds s * B(A(drop(x))): its rank-r input s * A(drop(x)) is appended to x and
    B's weight to W (a [V, H + r] copy per call), so the fused kernels see one Linear and the
    adapters get their gradients through the concatenations; B's bias joins the bias."""
    terms = head_terms(head, linear)
    base = head if not terms and (linear or _plain_linear(head)) else head.base_layer
    weight, bias = base.weight, base.bias
    if not terms:
        return x, weight, bias
    inputs, weights = [x], [weight]
    for a, b, dropout, scaling in terms:
        low = a(dropout(x.to(a.weight.dtype))) * scaling
        inputs.append(low.to(x.dtype))
        weights.append(b.weight.to(weight.dtype))
        if b.bias is not None:
            extra = (b.bias * scaling).to(weight.dtype)
            bias = extra if bias is None else bias + extra
    return torch.cat(inputs, dim=-1), torch.cat(weights, dim=1), bias


def _warn_unfused(head: nn.Module) -> None:
    # warnings' default filter shows it once per place and message, not every step
    name = f"{type(head).__module__}.{type(head).__qualname__}"
    warnings.warn(
        f"kernels: the fused loss cannot fold lm_head's {name} into its kernel; this head's own "
        "forward builds the logits and the loss runs on them",
        stacklevel=3,
    )


def causal_lm_forward(
    model: nn.Module,
    input_ids,
    attention_mask,
    position_ids,
    cache,
    inputs_embeds,
    labels,
    use_cache,
    logits_to_keep,
    kwargs: dict,
    fused: bool = True,
    moe: bool = False,
):
    """The body of ``ForCausalLM.forward`` (module-level: layers hold no helpers); with
    ``fused=False`` the logits are built and the loss runs on the CE kernel; ``moe`` returns
    the MoE output class (no aux loss: router logits were not asked for)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    if kwargs.pop("fused_lm_head", False):
        return fused_lm_head_forward(
            model, input_ids, attention_mask, position_ids, cache, inputs_embeds, labels, kwargs
        )
    return_logits = kwargs.pop("return_logits", None)
    return_dict = kwargs.pop("return_dict", None)
    if cache is None:  # the name transformers' deprecate_kwarg maps onto `cache`
        cache = kwargs.pop("past_key_values", None)
    cache_arg = _cache_arg(type(model.model))
    own_cache = None
    if use_cache is None and cache is None and labels is not None and model.training:
        # no cache nobody asked for, in a step that will not decode, except one that keeps the
        # causal mask implicit (step_cache says why)
        cache = own_cache = step_cache(model, attention_mask, position_ids)
        use_cache = own_cache is not None
    embedding = getattr(model, "kernels_input_embedding", None)
    if (
        embedding
        and inputs_embeds is None
        and input_ids is not None
        and torch.compiler.is_compiling()
    ):
        # the probe saw the decoder use input_ids for this embedding only; traced here, its
        # backward is eager's kernel (embedding.py says why). Eager calls stay as they were.
        inputs_embeds = token_embedding(model.model.embed_tokens, input_ids, embedding)
        input_ids = None
    outputs = model.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        **{cache_arg: cache},
        **kwargs,
    )
    hidden = keep_positions(outputs.last_hidden_state, logits_to_keep)
    softcap = logit_softcap(model)
    scale = logit_scale(model)
    loss = logits = None
    if labels is None:
        logits = _head_logits(model, hidden, softcap, scale)
    elif not fused:
        logits = _head_logits(model, hidden, softcap, scale)
        loss = ForCausalLMLoss(
            logits,
            labels,
            logits.shape[-1],
            num_items_in_batch=kwargs.get("num_items_in_batch"),
            ignore_index=kwargs.get("ignore_index", -100),
            shift_labels=kwargs.get("shift_labels"),
        )
    else:
        loss = fused_causal_lm_loss(model, hidden, labels, softcap, kwargs, scale)
        if (not model.training) if return_logits is None else return_logits:
            logits = _head_logits(model, hidden, softcap, scale)
    extra = {"router_logits": getattr(outputs, "router_logits", None)} if moe else {}
    result = (MoeCausalLMOutputWithPast if moe else CausalLMOutputWithPast)(
        loss=loss,
        logits=logits,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
        **{cache_arg: None if own_cache is not None else getattr(outputs, cache_arg, None)},
        **extra,
    )
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    return result if return_dict else result.to_tuple()


def _decoder_inputs_from_labels(model: nn.Module, bound, labels) -> None:
    """An encoder-decoder whose forward makes its decoder inputs from the labels when the call
    gives none (``kernels_decoder_inputs`` names the method, set by the loader's probe): make
    them here, as the forward would, since it runs without labels."""
    maker = getattr(model, "kernels_decoder_inputs", None)
    args = bound.arguments
    if (
        maker
        and labels is not None
        and args.get("decoder_input_ids") is None
        and args.get("decoder_inputs_embeds") is None
    ):
        args["decoder_input_ids"] = getattr(model, maker)(labels)


def label_positions(model: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The head inputs the loss is on: all of them, or, where the loader's probe set
    ``kernels_label_positions`` (a forward that drops an image prefix of its logits: GIT),
    the last ones, as many as the labels have positions."""
    if not getattr(model, "kernels_label_positions", False) or labels is None:
        return hidden
    keep = labels.shape[-1]
    if hidden.shape[1] < keep:
        raise ValueError(f"{keep} label positions but {hidden.shape[1]} positions of logits")
    return hidden[:, hidden.shape[1] - keep :]


_SIGNATURES: dict[type, inspect.Signature] = {}


def _signature(cls: type) -> inspect.Signature:
    sig = _SIGNATURES.get(cls)
    if sig is None:
        sig = _SIGNATURES[cls] = inspect.signature(cls.forward)
    return sig


def output_head(model: nn.Module) -> nn.Module:
    """The Linear that makes the logits: ``lm_head``, or the submodule the loader's structure
    probe named in ``kernels_output_head`` (BERT-style heads: ``cls.predictions.decoder``)."""
    return model.get_submodule(getattr(model, "kernels_output_head", "lm_head"))


@torch.compiler.disable  # swaps lm_head's forward for one call
def _run_without_logits(model: nn.Module, bound: inspect.BoundArguments) -> tuple:
    """The family's forward with lm_head returning a 0-d placeholder; (output, lm_head input)."""
    head = output_head(model)
    captured: list[torch.Tensor] = []

    def keep_input(hidden: torch.Tensor) -> torch.Tensor:
        captured.append(hidden)
        return hidden.new_zeros(())  # softcap / scaling / .float() of it are free

    own = head.__dict__.get("forward")
    head.forward = keep_input
    try:
        out = type(model).forward(*bound.args, **bound.kwargs)
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own
    if len(captured) != 1:
        raise RuntimeError(f"{type(model).__name__} called lm_head {len(captured)} times, not once")
    return out, captured[0]


def any_causal_lm_forward(model: nn.Module, args: tuple, kwargs: dict):
    """The body of ``CausalLMHead.forward``."""
    kwargs = dict(kwargs)
    return_logits = kwargs.pop("return_logits", None)
    fused_head = kwargs.pop("fused_lm_head", False)
    options = _fused_options(kwargs) if fused_head else None
    sig = _signature(type(model))
    bound = sig.bind(model, *args, **kwargs)
    labels = bound.arguments.get("labels")
    if labels is None and not fused_head:
        return type(model).forward(*bound.args, **bound.kwargs)
    _decoder_inputs_from_labels(model, bound, labels)
    if "labels" in bound.arguments:
        bound.arguments["labels"] = None
    var_kw = next((n for n, p in sig.parameters.items() if p.kind is p.VAR_KEYWORD), None)
    extra = dict(bound.arguments.get(var_kw) or {}) if var_kw else {}
    if (
        "use_cache" in sig.parameters
        and bound.arguments.get("use_cache") is None
        and model.training
    ):
        bound.arguments["use_cache"] = (
            False  # a cache nobody asked for, in a step that will not decode
        )
    if fused_head:
        if "use_cache" in sig.parameters:
            bound.arguments["use_cache"] = False
        if (
            "output_router_logits" in sig.parameters
            and bound.arguments.get("output_router_logits") is None
        ):
            wanted = getattr(model.config.get_text_config(), "output_router_logits", False)
            bound.arguments["output_router_logits"] = wanted
    out, hidden = _run_without_logits(model, bound)
    if fused_head:
        aux = None if isinstance(out, tuple) else out.get("aux_loss")
        if getattr(model, "kernels_shift_labels", True) == "items":
            # a masked-LM loss: the labels as they are; the model's own loss ignores a caller's
            # shift_labels, and so does this one
            options["shift_labels"] = labels
        given = options["shift_labels"]
        rows = label_positions(model, hidden, labels if given is None else given)
        return fused_lm_head_output(model, rows, labels, output_head(model), options, aux)
    softcap = logit_softcap(model)
    scale = logit_scale(model)
    head = output_head(model)
    shift = getattr(model, "kernels_shift_labels", True)
    if shift == "items":
        # transformers' masked-LM loss (an encoder-decoder's decoder): the labels as they are,
        # ignore_index and num_items_in_batch as the causal loss takes them
        extra = {**extra, "shift_labels": labels}
    elif not shift:
        # nn.CrossEntropyLoss over labels the caller shifted (BART-style decoders): mean over
        # the non-ignored tokens, no num_items_in_batch
        extra = {"shift_labels": labels}
    given = extra.get("shift_labels")
    rows = label_positions(model, hidden, labels if given is None else given)
    loss = fused_causal_lm_loss(model, rows, labels, softcap, extra, scale, head)
    aux_spec = getattr(model, "kernels_aux_loss", None)
    aux = None if isinstance(out, tuple) else out.get("aux_loss")
    if aux_spec is not None and aux is not None:
        # the family adds `coef * aux_loss` to the loss only with labels: so do we
        holder, attr = aux_spec
        coef = model if holder == "model" else model.config
        for part in attr.split("."):  # a dotted path: a VLM's config.text_config.<coef>
            coef = getattr(coef, part)
        loss = loss + coef * aux.to(loss.device)
    logits = None
    if (not model.training) if return_logits is None else return_logits:
        logits = _head_logits(model, hidden, softcap, scale, head)
    if isinstance(out, tuple):  # return_dict=False: (logits, *rest) without labels
        return (loss, logits, *out[1:])
    out["loss"] = loss
    out["logits"] = logits
    return out


# -- TRL's fused LM head contract (``model(..., labels=..., fused_lm_head=True)``) --------------

FUSED_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
_FUSED_OUTPUT: list[type] = []


def fused_output_class() -> type:
    """A transformers ``ModelOutput`` with the fields of TRL 1.16's ``FusedCausalLMOutput``
    (made on first use: transformers is imported lazily)."""
    if not _FUSED_OUTPUT:
        from dataclasses import dataclass

        from transformers.utils import ModelOutput

        @dataclass
        class FusedCausalLMOutput(ModelOutput):
            loss: torch.Tensor | None = None
            log_probs: torch.Tensor | None = None
            entropy: torch.Tensor | None = None
            log_sum_sq_probs: torch.Tensor | None = None
            mean_logits: torch.Tensor | None = None
            is_top1: torch.Tensor | None = None
            label_mask: torch.Tensor | None = None
            aux_loss: torch.Tensor | None = None

        _FUSED_OUTPUT.append(FusedCausalLMOutput)
    return _FUSED_OUTPUT[0]


def _fused_options(kwargs: dict) -> dict:
    """The fused-head arguments of a call, taken out of the kwargs the backbone gets:
    TRL's ``labels``/``shift_labels``/``num_items_in_batch`` and this layer's ``temperature``
    and ``fused_outputs`` (TRL sets those two once, in ``add_fused_lm_head``)."""
    outputs = tuple(kwargs.pop("fused_outputs", ("log_probs",)))
    unknown = set(outputs) - set(FUSED_FIELDS)
    if unknown:
        raise ValueError(f"fused_outputs {sorted(unknown)} unknown; choose among {FUSED_FIELDS}")
    return {
        "shift_labels": kwargs.pop("shift_labels", None),
        "num_items_in_batch": kwargs.pop("num_items_in_batch", None),
        "temperature": kwargs.pop("temperature", 1.0),
        "outputs": outputs if "log_probs" in outputs else ("log_probs", *outputs),
    }


def fused_lm_head_forward(
    model, input_ids, attention_mask, position_ids, cache, inputs_embeds, labels, kwargs: dict
):
    """``fused_lm_head=True`` on a Llama-style head: the backbone without a cache, then the
    per-token fields of TRL's contract from the fused log-prob kernel (no [tokens, vocab]
    logits), plus the MoE load-balancing loss when router logits are asked for."""
    options = _fused_options(kwargs)
    for name in ("return_logits", "return_dict", "use_cache", "past_key_values"):
        kwargs.pop(name, None)
    outputs = model.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        inputs_embeds=inputs_embeds,
        use_cache=False,
        **kwargs,
    )
    aux = None
    if kwargs.get("output_router_logits"):
        aux = _load_balancing_loss(model, outputs.router_logits, attention_mask)
    return fused_lm_head_output(
        model, outputs.last_hidden_state, labels, model.lm_head, options, aux
    )


def _load_balancing_loss(model: nn.Module, router_logits, attention_mask) -> torch.Tensor:
    """The router's load-balancing loss as TRL's fused head computes it (Mixtral's function,
    which every MoE family of transformers shares)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    config = model.config.get_text_config()
    return load_balancing_loss_func(
        router_logits, config.num_experts, config.num_experts_per_tok, attention_mask
    )


def fused_lm_head_output(
    model: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor | None,
    head: nn.Module,
    options: dict,
    aux: torch.Tensor | None = None,
):
    """TRL's ``FusedCausalLMOutput`` for the hidden states of every position: labels shifted
    left (or the caller's ``shift_labels`` as they are), only the positions whose label is not
    -100 projected, every field zero elsewhere; loss = -sum(log_probs) / (kept count or
    ``num_items_in_batch``), plus ``router_aux_loss_coef * aux``."""
    shift_labels = options["shift_labels"]
    if shift_labels is not None:
        targets = shift_labels
    elif labels is not None:
        hidden, targets = hidden[:, :-1], labels[:, 1:]
    else:
        raise ValueError("fused_lm_head=True needs labels (or shift_labels)")
    linear = linear_head(model, head)
    if head_terms(head, linear) is None:
        raise ValueError(
            f"fused_lm_head=True reads lm_head's weight, but lm_head is a {type(head).__name__} "
            "(not a plain Linear nor a plain LoRA Linear); call without fused_lm_head"
        )
    targets = targets.to(hidden.device)
    mask = targets != -100
    rows = hidden[mask]

    def fields_fn(x: torch.Tensor):
        x, weight, bias = head_operands(head, x, linear)
        return fused_linear_logprob(
            x,
            weight,
            targets[mask],
            bias,
            temperature=options["temperature"],
            softcap=logit_softcap(model),
            logit_scale=logit_scale(model),
            outputs=options["outputs"],
        )

    found = _through_module(head, fields_fn, rows)
    # masked_scatter keeps an all-ignored batch connected to the graph (a zero loss that
    # backpropagates), as TRL's head does
    per_token = {
        name: None if value is None else value.new_zeros(mask.shape).masked_scatter(mask, value)
        for name, value in zip(FUSED_FIELDS, found, strict=True)
    }
    num_items = options["num_items_in_batch"]
    count = mask.sum().clamp(min=1) if num_items is None else num_items
    loss = -per_token["log_probs"].sum() / count
    if aux is not None:
        loss = loss + getattr(model.config.get_text_config(), "router_aux_loss_coef", 0.0) * aux
    return fused_output_class()(loss=loss, label_mask=mask, aux_loss=aux, **per_token)
