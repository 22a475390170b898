"""Loss layers on tiny Qwen3 and Llama models (CPU, Triton interpreter) against the originals.

The fused loss's numbers are checked interpreted (the first tests, with num_items_in_batch and
the drop-in losses); what the layer does around it (caches, eval, shifted labels, hooks,
compile, FSDP) runs on the kernels' torch formulas (`torch_path`), the same layer code.
"""

from __future__ import annotations

import copy
import importlib
from types import MethodType

import pytest
import torch
from _training_refs import rel_err
from torch.utils._python_dispatch import TorchDispatchMode

VOCAB = 1531
BATCH, SEQ, HIDDEN = 2, 24, 32  # 48 tokens: more than the hidden size, so N*V is the largest


@pytest.fixture(scope="module")
def ll(kt):
    return importlib.import_module(f"{kt.__name__}.loss_layers")


@pytest.fixture(scope="module")
def fl(kt):
    return importlib.import_module(f"{kt.__name__}.fused_linear_cross_entropy")


@pytest.fixture
def small_chunks(fl, monkeypatch):
    """16-token chunks, so that the fused path is visibly chunked at these tiny sizes."""
    monkeypatch.setattr(fl, "default_chunk_rows", lambda n, vocab, itemsize: 16)


class LargestTensor(TorchDispatchMode):
    """Records the most elements of any new tensor an aten op creates (views, in-place results
    and the interpreter's byte views of existing storages do not count: they allocate nothing)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = set()
        for a in [*args, *(kwargs or {}).values()]:
            if isinstance(a, torch.Tensor):
                inputs.add(a.untyped_storage().data_ptr())
            elif isinstance(a, (torch.UntypedStorage, torch.TypedStorage)):
                inputs.add(a.data_ptr())
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel())
        return out


def tiny_model(arch: str, tied: bool):
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    if arch == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = Qwen3ForCausalLM(Qwen3Config(**common))
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**common))
    return model.float().train()


def batch():
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    labels = ids.clone()
    labels[0, :5] = -100  # a masked prompt
    labels[1, -3:] = -100  # padding
    return ids, labels


def bound(model, ll):
    ours = copy.deepcopy(model)
    ours.forward = MethodType(ll.ForCausalLM.forward, ours)
    return ours


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "arch,tied", [("qwen3", True), ("llama", False)], ids=["qwen3-tied", "llama-untied"]
)
def test_fused_loss_and_grads_match_original(ll, small_chunks, arch, tied):
    model = tiny_model(arch, tied)
    ours = bound(model, ll)
    ids, labels = batch()
    ref = model(input_ids=ids, labels=labels)
    ref.loss.backward()
    with LargestTensor() as seen_ref:
        model(input_ids=ids, labels=labels)
    with LargestTensor() as seen:
        out = ours(input_ids=ids, labels=labels)
        out.loss.backward()
    assert out.logits is None
    # The original materialises [tokens, vocab] logits; ours never does, backward included.
    assert seen_ref.largest >= BATCH * SEQ * VOCAB
    assert seen.largest < BATCH * SEQ * VOCAB
    assert rel_err(out.loss.detach(), ref.loss.detach()) < 1e-5
    ref_grads, our_grads = grads(model), grads(ours)
    assert ref_grads.keys() == our_grads.keys()
    for name, g in ref_grads.items():
        assert rel_err(our_grads[name], g) < 1e-4, name


def test_num_items_in_batch_and_return_logits(ll, small_chunks):
    model = tiny_model("qwen3", tied=False)
    ours = bound(model, ll)
    ids, labels = batch()
    n = torch.tensor(57)
    ref = model(input_ids=ids, labels=labels, num_items_in_batch=n)
    out = ours(input_ids=ids, labels=labels, num_items_in_batch=n, return_logits=True)
    assert rel_err(out.loss.detach(), ref.loss.detach()) < 1e-5
    assert torch.equal(out.logits, ref.logits)


def test_training_builds_no_kv_cache_unless_asked(ll, small_chunks, torch_path):
    model = tiny_model("qwen3", tied=True)
    assert model.config.use_cache  # transformers would build a cache from this in training
    ours = bound(model, ll)
    ids, labels = batch()
    assert model(input_ids=ids, labels=labels).past_key_values is not None
    out = ours(input_ids=ids, labels=labels)
    assert out.past_key_values is None
    ref = model(input_ids=ids, labels=labels, use_cache=False)
    assert rel_err(out.loss.detach(), ref.loss.detach()) < 1e-5
    assert ours(input_ids=ids, labels=labels, use_cache=True).past_key_values is not None
    assert ours(input_ids=ids).past_key_values is not None  # no labels: the original behaviour
    ours.eval()
    assert ours(input_ids=ids, labels=labels).past_key_values is not None


def test_eval_and_no_labels_behave_like_the_original(ll, torch_path):
    model = tiny_model("llama", tied=True).eval()
    ours = bound(model, ll)
    ids, labels = batch()
    with torch.no_grad():
        ref = model(input_ids=ids, labels=labels)
        out = ours(input_ids=ids, labels=labels)  # eval: logits returned as usual
        assert torch.equal(out.logits, ref.logits)
        assert rel_err(out.loss, ref.loss) < 1e-5
        plain, plain_ref = ours(input_ids=ids), model(input_ids=ids)
        assert plain.loss is None and torch.equal(plain.logits, plain_ref.logits)
        last = ours(input_ids=ids, logits_to_keep=1)
        assert torch.equal(last.logits, model(input_ids=ids, logits_to_keep=1).logits)
        tup = ours(input_ids=ids, return_dict=False)
        assert isinstance(tup, tuple) and torch.equal(tup[0], plain_ref.logits)
        skipped = ours(input_ids=ids, labels=labels, return_logits=False)
        assert skipped.logits is None


def test_shift_labels_and_mismatch(ll, torch_path):
    model = tiny_model("qwen3", tied=True)
    ours = bound(model, ll)
    ids, labels = batch()
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    ref = model(input_ids=ids, labels=labels)
    out = ours(input_ids=ids, labels=torch.zeros_like(labels), shift_labels=shifted)
    assert rel_err(out.loss.detach(), ref.loss.detach()) < 1e-5
    with pytest.raises(ValueError, match="logits_to_keep"):
        ours(input_ids=ids, labels=labels, logits_to_keep=4)


def test_layer_contract(ll):
    """Stateless, and the same parameter kinds as the forwards it replaces."""
    import inspect

    from torch import nn
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM

    for layer in (ll.ForCausalLM, ll.CrossEntropyLoss):
        assert layer.__init__ is nn.Module.__init__
        assert set(dir(layer)) - set(dir(nn.Module)) == {"has_backward", "can_torch_compile"}
    kinds = [p.kind for p in inspect.signature(ll.ForCausalLM.forward).parameters.values()]
    for cls in (Qwen3ForCausalLM, LlamaForCausalLM):
        theirs = [p.kind for p in inspect.signature(cls.forward).parameters.values()]
        assert kinds == theirs
    ce_kinds = [p.kind for p in inspect.signature(ll.CrossEntropyLoss.forward).parameters.values()]
    assert ce_kinds == [
        p.kind for p in inspect.signature(nn.CrossEntropyLoss.forward).parameters.values()
    ]


@pytest.mark.parametrize("with_num_items", [False, True])
def test_for_causal_lm_loss_drop_in(ll, with_num_items):
    from transformers.loss.loss_utils import ForCausalLMLoss

    logits = torch.randn(BATCH, SEQ, VOCAB, dtype=torch.bfloat16)
    _, labels = batch()
    kw = {"num_items_in_batch": torch.tensor(40)} if with_num_items else {}
    x_ref = logits.clone().requires_grad_(True)
    ref = ForCausalLMLoss(x_ref, labels, VOCAB, **kw)
    ref.backward()
    x = logits.clone().requires_grad_(True)
    loss = ll.ForCausalLMLoss(x, labels, VOCAB, **kw)
    loss.backward()
    assert torch.equal(x.detach(), logits)  # the logits a model returns stay intact
    assert loss.dtype == ref.dtype == torch.float32
    assert rel_err(loss.detach(), ref.detach()) < 1e-5
    assert rel_err(x.grad, x_ref.grad) < 1e-2  # bf16 gradients


def test_cross_entropy_loss_layer(ll):
    mod = torch.nn.CrossEntropyLoss(ignore_index=3, label_smoothing=0.1, reduction="sum")
    ours = copy.deepcopy(mod)
    ours.forward = MethodType(ll.CrossEntropyLoss.forward, ours)
    logits = torch.randn(20, VOCAB)
    target = torch.randint(0, VOCAB, (20,))
    target[:4] = 3
    x_ref, x = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    ref, out = mod(x_ref, target), ours(x, target)
    ref.backward()
    out.backward()
    assert rel_err(out.detach(), ref.detach()) < 1e-5
    assert rel_err(x.grad, x_ref.grad) < 1e-5
    # Class weights take torch's own path.
    w = torch.rand(VOCAB)
    mod_w = torch.nn.CrossEntropyLoss(weight=w)
    ours_w = copy.deepcopy(mod_w)
    ours_w.forward = MethodType(ll.CrossEntropyLoss.forward, ours_w)
    assert torch.equal(ours_w(logits, target), mod_w(logits, target))


def test_under_torch_compile(ll, small_chunks, torch_path):
    """The fused loss is traced into a compiled model (its custom op) and matches the model's
    own loss and gradients."""
    model = tiny_model("qwen3", tied=True)
    ours = bound(model, ll)
    ids, labels = batch()
    ref = model(input_ids=ids, labels=labels).loss
    compiled = torch.compile(ours, backend="aot_eager")
    loss = compiled(input_ids=ids, labels=labels).loss
    loss.backward()
    ref.backward()
    assert rel_err(loss.detach(), ref.detach()) < 1e-5
    ref_grads, our_grads = grads(model), grads(ours)
    assert ref_grads.keys() == our_grads.keys()
    for name, g in ref_grads.items():  # the head's gradient (tied: the embedding's) included
        assert rel_err(our_grads[name], g) < 1e-4, name


@pytest.mark.parametrize("hooked", [False, True], ids=["plain-head", "hooked-head"])
def test_head_hooks_run_and_plain_heads_are_not_touched(
    ll, small_chunks, monkeypatch, torch_path, hooked
):
    """A head with forward hooks runs the fused loss as its forward (the hooks fire around it,
    the instance attribute is restored); a head without hooks is read directly, never patched."""
    model = tiny_model("qwen3", tied=True)
    ours = bound(model, ll)
    head = ours.lm_head
    fired, patched = [], []
    fused = ll.fused_linear_cross_entropy

    def spy(hidden, weight, *args, **kwargs):
        patched.append("forward" in head.__dict__)
        return fused(hidden, weight, *args, **kwargs)

    monkeypatch.setattr(ll, "fused_linear_cross_entropy", spy)
    if hooked:
        head.register_forward_pre_hook(lambda module, args: fired.append("pre"))
        head.register_forward_hook(lambda module, args, out: fired.append("post"))
    ids, labels = batch()
    loss = ours(input_ids=ids, labels=labels).loss
    assert rel_err(loss.detach(), model(input_ids=ids, labels=labels).loss.detach()) < 1e-5
    assert patched == [hooked]
    assert fired == (["pre", "post"] if hooked else [])
    assert "forward" not in head.__dict__  # nothing left behind


def test_fsdp2_sharded_lm_head(ll, small_chunks, monkeypatch, torch_path):
    """fully_shard on lm_head and the model (one-rank gloo group on the CPU): the layer runs the
    loss inside lm_head's FSDP hooks, so it sees the gathered weight and FSDP reduce-scatters the
    gradient into the sharded parameter."""
    import socket

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    started = not dist.is_initialized()
    if started:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = tiny_model("llama", tied=False)
        ours = bound(model, ll)
        seen = []
        fused = ll.fused_linear_cross_entropy

        def spy(hidden, weight, *args, **kwargs):
            seen.append(type(weight))
            return fused(hidden, weight, *args, **kwargs)

        monkeypatch.setattr(ll, "fused_linear_cross_entropy", spy)
        fully_shard(ours.lm_head, mesh=mesh)
        fully_shard(ours, mesh=mesh)
        ids, labels = batch()
        ref = model(input_ids=ids, labels=labels)
        ref.loss.backward()
        out = ours(input_ids=ids, labels=labels)
        out.loss.backward()
        assert seen == [torch.nn.Parameter]  # gathered by FSDP's pre-forward hook
        grad = ours.lm_head.weight.grad
        assert isinstance(grad, DTensor)
        assert rel_err(out.loss.detach(), ref.loss.detach()) < 1e-5
        assert rel_err(grad.full_tensor(), model.lm_head.weight.grad) < 1e-4
    finally:
        if started:
            dist.destroy_process_group()
