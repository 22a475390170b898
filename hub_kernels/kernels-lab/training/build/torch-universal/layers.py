"""Layer classes for kernelize: each forward is bound onto an existing transformers module.

The classes hold no state; ``forward`` reads the original module's attributes (``weight``,
``variance_epsilon`` or ``eps``, ``gate_proj``/``up_proj``/``down_proj`` or ``gate_up_proj``,
``act_fn`` or ``activation_fn``) and keeps the signature of the forward it replaces. Which layer
fits which module is decided by the loader's structure probes (kernels.training), which run the
module's own forward next to each layer's formula.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from ._common import has_hooks
from .add_rms_norm import fused_add_rms_norm
from .gated_mlp import gated_mlp
from .layer_norm import layer_norm
from .relu_squared_mlp import relu_squared_mlp
from .rms_norm import rms_norm
from .rope import (
    apply_interleaved_rotary_pos_emb,
    apply_partial_rotary_pos_emb,
    apply_rotary_pos_emb,
)
from .swiglu import GELU_ERF, GELU_TANH, SILU, gelu_mul, glu_halves, relu_squared, silu, silu_mul

_SILU_CLASSES = {"SiLUActivation", "SiLU"}
# Classes whose function is 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))).
_GELU_TANH_CLASSES = {"GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "FastGELUActivation"}


def _eps(module: nn.Module) -> float:
    for name in ("variance_epsilon", "eps", "epsilon"):
        eps = getattr(module, name, None)
        if eps is not None:
            return eps
    raise AttributeError(f"{type(module).__name__} has no variance_epsilon / eps")


def _act(module: nn.Module) -> nn.Module:
    act = getattr(module, "act_fn", None)
    return getattr(module, "activation_fn", None) if act is None else act


def _glu_code(module: nn.Module) -> int:
    """The fused kernel's activation code for the module's act_fn."""
    act = _act(module)
    if type(act).__name__ in _SILU_CLASSES:
        return SILU
    return GELU_TANH if _gelu_approximate(act) == "tanh" else GELU_ERF


# The RMSNorm kernel's casting modes (a newer kernel build); without them, "weight in fp32,
# one cast at the end" is Gemma's mode with the offset taken back out of the weight.
_HAS_CASTING_MODE = "casting_mode" in inspect.signature(rms_norm).parameters


def _gelu_approximate(act: nn.Module) -> str:
    if isinstance(act, nn.GELU):
        return act.approximate
    name = type(act).__name__
    if name in _GELU_TANH_CLASSES:
        return "tanh"
    if name == "GELUActivation":
        return "none"
    raise ValueError(f"GeGLUMLP needs a GELU act_fn, got {name}; map this MLP to another layer")


# Marked by the binder on norm classes that cast x̂ to a 16-bit weight's dtype (T5LayerNorm and
# its copies). Where x and the weight share a dtype that is Llama's formula; where they differ
# (an fp16 T5 keeps `wo` in fp32, so its residual stream is fp32) the result's dtype and
# rounding are not, and the layer computes T5's formula itself.
_CASTS_TO_WEIGHT = "kernels_norm_casts_to_weight"


def _t5_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """T5LayerNorm's result: x̂ in fp32, cast to the weight's dtype when that is 16-bit."""
    h = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype in (torch.float16, torch.bfloat16):
        h = h.to(weight.dtype)
    return weight * h


def _mixed_t5(module: nn.Module, x: torch.Tensor) -> bool:
    return x.dtype != module.weight.dtype and getattr(module, _CASTS_TO_WEIGHT, False)


class RMSNorm(nn.Module):
    """LlamaRMSNorm / Qwen3RMSNorm (also over the last dim of [B, T, H, D] for q/k norms)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if _mixed_t5(self, hidden_states):
            return _t5_rms_norm(hidden_states, self.weight, _eps(self))
        return rms_norm(hidden_states, self.weight, _eps(self))


class MemoryEfficientRMSNorm(nn.Module):
    """RMSNorm that keeps its output, not its input, for the backward (x̂ = y / weight).

    Where the next layer saves the output anyway (the input norm before q/k/v, the norm before
    the MLP), the input is no longer kept alive: one [tokens, hidden] tensor less per norm. A
    weight entry of exactly zero makes that column's gradients NaN; use ``RMSNorm`` for such
    weights.
    """

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if _mixed_t5(self, hidden_states):
            return _t5_rms_norm(hidden_states, self.weight, _eps(self))
        return rms_norm(hidden_states, self.weight, _eps(self), save_output=True)


class GemmaRMSNorm(nn.Module):
    """GemmaRMSNorm: (1 + weight) scaling, all in fp32, cast to the input dtype at the end."""

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _HAS_CASTING_MODE:
            return rms_norm(x, self.weight, _eps(self), offset=1.0, casting_mode="gemma")
        return rms_norm(x, self.weight, _eps(self), gemma=True)


class RMSNormFloatWeight(nn.Module):
    """OLMo2-style RMSNorm: ``(weight * x_hat).to(input dtype)``, the product in fp32. An
    instance without a weight (one class with a scale-free variant: MuseGlimmer's
    ``with_scale=False``) gets ``x_hat`` cast, which is this formula with no weight."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if getattr(self, "weight", None) is None:
            return WeightlessRMSNorm.forward(self, hidden_states)
        if _HAS_CASTING_MODE:
            return rms_norm(hidden_states, self.weight, _eps(self), casting_mode="gemma")
        # gemma mode computes x_hat * (1 + w) in fp32; (w - 1) in fp32 gives back w (exactly for
        # weights near 1, which is where RMSNorm weights live)
        return rms_norm(hidden_states, self.weight.float() - 1.0, _eps(self), gemma=True)


class WeightlessRMSNorm(nn.Module):
    """RMSNorm without a weight (``x_hat`` cast to the input dtype)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if _HAS_CASTING_MODE:  # the newer kernel takes no weight at all
            return rms_norm(hidden_states, None, _eps(self))
        ones = torch.ones(
            hidden_states.shape[-1], dtype=hidden_states.dtype, device=hidden_states.device
        )
        return rms_norm(hidden_states, ones, _eps(self))


class FusedAddRMSNorm(nn.Module):
    """RMSNorm with the residual add before it: ``forward(hidden_states, residual)`` returns
    (the normed sum, the sum), for a module holding ``weight`` and ``variance_epsilon`` (or ``eps``)
    whose forward has that signature (as Liger's LigerFusedAddRMSNorm)."""

    has_backward = True
    can_torch_compile = True

    def forward(
        self, hidden_states: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_add_rms_norm(hidden_states, residual, self.weight, _eps(self))


class rotary_pos_emb(nn.Module):  # noqa: N801 - the layer name transformers asks for
    """transformers' apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1); with cos narrower
    than the head (partial rotary: phi3, stablelm, ...) the first cos.shape[-1] dims rotate and
    the rest pass through. q and k may be rotated in place (rope.py says when): transformers'
    call sites rebind their names to the results."""

    has_backward = True
    can_torch_compile = True

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        unsqueeze_dim: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if cos.shape[-1] == q.shape[-1]:
            return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
        return apply_partial_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)


class half_rotary_pos_emb(nn.Module):  # noqa: N801 - a function's layer
    """GPT-OSS's apply_rotary_pos_emb: rotate-half with cos/sin holding one value per pair
    ([B, T, D/2]); the kernel gets them repeated ([f, f]) and skips reading the copy."""

    has_backward = True
    can_torch_compile = True

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        unsqueeze_dim: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)


class interleaved_rotary_pos_emb(nn.Module):  # noqa: N801 - a function's layer
    """Cohere's apply_rotary_pos_emb: interleaved pairs, cos/sin already repeated per pair
    ([c0, c0, c1, c1, ...]); partial when cos is narrower than the head."""

    has_backward = True
    can_torch_compile = True

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        unsqueeze_dim: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_interleaved_rotary_pos_emb(q, k, cos[..., 0::2], sin[..., 0::2], unsqueeze_dim)


class half_interleaved_rotary_pos_emb(nn.Module):  # noqa: N801 - a function's layer
    """GLM's apply_rotary_pos_emb: transformers' [f, f] cos/sin, the first half used per pair,
    interleaved rotation over cos.shape[-1] dims, the rest of the head passing."""

    has_backward = True
    can_torch_compile = True

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        unsqueeze_dim: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        half = cos.shape[-1] // 2
        return apply_interleaved_rotary_pos_emb(
            q, k, cos[..., :half], sin[..., :half], unsqueeze_dim
        )


class SiLU(nn.Module):
    """SiLUActivation."""

    has_backward = True
    can_torch_compile = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return silu(input)


def _gated_projections(module: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(gate, up, down): ``gate_proj``/``up_proj``/``down_proj``, or the child names the class
    attribute ``kernels_mlp_projections`` gives (LFM2's w1/w3/w2, T5's wi_0/wi_1/wo)."""
    names = getattr(module, "kernels_mlp_projections", ("gate_proj", "up_proj", "down_proj"))
    gate, up, down = (getattr(module, n) for n in names)
    return gate, up, down


def _gated_activation(module: nn.Module) -> str | None:
    """The activation the loader's probe found ("silu", "gelu", "gelu_tanh": set where the MLP
    calls it inline or under another name), else None (read the act_fn module)."""
    return getattr(module, "kernels_mlp_activation", None)


class SwiGLUMLP(nn.Module):
    """Llama/Qwen3-style MLP, down(silu(gate(x)) * up(x)), with the gated product fused."""

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probed = _gated_activation(self)
        name = probed or type(_act(self)).__name__
        if name not in _SILU_CLASSES and name != "silu":
            raise ValueError(
                f"SwiGLUMLP needs a SiLU act_fn, got {name}; map this MLP to another layer"
            )
        gate_proj, up_proj, down_proj = _gated_projections(self)
        out = gated_mlp(x, gate_proj, up_proj, down_proj, SILU)
        if out is None:
            in_place = _outputs_private(gate_proj, up_proj)
            out = down_proj(silu_mul(gate_proj(x), up_proj(x), in_place=in_place))
        return out


class GeGLUMLP(nn.Module):
    """Gemma-style MLP, down(gelu(gate(x)) * up(x)); tanh or erf GELU as the module's act_fn."""

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probed = _gated_activation(self)
        if probed is not None and probed not in ("gelu", "gelu_tanh"):
            raise ValueError(f"GeGLUMLP needs a GELU, got {probed}; map this MLP to another layer")
        if probed is None:
            approximate = _gelu_approximate(_act(self))
        else:
            approximate = "tanh" if probed == "gelu_tanh" else "none"
        act = GELU_TANH if approximate == "tanh" else GELU_ERF
        gate_proj, up_proj, down_proj = _gated_projections(self)
        out = gated_mlp(x, gate_proj, up_proj, down_proj, act)
        if out is None:
            in_place = _outputs_private(gate_proj, up_proj)
            gate, up = gate_proj(x), up_proj(x)
            out = down_proj(gelu_mul(gate, up, approximate, in_place=in_place))
        return out


class FusedSwiGLUMLP(nn.Module):
    """Phi3/GLM-style MLP: ``gate, up = gate_up_proj(x).chunk(2)``, down(act(gate) * up)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return fused_gate_up_mlp(self, hidden_states)


class FusedGeGLUMLP(nn.Module):
    """FusedSwiGLUMLP with a GELU act_fn (a separate name: Liger's geglu switch)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return fused_gate_up_mlp(self, hidden_states)


def fused_gate_up_mlp(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """down(act(gate) * up) with gate, up the halves of gate_up_proj(x), the product fused;
    d(gate_up) written over gate_up's output where that output is private (see below)."""
    code = _glu_code(module)
    gate_up = module.gate_up_proj(x)
    product = glu_halves(gate_up, code, in_place=_outputs_private(module.gate_up_proj))
    return module.down_proj(product)


def _outputs_private(*projections: nn.Module) -> bool:
    """Whether the gated product may write its gradients over these projections' outputs.

    A linear layer saves its input, not its output, so the gate/up outputs are read by the
    product alone, unless a hook is there to hand them to someone else: then new buffers. A
    projection whose own backward reads its output finds the version counter bumped and raises
    autograd's "modified by an inplace operation" error, never a silently wrong gradient.
    """
    return not any(has_hooks(p) for p in projections)


class LayerNorm(nn.Module):
    """LayerNorm over the last dim: torch.nn.LayerNorm, and modules holding ``weight`` (and
    maybe ``bias``) with ``eps`` / ``variance_epsilon`` (Cohere's bias-free LayerNorm), in
    fp32 with one cast at the end. Other normalized shapes run torch's layer_norm."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = getattr(self, "weight", None)
        bias = getattr(self, "bias", None)
        shape = getattr(self, "normalized_shape", hidden_states.shape[-1:])
        if len(shape) != 1:
            return F.layer_norm(hidden_states, shape, weight, bias, _eps(self))
        return layer_norm(hidden_states, weight, bias, _eps(self))


# Loss layers (loss_layers.py): transformers' *ForCausalLM forward with the fused linear
# cross-entropy, and nn.CrossEntropyLoss on the CE kernel.
from .loss_layers import (  # noqa: E402, F401
    CausalLMHead,
    CrossEntropyLoss,
    ForCausalLM,
    ForCausalLMCrossEntropy,
    MoEForCausalLM,
)

# Mixture-of-experts experts with fused 3-D weights (moe.py).
from .moe import MoEExperts  # noqa: E402, F401


class complex_rotary_emb(nn.Module):  # noqa: N801 - a function's layer
    """Llama 4's apply_rotary_emb(xq, xk, freqs_cis): q and k [B, T, H, D], each pair
    (2i, 2i+1) a complex number multiplied by freqs_cis [B, T, D/2] (complex). That product is
    the interleaved rotation with cos = freqs_cis.real and sin = freqs_cis.imag (any magnitude:
    the rotary embedding's attention scaling is folded in). The fp32 cos/sin make the kernel
    compute in fp32 and round once to q's dtype, as the family's forward does."""

    has_backward = True
    can_torch_compile = True

    def forward(
        self, xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = apply_interleaved_rotary_pos_emb(xq, xk, freqs_cis.real, freqs_cis.imag, 2)
        return q.type_as(xq), k.type_as(xk)  # the torch fallback promotes to fp32


class complex_rotary_emb_bhtd(nn.Module):  # noqa: N801 - a function's layer
    """DeepSeek-V2's apply_rotary_emb(xq, xk, freqs_cis): complex_rotary_emb with q and k
    laid out [B, H, T, D] (freqs_cis broadcast over the heads at dim 1)."""

    has_backward = True
    can_torch_compile = True

    def forward(
        self, xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs_cis = freqs_cis.to(xq.device)
        q, k = apply_interleaved_rotary_pos_emb(xq, xk, freqs_cis.real, freqs_cis.imag, 1)
        return q.type_as(xq), k.type_as(xk)


class ScaledSwiGLUMLP(nn.Module):
    """Falcon-H1's MLP: down(silu(gate(x) * gate_multiplier) * up(x)) * down_multiplier, the
    gated product fused; the multipliers are read from the module (muP scaling)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x) * self.gate_multiplier
        return self.down_proj(silu_mul(gate, self.up_proj(x))) * self.down_multiplier


# ReLU² (Nemotron's "relu2"): the activation alone, and the whole non-gated MLP around it.


class ReLUSquared(nn.Module):
    """ReLUSquaredActivation: relu(x)^2, keeping x only for the backward."""

    has_backward = True
    can_torch_compile = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return relu_squared(input)


class ReLUSquaredMLP(nn.Module):
    """Nemotron's MLP, down(relu(up(x))^2): keeps up(x) alone for the backward (h recomputed,
    d(up) written over up's output; see relu_squared_mlp.py); with biases or hooks, the
    projections run as modules around the ReLU² kernel, d(up) over up's output where private.

    The projections are ``up_proj`` and ``down_proj``, or the (in, out) child names the class
    attribute ``kernels_mlp_projections`` gives (``fc1``/``fc2``, ``dense_h_to_4h``/...), which
    the loader's structure probe sets."""

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = getattr(self, "kernels_mlp_projections", ("up_proj", "down_proj"))
        up, down = getattr(self, first), getattr(self, second)
        out = relu_squared_mlp(x, up, down)
        if out is None:
            out = down(relu_squared(up(x), in_place=_outputs_private(up)))
        return out


# Attention with one fused q/k/v projection (Phi-3's qkv_proj; qkv_attention.py).
from .qkv_attention import qkv_attention  # noqa: E402


class FusedQKVAttention(nn.Module):
    """Phi-3-style attention: ``qkv = qkv_proj(x)`` holding [q | k | v] in three blocks,
    rotate-half RoPE (partial or full), the model's attention function, ``o_proj``. The split
    and the rotation are one node that keeps only cos/sin: qkv is freed after it (v no longer
    pins it for the attention's backward) and d(qkv) is written once. A KV cache that already
    holds the layer's tokens (decoding), or torch.compile, runs the module's own forward.

    The projections are ``qkv_proj`` and ``o_proj``, or the child names the class attribute
    ``kernels_qkv_projections`` gives (the loader's structure probe sets it)."""

    has_backward = True
    can_torch_compile = True

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache=None,
        **kwargs,
    ):
        return qkv_attention(
            self, hidden_states, position_embeddings, attention_mask, cache, kwargs
        )


# Vision-language models (vision_layers.py): the multimodal rotary embedding, the vision
# towers' rotary function and their non-gated GELU MLP.
from .vision_layers import (  # noqa: E402, F401
    GELUMLP,
    GELUNormMLP,
    MultimodalRotaryEmbedding,
    VisionVarlenAttention,
    vision_rotary_pos_emb,
)
