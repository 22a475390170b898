"""The multimodal rotary embedding's cos/sin kernel (mrope.py) and the vision towers' rotary on
the Triton interpreter, against float64 references written from the formulas, and against
transformers' own modules."""

from __future__ import annotations

import types

import pytest
import torch
from _training_refs import DTYPES, assert_close, check_rope, leaf64, rope64

# (sections, layout, pairs): Qwen2-VL (chunked, [f, f]), GLM-4V (chunked, repeated pairs),
# Qwen3-VL (interleaved t h w, [f, f]), and an odd split
CASES = [
    ([2, 3, 3], "chunked", False),
    ([2, 3, 3], "chunked", True),
    ([4, 2, 2], "interleaved", False),
    ([3, 1, 2], "interleaved", True),
    ([5, 6, 5], "chunked", False),
]


def mrope64(pos, inv_freq, sections, layout, pairs, scaling):
    """cos, sin [B, T, D] in float64: frequency i takes the position of one axis (chunked: axis
    k % 3 in the k-th section; interleaved: 1 where i % 3 == 1 and i < 3 * s_h, 2 where
    i % 3 == 2 and i < 3 * s_w, else 0); the angle is the fp32 product transformers forms."""
    half = sum(sections)
    axis = []
    if layout == "chunked":
        for k, n in enumerate(sections):
            axis += [k % 3] * n
    else:
        for i in range(half):
            a = i % 3
            axis.append(a if a and i < 3 * sections[a] else 0)
    if pos.dim() == 2:
        pos = pos.expand(3, -1, -1)
    per_freq = torch.stack([pos[axis[i]] for i in range(half)], dim=-1)  # [B, T, half]
    # the fp32 product transformers forms from fp32 frequencies (float64 ones: the exact angle,
    # which a gradient flows through)
    angle = (per_freq.to(inv_freq.dtype) * inv_freq).double()
    cols = angle.repeat_interleave(2, dim=-1) if pairs else torch.cat((angle, angle), dim=-1)
    return cols.cos() * scaling, cols.sin() * scaling


def inv_freq_for(half: int) -> torch.Tensor:
    return 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32) / half))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("sections", "layout", "pairs"), CASES, ids=str)
def test_cos_sin_match_float64(kt, sections, layout, pairs, dtype):
    inv = inv_freq_for(sum(sections))
    pos = torch.randint(0, 3000, (3, 2, 37))
    cos, sin = kt.mrope_cos_sin(pos, inv, sections, layout, pairs, 0.75, dtype)
    want_cos, want_sin = mrope64(pos, inv, sections, layout, pairs, 0.75)
    assert cos.dtype == sin.dtype == dtype and cos.shape == (2, 37, 2 * sum(sections))
    assert_close(cos, want_cos, dtype, "cos")
    assert_close(sin, want_sin, dtype, "sin")


def test_two_dimensional_positions_are_every_axis(kt):
    inv = inv_freq_for(8)
    pos = torch.randint(0, 500, (3, 9))
    cos, sin = kt.mrope_cos_sin(pos, inv, [2, 3, 3], "chunked", False, 1.0, torch.float32)
    want_cos, want_sin = mrope64(pos, inv, [2, 3, 3], "chunked", False, 1.0)
    assert_close(cos, want_cos, torch.float32, "cos")
    assert_close(sin, want_sin, torch.float32, "sin")


def test_sections_that_miss_the_frequencies_are_refused(kt):
    with pytest.raises(ValueError, match="do not cover 8 frequencies"):
        kt.mrope_cos_sin(torch.zeros(3, 1, 2, dtype=torch.long), inv_freq_for(8), [2, 2, 2])


def test_trainable_inverse_frequencies_get_their_gradient(kt):
    """A trainable inv_freq takes the torch formula: autograd reaches it (the op has none)."""
    inv = inv_freq_for(8).requires_grad_()
    pos = torch.randint(0, 50, (3, 2, 5))
    cos, sin = kt.mrope_cos_sin(pos, inv, [2, 3, 3], "interleaved", False, 1.0, torch.float32)
    dc, ds = torch.randn_like(cos), torch.randn_like(sin)
    torch.autograd.backward((cos, sin), (dc, ds))
    inv64 = leaf64(inv)
    c64, s64 = mrope64(pos, inv64, [2, 3, 3], "interleaved", False, 1.0)
    torch.autograd.backward((c64, s64), (dc.double(), ds.double()))
    assert_close(cos, c64, torch.float32, "cos")
    assert_close(inv.grad, inv64.grad, torch.float32, "d inv_freq")


def _text_rotary(model_type: str):
    """transformers' text rotary embedding of a multimodal-RoPE family, head_dim 16,
    sections [2, 3, 3]."""
    if model_type == "qwen2_vl":
        from transformers.models.qwen2_vl import modeling_qwen2_vl as m

        config, cls = m.Qwen2VLTextConfig(), m.Qwen2VLRotaryEmbedding
    elif model_type == "qwen3_vl":
        from transformers.models.qwen3_vl import modeling_qwen3_vl as m

        config, cls = m.Qwen3VLTextConfig(), m.Qwen3VLTextRotaryEmbedding
    else:
        from transformers.models.glm4v import modeling_glm4v as m

        config, cls = m.Glm4vTextConfig(), m.Glm4vTextRotaryEmbedding
    config.hidden_size, config.num_attention_heads, config.head_dim = 64, 4, 16
    config.rope_parameters["mrope_section"] = [2, 3, 3]
    config.rope_parameters["partial_rotary_factor"] = 1.0
    return cls(config)


@pytest.mark.parametrize(
    ("model_type", "layout", "pairs"),
    [
        ("qwen2_vl", "chunked", False),
        ("qwen3_vl", "interleaved", False),
        ("glm4v", "chunked", True),
    ],
)
def test_layer_matches_the_familys_rotary_embedding(kt, model_type, layout, pairs):
    """The layer bound on transformers' own text rotary embedding returns its cos and sin."""
    module = _text_rotary(model_type)
    module.kernels_mrope_layout = (layout, pairs)
    x = torch.randn(2, 7, 64)
    pos = torch.randint(0, 2000, (3, 2, 7))
    want = module(x, pos)
    got = types.MethodType(kt.layers.MultimodalRotaryEmbedding.forward, module)(x, pos)
    for g, w, what in zip(got, want, ("cos", "sin"), strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=what)


def test_custom_op_traces_under_compile(kt):
    torch._dynamo.reset()
    inv = inv_freq_for(8)
    pos = torch.randint(0, 100, (3, 2, 6))

    def fn(p):
        return kt.mrope_cos_sin(p, inv, [4, 2, 2], "interleaved", False, 1.0, torch.float32)

    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(pos)
    for g, w in zip(got, fn(pos), strict=True):
        assert torch.equal(g, w)
    torch.library.opcheck(
        kt.mrope.mrope_cos_sin_op,
        (pos, inv, [2, 3, 3], "chunked", True, 0.5, torch.bfloat16),
        test_utils=("test_schema", "test_faketensor"),
    )


# -- the vision towers' rotary ----------------------------------------------------------------


def vision_rope64(q, k, cos, sin, unsqueeze_dim=None):
    """apply_rotary_pos_emb_vision's formula in float64: q, k [S, H, D], cos/sin [S, D]."""
    return rope64(q, k, cos, sin, unsqueeze_dim=-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(20, 3, 16), (7, 1, 32)], ids=str)
def test_vision_rotary_values_and_gradients(kt, shape, dtype):
    s, h, d = shape
    # q and k as the vision attention makes them: views of one fused qkv projection
    qkv = torch.randn(s, 3, h, d, dtype=dtype).permute(1, 0, 2, 3)
    q, k = (t.detach().clone().requires_grad_() for t in qkv[:2])
    angle = torch.rand(s, d // 2) * 6
    cos, sin = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()
    qo, ko = kt.apply_vision_rotary_pos_emb(q, k, cos, sin)
    assert qo.dtype == dtype and qo.shape == q.shape
    check_rope(q, k, cos, sin, qo, ko, None, dtype, ref=vision_rope64)


def test_vision_rotary_layer_matches_transformers(kt):
    """Bound in place of Qwen2.5-VL's apply_rotary_pos_emb_vision, it returns what that
    function returns (fp16: one rounding of the fp32 rotation each)."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision

    q, k = torch.randn(2, 11, 4, 16, dtype=torch.float16).unbind(0)
    angle = torch.rand(11, 8) * 6
    cos, sin = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()
    want = apply_rotary_pos_emb_vision(q, k, cos, sin)
    got = kt.layers.vision_rotary_pos_emb.forward(None, q, k, cos, sin)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-3)


def _launched(kt, call) -> set[str]:
    import sys

    from tests.gpu.launches import TritonLaunches

    modules = [m for name, m in sys.modules.items() if name.startswith(kt.__name__ + ".")]
    with TritonLaunches(*modules) as launches:
        call()
    return set(launches.counts())


def test_the_triton_kernels_run(kt):
    """Value checks cannot tell the kernels from the torch formulas: the launches can."""
    inv = inv_freq_for(8)
    pos = torch.randint(0, 100, (3, 2, 6))
    assert "_mrope_kernel" in _launched(
        kt, lambda: kt.mrope_cos_sin(pos, inv, [2, 3, 3], "chunked", False)
    )
    q = torch.randn(10, 2, 16, requires_grad=True)
    cos, sin = torch.randn(10, 16), torch.randn(10, 16)

    def vision():
        qo, ko = kt.apply_vision_rotary_pos_emb(q, q * 2, cos, sin)
        (qo.sum() + ko.sum()).backward()

    assert "_rope_kernel" in _launched(kt, vision)


def test_layer_classes_take_the_forwards_they_replace(kt):
    """Bound as module.forward, a layer must take the replaced forward's arguments."""
    import inspect

    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VLRotaryEmbedding,
        apply_rotary_pos_emb_vision,
    )

    def kinds(fn, drop_self):
        params = list(inspect.signature(fn).parameters.values())[int(drop_self) :]
        return [p.kind for p in params]

    for layer, replaced, is_method in (
        (kt.layers.MultimodalRotaryEmbedding, Qwen2VLRotaryEmbedding.forward, True),
        (kt.layers.vision_rotary_pos_emb, apply_rotary_pos_emb_vision, False),
    ):
        assert "__init__" not in vars(layer)
        assert {k for k in vars(layer) if not k.startswith("__")} - {"forward"} <= {
            "has_backward",
            "can_torch_compile",
        }
        assert kinds(layer.forward, True) == kinds(replaced, is_method), layer
