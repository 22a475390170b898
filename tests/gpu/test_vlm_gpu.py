"""Vision-language models on a CUDA GPU: the VLM kernels at real shapes against float64 (with the
Triton launches recorded), the one-line ``from_pretrained(..., use_kernels=True,
kernel_config=kernels.training_kernel_config(path))`` on a VLM checkpoint with images, and the
bf16 sweep of every image-text-to-text type (tests/models/vlm_registry.py; judged against
float64 as the causal sweep's bf16 verdict). The committed table of the same sweep is
``python scripts/sweep_vlm.py --device cuda --dtype bf16 --out docs/models-vlm-h200.md
--out-jsonl docs/models-vlm-h200.jsonl``. Run in its own pytest process.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import kernels
import pytest
import torch

from tests.gpu.launches import TritonLaunches
from tests.gpu.variant import load_variant, rel_err
from tests.models.registry import train_steps
from tests.models.vlm_registry import build_vlm, mapping, run_vlm, vlm_batches

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        reason="TRITON_INTERPRET is set: run tests/gpu in its own pytest process",
    ),
]

HUB_KERNELS = Path(__file__).resolve().parents[2] / "hub_kernels"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture(scope="module")
def kt():
    return load_variant("_kernels_training_vlm_gpu_test")


@pytest.fixture
def mirror(hub):
    hub.build(HUB_KERNELS)
    return hub


def _launched(kt, call) -> set[str]:
    modules = [m for name, m in sys.modules.items() if name.startswith(kt.__name__ + ".")]
    with TritonLaunches(*modules) as launches:
        call()
    return set(launches.counts())


def _check(out, ref, dtype, what):
    err = rel_err(out, ref)
    assert err <= TOLERANCE[dtype], f"{what}: relative error {err:.2e} > {TOLERANCE[dtype]:.0e}"


@pytest.mark.parametrize(("layout", "pairs"), [("chunked", False), ("interleaved", False),
                                              ("chunked", True)])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mrope_cos_sin_at_qwen2_5_vl_3b_shape(kt, dtype, layout, pairs):
    """head_dim 128 (sections [16, 24, 24]), 2 x 8192 tokens, positions up to 32k."""
    inv = 1.0 / (1e6 ** (torch.arange(0, 128, 2, dtype=torch.float32, device="cuda") / 128))
    pos = torch.randint(0, 32768, (3, 2, 8192), device="cuda")
    sections = [16, 24, 24]
    got = {}

    def call():
        got["out"] = kt.mrope_cos_sin(pos, inv, sections, layout, pairs, 1.0, dtype)

    assert "_mrope_kernel" in _launched(kt, call)
    cos, sin = got["out"]
    # the fp32 angle transformers forms (position x inv_freq), its cos and sin in float64
    axis, freq = kt.mrope.column_table(tuple(sections), layout, pairs)
    angles = pos[..., None].float() * inv  # [3, B, T, 64]
    cols = torch.stack([angles[a, ..., f] for a, f in zip(axis, freq, strict=True)], -1)
    _check(cos, cols.double().cos(), dtype, "cos")
    _check(sin, cols.double().sin(), dtype, "sin")


@pytest.mark.parametrize("ragged", [False, True], ids=["windows", "ragged"])
def test_packed_vision_attention_at_qwen2_5_vl_3b_shape(kt, ragged):
    """VisionVarlenAttention against Qwen2.5-VL's own vision attention (SDPA, bf16): 4 images of
    1024 patches in windows of 64 (the tower's window layers), or with windows of three lengths;
    one SDPA call per distinct length against one per window; output and gradients within bf16
    of each other."""
    import importlib

    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLVisionAttention

    layer = importlib.import_module(f"{kt.__name__}.vision_layers").VisionVarlenAttention
    config = Qwen2_5_VLVisionConfig(hidden_size=1280, num_heads=16, depth=1)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    module = Qwen2_5_VLVisionAttention(config).to("cuda", torch.bfloat16)
    s = 4096
    bounds = list(range(0, s + 1, 64))
    if ragged:  # every fourth window split 40 + 24, as the edge windows of odd grids
        bounds = sorted(set(bounds) | {b + 40 for b in bounds[:-1:4]})
    cu = torch.tensor(bounds, device="cuda", dtype=torch.int32)
    angle = torch.rand(s, 40, device="cuda") * 100
    cos, sin = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()
    x = torch.randn(s, 1280, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(s, 1280, device="cuda", dtype=torch.bfloat16)
    results = []
    for forward in (type(module).forward, layer.forward):
        module.zero_grad(set_to_none=True)
        xl = x.clone().requires_grad_()
        calls = []
        real = torch.nn.functional.scaled_dot_product_attention

        def counted(*args, _real=real, _calls=calls, **kwargs):
            _calls.append(1)
            return _real(*args, **kwargs)

        torch.nn.functional.scaled_dot_product_attention = counted
        try:
            out = forward(module, xl, cu, (cos, sin))
        finally:
            torch.nn.functional.scaled_dot_product_attention = real
        out.backward(g)
        results.append((len(calls), out, xl.grad, module.qkv.weight.grad, module.proj.weight.grad))
    (family_calls, *want), (our_calls, *got) = results
    lengths = {b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)}
    assert family_calls == len(bounds) - 1 and our_calls == len(lengths)  # 1, or 3 ragged
    for name, a, b in zip(("out", "dx", "dqkv", "dproj"), got, want, strict=True):
        assert rel_err(a, b) < 2e-2, (name, rel_err(a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_vision_rotary_at_qwen2_5_vl_3b_shape(kt, dtype):
    """q, k [4096 patches, 16 heads, 80] as views of the fused qkv; fp32 cos/sin; gradients."""
    s, h, d = 4096, 16, 80
    qkv = torch.randn(s, 3, h, d, device="cuda", dtype=dtype).permute(1, 0, 2, 3)
    q, k = (t.detach().clone().requires_grad_() for t in qkv[:2])
    angle = torch.rand(s, d // 2, device="cuda") * 100
    cos, sin = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()
    out = {}

    def call():
        out["qk"] = kt.apply_vision_rotary_pos_emb(q, k, cos, sin)
        dq, dk = torch.randn_like(out["qk"][0]), torch.randn_like(out["qk"][1])
        out["grads"] = (dq, dk)
        torch.autograd.backward(out["qk"], (dq, dk))

    assert "_rope_kernel" in _launched(kt, call)
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    c, sn = cos.double().unsqueeze(-2), sin.double().unsqueeze(-2)

    def rot(x):
        a, b = x.chunk(2, -1)
        return torch.cat((-b, a), -1)

    qr, kr = q64 * c + rot(q64) * sn, k64 * c + rot(k64) * sn
    torch.autograd.backward((qr, kr), tuple(g.double() for g in out["grads"]))
    _check(out["qk"][0], qr, dtype, "q")
    _check(out["qk"][1], kr, dtype, "k")
    _check(q.grad, q64.grad, dtype, "dq")
    _check(k.grad, k64.grad, dtype, "dk")


@pytest.mark.parametrize("act", ["gelu_tanh", "quick_gelu", "gelu", "relu"])
def test_gelu_mlp_at_siglip_so400m_shape(kt, act):
    """SigLIP-so400m's MLP (1152 -> 4304 -> 1152, biases), 4096 patches, bf16, every gradient;
    the lean path's activation kernels launch. relu: the code GELUMLP serves T5's and UDOP's
    wi -> relu -> wo with (the shape is SigLIP's; the activation is what is checked)."""
    import math
    import types

    m = torch.nn.Module()
    m.fc1 = torch.nn.Linear(1152, 4304, device="cuda", dtype=torch.bfloat16)
    m.fc2 = torch.nn.Linear(4304, 1152, device="cuda", dtype=torch.bfloat16)
    m.kernels_mlp_projections, m.kernels_mlp_activation = ("fc1", "fc2"), act
    x = torch.randn(2, 2048, 1152, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(2, 2048, 1152, device="cuda", dtype=torch.bfloat16)
    out = {}

    def call():
        out["y"] = types.MethodType(kt.layers.GELUMLP.forward, m)(x)
        out["y"].backward(dy)

    assert {"_act_fwd_kernel", "_act_bwd_kernel"} <= _launched(kt, call)
    p64 = {n: p.detach().double().requires_grad_() for n, p in m.named_parameters()}
    x64 = x.detach().double().requires_grad_()
    u = x64 @ p64["fc1.weight"].t() + p64["fc1.bias"]
    if act == "relu":
        h = torch.relu(u)
    elif act == "gelu":
        h = 0.5 * u * (1 + torch.erf(u / math.sqrt(2)))
    elif act == "gelu_tanh":
        h = 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))
    else:
        h = u * torch.sigmoid(1.702 * u)
    ref = h @ p64["fc2.weight"].t() + p64["fc2.bias"]
    ref.backward(dy.double())
    _check(out["y"], ref, torch.bfloat16, "y")
    _check(x.grad, x64.grad, torch.bfloat16, "dx")
    for name, p in m.named_parameters():
        _check(p.grad, p64[name].grad, torch.bfloat16, f"d {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gelu_norm_mlp_at_kosmos_2_5_shape(kt, dtype):
    """Kosmos-2.5's text FFN (1536 -> 6144, LayerNorm, -> 1536, biases, GELU), 2 x 2048 tokens:
    ``fc2(ffn_layernorm(gelu(fc1(x))))`` with the activation kernel, every gradient against
    float64."""
    import math
    import types

    m = torch.nn.Module()
    m.fc1 = torch.nn.Linear(1536, 6144, device="cuda", dtype=dtype)
    m.ffn_layernorm = torch.nn.LayerNorm(6144, eps=1e-5, device="cuda", dtype=dtype)
    m.fc2 = torch.nn.Linear(6144, 1536, device="cuda", dtype=dtype)
    with torch.no_grad():  # a norm weight and bias away from 1 and 0, so both show
        m.ffn_layernorm.weight.uniform_(0.5, 1.5)
        m.ffn_layernorm.bias.uniform_(-0.5, 0.5)
    m.kernels_mlp_projections = ("fc1", "ffn_layernorm", "fc2")
    m.kernels_mlp_activation = "gelu"
    x = torch.randn(2, 2048, 1536, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(2, 2048, 1536, device="cuda", dtype=dtype)
    out = {}

    def call():
        out["y"] = types.MethodType(kt.vision_layers.GELUNormMLP.forward, m)(x)
        out["y"].backward(dy)

    assert "_act_fwd_kernel" in _launched(kt, call)
    p64 = {n: p.detach().double().requires_grad_() for n, p in m.named_parameters()}
    x64 = x.detach().double().requires_grad_()
    u = x64 @ p64["fc1.weight"].t() + p64["fc1.bias"]
    h = 0.5 * u * (1 + torch.erf(u / math.sqrt(2)))
    h = torch.nn.functional.layer_norm(
        h, (6144,), p64["ffn_layernorm.weight"], p64["ffn_layernorm.bias"], 1e-5
    )
    ref = h @ p64["fc2.weight"].t() + p64["fc2.bias"]
    ref.backward(dy.double())
    _check(out["y"], ref, dtype, "y")
    _check(x.grad, x64.grad, dtype, "dx")
    for name, p in m.named_parameters():
        _check(p.grad, p64[name].grad, dtype, f"d {name}")


# Round 2's binding rules (issue 32), first run on a GPU here: type -> layers that must bind in
# the text model, and what each rule is
ROUND_2 = {
    "idefics": {"CausalLMHead", "GELUMLP", "SwiGLUMLP"},  # a Linear-subclass head
    "pix2struct": {"CausalLMHead", "GeGLUMLP", "RMSNorm"},  # the decoder's loss
    "udop": {"CausalLMHead", "GELUMLP", "RMSNorm"},  # GELUMLP with relu; decoder inputs
    "kosmos-2.5": {"CausalLMHead", "GELUNormMLP", "LayerNorm"},  # a norm between projections
    "muse_glimmer": {"CausalLMHead", "RMSNormFloatWeight", "GemmaRMSNorm", "SwiGLUMLP"},
}


@pytest.mark.parametrize("model_type", sorted(ROUND_2))
def test_round_2_rules_bind_and_match_in_bf16(mirror, model_type):
    """The tiny model with images in bf16 on the GPU: as near float64 as the plain model, with
    the round-2 layers bound (GELUMLP's relu code, GELUNormMLP, the heads' loss rules, a norm
    class with a scale-free layout)."""
    outcome = run_vlm(model_type, device="cuda", dtype=torch.bfloat16)
    assert outcome.status == "match", (outcome.reason, outcome.loss_diff, outcome.grad_diff)
    d = outcome.details
    bound = set(d["text_bound"]) | set(d["head_bound"])
    assert ROUND_2[model_type] <= bound, (ROUND_2[model_type] - bound, d["text_unbound"])


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "gemma3", "llava", "qwen3_vl"])
def test_kernel_config_from_a_vlm_checkpoint_trains_like_the_plain_model(
    mirror, tmp_path, model_type
):
    """The one line transformers users write, on a VLM checkpoint, with image batches: every
    planned layer binds, and 3 bf16 AdamW steps agree with the plain model within 2e-2."""
    from transformers import AutoModelForImageTextToText

    build_vlm(model_type).save_pretrained(tmp_path / "ckpt")
    path = str(tmp_path / "ckpt")
    config = kernels.training_kernel_config(path)
    load = dict(device_map="cuda", dtype=torch.bfloat16, attn_implementation="eager")
    ours = AutoModelForImageTextToText.from_pretrained(
        path, use_kernels=True, kernel_config=copy.deepcopy(config), **load
    )
    plain = AutoModelForImageTextToText.from_pretrained(path, **load)
    batches = vlm_batches(plain, "cuda", batch=4, text=64)
    got, want = train_steps(ours, batches), train_steps(plain, batches)
    report = kernels.last_report(ours)
    bound = {e.layer_name for e in report if e.status == "bound"}
    assert set(config.kernel_mapping) <= bound, str(report)
    for (loss, norm), (loss_ref, norm_ref) in zip(got, want, strict=True):
        assert loss == pytest.approx(loss_ref, rel=2e-2), str(report)
        assert norm == pytest.approx(norm_ref, rel=2e-2), str(report)


@pytest.mark.parametrize("model_type", list(mapping()))
def test_bf16_sweep(mirror, model_type):
    """Every image-text-to-text type in bf16 with images: skipped only where the plain model or
    its inputs cannot be made; else the kernelized model is as near float64 as the plain one."""
    outcome = run_vlm(model_type, device="cuda", dtype=torch.bfloat16)
    if outcome.status == "skipped":
        pytest.skip(outcome.reason)
    assert outcome.status == "match", (outcome.reason, outcome.loss_diff, outcome.grad_diff)
