"""FusedQKVAttention on a tiny Phi-3 (transformers 5.24, from a config), bound by
``kernels.apply_training_kernels`` from `kernels serve` on loopback, the rope kernel on Triton's
interpreter: the same losses and gradients as the family's own forward over 3 AdamW steps, the
fused qkv buffer not kept for the backward, d(qkv) written without slice zero-fills, and the
family's own forward where the layer cannot serve a call."""

from __future__ import annotations

import copy
import types
from pathlib import Path

import kernels
import pytest
import torch
from _training_refs import assert_close, rel_err
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 256


def tiny_phi3(rotary: float = 1.0, attn: str = "sdpa", kv_heads: int = 2):
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
        sliding_window=10, pad_token_id=VOCAB - 1, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": rotary},
        attention_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return Phi3ForCausalLM._from_config(config, attn_implementation=attn)


@pytest.fixture
def mirror(hub):
    hub.build(ROOT / "hub_kernels")
    return hub


def _steps(model, batches):
    """(loss, {name: grad}) of each of 3 AdamW steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    out = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize(
    "rotary, attn, kv_heads",
    [(1.0, "sdpa", 2), (0.5, "sdpa", 2), (1.0, "eager", 4)],
    ids=["full-sdpa-gqa", "partial-sdpa-gqa", "full-eager-mha"],
)
def test_phi3_trains_as_its_own_forward(mirror, rotary, attn, kv_heads):
    plain = tiny_phi3(rotary, attn, kv_heads)
    ours = copy.deepcopy(plain)
    report = kernels.apply_training_kernels(ours)
    attention = [e for e in report if e.path.endswith("self_attn") and e.status == "bound"]
    assert [e.layer_name for e in attention] == ["FusedQKVAttention"] * 2, str(report)
    gen = torch.Generator().manual_seed(1)
    # 14 tokens: past the sliding window of 10, so the mask is not plain causal
    batches = [torch.randint(0, VOCAB - 1, (2, 14), generator=gen) for _ in range(3)]
    for (loss, grads), (ref_loss, ref_grads) in zip(
        _steps(ours, batches), _steps(plain, batches), strict=True
    ):
        assert_close(loss, ref_loss, torch.float32, "loss")
        for name, ref in ref_grads.items():
            assert_close(grads[name], ref, torch.float32, name)


def _layer(kt, module):
    module.forward = types.MethodType(kt.layers.FusedQKVAttention.forward, module)
    return module


def _attention_and_inputs(rotary: float = 1.0):
    model = tiny_phi3(rotary)
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 14, 64, requires_grad=True)
    position_ids = torch.arange(14)[None].expand(2, -1)
    cos, sin = model.model.rotary_emb(x, position_ids)
    return attn, x, (cos, sin)


def _saved_storages(attn, x, pe) -> tuple[set[int], int]:
    """(data pointers of the storages the forward saves for the backward, qkv's pointer)."""
    saved: set[int] = set()
    qkv_ptr = []
    hook = attn.qkv_proj.register_forward_hook(
        lambda _m, _a, out: qkv_ptr.append(out.untyped_storage().data_ptr())
    )

    def pack(t):
        saved.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = attn(hidden_states=x, position_embeddings=pe, attention_mask=None)
    hook.remove()
    out.sum().backward()
    return saved, qkv_ptr[0]


def test_qkv_buffer_is_not_kept_for_the_backward(kt):
    """The family's forward hands sdpa v as a slice of qkv (no cache in training), so qkv is
    saved; the layer's forward saves none of it."""
    attn, x, pe = _attention_and_inputs()
    saved, qkv = _saved_storages(attn, x, pe)
    assert qkv in saved  # the check sees the family's own forward keep it
    saved, qkv = _saved_storages(_layer(kt, attn), x, pe)
    assert qkv not in saved


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rotary", [1.0, 0.5], ids=["full", "partial"])
def test_dqkv_is_written_once(kt, rotary):
    """The backward of the split is one buffer written block by block: no slice_backward (a
    zero-filled qkv-sized buffer per slice) and no add of the three; the gradients are the
    family's."""
    attn, x, pe = _attention_and_inputs(rotary)
    dy = torch.randn(2, 14, 64)
    ref = torch.autograd.grad(attn(x, pe, None)[0], [x, attn.qkv_proj.weight], dy)
    plain_ops = _Ops()
    out = attn(x, pe, None)[0]
    with plain_ops:
        torch.autograd.grad(out, [x], dy)
    assert "slice_backward.default" in plain_ops.names  # what the check looks for is there
    _layer(kt, attn)
    ops = _Ops()
    out = attn(x, pe, None)[0]
    with ops:
        got = torch.autograd.grad(out, [x, attn.qkv_proj.weight], dy)
    assert "slice_backward.default" not in ops.names
    assert not {n for n in ops.names if n.startswith(("zeros", "new_zeros", "zero_"))}
    for g, r, what in zip(got, ref, ("dx", "d qkv_proj.weight"), strict=True):
        assert_close(g, r, torch.float32, what)


def test_bf16_matches_the_family_forward_at_bf16_tolerance(kt):
    attn, x, pe = _attention_and_inputs(0.5)
    attn = attn.to(torch.bfloat16)
    x = x.detach().bfloat16().requires_grad_()
    pe = tuple(t.bfloat16() for t in pe)
    dy = torch.randn(2, 14, 64, dtype=torch.bfloat16)
    out = attn(x, pe, None)[0]
    ref = (out, *torch.autograd.grad(out, [x, attn.qkv_proj.weight], dy))
    _layer(kt, attn)
    out = attn(x, pe, None)[0]
    got = (out, *torch.autograd.grad(out, [x, attn.qkv_proj.weight], dy))
    for g, r, what in zip(got, ref, ("y", "dx", "d qkv_proj.weight"), strict=True):
        assert g.dtype == torch.bfloat16
        assert_close(g, r, torch.bfloat16, what)


def _graph(t: torch.Tensor) -> set[str]:
    """The names of the autograd nodes ``t`` was made by."""
    seen, names, todo = set(), set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(node.name())
        todo += [n for n, _ in node.next_functions]
    return names


def test_a_kv_cache_runs_the_family_forward(kt):
    """With a cache the family's forward runs (the cache is updated, the split node is not
    used), with the family's result."""
    from transformers import DynamicCache

    attn, x, pe = _attention_and_inputs()
    ref, _ = attn(x, pe, None, DynamicCache(config=attn.config))
    _layer(kt, attn)
    cache = DynamicCache(config=attn.config)
    got, _ = attn(x, pe, None, cache)
    assert cache.get_seq_length(0) == 14
    assert not any("SplitQKVRope" in n for n in _graph(got))
    assert rel_err(got, ref) == 0.0
    # the name the decoder layers used before transformers renamed it to cache
    cache = DynamicCache(config=attn.config)
    got, _ = attn(x, pe, None, past_key_values=cache)
    assert cache.get_seq_length(0) == 14
    assert rel_err(got, ref) == 0.0
    fused, _ = attn(x, pe, None)
    assert any("SplitQKVRope" in n for n in _graph(fused))
    assert_close(fused, ref, torch.float32, "y")


def _saved_masks(model, ids) -> set[int]:
    """Storages of the [B, 1, T, T] masks sdpa keeps for the backward, over the whole model."""
    t = ids.shape[1]
    masks: set[int] = set()

    def pack(x):
        if x.dim() == 4 and x.shape[-2:] == (t, t) and x.is_floating_point():
            masks.add(x.untyped_storage().data_ptr())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return masks


def test_layers_share_one_additive_mask(kt):
    """sdpa turns the model's bool (sliding-window) mask into an additive one on each call and
    keeps it for the backward: one per layer in the family's forward, one for all layers here,
    with the same loss."""
    model = tiny_phi3()
    ids = torch.randint(0, VOCAB - 1, (2, 14))
    assert len(_saved_masks(model, ids)) == 2  # the family's forward: one per layer
    ref = model(input_ids=ids, labels=ids).loss
    for layer in model.model.layers:
        _layer(kt, layer.self_attn)
    assert len(_saved_masks(model, ids)) == 1
    assert_close(model(input_ids=ids, labels=ids).loss, ref, torch.float32, "loss")


def test_torch_compile_runs_the_family_forward(kt):
    """Under torch.compile (fullgraph, aot_eager) the layer runs the family's forward, which
    Dynamo traces without a break: the same values and gradients as uncompiled."""
    attn, x, pe = _attention_and_inputs()
    _layer(kt, attn)
    ref = attn(x, pe, None)[0]
    ref_grads = torch.autograd.grad(ref.sum(), [x, attn.qkv_proj.weight])
    torch._dynamo.reset()
    compiled = torch.compile(attn, fullgraph=True, backend="aot_eager")
    got = compiled(x, pe, None)[0]
    grads = torch.autograd.grad(got.sum(), [x, attn.qkv_proj.weight])
    assert_close(got, ref, torch.float32, "y")
    for g, r, what in zip(grads, ref_grads, ("dx", "d qkv_proj.weight"), strict=True):
        assert_close(g, r, torch.float32, what)
