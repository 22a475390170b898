"""ReLU² (Nemotron's activation) and Nemotron's MLP on the Triton interpreter against float64
references; what the MLP keeps for the backward and its peak, next to the composed modules."""

from __future__ import annotations

import types

import pytest
import torch
from _live_bytes import extra_peak, saved_bytes
from _training_refs import DTYPES, assert_close, leaf64
from torch import nn

SHAPES = [(7, 77), (37, 1000), (2, 3, 96)]


def relu2_64(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 0, x, torch.zeros_like(x)) ** 2


def signed_input(shape, dtype) -> torch.Tensor:
    """Random values of both signs, with exact zeros (where relu's gradient switches)."""
    x = torch.randn(shape, dtype=dtype)
    x.view(-1)[::7] = 0.0
    return x.requires_grad_()


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_relu_squared_values_and_gradient(kt, shape, dtype, in_place):
    x = signed_input(shape, dtype)
    inner = x * 1.0  # a non-leaf: its buffer may take the gradient when in place
    y = kt.relu_squared(inner, in_place=in_place)
    assert y.shape == x.shape and y.dtype == dtype
    dy = torch.randn_like(y)
    y.backward(dy)
    x64 = leaf64(x)
    y64 = relu2_64(x64)
    y64.backward(dy.double())
    assert_close(y, y64, dtype, "y")
    assert_close(x.grad, x64.grad, dtype, "dx")
    if in_place:  # the gradient went over the saved input: no new buffer
        assert torch.equal(inner.detach(), x.grad)


def test_relu_squared_rounds_as_transformers_does(kt):
    """One rounding of the fp32 square, bit for bit what ReLUSquaredActivation returns. fp16,
    not bf16: the interpreter converts fp32 to bf16 by truncation, a GPU rounds to nearest."""
    from transformers.activations import ReLUSquaredActivation

    x = signed_input((9, 300), torch.float16)
    want = ReLUSquaredActivation()(x)
    assert torch.equal(kt.relu_squared(x), want)
    assert torch.equal(types.MethodType(kt.layers.ReLUSquared.forward, nn.Module())(x), want)


def test_in_place_backward_keeps_a_retained_graph_readable(kt):
    """retain_graph=True: the first backward must not overwrite x, the second reads it."""
    x = signed_input((5, 64), torch.float32)
    inner = x * 1.0
    y = kt.relu_squared(inner, in_place=True)
    dy = torch.randn_like(y)
    (g1,) = torch.autograd.grad(y, x, dy, retain_graph=True)
    (g2,) = torch.autograd.grad(y, x, dy)
    assert_close(g1, 2 * torch.relu(x.detach()) * dy, torch.float32, "first")
    assert torch.equal(g1, g2)


# -- the MLP ----------------------------------------------------------------------------------

T, H, INTER = 48, 16, 384  # tokens, hidden, intermediate: the [T, INTER] activations dominate


def nemotron_like(hidden: int, inter: int, dtype=torch.float32, bias: bool = False) -> nn.Module:
    from transformers.activations import ReLUSquaredActivation

    m = nn.Module()
    m.up_proj = nn.Linear(hidden, inter, bias=bias, dtype=dtype)
    m.down_proj = nn.Linear(inter, hidden, bias=bias, dtype=dtype)
    m.act_fn = ReLUSquaredActivation()
    return m


def eager(m: nn.Module):
    return lambda x: m.down_proj(m.act_fn(m.up_proj(x)))


def layer(kt, m: nn.Module):
    return types.MethodType(kt.layers.ReLUSquaredMLP.forward, m)


@pytest.mark.parametrize("bias", [False, True], ids=["lean", "composed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(5, 48), (2, 7, 32)], ids=str)
def test_mlp_values_and_every_gradient(kt, shape, dtype, bias):
    m = nemotron_like(shape[-1], 80, dtype, bias)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    out = layer(kt, m)(x)
    x64 = leaf64(x)
    p64 = {n: leaf64(p) for n, p in m.named_parameters()}
    u64 = x64 @ p64["up_proj.weight"].t() + (p64["up_proj.bias"] if bias else 0)
    ref = relu2_64(u64) @ p64["down_proj.weight"].t() + (p64["down_proj.bias"] if bias else 0)
    dy = torch.randn_like(out)
    out.backward(dy)
    ref.backward(dy.double())
    assert_close(out, ref, dtype, "output")
    assert_close(x.grad, x64.grad, dtype, "d x")
    for name, p in m.named_parameters():
        assert_close(p.grad, p64[name].grad, dtype, f"d {name}")


def test_mlp_keeps_one_intermediate_tensor_not_two(kt):
    """Composed modules keep relu(u) and relu(u)^2; the MLP layer keeps u = up(x) alone."""
    m = nemotron_like(H, INTER)
    x = torch.randn(T, H, requires_grad=True)
    weights = sum(p.numel() * 4 for p in m.parameters())
    act, inp = T * INTER * 4, T * H * 4
    assert saved_bytes(eager(m), x) == weights + inp + 2 * act
    assert saved_bytes(layer(kt, m), x) == weights + inp + act


def _fwd_bwd_peak(m: nn.Module, forward) -> int:
    x = torch.randn(T, H, requires_grad=True)
    dy = torch.randn(T, H)
    peak, _grads = extra_peak(lambda: torch.autograd.grad(forward(x), [x, *m.parameters()], dy))
    return peak


def test_mlp_fwd_bwd_peak_is_two_intermediate_tensors(kt):
    """The MLP's fwd+bwd holds at most two [T, INTER] tensors at once: u (which becomes d(u))
    and d(h) (which becomes h); the composed modules peak more than twice as high."""
    m = nemotron_like(H, INTER)
    act = T * INTER * 4
    composed = _fwd_bwd_peak(m, eager(m))
    ours = _fwd_bwd_peak(m, layer(kt, m))
    assert ours <= 2 * act < composed / 2, (ours, composed, act)


def test_mlp_falls_back_where_the_lean_path_does_not_apply(kt):
    x = torch.randn(4, 32)
    biased = nemotron_like(32, 64, bias=True)
    assert kt.relu_squared_mlp.relu_squared_mlp(x, biased.up_proj, biased.down_proj) is None
    hooked = nemotron_like(32, 64)
    hooked.up_proj.register_forward_hook(lambda *a: None)
    assert kt.relu_squared_mlp.relu_squared_mlp(x, hooked.up_proj, hooked.down_proj) is None
    plain = nemotron_like(32, 64)
    assert kt.relu_squared_mlp.relu_squared_mlp(x, plain.up_proj, plain.down_proj) is not None


def test_mlp_gradients_twice_with_retain_graph(kt):
    m = nemotron_like(H, 64)
    x = torch.randn(6, H, requires_grad=True)
    out = layer(kt, m)(x)
    dy = torch.randn_like(out)
    first = torch.autograd.grad(out, [x, *m.parameters()], dy, retain_graph=True)
    second = torch.autograd.grad(out, [x, *m.parameters()], dy)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_mlp_layer_matches_nemotron_mlp(kt):
    from transformers import NemotronConfig
    from transformers.models.nemotron.modeling_nemotron import NemotronMLP

    module = NemotronMLP(NemotronConfig(hidden_size=48, intermediate_size=96))
    x = torch.randn(2, 5, 48, requires_grad=True)
    want = module(x)
    got = layer(kt, module)(x)
    assert_close(got, want, torch.float32, "output")


@pytest.mark.parametrize("what", ["activation", "mlp"])
def test_fullgraph_compile_matches_eager(kt, what):
    """Under torch.compile the activation is the act_fwd custom op (no graph break) and the MLP
    composes its Linears around it; values and gradients as eager, bit for bit."""
    torch._dynamo.reset()
    m = nemotron_like(24, 40)
    fn = kt.relu_squared if what == "activation" else layer(kt, m)
    x = torch.randn(5, 24 if what == "mlp" else 40, requires_grad=True)
    leaves = [x, *m.parameters()] if what == "mlp" else [x]
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got = compiled(x)
    want = fn(x)
    dy = torch.randn_like(want)
    for c, e in zip(
        (got, *torch.autograd.grad(got, leaves, dy)),
        (want, *torch.autograd.grad(want, leaves, dy)),
        strict=True,
    ):
        torch.testing.assert_close(c, e, rtol=0, atol=0)


@pytest.mark.parametrize("hooked", [False, True])
def test_composed_mlp_writes_d_up_over_up_unless_hooked(kt, hooked):
    """With biases the layer composes its Linears around relu_squared: d(u) goes over u (its
    version counter bumps), except where a hook on up_proj may have handed u to someone else."""
    m = nemotron_like(H, 64, bias=True)
    if hooked:
        m.up_proj.register_forward_hook(lambda *a: None)
    x = torch.randn(6, H, requires_grad=True)
    saved: list[tuple[torch.Tensor, int]] = []

    def pack(t):
        saved.append((t, t._version))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(kt, m)(x)
    out.sum().backward()
    bumped = [t for t, v in saved if t.shape == (6, 64) and t._version != v]
    assert len(bumped) == (0 if hooked else 1)


def test_mlp_layer_reads_the_projection_names_from_the_class(kt):
    """The loader sets ``kernels_mlp_projections`` on the class (fc1/fc2, or an output
    projection declared first); the layer then computes what the module's own forward does."""

    class OutFirst(nn.Module):
        kernels_mlp_projections = ("w_in", "w_out")

        def __init__(self):
            super().__init__()
            self.w_out, self.w_in = nn.Linear(64, 24, bias=False), nn.Linear(24, 64, bias=False)

        def forward(self, x):
            return self.w_out(torch.relu(self.w_in(x)) ** 2)

    m = OutFirst()
    x = torch.randn(5, 24, requires_grad=True)
    got = types.MethodType(kt.layers.ReLUSquaredMLP.forward, m)(x)
    want = m(x)
    assert_close(got, want, torch.float32, "output")
    g = torch.autograd.grad(got, [x, m.w_in.weight, m.w_out.weight], torch.ones_like(got))
    w = torch.autograd.grad(want, [x, m.w_in.weight, m.w_out.weight], torch.ones_like(want))
    for a, b, what in zip(g, w, ("dx", "d w_in", "d w_out"), strict=True):
        assert_close(a, b, torch.float32, what)
