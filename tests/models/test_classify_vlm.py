"""The structure classifier on the vision-language models' own modules, built here under names
no family uses: what a module computes decides its layer (classify() alone, no kernel repo)."""

from __future__ import annotations

import torch
from kernels.training import classify
from torch import nn

# -- multimodal rotary embeddings ---------------------------------------------------------------


class SectionRotary(nn.Module):
    """A rotary embedding whose frequencies take the positions of three axes (time, height,
    width): cut into sections, or interleaved t h w t h w...; columns [f, f] or pairs."""

    def __init__(self, sections=(2, 3, 3), layout="chunked", pairs=False, reorder=False):
        super().__init__()
        half = sum(sections)
        self.register_buffer("inv_freq", 1.0 / (1000.0 ** (torch.arange(half) / half)))
        self.mrope_section = list(sections)
        self.attention_scaling = 0.9
        self.rope_type = "default"
        self.layout, self.pairs, self.reorder = layout, pairs, reorder

    def forward(self, x, position_ids):
        pos = position_ids.expand(3, -1, -1)
        freqs = pos[..., None].float() * self.inv_freq  # [3, B, T, half]
        if self.layout == "chunked":
            parts = freqs.split(self.mrope_section, -1)
            if self.reorder:  # h and w first, then t (an order no layout here has)
                freq = torch.cat([parts[1][1], parts[2][2], parts[0][0]], -1)
            else:
                freq = torch.cat([m[i % 3] for i, m in enumerate(parts)], -1)
        else:
            freq = freqs[0].clone()
            for axis in (1, 2):
                idx = slice(axis, 3 * self.mrope_section[axis], 3)
                freq[..., idx] = freqs[axis, ..., idx]
        emb = freq.repeat_interleave(2, -1) if self.pairs else torch.cat((freq, freq), -1)
        scale = self.attention_scaling
        return (emb.cos() * scale).to(x.dtype), (emb.sin() * scale).to(x.dtype)


class Holder(nn.Module):
    def __init__(self, *children):
        super().__init__()
        self.parts = nn.ModuleList(children)


def _verdict(module: nn.Module):
    return classify(Holder(module)).classes[type(module)]


def test_multimodal_rotary_layouts_are_told_apart_by_running_them():
    for layout, pairs, sections in (
        ("chunked", False, (2, 3, 3)),
        ("chunked", True, (4, 2, 2)),
        ("interleaved", False, (4, 2, 2)),
        ("interleaved", True, (2, 3, 3)),
    ):
        cls = type(f"Rotary_{layout}_{pairs}", (SectionRotary,), {})
        verdict = _verdict(cls(sections, layout, pairs))
        assert verdict.layer == "MultimodalRotaryEmbedding", (layout, pairs, verdict)
        assert dict(verdict.attributes)["kernels_mrope_layout"] == (layout, pairs)


def test_an_unknown_axis_order_keeps_its_forward_with_the_reason():
    verdict = _verdict(type("ReorderedRotary", (SectionRotary,), {})(reorder=True))
    assert verdict.layer is None
    assert verdict.reason == "assigns frequencies to position axes in an order no layout here knows"


def test_dynamic_rope_instances_keep_their_forward():
    verdict = _verdict(SectionRotary())
    dynamic = SectionRotary()
    dynamic.rope_type = "dynamic"
    assert verdict.condition(SectionRotary()) and not verdict.condition(dynamic)


# -- the vision towers' rotary function and GELU MLPs -------------------------------------------


def _rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def apply_rotary_pos_emb_patches(q, k, cos, sin):
    """[S, H, D] q and k, [S, D] cos/sin, in fp32 (named like no family's function)."""
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    qf, kf = q.float(), k.float()
    qo = qf * cos + _rotate_half(qf) * sin
    return qo.to(q.dtype), (kf * cos + _rotate_half(kf) * sin).to(k.dtype)


def apply_rotary_swapped(q, k, cos, sin):
    """Rotates the halves the other way: not rotate-half RoPE."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return q * cos - _rotate_half(q) * sin, k * cos - _rotate_half(k) * sin


class PatchAttention(nn.Module):
    rotary = staticmethod(apply_rotary_pos_emb_patches)

    def forward(self, q, k, cos, sin):
        return apply_rotary_pos_emb_patches(q, k, cos, sin)


class SwappedAttention(nn.Module):
    def forward(self, q, k, cos, sin):
        return apply_rotary_swapped(q, k, cos, sin)


def test_vision_rotary_functions_bind_by_what_they_compute():
    plan = classify(Holder(PatchAttention(), SwappedAttention()))
    uses = {u.owner.__name__: u.verdict for u in plan.rotary}
    assert uses["PatchAttention"].layer == "vision_rotary_pos_emb"
    assert uses["SwappedAttention"].layer is None
    assert "not rotate-half RoPE over [S, H, D]" in uses["SwappedAttention"].reason


class QuickGate(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class Softplus(nn.Module):
    def forward(self, x):
        return torch.nn.functional.softplus(x)


class TowerMLP(nn.Module):
    """fc_in -> act -> fc_out, child names no family uses, the output one declared first."""

    def __init__(self, act):
        super().__init__()
        self.fc_out = nn.Linear(96, 32)
        self.fc_in = nn.Linear(32, 96)
        self.activation_fn = act

    def forward(self, hidden_states):
        return self.fc_out(self.activation_fn(self.fc_in(hidden_states)))


def test_gelu_mlps_bind_with_the_gelu_they_compute():
    for act, kind in (
        (nn.GELU(), "gelu"),
        (nn.GELU(approximate="tanh"), "gelu_tanh"),
        (QuickGate(), "quick_gelu"),
    ):
        cls = type(f"TowerMLP_{kind}", (TowerMLP,), {})
        verdict = _verdict(cls(act))
        assert verdict.layer == "GELUMLP", (kind, verdict)
        attrs = dict(verdict.attributes)
        assert attrs["kernels_mlp_activation"] == kind
        assert attrs["kernels_mlp_projections"] == ("fc_in", "fc_out")


def test_a_non_gelu_activation_leaves_the_mlp_unbound():
    verdict = _verdict(type("SoftplusMLP", (TowerMLP,), {})(Softplus()))
    assert verdict.layer is None and verdict.reason.startswith("not gated")


# -- gated MLPs under other names ---------------------------------------------------------------


class NamedGated(nn.Module):
    """A gated MLP under names no family uses, the down projection declared first; the
    activation inline (``act`` None) or a module; ``gate`` says which child is the gate."""

    def __init__(self, fn=torch.nn.functional.silu, act=None, dropout=0.0, width=(32, 48)):
        super().__init__()
        hidden, inner = width
        self.out = nn.Linear(inner, hidden, bias=False)
        self.left = nn.Linear(hidden, inner, bias=False)
        self.right = nn.Linear(hidden, inner, bias=False)
        self.drop = nn.Dropout(dropout)
        self.fn, self.act = fn, act

    def forward(self, x):
        act = self.act if self.act is not None else self.fn
        return self.out(self.drop(act(self.right(x)) * self.left(x)))


def test_gated_mlps_under_other_names_bind_with_their_gate_and_activation():
    gelu_tanh = lambda x: torch.nn.functional.gelu(x, approximate="tanh")  # noqa: E731
    for i, (kwargs, layer, kind) in enumerate(
        (
            ({}, "SwiGLUMLP", "silu"),
            ({"fn": gelu_tanh}, "GeGLUMLP", "gelu_tanh"),
            ({"act": nn.GELU()}, "GeGLUMLP", "gelu"),
            # square projections: the shapes cannot tell the down projection, the probe does
            ({"width": (32, 32)}, "SwiGLUMLP", "silu"),
        )
    ):
        verdict = _verdict(type(f"NamedGated{i}", (NamedGated,), {})(**kwargs))
        assert verdict.layer == layer, (kind, verdict)
        attrs = dict(verdict.attributes)
        assert attrs["kernels_mlp_projections"] == ("right", "left", "out"), attrs
        assert attrs["kernels_mlp_activation"] == kind


def test_a_gated_mlp_with_dropout_or_another_activation_keeps_its_forward():
    verdict = _verdict(type("DroppingGated", (NamedGated,), {})(dropout=0.1))
    assert verdict.layer is None
    assert verdict.reason == "applies dropout (drop) the fused layer does not"
    softplus = type("SoftplusGatedMLP", (NamedGated,), {})(fn=torch.nn.functional.softplus)
    assert _verdict(softplus).layer is None  # no fused kernel for it: left as it is


# -- loss heads: a head inside a language model, a dropped image prefix --------------------------


class TinyLM(nn.Module):
    """A causal LM the captioner holds: ``lm_head`` its output embedding."""

    def __init__(self, scale_logits=False):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, 16, bias=False)
        self.scale_logits = scale_logits

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, inputs_embeds=None, labels=None, **kwargs):
        hidden_states = self.body(inputs_embeds)
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = logits.sum()
        return {"loss": loss, "logits": logits}


class DoublingLM(TinyLM):
    def forward(self, inputs_embeds=None, labels=None, **kwargs):
        hidden_states = self.body(inputs_embeds)
        logits = self.lm_head(hidden_states)
        logits = logits * 2.0
        loss = None
        if labels is not None:
            loss = logits.sum()
        return {"loss": loss, "logits": logits}


def _ce(logits=None, labels=None, vocab_size=16, shift_labels=None, **kwargs):
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, vocab_size), shift_labels.reshape(-1)
    )


class Captioner(nn.Module):
    """Its loss on the logits of the language model it holds (no head of its own)."""

    inner = TinyLM

    def __init__(self):
        super().__init__()
        self.language_model = self.inner()
        self.loss_function = _ce

    def forward(self, inputs_embeds=None, labels=None, **kwargs):
        outputs = self.language_model(
            inputs_embeds=inputs_embeds,
            **kwargs,
        )
        logits = outputs.logits
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=16, **kwargs)
        return loss, logits


class DoublingCaptioner(Captioner):
    inner = DoublingLM


def _head(model: nn.Module):
    return classify(model).classes[type(model)]


def test_a_loss_on_a_held_language_models_logits_binds_its_head():
    verdict = _head(Captioner())
    assert verdict.layer == "CausalLMHead", verdict
    attrs = dict(verdict.attributes)
    assert attrs["kernels_output_head"] == "language_model.lm_head"
    assert attrs["kernels_shift_labels"] is True and not attrs["kernels_label_positions"]
    # what the language model does to its logits counts as much as the captioner's own lines
    doubled = _head(DoublingCaptioner())
    assert doubled.layer is None
    assert (
        doubled.reason == "language_model: post-processes its logits with `logits = logits * 2.0`"
    )


class PrefixCaptioner(nn.Module):
    """GIT-style: image positions before the text, the loss on the text positions only."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, 16, bias=False)
        self.loss_function = _ce

    def forward(self, inputs_embeds=None, labels=None, **kwargs):
        hidden_states = self.body(inputs_embeds)
        logits = self.lm_head(hidden_states)
        loss = None
        shift_labels = kwargs.pop("shift_labels", None)
        if labels is not None:
            num_image_tokens = 4
            if shift_labels is None:
                shifted_logits = logits[:, num_image_tokens:-1, :].contiguous()
                shift_labels = labels[:, 1:].contiguous()
            else:
                shifted_logits = logits[:, num_image_tokens:, :].contiguous()
            loss = self.loss_function(
                logits=shifted_logits, labels=None, vocab_size=16, shift_labels=shift_labels
            )
        return loss, logits


class SkippingCaptioner(PrefixCaptioner):
    """Drops a prefix but shifts its labels by two: not the causal loss."""

    def forward(self, inputs_embeds=None, labels=None, **kwargs):
        hidden_states = self.body(inputs_embeds)
        logits = self.lm_head(hidden_states)
        loss = None
        shift_labels = kwargs.pop("shift_labels", None)
        if labels is not None:
            num_image_tokens = 4
            if shift_labels is None:
                shifted_logits = logits[:, num_image_tokens:-1, :].contiguous()
                shift_labels = labels[:, 2:].contiguous()
            else:
                shifted_logits = logits[:, num_image_tokens:, :].contiguous()
            loss = self.loss_function(
                logits=shifted_logits, labels=None, vocab_size=16, shift_labels=shift_labels
            )
        return loss, logits


def test_a_loss_on_the_text_positions_binds_on_the_last_positions_only():
    verdict = _head(PrefixCaptioner())
    assert verdict.layer == "CausalLMHead", verdict
    assert dict(verdict.attributes)["kernels_label_positions"] is True
    skipping = _head(SkippingCaptioner())
    assert skipping.layer is None
    assert skipping.reason == "computes its loss on `shifted_logits`, not on the logits of its head"


def _mark(verdict, module) -> None:
    """What Plan.mark does to the class for a served verdict (its attributes, process-wide)."""
    for name, value in verdict.attributes:
        setattr(type(module), name, value)


def test_a_second_model_of_the_class_with_another_activation_changes_neither():
    """The activation is marked on the class; each instance is pinned to its own when bound,
    and one met after the class was marked with another keeps its forward."""
    cls = type("PinnedGated", (NamedGated,), {})
    tanh_one, erf_one = cls(act=nn.GELU(approximate="tanh")), cls(act=nn.GELU())
    for module in (tanh_one, erf_one):
        verdict = _verdict(module)
        _mark(verdict, module)
        assert verdict.condition(module)
    assert tanh_one.kernels_mlp_activation == "gelu_tanh"
    assert erf_one.kernels_mlp_activation == "gelu"
    assert cls.kernels_mlp_activation == "gelu"
    assert not verdict.condition(cls(act=nn.GELU(approximate="tanh")))


def test_a_gated_mlp_whose_down_projection_is_kept_in_another_dtype_keeps_its_forward():
    """T5 keeps ``wo`` in fp32 under an fp16 load, and its forward casts to it: the fused
    layer would not."""
    module = type("MixedGated", (NamedGated,), {})()
    verdict = _verdict(module)
    _mark(verdict, module)
    assert verdict.condition(module)
    module.right.half()
    module.left.half()
    assert not verdict.condition(module)


# -- ReLU MLPs, heads that are Linear subclasses, a loss a child computes ------------------------


def test_a_relu_mlp_binds_gelumlp_with_relu_and_keeps_its_forward_with_dropout():
    verdict = _verdict(type("ReluTowerMLP", (TowerMLP,), {})(nn.ReLU()))
    assert verdict.layer == "GELUMLP", verdict
    assert dict(verdict.attributes)["kernels_mlp_activation"] == "relu"

    class DroppingMLP(TowerMLP):
        def __init__(self, act, p):
            super().__init__(act)
            self.dropout = nn.Dropout(p)

        def forward(self, hidden_states):
            h = self.dropout(self.activation_fn(self.fc_in(hidden_states)))
            return self.fc_out(h)

    dropping = _verdict(DroppingMLP(nn.ReLU(), 0.1))
    assert dropping.layer is None
    assert dropping.reason == "applies dropout (dropout) the fused layer does not"
    # a class whose dropout is off binds, and an instance of it with dropout on keeps its forward
    off = DroppingMLP(nn.GELU(), 0.0)
    bound = _verdict(off)
    assert bound.layer == "GELUMLP" and bound.condition(off)
    assert not bound.condition(DroppingMLP(nn.GELU(), 0.1))


class ExtraRowsHead(nn.Linear):
    """A Linear subclass with a forward of its own: extra vocabulary rows from a child Linear
    appended when it has them (Idefics' decoupled head), the Linear alone otherwise."""

    def __init__(self, extra: int):
        super().__init__(8, 16, bias=False)
        self.extra = extra
        if extra:
            self.additional = nn.Linear(8, extra, bias=False)

    def forward(self, input):
        out = torch.nn.functional.linear(input, self.weight, self.bias)
        if self.extra:
            out = torch.cat((out, self.additional(input)), -1)
        return out


class ScaledRowsHead(nn.Linear):
    """A learned per-row logit scale, ones at init (Dory's head)."""

    def __init__(self):
        super().__init__(8, 16, bias=False)
        self.scale = nn.Parameter(torch.ones(16))

    def forward(self, input):
        return super().forward(input) * self.scale


def _lm_with_head(extra: int) -> nn.Module:
    cls = type(f"ExtraRowsLM{extra}", (DecoderWithLoss,), {})
    model = cls()
    model.lm_head = ExtraRowsHead(extra)
    return model


def test_a_linear_subclass_head_binds_only_where_it_computes_the_linear():
    verdict = _head(_lm_with_head(0))
    assert verdict.layer == "CausalLMHead", verdict
    assert dict(verdict.attributes)["kernels_linear_head"] is True
    extra = _head(_lm_with_head(4))
    assert extra.layer is None and extra.reason == "lm_head is not a plain nn.Linear"
    # a parameter of its own that is all ones at init still takes part (Dory's logit scale)
    scaled = type("ScaledHeadLM", (DecoderWithLoss,), {})()
    scaled.lm_head = ScaledRowsHead()
    verdict = _head(scaled)
    assert verdict.layer is None and verdict.reason == "lm_head is not a plain nn.Linear"
    # a plain Linear head does not carry the attribute
    plain = _head(DecoderWithLoss())
    assert plain.layer == "CausalLMHead" and "kernels_linear_head" not in dict(plain.attributes)


class DecoderWithLoss(nn.Module):
    """A decoder computing a plain cross-entropy on the labels as they come (Pix2Struct's)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, 16, bias=False)

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, inputs_embeds=None, labels=None, **kwargs):
        hidden_states = self.body(inputs_embeds)
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            # fmt: off
            loss_fct = nn.CrossEntropyLoss(ignore_index=-100, reduction="mean")
            loss = loss_fct(logits.contiguous().view(-1, logits.size(-1)), labels.contiguous().view(-1))  # noqa: E501
            # fmt: on
        return {"loss": loss, "logits": logits}


class Seq2Seq(nn.Module):
    """Passes the labels to its decoder and returns the decoder's loss as it is."""

    def __init__(self):
        super().__init__()
        self.decoder = DecoderWithLoss()

    def forward(self, inputs_embeds=None, labels=None, **kwargs):
        decoder_outputs = self.decoder(
            inputs_embeds=inputs_embeds,
            labels=labels,
        )
        return {"loss": decoder_outputs["loss"], "logits": decoder_outputs["logits"]}


class ReturningSeq2Seq(Seq2Seq):
    def forward(self, inputs_embeds=None, labels=None, **kwargs):
        decoder_outputs = self.decoder(
            inputs_embeds=inputs_embeds,
            labels=labels,
        )
        return dict(loss=decoder_outputs.loss, logits=decoder_outputs.logits)


class ScalingSeq2Seq(Seq2Seq):
    def forward(self, inputs_embeds=None, labels=None, **kwargs):
        decoder_outputs = self.decoder(
            inputs_embeds=inputs_embeds,
            labels=labels,
        )
        return dict(loss=decoder_outputs.loss * 2, logits=decoder_outputs.logits)


def test_a_loss_the_decoder_computes_binds_on_the_decoder():
    plan = classify(ReturningSeq2Seq()).classes
    decoder = plan[DecoderWithLoss]
    assert decoder.layer == "CausalLMHead", decoder
    assert dict(decoder.attributes)["kernels_shift_labels"] is False  # the labels as they come
    top = plan[ReturningSeq2Seq]
    assert top.layer is None and top.reason == "returns the loss self.decoder computes"
    # a model that does anything to the child's loss keeps its forward, and so does the child
    scaled = classify(ScalingSeq2Seq()).classes
    assert scaled[ScalingSeq2Seq].layer is None
    assert DecoderWithLoss not in scaled or scaled[DecoderWithLoss].layer is None


class NormedFFN(nn.Module):
    """fc_in -> gelu -> F.dropout(p) -> norm -> fc_out (Kosmos-2.5's text FFN), or with the norm
    before the activation (``norm_first``), where the layer would compute something else."""

    def __init__(self, p=0.0, norm_first=False):
        super().__init__()
        self.fc_in = nn.Linear(32, 96)
        self.fc_out = nn.Linear(96, 32)
        self.inner_norm = nn.LayerNorm(96)
        self.activation_fn = nn.GELU()
        self.activation_dropout = p
        self.norm_first = norm_first

    def forward(self, hidden_states):
        h = self.fc_in(hidden_states)
        if self.norm_first:
            h = self.activation_fn(self.inner_norm(h))
        else:
            h = self.inner_norm(self.activation_fn(h))
        h = torch.nn.functional.dropout(h, p=self.activation_dropout, training=self.training)
        return self.fc_out(h)


def test_an_mlp_with_a_norm_between_its_projections_binds_gelunormmlp():
    verdict = _verdict(NormedFFN())
    assert verdict.layer == "GELUNormMLP", verdict
    attrs = dict(verdict.attributes)
    assert attrs["kernels_mlp_projections"] == ("fc_in", "inner_norm", "fc_out")
    assert attrs["kernels_mlp_activation"] == "gelu"
    assert not verdict.condition(NormedFFN(p=0.1))  # an instance with dropout keeps its forward
    first = _verdict(type("NormFirstFFN", (NormedFFN,), {})(norm_first=True))
    assert first.layer is None
    assert first.reason == "does not compute fc_out(inner_norm(gelu(fc_in(x))))"
    dropping = _verdict(type("DroppingFFN", (NormedFFN,), {})(p=0.1))
    assert dropping.layer is None
    assert dropping.reason == "applies dropout (activation_dropout) the fused layer does not"


# -- a norm class with a weighted and a scale-free layout (MuseGlimmer's RMSNorm) ----------------


class OptionalScaleNorm(nn.Module):
    """RMS over the last dim in fp32, times the weight in fp32 where the instance holds one
    (``with_scale=False`` holds none and records no width); one cast at the end."""

    def __init__(self, dim=None, eps=1e-6, with_scale=True):
        super().__init__()
        self.eps, self.with_scale = eps, with_scale
        if with_scale:
            self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, hidden_states):
        x = hidden_states.float()
        y = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.with_scale:
            y = y * self.weight.float()
        return y.type_as(hidden_states)


class OptionalScaleLlamaNorm(OptionalScaleNorm):
    """The same with Llama's casts: the weight multiplies the value already cast back."""

    def forward(self, hidden_states):
        x = hidden_states.float()
        y = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(hidden_states.dtype)
        return self.weight * y if self.with_scale else y


def _layouts_verdict(*modules):
    return classify(Holder(*modules)).classes[type(modules[0])]


def test_a_norm_class_with_a_scale_free_layout_binds_both_layouts():
    """Whichever layout comes first, the class binds the fp32-weight layer, whose forward serves
    an instance without a weight as the weight-less norm; a layout no layer fits (a 2-D weight)
    keeps its forward."""
    free, scaled = OptionalScaleNorm(with_scale=False), OptionalScaleNorm(16)
    for first, second in ((free, scaled), (scaled, free)):
        verdict = _layouts_verdict(first, second)
        assert verdict.layer == "RMSNormFloatWeight", verdict
        assert verdict.condition(free) and verdict.condition(scaled)
    wide = OptionalScaleNorm(16)
    wide.weight = nn.Parameter(torch.ones(2, 16))
    verdict = _layouts_verdict(free, scaled, wide)
    assert verdict.layer == "RMSNormFloatWeight" and not verdict.condition(wide)


def test_a_scale_free_layout_alone_binds_the_weightless_norm():
    verdict = _layouts_verdict(OptionalScaleNorm(with_scale=False))
    assert verdict.layer == "WeightlessRMSNorm", verdict


def test_a_layer_that_needs_the_weight_leaves_the_scale_free_instances_as_they_are():
    free, scaled = OptionalScaleLlamaNorm(with_scale=False), OptionalScaleLlamaNorm(16)
    verdict = _layouts_verdict(free, scaled)
    assert verdict.layer == "RMSNorm", verdict
    assert verdict.condition(scaled) and not verdict.condition(free)


def _vision_attention_classes():
    """Qwen2.5-VL's vision attention, and a class running the same forward code with its
    vision rotary a no-op (the same structure, another function)."""
    import types

    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLVisionAttention

    forward = Qwen2_5_VLVisionAttention.forward
    unrotated = dict(forward.__globals__, apply_rotary_pos_emb_vision=lambda q, k, c, s: (q, k))
    no_rotary = type(
        "NoRotaryAttention",
        (Qwen2_5_VLVisionAttention,),
        {"forward": types.FunctionType(forward.__code__, unrotated, "forward",
                                       forward.__defaults__, forward.__closure__)},
    )  # fmt: skip
    config = Qwen2_5_VLVisionConfig(hidden_size=32, num_heads=4, depth=1)
    config._attn_implementation = "sdpa"
    return Qwen2_5_VLVisionAttention(config), no_rotary(config)


def test_packed_vision_attention_binds_where_it_attends_within_segments():
    family, no_rotary = _vision_attention_classes()
    plan = classify(Holder(family, no_rotary))
    verdict = plan.classes[type(family)]
    assert verdict.layer == "VisionVarlenAttention", verdict
    assert dict(verdict.attributes)["kernels_qkv_projections"] == ("qkv", "proj")
    other = plan.classes[type(no_rotary)]
    assert other.layer is None
    assert "rotate-half attention within each cu_seqlens segment" in other.reason, other
