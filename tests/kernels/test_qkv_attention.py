"""FusedQKVAttention on a tiny Phi-3 (transformers 5.24, from a config), bound by
``kernels.apply_training_kernels`` from `kernels serve` on loopback, the rope kernel on Triton's
interpreter: the same losses and gradients as the family's own forward over 3 AdamW steps, the
fused qkv buffer not kept for the backward, d(qkv) written without slice zero-fills, and the
family's own forward where the layer cannot serve a call (a KV cache holding tokens, compile)."""

from __future__ import annotations

import copy
import sys
import types
from pathlib import Path

import kernels
import pytest
import torch
from _training_refs import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from tests.sweep import sweep_param

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 256


def tiny_phi3(rotary: float = 1.0, attn: str = "sdpa", kv_heads: int = 2, **overrides):
    from transformers import Phi3Config, Phi3ForCausalLM

    settings = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
        sliding_window=10, pad_token_id=VOCAB - 1, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": rotary},
        attention_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False,
    )  # fmt: skip
    settings.update(overrides)
    torch.manual_seed(0)
    return Phi3ForCausalLM._from_config(Phi3Config(**settings), attn_implementation=attn)


@pytest.fixture
def mirror(hub):
    hub.build(ROOT / "hub_kernels")
    return hub


def _padded_batches(pads: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, attention_mask) [2, 14] per step, row 0 left-padded by that step's pad: the
    same shape every step with a different mask, which a mask cache keyed wrongly would reuse.
    14 tokens: past the sliding window of 10, so the mask is not plain causal either."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for pad in pads:
        ids = torch.randint(0, VOCAB - 1, (2, 14), generator=gen)
        mask = torch.ones(2, 14, dtype=torch.long)
        mask[0, :pad] = 0  # ordinary tokens under the padding, so attending to them shows
        out.append((ids, mask))
    return out


def _steps(model, batches, loss_fn=None):
    """(loss, {name: grad}) of each of the AdamW steps over (input_ids, attention_mask) batches;
    the model's own loss from labels, or ``loss_fn(logits, labels)`` on the logits when given."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    out = []
    for ids, mask in batches:
        labels = ids.masked_fill(mask == 0, -100)
        if loss_fn is None:
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        else:
            loss = loss_fn(model(input_ids=ids, attention_mask=mask).logits, labels)
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def _assert_trains_alike(ours, plain, batches) -> None:
    """Each step's loss and every gradient of `ours` match `plain`'s (fp32)."""
    for (loss, grads), (ref_loss, ref_grads) in zip(
        _steps(ours, batches), _steps(plain, batches), strict=True
    ):
        assert_close(loss, ref_loss, torch.float32, "loss")
        for name, ref in ref_grads.items():
            assert_close(grads[name], ref, torch.float32, name)


# The default run covers each value of each option (partial and full rotary, sdpa and eager,
# grouped and one k/v head per head) in two models; KERNELS_SWEEP=1 adds full-sdpa-gqa.
@pytest.mark.parametrize(
    "rotary, attn, kv_heads",
    [sweep_param(1.0, "sdpa", 2, what="a third option mix", id="full-sdpa-gqa"),
     pytest.param(0.5, "sdpa", 2, id="partial-sdpa-gqa"),
     pytest.param(1.0, "eager", 4, id="full-eager-mha")],
)  # fmt: skip
def test_phi3_trains_as_its_own_forward(mirror, rotary, attn, kv_heads):
    plain = tiny_phi3(rotary, attn, kv_heads)
    ours = copy.deepcopy(plain)
    report = kernels.apply_training_kernels(ours)
    attention = [e for e in report if e.path.endswith("self_attn") and e.status == "bound"]
    assert [e.layer_name for e in attention] == ["FusedQKVAttention"] * 2, str(report)
    batches = _padded_batches((3, 6, 0))
    _assert_trains_alike(ours, plain, batches)


def _layer(kt, module):
    module.forward = types.MethodType(kt.layers.FusedQKVAttention.forward, module)
    return module


def test_differently_padded_batches_train_as_the_family_forward(kt, torch_path):
    """Three AdamW steps over batches of one shape whose masks differ (row 0 left-padded by 3,
    6, 0 tokens): each step's shared additive mask is made from that step's mask, so the loss
    and every gradient are the family's. The layer alone is bound, so nothing else differs."""
    plain = tiny_phi3()
    ours = copy.deepcopy(plain)
    for layer in ours.model.layers:
        _layer(kt, layer.self_attn)
    batches = _padded_batches((3, 6, 0))
    _assert_trains_alike(ours, plain, batches)


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


def _fused_calls(t: torch.Tensor) -> int:
    """How many split nodes the autograd graph of ``t`` holds (one per fused layer call)."""
    seen, count, todo = set(), 0, [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += "SplitQKVRope" in node.name()
        todo += [n for n, _ in node.next_functions]
    return count


def test_a_kv_cache_stays_fused_until_it_holds_tokens(kt):
    """An empty cache (prefill, or training with use_cache) takes the fused path and is filled
    as the family's forward fills it; once it holds the layer's tokens (decoding) the family's
    forward runs, with the family's result."""
    from transformers import DynamicCache

    attn, x, pe = _attention_and_inputs()
    ref_cache = DynamicCache(config=attn.config)
    ref, _ = attn(x, pe, None, ref_cache)
    _layer(kt, attn)
    # the name the decoder layers used before transformers renamed it to cache, and the new one
    for by_name in (False, True):
        cache = DynamicCache(config=attn.config)
        got, _ = attn(x, pe, None, past_key_values=cache) if by_name else attn(x, pe, None, cache)
        assert _fused_calls(got) == 1
        assert_close(got, ref, torch.float32, "y")
        assert cache.get_seq_length(0) == 14
        for what in ("keys", "values"):
            mine, family = getattr(cache.layers[0], what), getattr(ref_cache.layers[0], what)
            assert_close(mine, family, torch.float32, f"cached {what}")
    # a decoding step: one new token over the 14 cached (filled without a graph, so the step's
    # graph holds only what the step made)
    cache = DynamicCache(config=attn.config)
    with torch.no_grad():
        attn(x, pe, None, cache)
    x1 = torch.randn(2, 1, 64, requires_grad=True)
    pe1 = tuple(t[:, -1:] for t in pe)
    want, _ = type(attn).forward(attn, x1, pe1, None, ref_cache)
    got, _ = attn(x1, pe1, None, cache)
    assert cache.get_seq_length(0) == 15
    assert _fused_calls(got) == 0
    assert_close(got, want, torch.float32, "decoded y")


def _loss_outside(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy computed outside the model (no labels handed to it)."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
    )


def test_use_cache_config_without_labels_trains_fused_and_generates(mirror):
    """Phi-3's config keeps use_cache, so transformers builds a DynamicCache even in training;
    without labels nothing turns it off. The fused path still serves every layer, with the
    family's loss and gradients, and generate() (prefill fused, decoding the family's forward)
    picks the family's tokens."""
    plain = tiny_phi3(use_cache=True)
    assert plain.config.use_cache
    ours = copy.deepcopy(plain)
    kernels.apply_training_kernels(ours)
    batches = _padded_batches((2,))  # one step: the point is the cache, not AdamW
    ids, mask = batches[0]
    ours.train()
    assert _fused_calls(ours(input_ids=ids, attention_mask=mask).logits) == 2
    for (loss, grads), (ref_loss, ref_grads) in zip(
        _steps(ours, batches, _loss_outside), _steps(plain, batches, _loss_outside), strict=True
    ):
        assert_close(loss, ref_loss, torch.float32, "loss")
        for name, ref in ref_grads.items():
            assert_close(grads[name], ref, torch.float32, name)
    prompt = torch.randint(0, VOCAB - 1, (2, 6), generator=torch.Generator().manual_seed(2))
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=VOCAB - 1)
    with torch.no_grad():
        want = plain.eval().generate(prompt, **settings)
        got = ours.eval().generate(prompt, **settings)
    assert torch.equal(got, want)


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


def test_layers_share_one_additive_mask(kt, torch_path):
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


def test_torch_compile_runs_the_family_forward(kt, monkeypatch):
    """Under torch.compile (fullgraph, aot_eager) the layer runs the family's forward, which
    Dynamo traces without a break (no call of the split): the same values and gradients as
    uncompiled."""
    attn, x, pe = _attention_and_inputs()
    _layer(kt, attn)
    ref = attn(x, pe, None)[0]
    ref_grads = torch.autograd.grad(ref.sum(), [x, attn.qkv_proj.weight])
    module = sys.modules[f"{kt.__name__}.qkv_attention"]
    calls = []

    def counted(*args):
        calls.append(1)
        return split(*args)

    split = module.split_qkv_rope
    monkeypatch.setattr(module, "split_qkv_rope", counted)
    attn(x, pe, None)
    assert len(calls) == 1  # the count sees an uncompiled call
    calls.clear()
    torch._dynamo.reset()
    compiled = torch.compile(attn, fullgraph=True, backend="aot_eager")
    got = compiled(x, pe, None)[0]
    assert not calls
    grads = torch.autograd.grad(got.sum(), [x, attn.qkv_proj.weight])
    assert_close(got, ref, torch.float32, "y")
    for g, r, what in zip(grads, ref_grads, ("dx", "d qkv_proj.weight"), strict=True):
        assert_close(g, r, torch.float32, what)
