"""The compile pass that scales the loss ops' saved gradients in place (compile_grad_scale.py):
that a compiled backward calls `scale_grad_` on each donated saved gradient and computes what
the unrewritten graph computes, bit for bit, at a grad_output of 1 and of another value; and
which chains it leaves alone.

Most tests run AOTAutograd's graphs through `Rewriting` (the pass from Inductor's slot, no
Inductor build); one runs Inductor itself on the CPU; tests/gpu runs it on the GPU. They run the
kernels' torch formulas (`torch_path`): Triton's interpreter rounds fp32 to bf16 toward zero
(triton 3.9; the GPU rounds to nearest even, as torch does), so bit-for-bit comparisons with
torch's multiply hold only there and on the GPU.
"""

from __future__ import annotations

import importlib
import re

import pytest
import torch
from _graph_code import Rewriting
from torch._inductor import config as inductor_config
from torch.fx.experimental.proxy_tensor import make_fx

pytestmark = pytest.mark.usefixtures("inductor_slot_emptied")


def _flce(kt, h, w, t, s):
    return kt.fused_linear_cross_entropy(h, w, t) * s


def _linear_ce(kt, h, w, t, s):
    """The unfused head: cross-entropy's saved d(logits) is read by the matmuls' backward."""
    return kt.cross_entropy(h @ w.t(), t) * s


# The saved gradients each loss keeps for its backward: d(hidden) and d(weight); d(logits).
SAVED = {_flce: 2, _linear_ce: 1}


def _step(kt, loss_fn, backend, dtype, factor, rows=24, compiled=None):
    """(loss, dh, dw) of loss_fn * factor on inputs seeded by `rows`, compiled with `backend`
    (None: eager), or run through `compiled`."""
    gen = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, 32, generator=gen).to(dtype).requires_grad_()
    w = (0.5 * torch.randn(80, 32, generator=gen)).to(dtype).requires_grad_()
    t = torch.randint(0, 80, (rows,), generator=gen)
    t[3] = -100
    fn = compiled or (
        (lambda *a: loss_fn(kt, *a))
        if backend is None
        else torch.compile(lambda *a: loss_fn(kt, *a), backend=backend, fullgraph=True)
    )
    loss = fn(h, w, t, torch.tensor(factor))
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("factor", [1.0, 0.37])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("loss_fn", [_flce, _linear_ce], ids=["flce", "linear_ce"])
def test_saved_gradients_scale_in_place_with_the_unrewritten_values(
    kt, torch_path, loss_fn, dtype, factor
):
    rewritten, plain = Rewriting(), Rewriting(rewrite=False)
    got = _step(kt, loss_fn, rewritten.backend, dtype, factor)
    torch._dynamo.reset()
    want = _step(kt, loss_fn, plain.backend, dtype, factor)
    eager = _step(kt, loss_fn, None, dtype, factor)
    assert rewritten.count("scale_grad_") == SAVED[loss_fn] and plain.count("scale_grad_") == 0
    for a, b, c in zip(got, want, eager, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_without_donated_buffers_nothing_is_rewritten(kt, torch_path):
    """AOTAutograd's donation record is what makes the in-place scale safe: without it (the
    config off), the multiply stays."""
    rewritten = Rewriting()
    with torch._functorch.config.patch(donated_buffer=False):
        got = _step(kt, _flce, rewritten.backend, torch.bfloat16, 0.37)
    want = _step(kt, _flce, None, torch.bfloat16, 0.37)
    assert rewritten.count("scale_grad_") == 0
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_inductor_scales_the_saved_gradients_in_place(kt, torch_path):
    """Inductor itself (its C++ build on the CPU): the pass runs from the slot on its graphs,
    the backward calls scale_grad_ instead of a multiply kernel, and the values are eager's."""
    from torch._inductor.utils import run_and_get_code

    for factor in (0.37, 1.0):
        torch._dynamo.reset()
        got, codes = run_and_get_code(
            lambda f=factor: _step(kt, _flce, "inductor", torch.bfloat16, f)
        )
        want = _step(kt, _flce, None, torch.bfloat16, factor)
        backward = codes[-1]
        assert backward.count("scale_grad_.default(") == 2, backward
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)


def test_inductor_with_symbolic_lengths(kt, torch_path):
    """dynamic=True: the backward also takes the saved lengths (symbolic ints come first among
    its inputs, and the donation record counts them); one graph serves three lengths."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    compiled = torch.compile(lambda *a: _flce(kt, *a), dynamic=True, fullgraph=True)
    for rows in (24, 40, 56):
        run = lambda r=rows: _step(kt, _flce, None, torch.bfloat16, 0.37, r, compiled)  # noqa: E731
        if rows == 24:  # run_and_get_code resets Dynamo: only around the first call
            got, codes = run_and_get_code(run)
            counters.clear()
            assert codes[-1].count("scale_grad_.default(") == 2, codes[-1]
            # The lengths arrive as inputs (`s12 = primals_3`), before the saved gradients.
            assert re.search(r"\bs\d+ = primals_", codes[-1]), "no symbolic length"
        else:
            got = run()
        want = _step(kt, _flce, None, torch.bfloat16, 0.37, rows)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
    assert counters["stats"]["unique_graphs"] == 0, "recompiled"


# --- which chains: graphs made by make_fx, the donation record planted ------------------------


def _module(kt):
    return importlib.import_module(kt.__name__ + ".compile_grad_scale")


def _rewrite(kt):
    return _module(kt).scale_saved_grads_in_place


def _bf16_chain(saved, tangents):
    return (saved.float() * tangents).to(saved.dtype)


def _fp32_chain(saved, tangents):
    return tangents * saved


def _chain_read_twice(saved, tangents):
    scaled = saved.float() * tangents
    return scaled.to(saved.dtype), scaled.sum()


def _upcast_read_twice(saved, tangents):
    up = saved.float()
    return (up * tangents).to(saved.dtype), up.sum()


def _other_dtype_out(saved, tangents):
    return (saved.float() * tangents).to(torch.float16)


def _bf16(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


CASES = {  # name: (function, saved, tangents, rewritten?)
    "bf16 chain": (_bf16_chain, _bf16(6, 8), torch.tensor(0.37), True),
    "fp32, factor first": (_fp32_chain, torch.randn(6, 8), torch.tensor(0.37), True),
    "factor of shape [1]": (_bf16_chain, _bf16(6, 8), torch.tensor([0.37]), True),
    "product read twice": (_chain_read_twice, _bf16(6, 8), torch.tensor(0.37), False),
    "upcast read twice": (_upcast_read_twice, _bf16(6, 8), torch.tensor(0.37), False),
    "per-row factor": (_bf16_chain, _bf16(6, 8), torch.rand(6, 1), False),
    "bf16 factor": (_fp32_chain, torch.randn(6, 8), torch.tensor(0.37).bfloat16(), False),
    "strided gradient": (_bf16_chain, _bf16(8, 6).t(), torch.tensor(0.37), False),
    "another dtype out": (_other_dtype_out, _bf16(6, 8), torch.tensor(0.37), False),
    "0-d gradient": (_fp32_chain, torch.tensor(1.5), torch.tensor(0.37), False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_which_chains_are_rewritten(kt, torch_path, monkeypatch, case):
    import torch._inductor.utils as inductor_utils

    fn, saved, tangents, expected = CASES[case]
    gm = make_fx(fn, tracing_mode="fake")(saved, tangents)
    monkeypatch.setattr(inductor_utils, "get_donated_idxs", lambda: [0])
    want = gm(saved.clone(), tangents)
    assert _rewrite(kt)(gm.graph) == int(expected)
    gm.recompile()
    got = gm(saved.clone(), tangents)
    leaves = torch.utils._pytree.tree_leaves
    for a, b in zip(leaves(got), leaves(want), strict=True):
        assert torch.equal(a, b)
    assert ("scale_grad_" in gm.code) == expected


def test_a_graph_without_grad_outputs_or_donations_is_left_alone(kt, monkeypatch):
    """A forward graph (no tangents_N inputs) is never rewritten, though the backward's
    donation record is readable while it compiles; nor a backward with no record."""
    import torch._inductor.utils as inductor_utils

    forward = make_fx(lambda primals, scale: _bf16_chain(primals, scale), tracing_mode="fake")(
        _bf16(6, 8), torch.tensor(0.37)
    )
    monkeypatch.setattr(inductor_utils, "get_donated_idxs", lambda: [0])
    assert _rewrite(kt)(forward.graph) == 0
    backward = make_fx(_bf16_chain, tracing_mode="fake")(_bf16(6, 8), torch.tensor(0.37))
    monkeypatch.setattr(inductor_utils, "get_donated_idxs", lambda: None)
    assert _rewrite(kt)(backward.graph) == 0


def test_a_record_that_is_not_the_graphs_is_not_read(kt, monkeypatch):
    """A donated index landing on a forward input or a grad_output, a view saved beside its
    base, or CUDA graphs without trees (their warm-up would scale twice): nothing rewritten."""
    import torch._inductor.utils as inductor_utils

    def chain(primals_1, saved, tangents):
        return primals_1 * 2, _bf16_chain(saved, tangents)

    gm = make_fx(chain, tracing_mode="fake")(torch.randn(3), _bf16(6, 8), torch.tensor(0.37))
    monkeypatch.setattr(inductor_utils, "get_donated_idxs", lambda: [0, 1])  # 0: primals_1
    assert _rewrite(kt)(gm.graph) == 0
    monkeypatch.setattr(inductor_utils, "get_donated_idxs", lambda: [1])
    with inductor_config.patch({"triton.cudagraphs": True, "triton.cudagraph_trees": False}):
        assert _rewrite(kt)(gm.graph) == 0
    assert _rewrite(kt)(gm.graph) == 1  # the same graph, the record and config as they should be

    base = _bf16(6, 8)
    aliased = make_fx(lambda saved, view, tangents: (_bf16_chain(saved, tangents), view * 2),
                      tracing_mode="fake")(base, base[:3], torch.tensor(0.37))  # fmt: skip
    first, second = list(aliased.graph.find_nodes(op="placeholder"))[:2]
    assert _module(kt)._storage(first) == _module(kt)._storage(second)  # the fakes share it
    monkeypatch.setattr(inductor_utils, "get_donated_idxs", lambda: [0, 1])
    assert _rewrite(kt)(aliased.graph) == 0


def test_a_nested_regions_graphs_are_left_alone(kt, torch_path):
    """Inductor passes a nested_compile_region's forward and backward graphs through the pass
    first, inside the outer backward's context: the outer donation record must not be read on
    them. Here it landed on the region's input s, a caller's tensor, and scaled it in place
    (s 0.37 -> 5.55, a.grad wrong)."""

    @torch.compiler.nested_compile_region
    def region(a, s):
        return a * s

    def fn(h, w, t, a, a2, s):
        return region(a, s) * 3 + region(a2, s) * 5 + kt.fused_linear_cross_entropy(h, w, t)

    gen = torch.Generator().manual_seed(0)
    h = torch.randn(24, 32, generator=gen).bfloat16().requires_grad_()
    w = (0.5 * torch.randn(80, 32, generator=gen)).bfloat16().requires_grad_()
    t = torch.randint(0, 80, (24,), generator=gen)
    a, a2 = torch.tensor([1.5], requires_grad=True), torch.tensor([-2.0], requires_grad=True)
    s = torch.tensor([0.37])
    torch.compile(fn, fullgraph=True)(h, w, t, a, a2, s).backward()
    assert s.item() == torch.tensor(0.37).item()
    torch.testing.assert_close(a.grad, 3 * s, rtol=0, atol=0)
    torch.testing.assert_close(a2.grad, 5 * s, rtol=0, atol=0)
