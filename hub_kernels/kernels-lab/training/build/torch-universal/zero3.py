"""DeepSpeed ZeRO-3 parameters read where they are partitioned.

Under ZeRO-3 a parameter is an empty tensor on every rank except while a module that owns it
runs (DeepSpeed's hooks gather it around the module's forward; the root module's forward keeps
its children's parameters gathered). The causal-LM loss layer reads ``lm_head.weight`` inside
the model's forward; a loss computed after the forward returned finds an empty shard, and the
matmuls would fail with a size mismatch that does not say why.
"""

from __future__ import annotations

import torch


def check_gathered(weight: torch.Tensor) -> None:
    """ValueError naming the fix when `weight` is an empty ZeRO-3 partition."""
    full = getattr(weight, "ds_shape", None)
    if full is not None and weight.numel() == 0:
        raise ValueError(
            f"the weight is a DeepSpeed ZeRO-3 partition (full shape {tuple(full)}, empty on "
            "this rank): compute the loss inside the model's forward (the ForCausalLM layer "
            "does) or under deepspeed.zero.GatheredParameters([weight])"
        )
