"""kernels-lab/training: Triton training kernels (RMSNorm, LayerNorm, RoPE, SwiGLU/GeGLU, SiLU).

Functional ops are exposed here; ``layers`` holds the layer classes that kernelize binds onto
transformers modules. CUDA tensors run Triton; CPU tensors run plain torch, or Triton's
interpreter when TRITON_INTERPRET=1.
"""

from . import layers
from .layer_norm import layer_norm
from .rms_norm import rms_norm
from .rope import apply_rotary_pos_emb
from .swiglu import gelu_mul, silu, silu_mul

__all__ = [
    "apply_rotary_pos_emb",
    "gelu_mul",
    "layer_norm",
    "layers",
    "rms_norm",
    "silu",
    "silu_mul",
]
