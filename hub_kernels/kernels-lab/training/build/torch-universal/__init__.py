"""kernels-lab/training: Triton training kernels (RMSNorm, fused add + RMSNorm, LayerNorm, RoPE,
SwiGLU/GeGLU, SiLU, ReLU²).

Functional ops are exposed here; ``layers`` holds the layer classes that kernelize binds onto
transformers modules. CUDA tensors run Triton; CPU tensors run plain torch, or Triton's
interpreter when TRITON_INTERPRET=1.
"""

from . import layers
from .add_rms_norm import fused_add_rms_norm
from .layer_norm import layer_norm
from .rms_norm import rms_norm
from .rope import apply_rotary_pos_emb
from .swiglu import gelu_mul, relu_squared, silu, silu_mul

__all__ = [
    "apply_rotary_pos_emb",
    "fused_add_rms_norm",
    "gelu_mul",
    "layer_norm",
    "layers",
    "relu_squared",
    "rms_norm",
    "silu",
    "silu_mul",
]

# Losses: cross-entropy, fused linear + cross-entropy, transformers' ForCausalLMLoss drop-in.
from .cross_entropy import cross_entropy  # noqa: E402
from .fused_linear_cross_entropy import fused_linear_cross_entropy  # noqa: E402
from .loss_layers import ForCausalLMLoss  # noqa: E402

__all__ += ["cross_entropy", "fused_linear_cross_entropy", "ForCausalLMLoss"]

# Post-training: the fused linear log-prob head and the distillation divergences (drop-ins for
# TRL's ChunkedLogProbFunction and ChunkedDivergenceFunction).
from .divergence import fused_linear_divergence, trl_chunked_divergence  # noqa: E402
from .logprob import fused_linear_logprob, trl_chunked_logprob  # noqa: E402

__all__ += [
    "fused_linear_divergence",
    "fused_linear_logprob",
    "trl_chunked_divergence",
    "trl_chunked_logprob",
]

# Parallelism: the vocab-parallel loss of a tensor-parallel head (DTensors are routed to it by
# fused_linear_cross_entropy too) and the global token count of a context-parallel loss.
from .context_parallel import token_count  # noqa: E402
from .vocab_parallel import vocab_parallel_cross_entropy  # noqa: E402

__all__ += ["token_count", "vocab_parallel_cross_entropy"]


# Vision-language models: multimodal RoPE cos/sin, the vision rotary, the non-gated GELU MLP.
from .gelu_mlp import gelu_activation  # noqa: E402
from .mrope import apply_vision_rotary_pos_emb, mrope_cos_sin  # noqa: E402

__all__ += ["apply_vision_rotary_pos_emb", "gelu_activation", "mrope_cos_sin"]
