"""MoEExperts (moe.py) against float64 references and against transformers' own experts modules."""

from __future__ import annotations

import copy
import importlib
import inspect

import pytest
import torch
import torch.nn.functional as F
from _training_refs import assert_close, leaf64
from conftest import VARIANT

E, K = 6, 2

# transformers 5.24 experts classes with the fused 3-D layout: (module, experts class, config
# class, config kwargs). Aria stores both weights transposed.
_COMMON = dict(hidden_size=32, intermediate_size=24, num_experts_per_tok=K, hidden_act="silu")
FAMILIES = {
    "mixtral": ("MixtralExperts", "MixtralConfig", dict(num_local_experts=E)),
    "qwen3_moe": ("Qwen3MoeExperts", "Qwen3MoeConfig", dict(num_experts=E, moe_intermediate_size=24)),
    "qwen2_moe": ("Qwen2MoeExperts", "Qwen2MoeConfig", dict(num_experts=E, moe_intermediate_size=24)),
    "deepseek_v3": ("DeepseekV3Experts", "DeepseekV3Config", dict(n_routed_experts=E, moe_intermediate_size=24)),
    "olmoe": ("OlmoeExperts", "OlmoeConfig", dict(num_experts=E)),
    "glm4_moe": ("Glm4MoeExperts", "Glm4MoeConfig", dict(n_routed_experts=E, moe_intermediate_size=24)),
    "ernie4_5_moe": ("Ernie4_5_MoeExperts", "Ernie4_5_MoeConfig", dict(moe_num_experts=E, moe_intermediate_size=24)),
    "minimax": ("MiniMaxExperts", "MiniMaxConfig", dict(num_local_experts=E)),
    "dots1": ("Dots1Experts", "Dots1Config", dict(n_routed_experts=E, moe_intermediate_size=24)),
    "hunyuan_v1_moe": ("HunYuanMoEV1Experts", "HunYuanMoEV1Config", dict(num_experts=E, moe_intermediate_size=24)),
    "flex_olmo": ("FlexOlmoExperts", "FlexOlmoConfig", dict(num_experts=E)),
    "aria": ("AriaExperts", "AriaTextConfig", dict(moe_num_experts=E, moe_topk=K)),
    # transposed, biases, the clamped gate: interleaved gate/up columns and halves
    "gpt_oss": ("GptOssExperts", "GptOssConfig", dict(num_local_experts=E)),
    "openai_privacy_filter": ("OpenAIPrivacyFilterExperts", "OpenAIPrivacyFilterConfig", dict(num_local_experts=E)),
}  # fmt: skip


def experts(family: str, dtype=torch.float32, seed: int = 0):
    cls_name, cfg_name, kwargs = FAMILIES[family]
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    config = getattr(mod, cfg_name)(**_COMMON, **kwargs)
    config._experts_implementation = "eager"  # transformers' default loop
    module = getattr(mod, cls_name)(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return module.to(dtype)


def routing(tokens: int, experts_: int = E, k: int = K, unused: int | None = E - 1):
    """top-k expert ids per token (distinct per token, expert `unused` never chosen) and
    positive routing weights."""
    choices = [e for e in range(experts_) if e != unused]
    idx = torch.stack(
        [torch.tensor(choices)[torch.randperm(len(choices))[:k]] for _ in range(tokens)]
    )
    return idx, torch.rand(tokens, k) + 0.1


def reference64(x, w_gate_up, w_down, idx, w, act: str, transposed: bool, **gate):
    """The experts' output from the formula, in float64, one (token, expert) pair at a time.
    `gate` may hold b_gate_up, b_down, interleaved, alpha and limit (act "clamped")."""
    b_gu, b_d = gate.get("b_gate_up"), gate.get("b_down")
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if e >= w_gate_up.shape[0]:
                continue
            wgu = w_gate_up[e] if transposed else w_gate_up[e].t()
            wd = w_down[e] if transposed else w_down[e].t()
            gu = x[t] @ wgu + (0 if b_gu is None else b_gu[e])
            gate_, up = (gu[0::2], gu[1::2]) if gate.get("interleaved") else gu.chunk(2)
            if act == "clamped":
                limit, alpha = gate["limit"], gate["alpha"]
                g = gate_.clamp(max=limit)
                h = (up.clamp(-limit, limit) + 1) * g * torch.sigmoid(alpha * g)
            else:
                a = (
                    F.silu(gate_)
                    if act == "silu"
                    else F.gelu(gate_, approximate=act.removeprefix("gelu_"))
                )
                h = a * up
            y = h @ wd + (0 if b_d is None else b_d[e])
            out[t] = out[t] + w[t, j] * y
    return out


ACTS = {"silu": "SILU", "gelu_tanh": "GELU_TANH", "gelu_none": "GELU_ERF"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("transposed", [False, True], ids=["ehi", "transposed"])
@pytest.mark.parametrize("shape", [(32, 24, "grouped"), (48, 40, "grouped"), (30, 20, "loop")])
def test_values_and_every_gradient(kt, dtype, act, transposed, shape):
    hidden, inter, path = shape
    tokens = 13
    if transposed:
        w_gate_up = torch.randn(E, hidden, 2 * inter) * 0.3
        w_down = torch.randn(E, inter, hidden) * 0.3
    else:
        w_gate_up = torch.randn(E, 2 * inter, hidden) * 0.3
        w_down = torch.randn(E, hidden, inter) * 0.3
    w_gate_up = w_gate_up.to(dtype).requires_grad_()
    w_down = w_down.to(dtype).requires_grad_()
    x = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
    idx, w = routing(tokens)
    w = w.requires_grad_()
    # Both paths are covered: torch._grouped_mm (16-byte aligned rows) and the loop over experts.
    assert kt.moe._use_grouped_mm(x, w_gate_up, w_down) == (path == "grouped")
    code = getattr(kt.moe, ACTS[act])
    out = kt.moe.moe_experts(x, w_gate_up, w_down, idx, w, code, transposed)
    x64, wgu64, wd64, w64 = (leaf64(t) for t in (x, w_gate_up, w_down, w))
    ref = reference64(x64, wgu64, wd64, idx, w64, act, transposed)
    dy = torch.randn_like(out)
    out.backward(dy)
    ref.backward(dy.double())
    factor = 4.0 if dtype == torch.bfloat16 else 1.0  # chained bf16 matmuls, as in test_gated_mlp
    assert out.dtype == dtype
    assert_close(out, ref, dtype, "output", factor)
    assert_close(x.grad, x64.grad, dtype, "d x", factor)
    assert_close(w_gate_up.grad, wgu64.grad, dtype, "d gate_up_proj", factor)
    assert_close(w_down.grad, wd64.grad, dtype, "d down_proj", factor)
    assert_close(w.grad, w64.grad, dtype, "d top_k_weights", factor)
    # The expert no token chose gets exactly zero weight gradients (no uninitialised memory).
    assert not w_gate_up.grad[E - 1].any() and not w_down.grad[E - 1].any()


def test_float64_runs_the_loop_and_sentinel_ids_contribute_nothing(kt, monkeypatch):
    """Expert-parallel sentinels (id == E) are skipped, as transformers' loop skips them. float64
    takes the loop over experts; the fused kernels compute in fp32 (fp32 tolerance)."""
    real = kt.moe._mm_groups

    def poisoned(a, b, offs, grouped, counts):
        # The rows past the last expert's are unspecified (torch._grouped_mm leaves them
        # uninitialised): NaN there must reach no output or gradient.
        out = real(a, b, offs, grouped, counts)
        out[int(offs[-1]) :] = float("nan")
        return out

    monkeypatch.setattr(kt.moe, "_mm_groups", poisoned)
    x = torch.randn(9, 16, dtype=torch.float64, requires_grad=True)
    w_gate_up = (torch.randn(E, 40, 16, dtype=torch.float64) * 0.3).requires_grad_()
    w_down = (torch.randn(E, 16, 20, dtype=torch.float64) * 0.3).requires_grad_()
    idx, w = routing(9, unused=None)
    idx[::3, 1] = E
    w = w.double().requires_grad_()
    assert not kt.moe._use_grouped_mm(x, w_gate_up, w_down)
    out = kt.moe.moe_experts(x, w_gate_up, w_down, idx, w, kt.moe.SILU, False)
    x64, wgu64, wd64, w64 = (leaf64(t) for t in (x, w_gate_up, w_down, w))
    ref = reference64(x64, wgu64, wd64, idx, w64, "silu", False)
    dy = torch.randn_like(out)
    out.backward(dy)
    ref.backward(dy)
    assert_close(out, ref, torch.float32, "output")
    assert_close(x.grad, x64.grad, torch.float32, "d x")
    assert_close(w_gate_up.grad, wgu64.grad, torch.float32, "d gate_up_proj")
    assert_close(w_down.grad, wd64.grad, torch.float32, "d down_proj")
    assert_close(w.grad, w64.grad, torch.float32, "d top_k_weights")
    assert not w.grad[::3, 1].any()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_layer_bound_by_kernelize_matches_the_module(kt, family, monkeypatch):
    """Each family's experts module, kernelized with MoEExperts, gives its own forward's output
    and gradients in fp32 (1e-5 relative)."""
    from kernels import LocalLayerRepository, Mode, kernelize, last_report, use_kernel_mapping

    ref = experts(family)
    module = experts(family)
    cls = type(module)
    # Declared through this package's API; monkeypatch removes the marks after the test.
    monkeypatch.setattr(cls, "kernel_layer_name", None, raising=False)
    monkeypatch.setattr(cls, "kernel_condition", None, raising=False)
    import kernels

    kernels.replace_kernel_forward_from_hub(cls, "MoEExperts")
    repo = LocalLayerRepository(VARIANT, layer_name="MoEExperts")
    holder = torch.nn.ModuleDict({"experts": module})
    with use_kernel_mapping({"MoEExperts": {"cpu": repo}}):
        kernelize(holder, mode=Mode.TRAINING, device="cpu")
    report = last_report(holder)
    assert [e.status for e in report if e.layer_name == "MoEExperts"] == ["bound"], str(report)
    assert module.forward.__func__.__qualname__ == "MoEExperts.forward"

    x = torch.randn(11, 32)
    idx, w = routing(11)
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    y_ref, y = ref(x1, idx, w1), module(x2, idx, w2)
    assert_close(y, y_ref, torch.float32, "output")
    dy = torch.randn_like(y)
    y_ref.backward(dy)
    y.backward(dy)
    assert_close(x2.grad, x1.grad, torch.float32, "d hidden_states")
    assert_close(w2.grad, w1.grad, torch.float32, "d top_k_weights")
    for (name, p), q in zip(module.named_parameters(), ref.parameters(), strict=True):
        assert_close(p.grad, q.grad, torch.float32, f"d {name}")


def tiny_moe_model(kind: str):
    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        cfg = Qwen3MoeConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            num_experts=E, num_experts_per_tok=K, decoder_sparse_step=1,
        )  # fmt: skip
        return Qwen3MoeForCausalLM(cfg)
    if kind == "gpt_oss":
        from transformers import GptOssConfig, GptOssForCausalLM

        cfg = GptOssConfig(
            vocab_size=128, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=E,
            num_experts_per_tok=K,
        )  # fmt: skip
        model = GptOssForCausalLM(cfg)
        with torch.no_grad():  # zero-initialised biases would leave their gradients untested
            for layer in model.model.layers:
                layer.mlp.experts.gate_up_proj_bias.normal_(0.0, 0.5)
                layer.mlp.experts.down_proj_bias.normal_(0.0, 0.5)
        return model
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=E, num_experts_per_tok=K,
    )  # fmt: skip
    return MixtralForCausalLM(cfg)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_whole_model_trains_the_same(kt, kind, monkeypatch):
    """A tiny causal LM with every experts module bound: loss and every parameter's gradient
    as the plain model's (fp32)."""
    from kernels import LocalLayerRepository, Mode, kernelize, last_report, use_kernel_mapping

    torch.manual_seed(0)
    ref = tiny_moe_model(kind)
    model = copy.deepcopy(ref)
    cls = type(model.model.layers[0].mlp.experts)
    monkeypatch.setattr(cls, "kernel_layer_name", None, raising=False)
    monkeypatch.setattr(cls, "kernel_condition", None, raising=False)
    import kernels

    kernels.replace_kernel_forward_from_hub(
        cls, "MoEExperts", condition=lambda m: kt.moe.experts_supported(m) is None
    )
    repo = LocalLayerRepository(VARIANT, layer_name="MoEExperts")
    with use_kernel_mapping({"MoEExperts": {"cpu": repo}}):
        kernelize(model, mode=Mode.TRAINING, device="cpu")
    bound = [e for e in last_report(model) if e.status == "bound" and e.layer_name == "MoEExperts"]
    assert len(bound) == 2, str(last_report(model))
    ids = torch.randint(0, 128, (2, 16))
    ref.train()
    model.train()
    loss_ref = ref(input_ids=ids, labels=ids).loss
    loss = model(input_ids=ids, labels=ids).loss
    assert_close(loss, loss_ref, torch.float32, "loss")
    loss_ref.backward()
    loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert_close(p.grad, q.grad, torch.float32, f"d {name}")


def test_what_is_not_served_says_why(kt):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    supported = kt.moe.experts_supported
    relu = experts("mixtral")
    relu.act_fn = torch.nn.ReLU()
    assert supported(relu) == "act_fn ReLU has no fused kernel"
    assert "no 3-D gate_up_proj" in supported(torch.nn.Linear(4, 4))
    gelu = experts("qwen3_moe")
    gelu.act_fn = torch.nn.GELU(approximate="tanh")
    assert supported(gelu) is None
    assert supported(experts("aria")) is None  # transposed weights are served
    assert supported(experts("gpt_oss")) is None  # recognised by what its _apply_gate computes

    class OtherGate(Qwen3MoeExperts):  # a custom gate with gpt-oss's attributes, another formula
        alpha, limit = 1.702, 7.0

        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return gate.clamp(max=self.limit) * torch.sigmoid(gate) * up

    other = OtherGate(experts("qwen3_moe").config)
    assert supported(other) == "custom gate OtherGate._apply_gate has no fused kernel"
    no_gate = experts("qwen3_moe")
    no_gate.has_gate = False
    assert "without a gate" in supported(no_gate)

    relu.forward = kt.layers.MoEExperts.forward.__get__(relu)
    with pytest.raises(ValueError, match="act_fn ReLU has no fused kernel"):
        relu(torch.randn(3, 32), *routing(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "halves"])
@pytest.mark.parametrize("path", ["grouped", "loop"])
def test_clamped_gate_with_biases_every_gradient(kt, dtype, interleaved, path):
    """gpt-oss's experts (transposed weights, biases, clamped SwiGLU) against the formula; a
    small limit makes both clamps bite on many elements."""
    hidden, inter = (32, 24) if path == "grouped" else (30, 20)
    tokens, alpha, limit = 13, 1.702, 0.7
    mk = lambda *shape: (torch.randn(*shape) * 0.5).to(dtype).requires_grad_()  # noqa: E731
    w_gate_up, w_down = mk(E, hidden, 2 * inter), mk(E, inter, hidden)
    b_gate_up, b_down = mk(E, 2 * inter), mk(E, hidden)
    x = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
    idx, w = routing(tokens)
    w = w.requires_grad_()
    assert kt.moe._use_grouped_mm(x, w_gate_up, w_down) == (path == "grouped")
    out = kt.moe.moe_experts(
        x, w_gate_up, w_down, idx, w, kt.moe.CLAMPED_SWIGLU, True, b_gate_up=b_gate_up,
        b_down=b_down, interleaved=interleaved, alpha=alpha, limit=limit,
    )  # fmt: skip
    leaves = [leaf64(t) for t in (x, w_gate_up, w_down, b_gate_up, b_down, w)]
    x64, wgu64, wd64, bgu64, bd64, w64 = leaves
    ref = reference64(
        x64, wgu64, wd64, idx, w64, "clamped", True, b_gate_up=bgu64, b_down=bd64,
        interleaved=interleaved, alpha=alpha, limit=limit,
    )  # fmt: skip
    dy = torch.randn_like(out)
    out.backward(dy)
    ref.backward(dy.double())
    factor = 4.0 if dtype == torch.bfloat16 else 1.0
    assert_close(out, ref, dtype, "output", factor)
    names = ["d x", "d gate_up_proj", "d down_proj", "d gate_up_proj_bias", "d down_proj_bias"]
    for name, got, want in zip(names + ["d top_k_weights"], (x, w_gate_up, w_down, b_gate_up, b_down, w), leaves, strict=True):  # fmt: skip
        # In bf16 a pre-activation within a rounding step of +-limit may fall on the other side
        # of the clamp than in float64, and the clamp's gradient jumps there: the gradients
        # upstream of the gate are checked in fp32 only.
        if dtype == torch.float32 or name in ("d down_proj", "d down_proj_bias", "d top_k_weights"):
            assert_close(got.grad, want.grad, dtype, name, factor)
    assert not b_gate_up.grad[E - 1].any() and not b_down.grad[E - 1].any()


def test_only_gate_up_is_kept_for_the_backward(kt):
    """Saved: the inputs, the [S, 2I] gate_up output and the sort; not x gathered per pair, the
    gated product h or the per-pair expert outputs y."""
    tokens, hidden, inter = 10, 32, 24
    x = torch.randn(tokens, hidden, requires_grad=True)
    w_gate_up = torch.randn(E, 2 * inter, hidden, requires_grad=True)
    w_down = torch.randn(E, hidden, inter, requires_grad=True)
    idx, w = routing(tokens)
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        kt.moe.moe_experts(x, w_gate_up, w_down, idx, w.requires_grad_(), kt.moe.SILU)
    s = tokens * K
    float_shapes = sorted(tuple(t.shape) for t in saved if t.is_floating_point())
    assert float_shapes == sorted(
        [(tokens, hidden), tuple(w_gate_up.shape), tuple(w_down.shape), (tokens, K), (s, 2 * inter)]
    )


def test_layer_class_follows_the_layer_contract(kt):
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cls = kt.layers.MoEExperts
    assert "__init__" not in vars(cls)
    assert {k for k in vars(cls) if not k.startswith("__")} == {
        "forward", "has_backward", "can_torch_compile"
    }  # fmt: skip
    assert cls.has_backward is True and cls.can_torch_compile is True
    ours = list(inspect.signature(cls.forward).parameters)
    theirs = list(inspect.signature(MixtralExperts.forward).parameters)
    assert len(ours) == len(theirs)


def test_compiles_fullgraph(kt):
    """torch.compile(fullgraph=True) over the bound layer: the custom ops, no graph break."""
    module = experts("qwen3_moe")
    ref = copy.deepcopy(module)
    module.forward = kt.layers.MoEExperts.forward.__get__(module)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    x = torch.randn(7, 32)
    idx, w = routing(7)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = compiled(x1, idx, w)
    y_ref = ref(x2, idx, w)
    assert_close(y, y_ref, torch.float32, "output")
    y.sum().backward()
    y_ref.sum().backward()
    assert_close(x1.grad, x2.grad, torch.float32, "d hidden_states")
    assert_close(module.gate_up_proj.grad, ref.gate_up_proj.grad, torch.float32, "d gate_up_proj")


def test_autocast_runs_the_matmuls_in_the_autocast_dtype(kt):
    """Under autocast with fp32 weights (mixed-precision training) the experts compute in bf16
    as the module's own linears would, and the fp32 weights get fp32 gradients."""
    ref = experts("qwen3_moe")
    module = copy.deepcopy(ref)
    module.forward = kt.layers.MoEExperts.forward.__get__(module)
    x = torch.randn(9, 32)
    idx, w = routing(9)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = module(x1, idx, w)
        y_ref = ref(x2, idx, w)
    # The [S, 2I] gate/up output was computed in bf16, not in the weights' fp32.
    assert [t.dtype for t in saved if t.shape == (9 * K, 48)] == [torch.bfloat16]
    assert y.dtype == y_ref.dtype == torch.float32
    wgu64, wd64 = leaf64(ref.gate_up_proj), leaf64(ref.down_proj)
    want = reference64(leaf64(x), wgu64, wd64, idx, w.double(), "silu", False)
    assert_close(y, want, torch.bfloat16, "output", 4.0)
    y.sum().backward()
    want.sum().backward()
    assert module.gate_up_proj.grad.dtype == torch.float32
    assert_close(module.gate_up_proj.grad, wgu64.grad, torch.bfloat16, "d gate_up_proj", 4.0)
    assert_close(module.down_proj.grad, wd64.grad, torch.bfloat16, "d down_proj", 4.0)


def test_gpt_oss_compiles_fullgraph_once_its_gate_was_probed(kt):
    """The clamped gate is recognised eagerly (experts_supported, or a first eager call); then
    torch.compile(fullgraph=True) runs it through the custom ops; unprobed, a clear error."""
    kt.moe._PROBED.clear()
    module = experts("gpt_oss")
    ref = copy.deepcopy(module)
    module.forward = kt.layers.MoEExperts.forward.__get__(module)
    x = torch.randn(7, 32)
    idx, w = routing(7)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="has not seen GptOssExperts.s gate yet"):
        torch.compile(module, backend="aot_eager", fullgraph=True)(x, idx, w)
    assert kt.moe.experts_supported(module) is None
    torch._dynamo.reset()
    y = torch.compile(module, backend="aot_eager", fullgraph=True)(x, idx, w)
    assert_close(y, ref(x, idx, w), torch.float32, "output")


def test_unaligned_intermediate_rows_take_the_loop(kt):
    """Transposed weights hide the intermediate size from the weights' strides: a [S, I] operand
    whose rows are not 16-byte aligned must still send the call to the loop over experts."""
    x = torch.randn(8, 32, requires_grad=True)
    w_gate_up = (torch.randn(E, 32, 20) * 0.3).requires_grad_()  # I = 10: 40-byte rows
    w_down = (torch.randn(E, 10, 32) * 0.3).requires_grad_()
    assert not kt.moe._use_grouped_mm(x, w_gate_up, w_down)
    idx, w = routing(8)
    out = kt.moe.moe_experts(x, w_gate_up, w_down, idx, w, kt.moe.SILU, True)
    ref = reference64(leaf64(x), leaf64(w_gate_up), leaf64(w_down), idx, w.double(), "silu", True)
    assert_close(out, ref, torch.float32, "output")
