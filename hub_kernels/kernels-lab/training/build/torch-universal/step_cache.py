"""The KV cache a training step hands its decoder, so that the causal mask stays implicit.

Without a cache, transformers (5.x) looks for packed sequences in the position ids: the ones
it made itself when the caller gave none. Under ``torch.compile`` it cannot read them, so it
builds an explicit [S, S] mask and SDPA runs without ``is_causal`` (no flash or cuDNN kernel:
twice the attention time on an H200); in eager it reads them back, a host sync per step.
Positions the decoder makes itself are 0..S-1 and cannot be packed, and with a cache present
the search is skipped and SDPA gets ``is_causal=True`` as in inference.

``step_cache`` makes that cache: transformers' ``DynamicCache`` whose full and sliding-window
layers keep the first keys and values they are given by reference (the window's last ones: a
view), where ``DynamicCache`` copies them (``torch.cat`` onto an empty tensor). Attention saves the same tensors for its backward, so
the cache adds no memory; it is dropped with the step's output.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

_CLASS: list[type] = []


def _cache_class() -> type:
    if _CLASS:
        return _CLASS[0]
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    class StepCache(DynamicCache):
        kv_layers = (DynamicLayer, DynamicSlidingWindowLayer)

        def holds_kv_only(self) -> bool:
            return all(type(layer) in self.kv_layers for layer in self.layers)

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
            kind = type(layer)
            if (
                kind in self.kv_layers
                and not layer.is_initialized
                and not getattr(layer, "record_past", False)
            ):
                # what the layer's first update keeps and returns, without its torch.cat
                layer.lazy_initialization(key_states, value_states)
                if kind is DynamicSlidingWindowLayer:
                    layer.cumulative_length += key_states.shape[-2]
                    kept = slice(-layer.sliding_window + 1, None)
                    layer.keys, layer.values = key_states[:, :, kept], value_states[:, :, kept]
                else:
                    layer.keys, layer.values = key_states, value_states
                return key_states, value_states
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    _CLASS.append(StepCache)
    return StepCache


def step_cache(model: nn.Module, attention_mask, position_ids):
    """A cache for ``model.model`` in a training step that asked for none, or None where it
    would change what the step computes: positions or a mask given (packed sequences are found
    there), a decoder that builds no ``DynamicCache`` of its own or one with other layers than
    key/value ones (the loader's probe sets ``kernels_step_cache``; checked again here), or
    gradient checkpointing (its layers drop any cache)."""
    if attention_mask is not None or position_ids is not None:
        return None
    if not getattr(model, "kernels_step_cache", False):
        return None
    if getattr(model.model, "gradient_checkpointing", False):
        return None
    if not _CLASS and torch.compiler.is_compiling():
        return None  # Dynamo cannot trace a class statement; made at import, see below
    cache = _cache_class()(config=model.model.config)
    # the probe saw key/value layers only; another instance of the class may hold recurrent ones
    return cache if cache.holds_kv_only() else None


# A model exists before its kernels load, so transformers' cache module is there to subclass:
# the class is made now, outside any trace.
if "transformers.cache_utils" in sys.modules:
    _cache_class()
