"""Layer classes for kernelize: each forward is bound onto an existing transformers module.

The classes hold no state; ``forward`` reads the original module's attributes (``weight``,
``variance_epsilon`` or ``eps``, ``gate_proj``/``up_proj``/``down_proj``, ``act_fn``) and keeps
the signature of the forward it replaces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .add_rms_norm import fused_add_rms_norm
from .gated_mlp import gated_mlp
from .layer_norm import layer_norm
from .rms_norm import rms_norm
from .rope import apply_rotary_pos_emb
from .swiglu import GELU_ERF, GELU_TANH, SILU, gelu_mul, silu, silu_mul

_SILU_CLASSES = {"SiLUActivation", "SiLU"}
# Classes whose function is 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))).
_GELU_TANH_CLASSES = {"GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "FastGELUActivation"}


def _eps(module: nn.Module) -> float:
    eps = getattr(module, "variance_epsilon", None)
    return module.eps if eps is None else eps


def _gelu_approximate(act: nn.Module) -> str:
    if isinstance(act, nn.GELU):
        return act.approximate
    name = type(act).__name__
    if name in _GELU_TANH_CLASSES:
        return "tanh"
    if name == "GELUActivation":
        return "none"
    raise ValueError(f"GeGLUMLP needs a GELU act_fn, got {name}; map this MLP to another layer")


class RMSNorm(nn.Module):
    """LlamaRMSNorm / Qwen3RMSNorm (also over the last dim of [B, T, H, D] for q/k norms)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
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
        return rms_norm(hidden_states, self.weight, _eps(self), save_output=True)


class GemmaRMSNorm(nn.Module):
    """GemmaRMSNorm: (1 + weight) scaling, all in fp32, cast to the input dtype at the end."""

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, _eps(self), gemma=True)


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
    """transformers' apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)."""

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
        return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)


class SiLU(nn.Module):
    """SiLUActivation."""

    has_backward = True
    can_torch_compile = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return silu(input)


class SwiGLUMLP(nn.Module):
    """Llama/Qwen3-style MLP, down(silu(gate(x)) * up(x)), with the gated product fused."""

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = type(self.act_fn).__name__
        if name not in _SILU_CLASSES:
            raise ValueError(
                f"SwiGLUMLP needs a SiLU act_fn, got {name}; map this MLP to another layer"
            )
        out = gated_mlp(x, self.gate_proj, self.up_proj, self.down_proj, SILU)
        if out is None:
            out = self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))
        return out


class GeGLUMLP(nn.Module):
    """Gemma-style MLP, down(gelu(gate(x)) * up(x)); tanh or erf GELU as the module's act_fn."""

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        approximate = _gelu_approximate(self.act_fn)
        act = GELU_TANH if approximate == "tanh" else GELU_ERF
        out = gated_mlp(x, self.gate_proj, self.up_proj, self.down_proj, act)
        if out is None:
            out = self.down_proj(gelu_mul(self.gate_proj(x), self.up_proj(x), approximate))
        return out


class LayerNorm(nn.Module):
    """torch.nn.LayerNorm over the last dim (other normalized shapes run torch's layer_norm)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if len(self.normalized_shape) != 1:
            return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)
        return layer_norm(input, self.weight, self.bias, self.eps)


# Loss layers (loss_layers.py): transformers' *ForCausalLM forward with the fused linear
# cross-entropy, and nn.CrossEntropyLoss on the CE kernel.
from .loss_layers import CrossEntropyLoss, ForCausalLM, ForCausalLMCrossEntropy  # noqa: E402, F401

# Mixture-of-experts experts with fused 3-D weights (moe.py).
from .moe import MoEExperts  # noqa: E402, F401
