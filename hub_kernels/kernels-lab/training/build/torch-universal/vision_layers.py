"""Layer classes of the vision-language models' modules (kernelize binds them like layers.py's):
the multimodal rotary embedding, the vision towers' rotary function, non-gated GELU MLP and
packed-segment attention.

Which module each serves is decided by the loader's structure probes (kernels.training); the
attributes they read besides the module's own are set on the module's class by those probes:
``kernels_mrope_layout`` (the sections' layout and whether columns are repeated pairs),
``kernels_mlp_projections`` and ``kernels_mlp_activation``.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import has_hooks
from .gelu_mlp import CODES, gelu_activation, gelu_mlp
from .mrope import apply_vision_rotary_pos_emb, mrope_cos_sin
from .swiglu import GELU_ERF
from .vision_attention import vision_attention


class MultimodalRotaryEmbedding(nn.Module):
    """Qwen2-VL-style rotary embedding ``forward(x, position_ids) -> (cos, sin)``: positions
    [3, B, T] (time, height, width) or [B, T]; each frequency takes one axis's position by the
    module's ``mrope_section`` in the layout its class was probed with; cos and sin scaled by
    ``attention_scaling``, in x's dtype, in one kernel."""

    has_backward = True  # cos and sin take no gradient: nothing the op reads trains
    can_torch_compile = True

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        layout, pairs = getattr(self, "kernels_mrope_layout", ("chunked", False))
        return mrope_cos_sin(
            position_ids.to(self.inv_freq.device),
            self.inv_freq,
            self.mrope_section,
            layout,
            pairs,
            float(getattr(self, "attention_scaling", 1.0)),
            x.dtype,
        )


class vision_rotary_pos_emb(nn.Module):  # noqa: N801 - a function's layer
    """apply_rotary_pos_emb_vision(q, k, cos, sin): q, k [S, H, D], cos/sin [S, D]; rotate-half
    in fp32 (the RoPE kernel with fp32 cos/sin), each output rounded once to its dtype."""

    has_backward = True
    can_torch_compile = True

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_vision_rotary_pos_emb(q, k, cos, sin)


class GELUMLP(nn.Module):
    """Non-gated MLP ``fc2(gelu(fc1(x)))`` (biases or not): keeps fc1(x) alone for the backward
    (gelu_mlp.py); with hooks or other Linear modules, the projections run as modules around the
    activation kernel. The projections are the (in, out) child names ``kernels_mlp_projections``
    gives, the activation ``kernels_mlp_activation`` ("gelu", "gelu_tanh", "quick_gelu" or "relu")."""

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = getattr(self, "kernels_mlp_projections", ("fc1", "fc2"))
        act = CODES.get(getattr(self, "kernels_mlp_activation", "gelu"), GELU_ERF)
        fc1, fc2 = getattr(self, first), getattr(self, second)
        out = gelu_mlp(x, fc1, fc2, act)
        if out is None:
            # d(u) over fc1's output only where no hook can have handed it to someone else
            out = fc2(gelu_activation(fc1(x), act, in_place=not has_hooks(fc1)))
        return out


class GELUNormMLP(nn.Module):
    """Non-gated MLP with a norm between its projections, ``out(norm(gelu(in(x))))``
    (Kosmos-2.5's text FFN): the activation kernel keeps in(x) alone for the backward and
    writes d(in(x)) over it where no hook can have handed it on; the projections and the norm
    run as the module's own children (a norm bound to its kernel runs that). The names are
    ``kernels_mlp_projections`` (in, norm, out), the activation ``kernels_mlp_activation``."""

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, norm, second = self.kernels_mlp_projections
        act = CODES.get(getattr(self, "kernels_mlp_activation", "gelu"), GELU_ERF)
        fc1 = getattr(self, first)
        h = gelu_activation(fc1(x), act, in_place=not has_hooks(fc1))
        return getattr(self, second)(getattr(self, norm)(h))


class VisionVarlenAttention(nn.Module):
    """The Qwen2-VL family's vision attention ``forward(hidden_states, cu_seqlens,
    position_embeddings, max_seqlen, **kwargs)``: fused ``qkv``, the vision rotary, attention
    within each cu_seqlens segment (an image or a window) in one call of the model's attention
    function instead of one per segment, ``proj`` (vision_attention.py)."""

    has_backward = True
    can_torch_compile = True

    def forward(
        self,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        max_seqlen: int | None = None,
        **kwargs,
    ) -> torch.Tensor:
        return vision_attention(
            self, hidden_states, cu_seqlens, position_embeddings, max_seqlen, kwargs
        )
