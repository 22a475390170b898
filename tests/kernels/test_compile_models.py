"""torch.compile over models bound by ``kernels.apply_training_kernels``: the whole training
step traced (forward, fused loss head, backward), no graph break, no recompile per step, a
bounded number with varying sequence lengths, values equal to eager's, and per op no more
memory held between forward and backward than the eager path holds.

The kernels are custom ops; on the CPU their Triton code runs in the interpreter inside the
ops (tests/kernels/conftest.py). The ``aot_eager`` backend runs Dynamo and AOTAutograd, which
decide graph breaks, guards and what is saved for the backward, without Inductor's C++ build
of the code around the ops (minutes per graph on this machine's CPUs).
"""

from __future__ import annotations

import copy
import sys

import kernels
import pytest
import torch
from _graph_code import Counting
from _live_bytes import LiveBytes
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from tests.class_marks import restored
from tests.models.registry import causal_lm_class, tiny_config
from tests.sweep import sweep_only


@pytest.fixture(autouse=True)
def _model_classes_restored():
    with restored(("llama", "gemma2", "qwen3_moe")):
        yield


# (model type, attention, the custom ops the compiled graph must call: the loss head's too)
# (embedding_fwd: the decoder's input embedding, whose compiled backward is eager's kernel; a
# plain nn.Embedding for llama and qwen3_moe, Gemma-2's scaled one)
FAMILIES = {
    "llama": ("sdpa", ("flce_fwd", "rms_norm_fwd", "rope", "gated_mlp_fwd", "embedding_fwd")),
    # Gemma-2: (1 + w) norms, GeGLU, final logit softcap in the fused loss; softcapped attention
    # logits need eager attention
    "gemma2": ("eager", ("flce_fwd", "rms_norm_fwd", "rope", "gated_mlp_fwd", "embedding_fwd")),
    "qwen3_moe": ("sdpa", ("flce_fwd", "rms_norm_fwd", "rope", "moe_experts_fwd", "embedding_fwd")),
}


def bound_pair(model_type: str, attn: str):
    """Two copies of one tiny one-layer model (same weights), both bound to the kernels."""
    config = tiny_config(model_type)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1]
    torch.manual_seed(0)
    model = causal_lm_class(model_type)._from_config(config, attn_implementation=attn).train()
    twin = copy.deepcopy(model)
    report = kernels.apply_training_kernels(model)
    kernels.apply_training_kernels(twin)
    return model, twin, report


def step(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_whole_step_traces_without_graph_break_and_matches_eager(local_kernels, model_type):
    attn, ops = FAMILIES[model_type]
    model, eager, report = bound_pair(model_type, attn)
    bound = {e.layer_name for e in report if e.status == "bound"}
    assert {"ForCausalLM", "MoEForCausalLM"} & bound, str(report)  # the fused loss head
    backend = Counting()
    # fullgraph=True: any graph break raises instead of splitting the graph
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    loss = step(compiled, ids)
    ref = step(eager, ids)
    assert len(backend.graphs) == 1
    for op in ops:  # traced into the one graph, not run beside it
        assert f".{op}." in backend.graphs[0] or f".{op}(" in backend.graphs[0], op
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    pairs = zip(model.named_parameters(), eager.parameters(), strict=True)
    for (name, p), q in pairs:
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def train(model, lengths, mark_dynamic: bool = False) -> Counting:
    """AdamW steps of the compiled model, one batch per sequence length; the backend's count."""
    backend = Counting()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for length in lengths:
        ids = torch.randint(0, model.config.vocab_size, (2, length))
        if mark_dynamic:
            torch._dynamo.mark_dynamic(ids, 1)
        step(compiled, ids)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return backend


def test_steps_of_one_shape_compile_once(local_kernels):
    model, _, _ = bound_pair("llama", "sdpa")
    assert len(train(model, [12] * 4).graphs) == 1


def test_varying_lengths_compile_at_most_twice(local_kernels):
    """Dynamo's default: the first length is compiled static, the second recompiles with a
    symbolic length that serves every later one (no kernel choice depends on it at trace time)."""
    model, _, _ = bound_pair("llama", "sdpa")
    assert len(train(model, [8, 12, 16, 9]).graphs) == 2


@sweep_only("lengths marked dynamic (a third model compile)")
def test_lengths_marked_dynamic_compile_once(local_kernels):
    model, _, _ = bound_pair("gemma2", "eager")
    assert len(train(model, [8, 12, 16, 9], mark_dynamic=True).graphs) == 1


# --- what a compiled op holds between its forward and backward --------------------------------


def compiled_held(fn, *inputs) -> int:
    """Bytes the compiled forward of fn leaves alive for its caller and its backward: the
    forward graph's outputs (fn's outputs and the saved tensors), by storage, without the
    storages of the inputs (parameters, the caller's tensors)."""
    held: list[int] = []

    def forward(gm, example_inputs):
        inputs_storages = set()
        for node in gm.graph.nodes:
            if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor):
                inputs_storages.add(id(node.meta["val"].untyped_storage()))
        sizes = {}
        for out in next(n for n in gm.graph.nodes if n.op == "output").args[0]:
            val = getattr(out, "meta", {}).get("val")
            if isinstance(val, torch.Tensor) and id(val.untyped_storage()) not in inputs_storages:
                sizes[id(val.untyped_storage())] = val.untyped_storage().nbytes()
        held.append(sum(sizes.values()))
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=forward, bw_compiler=lambda gm, _: gm.forward)
    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    assert len(held) == 1
    return held[0]


def eager_held(fn, *inputs) -> int:
    """Bytes the eager call of fn allocates and leaves alive (outputs and what autograd keeps)."""
    with LiveBytes() as probe:
        out = fn(*inputs)
        live = probe.live
    del out
    return live


def _op_cases(kt):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    layers = sys.modules[kt.__name__ + ".layers"]
    mlp = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=64))
    x = torch.randn(2, 8, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    q = torch.randn(2, 8, 4, 16).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 8, 2, 16).transpose(1, 2).requires_grad_()
    cos, sin = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    head = torch.randn(48, 32, requires_grad=True)
    target = torch.randint(0, 48, (2, 8))
    logits = torch.randn(16, 48, requires_grad=True)
    return {
        "rms_norm": (lambda x, w: kt.rms_norm(x, w, 1e-6), x, w),
        "rms_norm_save_output": (lambda x, w: kt.rms_norm(x, w, 1e-6, save_output=True), x, w),
        "layer_norm": (lambda x, w: kt.layer_norm(x, w, None, 1e-5), x, w),
        "rope": (lambda q, k: kt.apply_rotary_pos_emb(q, k, cos, sin), q, k),
        "swiglu_mlp": (lambda x: layers.SwiGLUMLP.forward(mlp, x), x),
        "flce": (lambda x, w: kt.fused_linear_cross_entropy(x, w, target), x, head),
        "cross_entropy": (
            lambda z: kt.cross_entropy(z, target.reshape(-1), inplace=False),
            logits,
        ),
    }


@pytest.mark.parametrize(
    "op",
    [
        "rms_norm",
        "rms_norm_save_output",
        "layer_norm",
        "rope",
        "swiglu_mlp",
        "flce",
        "cross_entropy",
    ],
)
def test_compiled_op_holds_no_more_than_eager(kt, op):
    fn, *inputs = _op_cases(kt)[op]
    eager = eager_held(fn, *inputs)
    compiled = compiled_held(fn, *inputs)
    assert 0 < compiled <= eager, (compiled, eager)


def test_trainer_torch_compile_runs_one_graph(local_kernels, tmp_path):
    """transformers' Trainer with ``torch_compile=True`` compiles the bound model as users get
    it (num_items_in_batch reaches the fused loss): one graph over its steps, no graph break."""
    from torch._dynamo.utils import counters
    from transformers import Trainer, TrainingArguments

    model, _, _ = bound_pair("llama", "sdpa")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(8):
        ids = torch.randint(0, model.config.vocab_size, (12,), generator=gen)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, use_cpu=True,
        torch_compile=True, torch_compile_backend="aot_eager", report_to=[],
        save_strategy="no", logging_steps=1, dataloader_num_workers=0,
    )  # fmt: skip
    counters.clear()
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1
