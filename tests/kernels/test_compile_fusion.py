"""The compile pass that fuses residual adds into the RMSNorm ops (compile_fusion.py): which
pairs it rewrites, which it leaves, that values stay what the unfused graph computes, and how it
takes Inductor's post-grad pass slot.

The pass runs on the graphs AOTAutograd hands a backend; here `Rewriting` applies the pass from
Inductor's slot to them and runs them as they are (tests/gpu runs the real Inductor path).
"""

from __future__ import annotations

import copy
import importlib

import kernels
import pytest
import torch
from _graph_code import MARK, Rewriting
from torch._dynamo.backends.debugging import aot_eager
from torch._inductor import config as inductor_config

from tests.class_marks import restored
from tests.models.registry import causal_lm_class, tiny_config

pytestmark = pytest.mark.usefixtures("inductor_slot_emptied")


def _norm_and_sum(kt, a, b, w, c):
    """s = a + b normed, s also read afterwards: its gradient is the norm's dx plus c."""
    s = a + b
    y = kt.rms_norm(s, w, 1e-6)
    return y, s, (y.float() * c).sum() + (s.float() * c).sum()


def _run(kt, fn, backend, dtype, shape=(3, 5, 32), b_shape=None, upcast=None):
    """fn's (y, s, da, db, dw) compiled with `backend` on fresh inputs of `dtype` (seeded: the
    same values on every call), computed in `upcast` when given."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(shape, generator=gen).to(dtype)
    b = torch.randn(b_shape or shape, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    c = torch.randn(shape, generator=gen)
    a, b, w = (t.to(upcast or dtype).requires_grad_() for t in (a, b, w))
    y, s, loss = torch.compile(lambda *t: fn(kt, *t), backend=backend, fullgraph=True)(a, b, w, c)
    loss.backward()
    return y.detach(), s.detach(), a.grad, b.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_sum_and_the_norm_fuse_forward_and_backward_with_the_unfused_values(kt, dtype, request):
    if dtype == torch.bfloat16:
        # Triton's interpreter rounds fp32 to bf16 by truncation, torch to nearest
        # (scripts/probes/probe_interpreter_bf16_cast.py): the fused kernel's rounding of the sum
        # would differ from torch's add here, not on a GPU. The ops' torch formulas show
        # what the rewrite alone changes.
        request.getfixturevalue("torch_path")
    fused = Rewriting()
    got = _run(kt, _norm_and_sum, fused.backend, dtype)
    want = _run(kt, _norm_and_sum, Rewriting(rewrite=False).backend, dtype)
    assert fused.count("add_rms_norm_fwd") == 1 and fused.count("rms_norm_fwd") == 0
    assert fused.count("add_rms_norm_bwd") == 1 and fused.count("rms_norm_bwd") == 0
    # forward: the same kernel math on the same once-rounded sum
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    # backward: c is added to dx before dx's rounding instead of after. The fused gradient is
    # then within the dtype's rounding of the float64 one (at the gradient's scale: where dx
    # and c cancel, one step of dx is large against their sum); fp32 also to the unfused.
    exact = _run(kt, _norm_and_sum, Rewriting(rewrite=False).backend, dtype, upcast=torch.float64)
    step = torch.finfo(dtype).eps
    for g, r, e in zip(got[2:], want[2:], exact[2:], strict=True):
        torch.testing.assert_close(g.double(), e, rtol=step, atol=step * e.abs().max().item())
        if dtype == torch.float32:
            torch.testing.assert_close(g, r)


def _broadcast_sum(kt, a, b, w, c):
    s = a + b  # b is one row: the add broadcasts
    y = kt.rms_norm(s, w, 1e-6)
    return y, s, (y * c).sum() + (s * c).sum()


def _promoting_sum(kt, a, b, w, c):
    s = a + b.float()  # bf16 + fp32: the add promotes
    y = kt.rms_norm(s, w.float(), 1e-6)
    return y, s, (y * c).sum() + (s * c).sum()


def test_broadcast_and_promoting_sums_are_left_alone(kt):
    broadcast = Rewriting()
    _run(kt, _broadcast_sum, broadcast.backend, torch.float32, b_shape=(32,))
    assert broadcast.count("rms_norm_fwd") == 1 and broadcast.count("add_rms_norm_fwd") == 0
    promoting = Rewriting()
    _run(kt, _promoting_sum, promoting.backend, torch.bfloat16)
    assert promoting.count("rms_norm_fwd") == 1 and promoting.count("add_rms_norm_fwd") == 0


def test_a_norm_saving_its_output_is_fused_forward_only(kt):
    """save_output: the backward reads y (x̂ = y / w), which add_rms_norm_bwd does not take."""

    def saving(kt, a, b, w, c):
        s = a + b
        y = kt.rms_norm(s, w, 1e-6, save_output=True)
        return y, s, (y * c).sum() + (s * c).sum()

    fused = Rewriting()
    got = _run(kt, saving, fused.backend, torch.float32)
    want = _run(kt, saving, Rewriting(rewrite=False).backend, torch.float32)
    assert fused.count("add_rms_norm_fwd") == 1
    assert fused.count("add_rms_norm_bwd") == 0 and fused.count("rms_norm_bwd") == 1
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


@pytest.fixture
def _llama_restored():
    with restored(("llama",)):
        yield


def test_a_bound_llamas_residual_adds_fuse_and_its_step_matches_eager(
    local_kernels, _llama_restored
):
    config = tiny_config("llama")
    config.num_hidden_layers = 2
    torch.manual_seed(0)
    model = causal_lm_class("llama")._from_config(config, attn_implementation="sdpa").train()
    eager = copy.deepcopy(model)
    kernels.apply_training_kernels(model)
    kernels.apply_training_kernels(eager)
    fused = Rewriting()
    ids = torch.randint(0, config.vocab_size, (2, 12))
    loss = torch.compile(model, backend=fused.backend, fullgraph=True)(
        input_ids=ids, labels=ids
    ).loss
    loss.backward()
    ref = eager(input_ids=ids, labels=ids).loss
    ref.backward()
    # Every norm after the embedding reads a residual sum: 2 per layer; the backward's sums of
    # the residual stream's gradient with a norm's dx: one per such norm.
    assert fused.count("add_rms_norm_fwd") == 4 and fused.count("rms_norm_fwd") == 1
    assert fused.count("add_rms_norm_bwd") == 4 and fused.count("rms_norm_bwd") == 1
    # The loss head's saved d(hidden) and d(weight) are scaled in place (compile_grad_scale.py).
    assert fused.count("scale_grad_") == 2
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


# --- the slot --------------------------------------------------------------------------------


def _trace_a_norm(kt):
    torch.compile(lambda x: kt.rms_norm(x, None, 1e-6), backend=aot_eager)(torch.randn(2, 8))


def test_tracing_a_norm_puts_the_pass_in_an_empty_slot_once(kt):
    _trace_a_norm(kt)
    pass_ = inductor_config.post_grad_custom_post_pass
    assert len(getattr(pass_, MARK)) == 1
    torch._dynamo.reset()
    _trace_a_norm(kt)
    assert inductor_config.post_grad_custom_post_pass is pass_ and len(getattr(pass_, MARK)) == 1
    assert pass_.uuid() is not None  # Inductor caches compiled graphs under this key


def test_a_users_cacheable_pass_runs_first_and_a_plain_callable_is_left_alone(kt):
    from torch._inductor.custom_graph_pass import CustomGraphPass

    fusion = importlib.import_module(kt.__name__ + ".compile_fusion")
    seen = []

    class Users(CustomGraphPass):
        def __call__(self, graph):
            seen.append(graph)

        def uuid(self):
            return "users-pass"

    users = Users()
    inductor_config.post_grad_custom_post_pass = users
    assert fusion.install()
    chained = inductor_config.post_grad_custom_post_pass
    assert chained.before is users and users.uuid() in chained.uuid()
    graph = torch.fx.Graph()
    graph.output(None)
    chained(graph)
    assert seen == [graph]

    def plain(graph):
        pass

    inductor_config.post_grad_custom_post_pass = plain
    assert not fusion.install()
    assert inductor_config.post_grad_custom_post_pass is plain


def test_the_environment_turns_the_rewrite_off_and_changes_the_cache_key(kt, monkeypatch):
    _trace_a_norm(kt)  # installs the pass
    pass_ = inductor_config.post_grad_custom_post_pass
    key = pass_.uuid()
    monkeypatch.setenv("KERNELS_COMPILE_FUSION", "0")
    assert pass_.uuid() != key  # a graph compiled fused is not served to an unfused compile
    off = Rewriting()
    _run(kt, _norm_and_sum, off.backend, torch.float32)
    assert off.count("add_rms_norm_fwd") == 0 and off.count("rms_norm_fwd") == 1
    inductor_config.post_grad_custom_post_pass = None
    _trace_a_norm(kt)
    assert inductor_config.post_grad_custom_post_pass is None  # nor is it installed


def test_inductor_runs_the_pass_with_symbolic_lengths(kt, torch_path):
    """Inductor itself (its C++ build on the CPU, about 10 s here): the pass runs from the slot
    on graphs whose lengths are symbolic, and the step equals the uncompiled function's."""
    from torch._inductor.utils import run_and_get_code

    compiled = torch.compile(lambda *t: _norm_and_sum(kt, *t), dynamic=True)
    for length in (8, 12):
        a, b, c = (torch.randn(2, length, 32) for _ in range(3))
        w = 1 + 0.1 * torch.randn(32)
        got = [t.clone().requires_grad_() for t in (a, b, w)]
        want = [t.clone().requires_grad_() for t in (a, b, w)]

        def step(got=got, c=c):  # AOTAutograd compiles the backward at its first call
            y, s, loss = compiled(*got, c)
            loss.backward()
            return y, s

        (y, s), codes = run_and_get_code(step)
        y_ref, s_ref, loss_ref = _norm_and_sum(kt, *want, c)
        loss_ref.backward()
        if length == 8:  # compiled here; 12 reuses the symbolic graph
            code = "\n".join(codes)
            assert "add_rms_norm_fwd" in code and "add_rms_norm_bwd" in code
            assert ".rms_norm_fwd.default" not in code and ".rms_norm_bwd.default" not in code
        torch.testing.assert_close(y, y_ref)
        torch.testing.assert_close(s, s_ref)
        for g, r in zip(got, want, strict=True):
            torch.testing.assert_close(g.grad, r.grad)


def test_a_node_without_a_fake_value_is_not_rewritten(kt):
    """The fused op's fake outputs are computed from its inputs' fake values; where one is
    missing (here the weight's, in both graphs) the pair is left as it is."""

    class Unvalued(Rewriting):
        def _compile(self, gm, example_inputs):
            hidden = {}
            for node in gm.graph.nodes:
                value = node.meta.get("val")
                if (
                    node.op == "placeholder"
                    and isinstance(value, torch.Tensor)
                    and value.dim() == 1
                ):
                    hidden[node] = node.meta.pop("val")
            compiled = super()._compile(gm, example_inputs)
            for node, value in hidden.items():  # AOTAutograd reads them afterwards
                node.meta["val"] = value
            return compiled

    unvalued = Unvalued()
    got = _run(kt, _norm_and_sum, unvalued.backend, torch.float32)
    want = _run(kt, _norm_and_sum, Rewriting(rewrite=False).backend, torch.float32)
    assert unvalued.count("add_rms_norm_fwd") == 0 and unvalued.count("rms_norm_fwd") == 1
    assert unvalued.count("add_rms_norm_bwd") == 0 and unvalued.count("rms_norm_bwd") == 1
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


def test_an_inference_graph_runs_the_norms_without_stats(kt):
    """Compiled under no_grad, the norm ops are called with stats=False (no rstd to keep), the
    fused add + norm too; a compile with gradients keeps them. Values are eager's."""
    fusion = importlib.import_module(kt.__name__ + ".compile_fusion")

    def fn(a, b, w):
        return kt.rms_norm(a + b, w, 1e-6), kt.rms_norm(a, w, 1e-6)

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 5, 32, generator=gen), torch.randn(3, 5, 32, generator=gen)
    w = (1 + 0.1 * torch.randn(32, generator=gen)).requires_grad_()
    stats = {}
    for grad in (False, True):
        fused = Rewriting()
        with torch.set_grad_enabled(grad):
            got = torch.compile(fn, backend=fused.backend, fullgraph=True)(a, b, w)
            want = fn(a, b, w)
        norms = {  # op name -> its stats argument, defaults filled in
            node.target._schema.name.split("::")[1]: fusion._args(node, node.target)[-1]
            for graph in fused.graphs
            for node in graph.nodes
            if node.op == "call_function" and str(node.target).endswith("rms_norm_fwd.default")
        }
        assert set(norms) == {"add_rms_norm_fwd", "rms_norm_fwd"}
        stats[grad] = set(norms.values())
        for g, e in zip(got, want, strict=True):
            torch.testing.assert_close(g, e, rtol=0, atol=0)
        torch._dynamo.reset()
    assert stats == {False: {False}, True: {True}}
