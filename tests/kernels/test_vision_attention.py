"""VisionVarlenAttention (vision_attention.py) against the family's own forward: Qwen2.5-VL's
vision attention (transformers 5.24) over windows of one length, of two, and images of two
sizes, with SDPA and eager attention; one attention call per distinct segment length instead
of one per segment; the segments read once per cu_seqlens tensor."""

from __future__ import annotations

import importlib

import pytest
import torch
from _training_refs import assert_close

HEADS, HEAD_DIM = 4, 8
WIDTH = HEADS * HEAD_DIM
EQUAL = [0, 6, 12, 18, 24]  # four windows of six: one batched call, no mask
RAGGED = [0, 6, 12, 18, 22, 28, 34, 38]  # windows of 6 and an image's edge windows of 4
MIXED = [0, 9, 13, 22, 31]  # images of 9 and 4 patches (full-attention layers)


@pytest.fixture(scope="module")
def va(kt):
    return importlib.import_module(f"{kt.__name__}.vision_attention")


@pytest.fixture(scope="module")
def layer(kt):
    return importlib.import_module(f"{kt.__name__}.vision_layers").VisionVarlenAttention


def family_attention(attn: str):
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLVisionAttention

    config = Qwen2_5_VLVisionConfig(hidden_size=WIDTH, num_heads=HEADS, depth=1)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return Qwen2_5_VLVisionAttention(config)


def inputs(bounds, dtype=torch.float32):
    s = bounds[-1]
    x = torch.randn(s, WIDTH).to(dtype)
    angles = torch.rand(s, HEAD_DIM // 2) * 6
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    return x, torch.tensor(bounds, dtype=torch.int32), cos, sin


def run(forward, module, x, cu, cos, sin):
    xl = x.detach().clone().requires_grad_()
    out = forward(module, xl, cu, (cos, sin))
    g = torch.randn_like(out, generator=torch.Generator().manual_seed(3))
    params = [xl, module.qkv.weight, module.qkv.bias, module.proj.weight]
    return out, torch.autograd.grad(out, params, g)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("bounds", [EQUAL, RAGGED, MIXED], ids=["equal", "ragged", "mixed"])
def test_matches_the_family_forward(layer, attn, bounds):
    module = family_attention(attn)
    x, cu, cos, sin = inputs(bounds)
    want, want_grads = run(lambda m, *a: type(m).forward(m, *a), module, x, cu, cos, sin)
    got, got_grads = run(layer.forward, module, x, cu, cos, sin)
    assert_close(got, want, torch.float32, "out")
    for g, w, name in zip(got_grads, want_grads, ("x", "qkv.w", "qkv.b", "proj.w"), strict=True):
        assert_close(g, w, torch.float32, name)


@pytest.mark.parametrize("bounds", [EQUAL, RAGGED, MIXED], ids=["equal", "ragged", "mixed"])
def test_bf16_matches_the_family_forward(layer, bounds):
    module = family_attention("sdpa").to(torch.bfloat16)
    x, cu, cos, sin = inputs(bounds, torch.bfloat16)
    want, _ = run(lambda m, *a: type(m).forward(m, *a), module, x, cu, cos, sin)
    got, _ = run(layer.forward, module, x, cu, cos, sin)
    assert_close(got, want, torch.bfloat16, "out")


class _CountSDPA(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention:
            self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("bounds", [EQUAL, RAGGED, MIXED], ids=["equal", "ragged", "mixed"])
def test_one_attention_call_for_all_windows(layer, bounds):
    module = family_attention("sdpa")
    x, cu, cos, sin = inputs(bounds)
    with torch.no_grad():
        with _CountSDPA() as family:
            type(module).forward(module, x, cu, (cos, sin))
        with _CountSDPA() as ours:
            layer.forward(module, x, cu, (cos, sin))
    lengths = {b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a}
    assert family.calls == len(bounds) - 1
    assert ours.calls == len(lengths)  # one per distinct length: 1, 2 and 2 here


def test_segment_plan_read_once_per_tensor(va, monkeypatch):
    cu = torch.tensor(RAGGED, dtype=torch.int32)
    plan = va.segment_plan(cu)
    assert plan.lengths == (6, 6, 6, 4, 6, 6, 4)
    rows = {length: r.tolist() for length, r in plan.groups}
    assert rows[4] == [[18, 19, 20, 21], [34, 35, 36, 37]]
    assert [r[0] for r in rows[6]] == [0, 6, 12, 22, 28]
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or real(t))
    assert va.segment_plan(cu) is plan
    assert reads == []  # the same tensor, not written since: no host read
    cu[4] = 24  # written in place: read again
    assert va.segment_plan(cu).lengths == (6, 6, 6, 6, 4, 6, 4)
    assert len(reads) == 1
    other = torch.tensor(EQUAL, dtype=torch.int32)  # another tensor: read
    assert va.segment_plan(other).lengths == (6, 6, 6, 6)
    assert len(reads) == 2


def test_compiled_layer_reads_each_calls_segments(layer, torch_path):
    """Under torch.compile the segment plan is read per call, never baked into the graph: two
    calls with the same number of tokens and other windows give the family's outputs."""
    torch._dynamo.reset()
    module = family_attention("sdpa")
    compiled = torch.compile(layer.forward, backend="aot_eager")
    for bounds in (RAGGED, [0, 4, 10, 16, 22, 26, 32, 38], EQUAL[:3] + [18, 38]):
        x, cu, cos, sin = inputs(bounds)
        with torch.no_grad():
            want = type(module).forward(module, x, cu, (cos, sin))
            got = compiled(module, x, cu, (cos, sin))
        assert_close(got, want, torch.float32, str(bounds))
