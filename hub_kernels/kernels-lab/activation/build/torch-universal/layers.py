"""Stateless layers: their forward is bound onto an existing module instance."""

import torch
from torch import nn


class SiLU(nn.Module):
    """Replaces transformers' SiLUActivation.forward(self, input)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(input)


class GeLU(nn.Module):
    """Replaces transformers' GELUActivation.forward(self, input)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(input)


class SiluAndMul(nn.Module):
    """silu(a) * b over the two halves of the last dim."""

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(a) * b
