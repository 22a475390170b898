"""What each module of a causal LM *is*, decided from its structure, and which training-kernel
layer serves it.

No family table: a module class is recognised by what it holds (a weight vector and an epsilon;
gate/up/down projections and an activation; 3-D expert weights; an ``lm_head`` and a decoder),
by its forward's signature, and by a numerical probe (probes.py) that runs its own forward next
to the kernel layer's formula. A rotary function is found in the code of the module that calls
it (``apply_rotary_pos_emb*`` globals), decorated by transformers or not.

``classify(model)`` returns a ``Plan``: per module class a ``Verdict`` (the kernel layer, or the
one-line reason none fits) and the rotary functions with their callers. ``Plan.mark()`` gives
the classes the layer names kernelize binds by.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..layers.decorators import function_key, replace_kernel_forward_from_hub
from ..layers.funcs import KernelFunction, make_function_module
from . import mask_skip, multimodal, probes
from .attention import qkv_attention_verdict

UNSERVED = "_kernels_unserved"  # cls.__dict__: {kind: reason}, read by kernelize's report
_ATTACHED = "_kernels_attached_funcs"  # cls.__dict__: functions added to its _kernel_funcs

# The causal-LM head layer's arguments (loss_layers.ForCausalLM.forward), in order.
HEAD_ARGS = ("input_ids", "attention_mask", "position_ids", "cache", "inputs_embeds", "labels",
             "use_cache", "logits_to_keep")  # fmt: skip


@dataclass(frozen=True)
class Verdict:
    """``layer`` is the training repo's layer class serving the module (its layer name too);
    None with a ``reason`` when nothing serves it."""

    kind: str  # norm, mlp, experts, rotary, loss, activation, attention
    layer: str | None
    reason: str = ""
    condition: Callable[[nn.Module], bool] | None = None
    # class attributes the layer reads (the loss head's logit scaling ops)
    attributes: tuple[tuple[str, object], ...] = ()


@dataclass(frozen=True)
class RotaryUse:
    """A rotary function a module class calls through the global ``name`` of its module."""

    owner: type
    name: str
    namespace: dict
    function: Callable
    verdict: Verdict


@dataclass
class Plan:
    classes: dict[type, Verdict] = field(default_factory=dict)
    rotary: list[RotaryUse] = field(default_factory=list)

    def served(self) -> set[str]:
        found = {v.layer for v in self.classes.values() if v.layer}
        return found | {u.verdict.layer for u in self.rotary if u.verdict.layer}

    def unserved(self) -> list[tuple[str, str, str]]:
        """(class name, kind, reason) of every module class left as it is."""
        rows = [(c.__name__, v.kind, v.reason) for c, v in self.classes.items() if not v.layer]
        rows += [
            (u.owner.__name__, "rotary", u.verdict.reason)
            for u in self.rotary
            if not u.verdict.layer
        ]
        return rows

    def mark(self, model: nn.Module | None = None) -> None:
        """Give served classes their layer names (process-wide, as transformers' decorators do)
        and unserved ones their reason; route served rotary functions through a KernelFunction
        that the calling class (and its instances in ``model``) list in ``_kernel_funcs``."""
        served = self.served()
        if any(name == STEP_CACHE for v in self.classes.values() for name, _ in v.attributes):
            mask_skip.backport()  # the step cache's implicit mask, compiled on older torches
        for cls, verdict in self.classes.items():
            reasons = dict(cls.__dict__.get(UNSERVED) or {})
            if verdict.layer:
                replace_kernel_forward_from_hub(cls, verdict.layer, verdict.condition)
                for name, value in verdict.attributes:
                    setattr(cls, name, value)
                reasons.pop(verdict.kind, None)
            else:
                reasons[verdict.kind] = verdict.reason
                if getattr(cls, "kernel_layer_name", None) in served:
                    # transformers named it like a layer that does not compute what it does
                    cls.kernel_condition = staticmethod(_never)
            _set_reasons(cls, reasons)
        for use in self.rotary:
            reasons = dict(use.owner.__dict__.get(UNSERVED) or {})
            if not use.verdict.layer:
                reasons["rotary"] = use.verdict.reason
                _set_reasons(use.owner, reasons)
                if isinstance(use.function, KernelFunction):
                    type(use.function).kernel_condition = staticmethod(_never)
                continue
            reasons.pop("rotary", None)
            _set_reasons(use.owner, reasons)
            func = use.function
            if not isinstance(func, KernelFunction):
                func = make_function_module(func, use.verdict.layer, None)
                use.namespace[use.name] = func  # same result unbound; bindable per caller
            else:
                # transformers' name may promise another layout than the function computes
                type(func).kernel_layer_name = use.verdict.layer
            _attach(use.owner, func, model)


def _never(module: nn.Module) -> bool:
    return False


def _set_reasons(cls: type, reasons: dict) -> None:
    if reasons:
        setattr(cls, UNSERVED, reasons)
    elif UNSERVED in cls.__dict__:
        delattr(cls, UNSERVED)


def _attach(owner: type, func: KernelFunction, model: nn.Module | None) -> None:
    """``owner`` instances list ``func`` in ``_kernel_funcs``: new ones through __init__, the
    ones already in ``model`` now."""
    key = function_key(func)
    attached = owner.__dict__.get(_ATTACHED)
    if attached is None:
        attached = {}
        original_init = owner.__init__

        def __init__(self, *args, **kwargs):  # noqa: N807
            original_init(self, *args, **kwargs)
            for name, fn in owner.__dict__[_ATTACHED].items():
                _list_function(self, name, fn)

        __init__.__wrapped__ = original_init  # type: ignore[attr-defined]
        owner.__init__ = __init__
        setattr(owner, _ATTACHED, attached)
    attached[key] = func
    if model is not None:
        for module in model.modules():
            if type(module) is owner:
                _list_function(module, key, func)


def _list_function(module: nn.Module, key: str, func: KernelFunction) -> None:
    funcs = module.__dict__.setdefault("_kernel_funcs", {})
    if all(f is not func for f in funcs.values()):  # listed once, whatever its key
        funcs[key] = func


# -- per kind ---------------------------------------------------------------------------------


def _is_linear(m: object) -> bool:
    w = getattr(m, "weight", None)
    return isinstance(m, nn.Module) and w is not None and w.dim() == 2 and not m._modules


def _param_dims(module: nn.Module, name: str) -> int | None:
    p = module._parameters.get(name)
    return None if p is None else p.dim()


def norm_verdict(
    module: nn.Module,
    available: Callable[[str], str | None],
    variants: Sequence[nn.Module] = (),
) -> Verdict:
    """The layer for ``module``'s class. ``variants``: one instance of the class per other
    parameter layout in the model (MuseGlimmer's RMSNorm, weighted and scale-free). A class binds
    one layer: a weighted layout's, which also serves the weight-less instances where its formula
    without a weight is the weight-less norm (WEIGHTLESS_SERVED_BY); other layouts keep their
    forward."""
    found = [(m, _norm_layout_verdict(m, available)) for m in (module, *variants)]
    bound = [(m, v) for m, v in found if v.layer]
    if not bound:
        return found[0][1]
    layer = next((v.layer for _, v in bound if v.layer != "WeightlessRMSNorm"), bound[0][1].layer)
    layouts = {
        _layout(m)
        for m, v in bound
        if v.layer == layer or (v.layer == "WeightlessRMSNorm" and layer in WEIGHTLESS_SERVED_BY)
    }
    attributes = next(v.attributes for _, v in bound if v.layer == layer)
    return Verdict("norm", layer, condition=lambda m: _layout(m) in layouts, attributes=attributes)


# Norm layers whose forward, given an instance without a weight, computes the weight-less norm.
WEIGHTLESS_SERVED_BY = frozenset({"RMSNormFloatWeight"})
# The class attribute RMSNorm and MemoryEfficientRMSNorm read (layers.py).
NORM_CASTS_TO_WEIGHT = "kernels_norm_casts_to_weight"


def _norm_layout_verdict(module: nn.Module, available: Callable[[str], str | None]) -> Verdict:
    cls = type(module)
    if not probes.one_tensor_forward(cls):
        return Verdict("norm", None, "forward takes more than the hidden states (a gated norm)")
    weight = module._parameters.get("weight")
    if weight is not None and weight.dim() != 1:
        return Verdict(
            "norm", None, f"weight is {weight.dim()}-D, not one vector over the last dim"
        )
    layer, reason = probes.probe_norm(module)
    if layer is None:
        return Verdict("norm", None, reason)
    missing = available(layer)
    if missing:
        return Verdict("norm", None, missing)
    if layer == "RMSNorm" and probes.casts_to_weight_dtype(module):
        # T5-style: the layer takes the module's own formula when x and the weight differ in
        # dtype (an fp16 T5 keeps `wo` in fp32, so its residual stream is fp32).
        return Verdict("norm", layer, attributes=((NORM_CASTS_TO_WEIGHT, True),))
    return Verdict("norm", layer)


def _layout(module: nn.Module) -> frozenset:
    """Which parameters an instance holds and their ranks: instances of one class may differ
    (elementwise_affine=False, a 2-D q/k-norm weight, MuseGlimmer's with_scale=False)."""
    return frozenset((n, p.dim()) for n, p in module._parameters.items() if p is not None)


def norm_layouts(model: nn.Module, module: nn.Module) -> list[nn.Module]:
    """One instance of ``module``'s class in ``model`` per parameter layout it does not have."""
    seen, found = {_layout(module)}, []
    for m in model.modules():
        if type(m) is type(module) and (key := _layout(m)) not in seen:
            seen.add(key)
            found.append(m)
    return found


def mlp_verdict(module: nn.Module, available: Callable[[str], str | None]) -> Verdict | None:
    """None when the module is no MLP at all."""
    children = module._modules
    fused = _is_linear(children.get("gate_up_proj")) and _is_linear(children.get("down_proj"))
    separate = all(_is_linear(children.get(n)) for n in ("gate_proj", "up_proj", "down_proj"))
    if not (fused or separate):
        orders = probes.gated_orders(module)
        if orders and (v := named_gated_verdict(module, orders, available)) is not None:
            return v
        plain = _plain_projections(module)
        if plain is not None and (v := plain_mlp_verdict(module, plain, available)) is not None:
            return v
        if type(module).__name__.lower().endswith("mlp") and probes.one_tensor_forward(
            type(module)
        ):
            return Verdict(
                "mlp",
                None,
                "not gated (no gate/up projections): only its activation could be fused",
            )
        return None
    act = probes.activation_of(module)
    if act is None:
        return Verdict("mlp", None, "no act_fn / activation_fn module")
    name = type(act).__name__
    scaled = probes.has_multipliers(module)
    if name in probes.SILU_NAMES:
        layer = "FusedSwiGLUMLP" if fused else "SwiGLUMLP"
    elif name in probes.GELU_NAMES and name != "QuickGELUActivation":
        layer = "FusedGeGLUMLP" if fused else "GeGLUMLP"
    else:
        return Verdict("mlp", None, f"activation {name} has no fused gated kernel (SiLU, GELU)")
    if scaled:
        if layer != "SwiGLUMLP":
            return Verdict("mlp", None, f"gate/down multipliers: no scaled layer for {layer}")
        layer = "ScaledSwiGLUMLP"  # Falcon-H1: down(silu(gate(x) * g) * up(x)) * d
    if not probes.one_tensor_forward(type(module)) or not probes.probe_mlp(module, fused, scaled):
        want = "down(act(gate(x) * g) * up(x)) * d" if scaled else "down(act(gate(x)) * up(x))"
        return Verdict("mlp", None, f"does not compute {want}")
    missing = available(layer)
    return Verdict("mlp", None, missing) if missing else Verdict("mlp", layer)


def named_gated_verdict(
    module: nn.Module, orders: list[tuple[str, str, str]], available: Callable[[str], str | None]
) -> Verdict | None:
    """SwiGLUMLP / GeGLUMLP for a gated MLP whose three projections have other names (LFM2's
    w1/w3/w2, T5's wi_0/wi_1/wo) or whose activation is called inline (``F.silu``): which child
    is the gate, the up and the down projection, and the activation, are told by running it.
    None when no order and activation fit (the caller goes on to the non-gated rules)."""
    if not probes.one_tensor_forward(type(module)):
        return None
    found = next(((o, k) for o in orders if (k := probes.probe_gated_mlp(module, o))), None)
    if found is None:
        return None
    order, kind = found
    dropout = [n for n, m in module._modules.items() if isinstance(m, nn.Dropout) and m.p > 0]
    if dropout:
        # the fused layer has no dropout: binding it would train another model
        return Verdict("mlp", None, f"applies dropout ({dropout[0]}) the fused layer does not")
    layer = "SwiGLUMLP" if kind == "silu" else "GeGLUMLP"
    missing = available(layer)
    if missing:
        return Verdict("mlp", None, missing)
    return Verdict(
        "mlp",
        layer,
        condition=_serves_named_gated,
        attributes=((MLP_PROJECTIONS, order), (MLP_ACTIVATION, kind)),
    )


def _serves_named_gated(module: nn.Module) -> bool:
    """Per instance, when it is bound: not one whose config turned dropout on (T5's
    dropout_rate), nor one whose projections differ in dtype (T5 keeps ``wo`` in fp32 under an
    fp16 load, and its own forward casts to it; the fused layer would not), and its activation
    is the one its class was marked with (``_pins_activation``)."""
    if _active_dropout(module) or _mixed_dtypes(module):
        return False
    return _pins_activation(module)


def _serves_plain(module: nn.Module) -> bool:
    """Per instance, when it is bound: no active dropout (the class may differ per instance:
    T5's dropout_rate), projections of one dtype (T5's and UDOP's wi -> relu -> wo keep ``wo``
    in fp32 under an fp16 load), and its activation is the one its class was marked with."""
    return not _active_dropout(module) and not _mixed_dtypes(module) and _pins_activation(module)


def _mixed_dtypes(module: nn.Module) -> bool:
    """Whether the children its MLP layer runs (``kernels_mlp_projections``) hold weights of
    more than one dtype: the module's own forward casts between them, the fused layer would not."""
    children = (module._modules.get(n) for n in getattr(module, MLP_PROJECTIONS, ()))
    weights = (getattr(c, "weight", None) for c in children)
    return len({w.dtype for w in weights if isinstance(w, torch.Tensor)}) > 1


def _pins_activation(module: nn.Module) -> bool:
    """The layers read the activation from ``kernels_mlp_activation``, set on the class for the
    whole process; a second model of the same class with another activation would change the
    first one's. So an instance is bound only when its own activation module (where it has one)
    computes the marked kind, and that kind is then pinned on the instance."""
    kind = getattr(module, MLP_ACTIVATION, None)  # the instance's pin, else the class's mark
    act = probes.activation_of(module)
    if kind is not None and act is not None and _kind_of(act) != kind:
        return False
    if kind is not None:
        module.__dict__[MLP_ACTIVATION] = kind
    return True


def _kind_of(act: nn.Module) -> str | None:
    """The kernels' name for what an activation module computes, told by running it."""
    if kind := multimodal.gelu_kind(act):
        return kind
    if probes.computes_silu(act):
        return "silu"
    return "relu" if probes.computes_relu(act) else None


def _active_dropout(module: nn.Module) -> str | None:
    """The name of a dropout with p > 0 the module applies: an nn.Dropout child, or a float
    attribute named for dropout that its forward hands to F.dropout (Kosmos-2.5's FFN)."""
    for name, m in module._modules.items():
        if isinstance(m, nn.Dropout) and m.p > 0:
            return name
    for name, value in vars(module).items():
        if "dropout" in name and isinstance(value, float) and value > 0:
            return name
    return None


# The class attributes ReLUSquaredMLP, GELUMLP and the gated layers (for other child names)
# read: the names of the (in, out) projections, or (gate, up, down); which activation
# ("gelu", "gelu_tanh", "quick_gelu"; "silu" for a gated one).
MLP_PROJECTIONS = "kernels_mlp_projections"
MLP_ACTIVATION = "kernels_mlp_activation"
# MultimodalRotaryEmbedding reads (sections layout, repeated pairs) from its module's class.
MROPE_LAYOUT = "kernels_mrope_layout"


def _plain_projections(module: nn.Module) -> tuple[str, str] | None:
    """The two Linear child names of a non-gated MLP, in registration order: exactly two
    Linears, one [inner, hidden] and the other [hidden, inner]; None for anything else. Which
    one comes first in the forward is left to the probe."""
    linears = [(n, m) for n, m in module._modules.items() if _is_linear(m)]
    if len(linears) != 2:
        return None
    (first, w1), (second, w2) = ((n, m.weight) for n, m in linears)
    if w1.shape[0] != w2.shape[1] or w1.shape[1] != w2.shape[0]:
        return None
    return first, second


def plain_mlp_verdict(
    module: nn.Module, projections: tuple[str, str], available: Callable[[str], str | None]
) -> Verdict | None:
    """ReLUSquaredMLP for out(relu(in(x))^2) (Nemotron, Arcee, Persimmon, ...), GELUMLP for
    out(gelu(in(x))) with an erf, tanh or quick GELU (vision towers: CLIP, SigLIP, Qwen2-VL,
    ...); None for another activation (the caller reports what it reports for non-gated MLPs)."""
    act = probes.activation_of(module)
    if act is None:
        return None
    first, second = projections
    if probes.computes_relu_squared(act):
        layer, want, extra = "ReLUSquaredMLP", f"{second}(relu({first}(x))^2)", ()
    elif (kind := multimodal.gelu_kind(act)) is not None or probes.computes_relu(act):
        kind = kind or "relu"  # T5's and UDOP's wi -> relu -> wo: the same kernel, another act
        layer, want, extra = "GELUMLP", f"{second}({kind}({first}(x)))", ((MLP_ACTIVATION, kind),)
    else:
        return None
    dropout = _active_dropout(module)
    if dropout:
        # the fused layer has no dropout: binding it would train another model
        return Verdict("mlp", None, f"applies dropout ({dropout}) the fused layer does not")
    # a norm between the projections (Kosmos-2.5's text FFN): GELUNormMLP runs it as it is
    norms = [n for n, m in module._modules.items() if is_norm(m)]
    norm = norms[0] if len(norms) == 1 and layer == "GELUMLP" else None
    if norm is not None:
        layer, want = "GELUNormMLP", f"{second}({norm}({kind}({first}(x))))"
    # registration order is usually the forward's; a module may declare the output one first
    orders = (projections, projections[::-1]) if probes.one_tensor_forward(type(module)) else ()
    order = next((o for o in orders if probes.probe_plain_mlp(module, *o, norm)), None)
    if order is None:
        return Verdict("mlp", None, f"does not compute {want}")
    if norm is not None:
        order = (order[0], norm, order[1])
    missing = available(layer)
    if missing:
        return Verdict("mlp", None, missing)
    return Verdict(
        "mlp",
        layer,
        condition=_serves_plain,
        attributes=((MLP_PROJECTIONS, order), *extra),
    )


def rotary_embedding_verdict(
    module: nn.Module, available: Callable[[str], str | None]
) -> Verdict | None:
    """MultimodalRotaryEmbedding for a rotary embedding whose frequencies take the positions of
    three axes by sections (multimodal.py); None for any other module. Instances whose rotary
    type updates its frequencies as it goes (dynamic, long-RoPE) keep their forward."""
    if not multimodal.is_multimodal_rotary(module):
        return None
    found, reason = multimodal.probe_mrope(module)
    if found is None:
        return Verdict("rotary_embedding", None, reason)
    missing = available("MultimodalRotaryEmbedding")
    if missing:
        return Verdict("rotary_embedding", None, missing)
    return Verdict(
        "rotary_embedding",
        "MultimodalRotaryEmbedding",
        condition=lambda m: not multimodal.dynamic_rope(m),
        attributes=((MROPE_LAYOUT, found),),
    )


def activation_verdict(module: nn.Module, available: Callable[[str], str | None]) -> Verdict | None:
    """ReLUSquared for a parameter-free module computing relu(x)^2; None for any other module
    (activations the MLP layers fuse are served there, not on their own)."""
    if not probes.one_tensor_forward(type(module)) or not probes.computes_relu_squared(module):
        return None
    missing = available("ReLUSquared")
    return Verdict("activation", None, missing) if missing else Verdict("activation", "ReLUSquared")


def experts_verdict(
    module: nn.Module,
    available: Callable[[str], str | None],
    experts_check: Callable[[nn.Module], str | None] | None,
) -> Verdict | None:
    if _param_dims(module, "gate_up_proj") != 3 or _param_dims(module, "down_proj") != 3:
        return None
    if available("MoEExperts"):
        return Verdict("experts", None, "no experts kernel in this build")
    if not _routed_experts_forward(type(module)):
        # Llama4's experts take tokens already sorted per expert (forward(hidden_states)): the
        # layer, called with transformers' (hidden_states, top_k_index, top_k_weights), cannot
        # replace that forward, and binding it would fail the whole model.
        return Verdict(
            "experts", None, "forward is not (hidden_states, top_k_index, top_k_weights)"
        )
    reason = experts_check(module) if experts_check is not None else None
    return Verdict("experts", None, reason) if reason else Verdict("experts", "MoEExperts")


def _routed_experts_forward(cls: type) -> bool:
    """Whether ``cls.forward`` takes transformers' routed-experts arguments: three positional
    parameters after self (hidden states, top-k expert indices, top-k weights)."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    return len(params) == 3 and all(
        p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params
    )


# Lines a *ForCausalLM forward may have between lm_head and the loss, and what each needs.
_HEAD_LINE_OK = re.compile(
    r"^\s*("
    r"if .*(softcap|scal).*:|else:"
    r"|\w+ = self\.\w+\(.*\)"  # the call itself
    r"|\w+ = \w+\.(float\(\)|to\(torch\.float32\))"  # a cast to fp32 (the fused loss is fp32)
    r"|\w+ = (\w+(\.float\(\))?|self\.\w+\(.*\)) ?[*/] ?self\.(config\.(text_config\.)?|model\.)?(final_logit_softcapping|logit_scale|logits_scaling|lm_head_multiplier|output_multiplier)\)?"
    r"|\w+ = torch\.tanh\(\w+\)( \* self\.config\.final_logit_softcapping)?"
    r"|\w+ = \w+ ?[*/] ?final_logit_softcapping"  # a local read from the (text) config
    r'|final_logit_softcapping = getattr\(self\.config\.get_text_config\(\), "final_logit_softcapping", None\)'
    r"|if final_logit_softcapping is not None:"
    # the last hidden states collected (Pix2Struct's decoder), the logits not touched
    r"|if output_hidden_states:|all_hidden_states = all_hidden_states \+ \(hidden_states,\)"
    r")\s*$"
)


def head_verdict(model: nn.Module, available: Callable[[str], str | None]) -> Verdict:
    """ForCausalLM (MoEForCausalLM) for Llama-style heads: ``self.model`` decoder, the usual
    arguments; CausalLMHead for any other forward that ends in ``self.lm_head(hidden)`` and
    ``self.loss_function``. Either way the logits may only be soft-capped or scaled."""
    cls = type(model)
    head_path = _output_head_path(model)
    if head_path is None:
        return Verdict("loss", None, "no output embedding (lm_head) among its modules")
    head = model.get_submodule(head_path)
    # the fused loss reads the head's weight/bias: a head with its own forward (a per-token
    # scale, a LoRA wrapper, a quantized matmul) must run it
    linear_head = isinstance(head, nn.Linear) and type(head).forward is not nn.Linear.forward
    if not (isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward):
        # a Linear subclass whose forward computes the Linear and nothing more (Idefics'
        # decoupled head without extra vocabulary rows) binds: the loss layers read its
        # weight and bias as a plain Linear's
        if not (linear_head and probes.computes_linear(head)):
            return Verdict("loss", None, f"{head_path} is not a plain nn.Linear")
    source = _forward_source(cls)
    if source is None:
        return Verdict("loss", None, "its forward's source cannot be read")
    # transformers' causal loss (labels shifted inside), or nn.CrossEntropyLoss over labels
    # the caller already shifted (BART-style decoders): the fused loss does either
    unshifted = "self.loss_function(" not in source
    if unshifted and not _PLAIN_CE.search(source):
        return Verdict(
            "loss",
            None,
            "computes its loss neither with self.loss_function nor a plain CrossEntropyLoss",
        )
    # an encoder-decoder's masked-LM loss: the labels as they are (the decoder's inputs are
    # the labels shifted right), mean over them or / num_items_in_batch
    masked = not unshifted and _loss_name(model) == "ForMaskedLMLoss"
    top = head_path.split(".")[0]
    nested = _inner_head_path(model) == head_path
    source = _config_aliases(model, source)
    problem, ops = _logits_problem(model, source, top, nested)
    if problem:
        return Verdict("loss", None, problem)
    if nested:
        # a language model's head inside a submodule (Nemotron-H Omni): what that
        # model's forward does between its head and its logits must be known as well
        problem, inner_ops = _inner_logits_problem(model, top, head_path)
        if problem:
            return Verdict("loss", None, problem)
        ops = (*inner_ops, *ops)
    decoder_inputs = _decoder_inputs_maker(source)
    problem, last_positions = _loss_inputs_problem(source, top, nested, bool(decoder_inputs))
    if problem:
        return Verdict("loss", None, problem)
    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    names = tuple("cache" if p.name == "past_key_values" else p.name for p in params)
    moe = "output_router_logits" in names
    plain = tuple(n for n in names[:-1] if n != "output_router_logits")
    llama_style = (
        head_path == "lm_head"
        and isinstance(getattr(model, "model", None), nn.Module)
        and plain == HEAD_ARGS
        and bool(params)
        and params[-1].kind is params[-1].VAR_KEYWORD
        and (not moe or names.index("output_router_logits") == len(HEAD_ARGS) - 1)
    )
    aux = _AUX_LOSS.search(source)
    aux_spec = ("config" if aux.group(1) else "model", aux.group(2)) if aux else None
    if aux is None and re.search(r"loss \+=.*aux", source):
        return Verdict("loss", None, "adds an auxiliary loss in a way the loss layers do not know")
    if aux is not None and not (llama_style and moe):
        llama_style = False  # the generic head adds the family's aux loss from its output
    llama_style = llama_style and not unshifted and not masked
    if "labels" not in names:
        return Verdict("loss", None, "its forward takes no labels")
    layer = ("MoEForCausalLM" if moe else "ForCausalLM") if llama_style else "CausalLMHead"
    missing = available(layer)
    if missing:
        return Verdict("loss", None, missing)
    attributes = (
        (LOGIT_OPS, ops),
        (OUTPUT_HEAD, head_path),
        (SHIFT_LABELS, "items" if masked else not unshifted),
        (AUX_LOSS, aux_spec),
        (LABEL_POSITIONS, last_positions),
        (DECODER_INPUTS, decoder_inputs),
        *(((LINEAR_HEAD, True),) if linear_head else ()),
        *(((STEP_CACHE, True),) if llama_style and _builds_dynamic_cache(model.model) else ()),
        *(
            ((INPUT_EMBEDDING, kind),)
            if llama_style and (kind := _input_embedding(model.model))
            else ()
        ),
    )
    return Verdict("loss", layer, attributes=attributes)


_KV_LAYERS = {"full_attention", "sliding_attention", "chunked_attention"}

_SCALED_FORWARD = "return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)"


def _forward_source(module: nn.Module | type) -> str | None:
    """The source of the forward of a module's class (or of a class), or None where Python has
    none to give."""
    cls = module if isinstance(module, type) else type(module)
    try:
        return inspect.getsource(inspect.unwrap(cls.forward))
    except (OSError, TypeError):
        return None


def _embeds_ids_only(source: str) -> bool:
    """Whether a decoder forward's source uses ``input_ids`` only as transformers' decoders do
    around the embedding: the parameter, the exactly-one-of check
    ``if (input_ids is None) ^ (inputs_embeds is not None)`` (and its raise), and
    ``inputs_embeds = self.embed_tokens(input_ids)`` as the only statement of an
    ``if inputs_embeds is None:`` block. Anything else (a multiplier, another call, an alias)
    means handing the decoder embeddings would change what it computes."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return False
    func = tree.body[0] if tree.body else None
    if not isinstance(func, ast.FunctionDef):
        return False
    allowed: set[int] = set()
    embeds = 0
    for node in ast.walk(func):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "inputs_embeds is None":
            body = node.body
            if (len(body) == 1 and not node.orelse
                    and isinstance(body[0], ast.Assign | ast.AnnAssign)
                    and ast.unparse(body[0].value) == "self.embed_tokens(input_ids)"
                    and ast.unparse(body[0].targets[0] if isinstance(body[0], ast.Assign)
                                    else body[0].target) == "inputs_embeds"):  # fmt: skip
                embeds += 1
                allowed |= {id(n) for n in ast.walk(body[0].value)}
        if isinstance(node, ast.If) and ast.unparse(node.test) == (
            "(input_ids is None) ^ (inputs_embeds is not None)"
        ):
            allowed |= {id(n) for n in ast.walk(node.test)}
    uses = [n for n in ast.walk(func) if isinstance(n, ast.Name) and n.id == "input_ids"]
    return embeds == 1 and all(id(n) in allowed for n in uses)


def _input_embedding(decoder: nn.Module) -> str | None:
    """The input embedding's kind: "plain" (an ``nn.Embedding``) or "scaled" (transformers'
    ``*ScaledWordEmbedding``) when the decoder's forward uses input_ids for nothing but
    ``self.embed_tokens(input_ids)`` (see `_embeds_ids_only`) and that module is one of these;
    else None (the decoder embeds them itself, as it does now)."""
    emb = getattr(decoder, "embed_tokens", None)
    if not isinstance(emb, nn.Embedding):
        return None
    source = _forward_source(decoder)
    if source is None or not _embeds_ids_only(source):
        return None
    cls = type(emb)
    if cls is nn.Embedding:
        return "plain"
    if cls.__bases__ != (nn.Embedding,):
        return None
    source = _forward_source(cls)
    if source is None:
        return None
    body = [line.strip() for line in source.splitlines()[1:]]
    return "scaled" if [b for b in body if b] == [_SCALED_FORWARD] else None


def _builds_dynamic_cache(decoder: nn.Module) -> bool:
    """Whether the decoder's forward makes transformers' ``DynamicCache`` from its config when
    asked to cache, with key/value layers only (no recurrent state of a hybrid): the loss
    layers then hand it one that copies nothing (``step_cache``)."""
    source = _forward_source(decoder)
    if source is None or "= DynamicCache(config=self.config)" not in source:
        return False
    from transformers.cache_utils import get_layer_types_and_kwargs

    config = getattr(decoder, "config", None)
    try:
        kinds, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    except Exception:  # a config transformers' own cache cannot be made from
        return False
    return set(kinds) <= _KV_LAYERS


# `decoder_outputs = self.decoder(..., labels=labels, ...)` and `loss=decoder_outputs.loss`
_CHILD_CALL = re.compile(r"^\s*(\w+)(?:: [\w.]+)? = self\.(\w+)\(\s*$")  # an annotation allowed


def _loss_child(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(name, child) of the direct child whose loss the model's forward returns as it is: it
    passes the labels to that child's one call (``labels=labels``), returns ``loss=<out>.loss``
    and computes no loss of its own; None otherwise."""
    source = _forward_source(model)
    if source is None:
        return None
    source = "\n".join(_body_before(source, "\0"))  # the statements: no docstring
    if "loss_fct" in source or "self.loss_function" in source or "loss =" in source:
        return None
    lines = source.splitlines()
    found = []
    for i, line in enumerate(lines):
        call = _CHILD_CALL.match(line)
        if call is None:
            continue
        out, name = call.groups()
        args = []
        for arg in lines[i + 1 :]:
            if arg.strip() == ")":
                break
            args.append(arg.strip())
        if "labels=labels," in args and f"self.{name}(" in source:
            found.append((out, name))
    if len(found) != 1:
        return None
    out, name = found[0]
    child = model._modules.get(name)
    if child is None or source.count(f"self.{name}(") != 1:
        return None
    # every `loss=` hands on the child's loss as it is (nothing scaled or added)
    returned = re.findall(r"\bloss=([^,)\n]*)", source)
    if not returned or any(used.strip() != f"{out}.loss" for used in returned):
        return None
    return name, child


def _output_head_path(model: nn.Module) -> str | None:
    """Where the logits' Linear sits: transformers' get_output_embeddings(), else lm_head."""
    head = None
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter):
        try:
            head = getter()
        except (AttributeError, NotImplementedError, TypeError):
            head = None
    if head is None:
        head = getattr(model, "lm_head", None)
    if head is None:
        return _inner_head_path(model)
    return next((path for path, m in model.named_modules() if m is head and path), None)


def _loss_name(model: nn.Module) -> str:
    """The name of the loss function ``self.loss_function`` is: one set on the model, else
    transformers' for the model's ``loss_type`` (read without the property, which logs a
    warning for a model without one)."""
    fn = model.__dict__.get("_loss_function")
    if fn is not None:
        return getattr(fn, "__name__", "")
    return f"{getattr(model, 'loss_type', None)}Loss"


# `decoder_config = self.config.decoder`: a local name for a sub-config
_CONFIG_ALIAS = re.compile(r"^\s*(\w+) = self\.config\.(\w+)\s*$", re.M)


def _config_aliases(model: nn.Module, source: str) -> str:
    """The source with a local alias of the config whose soft-cap the loss layers read
    (T5Gemma 2's ``decoder_config = self.config.decoder``) written as ``self.config``; other
    aliases stay (and are refused where they touch the logits)."""
    config = getattr(model, "config", None)
    for match in _CONFIG_ALIAS.finditer(source):
        alias, attr = match.groups()
        sub = getattr(config, attr, None)
        if sub is not None and sub is softcap_config(config):
            source = source.replace(match.group(0) + "\n", "")
            source = re.sub(rf"\b{alias}\.", "self.config.", source)
    return source


# An encoder-decoder's forward that makes its decoder inputs from the labels exactly when the
# caller gave none: the method it calls (T5Gemma 2's prepare_decoder_input_ids_from_labels)
_DECODER_INPUTS = re.compile(
    r"^\s*if (labels is not None and decoder_input_ids is None and decoder_inputs_embeds is None"
    r"|decoder_input_ids is None and labels is not None):"
    r"\s*\n(?:\s*#[^\n]*\n)*\s*decoder_input_ids = self\.(\w+)\(labels\)\s*\n",
    re.M,
)


def _decoder_inputs_maker(source: str) -> str | None:
    found = _DECODER_INPUTS.search(source)
    return found.group(2) if found else None


def _inner_head_path(model: nn.Module) -> str | None:
    """The head of a language model the model holds as a direct child (``language_model``
    with its own ``lm_head``), when the model has none of its own; None when no child has one
    or more than one has."""
    found = []
    for name, child in model.named_children():
        getter = getattr(child, "get_output_embeddings", None)
        if not callable(getter):
            continue
        try:
            head = getter()
        except (AttributeError, NotImplementedError, TypeError):
            continue
        path = next((p for p, m in child.named_modules() if m is head and p), None)
        if path is not None:
            found.append(f"{name}.{path}")
    return found[0] if len(found) == 1 else None


def _inner_logits_problem(model: nn.Module, top: str, head_path: str) -> tuple[str, tuple]:
    """What the inner language model's forward does to its head's output, as _logits_problem
    says it for the model itself; its scaling ops read from the model (``top.`` paths)."""
    inner = model.get_submodule(top)
    source = _forward_source(inner)
    if source is None:
        return f"{top}'s forward's source cannot be read", ()
    rest = head_path[len(top) + 1 :]
    if "." in rest:
        return f"{head_path} is not its language model's own child", ()
    problem, ops = _logits_problem(inner, source, rest)
    if problem:
        return f"{top}: {problem}", ()
    if _SOFTCAP_USE.search(source) or "final_logit_softcapping" in source:
        # the loss layers read the soft-cap from the model's (text) config: it must be the
        # inner model's own
        if softcap_config(getattr(model, "config", None)) is not getattr(inner, "config", None):
            return f"{top} soft-caps its logits by a config the model does not read", ()
    prefixed = tuple(
        ("model", f"{top}.{attr}" if holder == "model" else f"{top}.config.{attr}", op)
        for holder, attr, op in ops
    )
    return "", prefixed


# The loss layers read this class attribute: how the forward scales lm_head's output, as
# ((holder "model" | "config", attribute, "*" | "/"), ...) in the forward's order; the
# attribute may be a dotted path from the holder ("model.lm_head_multiplier").
LOGIT_OPS = "kernels_logit_ops"
OUTPUT_HEAD = "kernels_output_head"  # the Linear making the logits, when not lm_head
# True: the loss is on the last positions, as many as the labels (an image prefix dropped)
LABEL_POSITIONS = "kernels_label_positions"
# the method making an encoder-decoder's decoder inputs from the labels, when none are given
DECODER_INPUTS = "kernels_decoder_inputs"
# True: the head is a Linear subclass the probe found computing F.linear(x, weight, bias)
LINEAR_HEAD = "kernels_linear_head"
# True: the decoder builds a DynamicCache when asked to; a training step hands it step_cache's
STEP_CACHE = "kernels_step_cache"
# "plain" or "scaled": the decoder uses input_ids only for embed_tokens, of that kind; a
# compiled step embeds them itself, with eager's backward kernel (embedding.py)
INPUT_EMBEDDING = "kernels_input_embedding"
SHIFT_LABELS = "kernels_shift_labels"  # False: the loss takes the labels as they come
AUX_LOSS = "kernels_aux_loss"  # (holder, coefficient attribute) of `loss += coef * aux_loss`
_AUX_LOSS = re.compile(r"loss \+= self\.(config\.)?((?:text_config\.)?\w+) \* aux_loss")
_PLAIN_CE = re.compile(
    r'loss_fct = (nn\.)?CrossEntropyLoss\((ignore_index=-100(, reduction="mean")?)?\)[^\n]*\n'
    r"\s*\w+ = loss_fct\(\w+(\.contiguous\(\))?\.view\(-1, (self\.config\.vocab_size|\w+\.size\(-1\))\), "
    r"labels(\.contiguous\(\))?\.view\(-1\)\)"
)
# Gemma 4's multimodal head binds the soft-cap to a local, read from its (text) config
_SOFTCAP_USE = re.compile(r"[*/] ?final_logit_softcapping")
_SOFTCAP_LOCAL = re.compile(
    r"\(final_logit_softcapping := self\.config(\.get_text_config\(\))?\.final_logit_softcapping\)"
    r'|final_logit_softcapping = getattr\(self\.config\.get_text_config\(\), "final_logit_softcapping"'
)
# a logit scale on the model, its config or its decoder (Falcon-H1: self.model.lm_head_multiplier)
_SCALE_OP = re.compile(
    r"([*/]) ?self\.(config\.(?:text_config\.)?|model\.)?(logit_scale|logits_scaling|lm_head_multiplier|output_multiplier)\b"
)


def softcap_config(config: object) -> object:
    """The config whose ``final_logit_softcapping`` the loss layers apply: the model's, or its
    text config's when the model's has none (Gemma 4's multimodal head reads it there)."""
    if config is not None and not hasattr(config, "final_logit_softcapping"):
        getter = getattr(config, "get_text_config", None)
        if callable(getter):
            return getter()
    return config


def _logits_problem(
    model: nn.Module, source: str, top: str = "lm_head", nested: bool = False
) -> tuple[str, tuple]:
    """(why the loss layers cannot reproduce what the forward does to lm_head's output, "" if
    they can: nothing, a soft-cap, a scale, a cast to fp32; the scaling ops it applies).
    ``nested``: ``self.<top>`` is a language model, whose output's logits may be taken."""
    lines = [line.split("#")[0].rstrip() for line in source.splitlines()]
    calls = [i for i, line in enumerate(lines) if f"self.{top}(" in line]
    if len(calls) != 1:
        return f"calls self.{top} {len(calls)} times in its forward", ()
    start = calls[0]
    end = next(
        (
            i
            for i, line in enumerate(lines)
            if i > start and re.match(r"\s*(loss = None|if labels|loss = self)", line)
        ),
        None,
    )
    if end is None:
        return f"no loss computed after `self.{top}(...)`", ()
    first = start
    if nested:  # the language model's call may span lines: from its closing parenthesis on
        depth = 0
        for first in range(start, end):
            depth += lines[first].count("(") - lines[first].count(")")
            if depth <= 0:
                break
        first += 1
    for line in lines[first:end]:
        if nested and _LOGITS_TAKEN.match(line):
            continue
        if line.strip() and not _HEAD_LINE_OK.match(line):
            return f"post-processes its logits with `{line.strip()}`", ()
    body = "\n".join(lines[start:end])
    config = getattr(model, "config", None)
    if _SOFTCAP_USE.search(body) and not _SOFTCAP_LOCAL.search(body):
        return "scales its logits by a final_logit_softcapping not read from its config", ()
    for attr, holder in (
        ("final_logit_softcapping", softcap_config(config)),
        ("logits_scaling", config),
        ("logit_scale", model),
    ):
        value = getattr(holder, attr, None)
        if value is not None and not isinstance(value, (int, float)):
            return f"its {attr} is a {type(value).__name__}, not a number", ()
        if value not in (None, 1, 1.0) and attr not in body:
            return f"has {attr} but its forward does not apply it", ()
    ops = tuple(
        ("config", owner[len("config.") :] + attr, op)
        if owner.startswith("config.")
        else ("model", owner + attr, op)
        for op, owner, attr in _SCALE_OP.findall(body)
    )
    for holder, attr, _ in ops:
        value = config if holder == "config" else model
        for part in attr.split("."):
            value = getattr(value, part, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return f"its {attr} is a {type(value).__name__}, not a number", ()
    return "", ops


def _body_before(source: str, marker: str) -> list[str]:
    """The forward's statements (no signature, no docstring), up to the line with `marker`."""
    import ast
    import textwrap

    text = textwrap.dedent(source)
    try:
        func = ast.parse(text).body[0]
    except (SyntaxError, IndexError):
        return []
    body = list(getattr(func, "body", []))
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    lines = text.splitlines()
    stop = next((i for i, line in enumerate(lines) if marker in line), len(lines))
    return [ast.get_source_segment(text, stmt) or "" for stmt in body if stmt.lineno - 1 < stop]


def _loss_inputs_problem(
    source: str, top: str, nested: bool = False, decoder_inputs: bool = False
) -> tuple[str, bool]:
    """(why the loss layers cannot stand in for the forward's loss, from what the loss is
    computed on: "" when the head's own logits and the labels as given; whether the loss
    drops leading positions of the logits: only the last ones, as many as the labels).
    ``decoder_inputs``: the one statement making decoder inputs from the labels is known
    (the loss layers make them the same way before they run the forward without labels)."""
    for stmt in _body_before(source, f"self.{top}("):
        # an encoder-decoder that makes its decoder inputs from the labels: the loss layers run
        # the forward without labels, which would then decode nothing
        if "decoder_input_ids" in stmt and re.search(r"\blabels\b", stmt):
            if decoder_inputs and _DECODER_INPUTS.search(stmt + "\n"):
                continue
            return "makes its decoder inputs from the labels", False
    head = re.search(rf"(\w+) = self\.{top}\(", source)
    if nested and head:
        # the language model's output: its logits taken as `logits = outputs.logits`
        taken = re.search(rf"^\s*(\w+) = {head.group(1)}(\.logits|\[0\])\s*$", source, re.M)
        head = taken or head
    call = re.search(r"self\.loss_function\(\s*(?:logits=)?(\w+)", source)
    if not (head and call):
        return "", False
    logits, used = head.group(1), call.group(1)
    if used != logits:
        if _dropped_prefix(source, logits, used):
            return "", True
        return f"computes its loss on `{used}`, not on the logits of its head", False
    return "", False


def _dropped_prefix(source: str, logits: str, used: str) -> bool:
    """Whether ``used`` is ``logits`` with a prefix of positions dropped and the labels shifted
    as the causal loss shifts them: GIT's logits[:, n:-1] against labels[:, 1:] (a caller's
    shift_labels against logits[:, n:]). The shapes must agree in the family's own loss, so n
    is the logits' length minus the labels': the loss of the last positions, as many as the
    labels."""
    shifted = re.search(
        rf"^\s*{used} = {logits}\[:, (\w+):-1, :\](\.contiguous\(\))?\s*$", source, re.M
    )
    if shifted is None:
        return False
    n = shifted.group(1)
    given = re.search(rf"^\s*{used} = {logits}\[:, {n}:, :\](\.contiguous\(\))?\s*$", source, re.M)
    labels = re.search(r"^\s*shift_labels = labels\[:, 1:\](\.contiguous\(\))?\s*$", source, re.M)
    call = re.search(
        rf"self\.loss_function\(\s*logits={used},\s*labels=None,[^)]*shift_labels=shift_labels",
        source,
    )
    return bool(given and labels and call)


# a language model's output, from which the model takes the logits
_LOGITS_TAKEN = re.compile(r"^\s*\w+ = \w+(\.logits|\[0\])\s*$")


def is_norm(module: nn.Module) -> bool:
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return True
    return "Norm" in type(module).__name__ and not module._modules and len(module._parameters) <= 2


def attention_verdict(module: nn.Module, available: Callable[[str], str | None]) -> Verdict | None:
    """FusedQKVAttention for Phi-3-style attention, VisionVarlenAttention for a vision tower's
    packed attention (attention.py); None for any other module."""
    found = qkv_attention_verdict(module)
    if found is None:
        return None
    layer, reason, attributes = found
    if layer is None:
        return Verdict("attention", None, reason)
    missing = available(layer)
    if missing:
        return Verdict("attention", None, missing)
    return Verdict("attention", layer, attributes=attributes)


def rotary_uses(cls: type, available: Callable[[str], str | None]) -> list[RotaryUse]:
    forward = getattr(cls, "forward", None)
    if forward is not None:
        forward = inspect.unwrap(forward)  # transformers wraps forwards (deprecate_kwarg, ...)
    code = getattr(forward, "__code__", None)
    if code is None:
        return []
    uses = []
    for name in code.co_names:
        # apply_rotary_pos_emb* (cos, sin) and apply_rotary_emb (complex freqs_cis)
        if not name.startswith("apply_rotary"):
            continue
        namespace = forward.__globals__
        fn = namespace.get(name)
        if fn is None:
            continue
        plain = fn.__dict__.get("__wrapped__", fn) if isinstance(fn, KernelFunction) else fn
        layer, reason = _probe_rotary_function(plain)
        reason = reason or available(layer)
        verdict = Verdict("rotary", None, reason) if reason else Verdict("rotary", layer)
        uses.append(RotaryUse(cls, name, namespace, fn, verdict))
    return uses


def _probe_rotary_function(fn: Callable) -> tuple[str | None, str]:
    """probes.probe_rotary, or the vision towers' (q, k, cos, sin) probe for that signature."""
    try:
        names = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        names = ()
    if names == multimodal.VISION_ROTARY_PARAMS:
        return multimodal.probe_vision_rotary(fn)
    return probes.probe_rotary(fn)


def classify(
    model: nn.Module,
    available: Callable[[str], str | None] = lambda layer: None,
    experts_check: Callable[[nn.Module], str | None] | None = None,
) -> Plan:
    """One verdict per module class of ``model`` that is a norm, an MLP, experts, the loss head
    or a caller of a rotary function. ``available(layer)`` is None when the kernel repo has that
    layer class, else the reason to report."""
    plan = Plan()
    seen: set[type] = set()

    for module in model.modules():
        cls = type(module)
        if cls in seen or isinstance(module, KernelFunction):
            continue
        seen.add(cls)
        verdict: Verdict | None = None
        if module is model:
            verdict = head_verdict(model, available)
            inner = None if verdict.layer else _loss_child(model)
            if inner is not None:
                # the loss is the child's (Pix2Struct's decoder): its head binds, the model's
                # forward runs as it is and returns the child's loss
                name, child = inner
                plan.classes[type(child)] = head_verdict(child, available)
                seen.add(type(child))
                verdict = Verdict("loss", None, f"returns the loss self.{name} computes")
        elif (v := experts_verdict(module, available, experts_check)) is not None:
            verdict = v
        elif (v := attention_verdict(module, available)) is not None:
            verdict = v
        elif (v := mlp_verdict(module, available)) is not None:
            verdict = v
        elif is_norm(module):
            verdict = norm_verdict(module, available, norm_layouts(model, module))
        elif (v := rotary_embedding_verdict(module, available)) is not None:
            verdict = v
        elif not module._parameters and not module._modules:
            verdict = activation_verdict(module, available)
        if verdict is not None:
            plan.classes[cls] = verdict
        plan.rotary += rotary_uses(cls, available)
    return plan
