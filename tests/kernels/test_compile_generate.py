"""Generation through a bound model under torch.compile, as transformers' static-cache decoding
runs it: `model.forward` compiled with `fullgraph=True`, `generate(cache_implementation=
"static")`, called for several prompts. The kernels' ops are traced into every graph (their
no-grad forms: nothing for a backward), no graph breaks, the greedy tokens equal the unbound
model's eager `generate`, and the bound model compiles exactly as many graphs as the unbound
model compiled the same way (the kernels add no recompile: transformers' own guards decide).

CPU, Triton interpreter inside the ops, backend ``aot_eager`` (tests/kernels/test_compile_models.py
says why).
"""

from __future__ import annotations

import copy

import kernels
import pytest
import torch
from _graph_code import Counting

from tests.class_marks import restored
from tests.models.registry import causal_lm_class, tiny_config
from tests.sweep import sweep_param

# model type -> (attention, the kernels' ops every compiled graph must call)
FAMILIES = {
    "llama": ("sdpa", ("rms_norm_fwd", "rope", "gated_mlp_fwd", "embedding_fwd")),
    "qwen3_moe": ("sdpa", ("rms_norm_fwd", "rope", "moe_experts_fwd")),
    # Gemma-2: (1 + w) norms, softcapped attention (eager), GeGLU, the final logit softcap
    "gemma2": ("eager", ("rms_norm_fwd", "rope", "gated_mlp_fwd")),
    # Gemma-3: sliding and full layers, q/k norms
    "gemma3_text": ("sdpa", ("rms_norm_fwd", "rope", "gated_mlp_fwd")),
    # Cohere: LayerNorm without bias, interleaved RoPE
    "cohere": ("sdpa", ("layer_norm_fwd", "rope", "gated_mlp_fwd")),
    # Phi-3: fused qkv and gate|up projections (the module's own attention forward)
    "phi3": ("sdpa", ("rms_norm_fwd", "rope", "glu_fwd")),
    # GPT-NeoX: LayerNorm with bias, GELU MLP, partial rotary, its own head (CausalLMHead)
    "gpt_neox": ("sdpa", ("layer_norm_fwd", "rope", "act_fwd")),
}
DEFAULT = ("llama",)
PROMPTS = (8, 12, 5)  # prompt lengths of the successive generate calls


@pytest.fixture(autouse=True)
def _model_classes_restored():
    # the modeling modules' names (Gemma-3's text model lives in models.gemma3)
    with restored(tuple({m.removesuffix("_text") for m in FAMILIES})):
        yield


GREEDY = dict(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)


def compiled_generations(model, prompts) -> tuple[list[torch.Tensor], Counting]:
    """Greedy static-cache generations of `prompts` through `model.forward` compiled."""
    backend = Counting()
    model.forward = torch.compile(model.forward, backend=backend, fullgraph=True)
    outs = []
    for ids in prompts:
        out = model.generate(
            ids, cache_implementation="static", return_dict_in_generate=True, **GREEDY
        )
        assert type(out.past_key_values).__name__ == "StaticCache"
        outs.append(out.sequences)
    return outs, backend


@pytest.mark.parametrize(
    "model_type",
    [m if m in DEFAULT else sweep_param(m, what="more families") for m in sorted(FAMILIES)],
)
def test_static_cache_generate_compiles_with_the_kernels_and_no_more_graphs(
    local_kernels, model_type
):
    attn, ops = FAMILIES[model_type]
    config = tiny_config(model_type)
    config.pad_token_id = 0
    config.use_cache = True  # the registry's tiny configs switch it off
    torch.manual_seed(0)
    ref = causal_lm_class(model_type)._from_config(config, attn_implementation=attn).eval()
    model, plain = copy.deepcopy(ref), copy.deepcopy(ref)
    kernels.apply_training_kernels(model)
    prompts = [torch.randint(1, config.vocab_size, (2, n)) for n in PROMPTS]

    got, bound = compiled_generations(model, prompts)
    torch._dynamo.reset()  # the unbound model's compiles counted from zero
    _, unbound = compiled_generations(plain, prompts)

    for ids, seq in zip(prompts, got, strict=True):
        assert torch.equal(seq, ref.generate(ids, **GREEDY))
    assert len(bound.graphs) == len(unbound.graphs), "the kernels made transformers recompile"
    for code in bound.graphs:
        for op in ops:
            assert f".{op}." in code or f".{op}(" in code, op
        assert "_bwd" not in code  # nothing traced for a backward under no_grad
