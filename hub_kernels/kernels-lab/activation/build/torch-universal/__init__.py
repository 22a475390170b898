"""Activation kernels in plain PyTorch (every device)."""

import torch

from . import layers


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(a) * b for x = [a, b] split in halves along the last dim."""
    a, b = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(a) * b


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(a) * b for x = [a, b] split in halves along the last dim."""
    a, b = x.chunk(2, dim=-1)
    return torch.nn.functional.gelu(a, approximate=approximate) * b


__all__ = ["layers", "silu_and_mul", "gelu_and_mul"]
