"""Host (Python) time per forward + backward of the training kernels' eager GPU paths, on the CPU.

    python scripts/probes/probe_host_cpu.py [--baseline REV] [--calls 200] [--rounds 9]
                                            [--profile] [--ops rms_norm,rope,...] [--dispatch]

What runs is the code a GPU training step runs, called the way a kernelized model calls it
(``layers.RMSNorm.forward`` bound on a LlamaRMSNorm, the fused add + RMSNorm, LayerNorm, the
rotary layer, silu_mul / gelu_mul with ``in_place=True`` as the MLP layers pass, cross_entropy,
``layers.SwiGLUMLP.forward`` bound on a Qwen3MLP (the gated MLP), fused_linear_cross_entropy,
the ForCausalLM loss head (``loss_layers.fused_causal_lm_loss``) and the log-prob head),
forward and ``torch.autograd.grad``, with CPU tensors standing in for CUDA ones. The losses'
and the gated MLP's torch.library custom ops (what torch.compile traces) are timed too, called
eagerly with their autograd registration ("... via custom op" rows, this tree only): what the
eager path would pay if it went through them. ``--dispatch`` adds rows for what a compiled graph
pays per custom-op call: the op called as Inductor's code calls it next to its Python body. The matmuls of the MLP and the heads run for
real, at a few rows and columns, so that the CPU's arithmetic stays small beside the Python:

- every `fast_launch` kernel takes its fast path (``enabled``), and the kernel it "compiles" is a
  stub whose launcher does nothing: the Python up to and around the compiled kernel's launcher is
  what is timed, not the launch (~6 µs per launch on the H200 host) nor the kernel;
- the two CUDA calls the fast path makes (current device, current raw stream) return 0;
- other Triton launches (kernels without `fast_launch`) are no-ops too;
- TRITON_INTERPRET=1 sends CPU tensors down the Triton paths (`interpreting()` answers True
  without reading the environment, as `use_triton` costs a CUDA tensor one `is_cuda`); where
  the code asks "CUDA or interpreter?" the interpreter's branch runs (the config picker returns
  the default untimed, the RoPE halves check lands at once).

So the numbers are our per-call Python on THIS machine's CPU, which differs from the H200
machine's (that one is slower: a no-op autograd.Function costs ~82 µs per fwd+bwd there). Use
them to compare two versions of the code on one machine, not as wall times. With --baseline,
the variant folder as committed at REV runs in the same process, rounds alternating between
the two, and the median round counts (the machine is shared).
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import io
import os
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: CPU tensors take Triton paths

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the bench harness
import torch  # noqa: E402
import triton  # noqa: E402
from bench_harness import load_training_kernels, per_call_us, variant_at  # noqa: E402
from bench_train import cpu_model  # noqa: E402
from torch import nn  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

BANNER = (
    "LAUNCHES STUBBED: every Triton launch is a no-op (the fast path's compiled-kernel launcher "
    "included);\nthis CPU is not the H200 machine's: compare versions on one machine, do not "
    "read these as GPU wall times."
)


# --- The stubs ----------------------------------------------------------------------------


def _no_launch(self, grid):
    return lambda *args, **kwargs: None


InterpretedFunction.__getitem__ = _no_launch  # kernels without fast_launch launch nothing


class _StubCompiled:
    """What Triton's compile returns, as far as fast_launch reads it: a launcher that does
    nothing."""

    function = packed_metadata = None

    @staticmethod
    def run(*args):
        return None


_COMPILED = _StubCompiled()


class _StubJit:
    """Stands in for a kernel's JITFunction under fast_launch: ``[grid](...)`` "compiles" (returns
    the stub compiled kernel) and launches nothing; ``fn`` and ``params`` as Triton's."""

    def __init__(self, real) -> None:
        self.real = real
        self.fn = real.fn
        self.__name__ = getattr(real.fn, "__name__", "kernel")
        self.params = [
            types.SimpleNamespace(
                name=p.name, is_constexpr="constexpr" in str(p.annotation), default=p.default
            )
            for p in inspect.signature(real.fn).parameters.values()
        ]

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _COMPILED

    def __getattr__(self, name):
        return getattr(self.real, name)


def stub_fast_launches(kt: types.ModuleType) -> int:
    """Enable every fast_launch kernel of the loaded variant `kt` over a stub JIT; how many."""
    common = sys.modules[kt.__name__ + "._common"]
    # A CUDA tensor answers use_triton() from is_cuda alone; here it would read the environment
    # on every call: the interpreter is on for the whole process, so answer that directly.
    common.interpreting = lambda: True
    count = 0
    for name, mod in list(sys.modules.items()):
        if not (name == kt.__name__ or name.startswith(kt.__name__ + ".")):
            continue
        for value in vars(mod).values():
            if isinstance(value, common.FastLaunch) and not isinstance(value.fn, _StubJit):
                value.fn = _StubJit(value.fn)
                value.enabled = True
                count += 1
    return count


# The fast path asks CUDA for the current device and stream; the CPU build of torch has neither.
torch._C._cuda_getDevice = lambda: 0
torch._C._cuda_getCurrentRawStream = lambda device: 0


# --- The ops, called as a kernelized model calls them --------------------------------------


class Inputs:
    """Small tensors (the CPU allocator's cost for large ones is not the GPU caching
    allocator's); Qwen3-0.6B's head counts and head_dim."""

    def __init__(self) -> None:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        torch.manual_seed(0)
        b, t, hidden, inter, d, vocab = 2, 16, 256, 512, 128, 2048

        def leaf(*shape):
            return torch.randn(*shape).requires_grad_()

        self.x, self.r = leaf(b, t, hidden), leaf(b, t, hidden)
        self.g = torch.randn(b, t, hidden)
        self.llama_norm = LlamaRMSNorm(hidden, eps=1e-6)
        self.layer_norm = nn.LayerNorm(hidden)
        self.q = leaf(b, t, 16, d).transpose(1, 2)
        self.k = leaf(b, t, 8, d).transpose(1, 2)
        emb = torch.randn(b, t, d // 2).repeat(1, 1, 2)
        self.cos, self.sin = emb.cos(), emb.sin()
        self.gq, self.gk = torch.randn_like(self.q), torch.randn_like(self.k)
        self.q_small = leaf(1, 4, 2, d).transpose(1, 2)
        self.k_small = leaf(1, 4, 1, d).transpose(1, 2)
        self.cos_small, self.sin_small = self.cos[:1, :4], self.sin[:1, :4]
        self.gq_small, self.gk_small = (
            torch.randn_like(self.q_small),
            torch.randn_like(self.k_small),
        )
        self.a, self.c = leaf(b * t, inter), leaf(b * t, inter)
        self.ga = torch.randn(b * t, inter)
        self.logits = leaf(b * t, vocab)
        self.target = torch.randint(0, vocab, (b * t,))
        # The MLP and the heads multiply for real: a few rows and columns keep the CPU's
        # arithmetic small beside the host time measured (the launches are what is stubbed).
        from transformers import Qwen3Config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

        rows, h_small, v_small = 8, 16, 64
        self.mlp = Qwen3MLP(Qwen3Config(hidden_size=h_small, intermediate_size=2 * h_small))
        self.h = leaf(1, rows, h_small)
        self.gh = torch.randn(1, rows, h_small)
        self.lm_head = nn.Linear(h_small, v_small, bias=False)
        self.head_model = nn.Module()
        self.head_model.lm_head = self.lm_head
        self.labels = torch.randint(0, v_small, (1, rows))
        self.rows_target = torch.randint(0, v_small, (rows,))


class _Floor(torch.autograd.Function):
    """What any Python autograd.Function costs: an RMSNorm's saves and allocations, no work."""

    @staticmethod
    def forward(ctx, x, weight, eps, numer):
        ctx.save_for_backward(x, weight)
        ctx.numer = numer
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight), None, None


def _grad(outs, leaves, grads):
    return lambda: torch.autograd.grad(outs(), leaves, grads)


def _rope_in_place(rotary, i: Inputs) -> tuple:
    """RoPE of fresh q and k (new tensors laid out like the leaves), each output through a mul:
    the gradients RoPE's backward receives are the muls' new tensors."""
    qo, ko = rotary(i.q_small * 1.0, i.k_small * 1.0, i.cos_small, i.sin_small)
    return qo * 1.0, ko * 1.0


def cases(kt: types.ModuleType, i: Inputs) -> dict:
    """op name -> a zero-argument forward + backward call."""
    sys.modules[kt.__name__ + ".rope"].MIN_CHECKED_ELEMENTS = 0  # check cos/sin as at the anchor
    layers = kt.layers
    x, r, g = i.x, i.r, i.g
    norm, ln = i.llama_norm, i.layer_norm
    rms = types.MethodType(layers.RMSNorm.forward, norm)
    add_rms = types.MethodType(layers.FusedAddRMSNorm.forward, norm)
    layer_norm = types.MethodType(layers.LayerNorm.forward, ln)
    rotary = types.MethodType(layers.rotary_pos_emb.forward, nn.Module())
    return {
        "autograd add (yardstick)": _grad(lambda: (x + r,), (x, r), (g,)),
        "no-op autograd.Function (floor)": _grad(
            lambda: (_Floor.apply(x, norm.weight, 1e-6, (0.0, 0)),), (x, norm.weight), (g,)
        ),
        "rms_norm": _grad(lambda: (rms(x),), (x, norm.weight), (g,)),
        "fused add + rms_norm": _grad(lambda: add_rms(x, r), (x, r, norm.weight), (g, g)),
        "layer_norm": _grad(lambda: (layer_norm(x),), (x, ln.weight, ln.bias), (g,)),
        "rope": _grad(lambda: rotary(i.q, i.k, i.cos, i.sin), (i.q, i.k), (i.gq, i.gk)),
        # As in a model: q and k fresh (a projection's outputs: rotated in their own memory),
        # the gradients made by ops (written over in the backward). Tiny tensors: the two muls
        # on each side (in both columns) cost their host time, not CPU arithmetic.
        "rope in place": _grad(
            lambda: _rope_in_place(rotary, i), (i.q_small, i.k_small), (i.gq_small, i.gk_small)
        ),
        "silu_mul in_place": _grad(
            lambda: (kt.silu_mul(i.a, i.c, in_place=True),), (i.a, i.c), (i.ga,)
        ),
        "gelu_mul in_place": _grad(
            lambda: (kt.gelu_mul(i.a, i.c, "tanh", in_place=True),), (i.a, i.c), (i.ga,)
        ),
        "cross_entropy": _grad(
            lambda: (kt.cross_entropy(i.logits, i.target),), (i.logits,), (torch.ones(()),)
        ),
        **loss_and_mlp_cases(kt, i),
    }


def loss_and_mlp_cases(kt: types.ModuleType, i: Inputs) -> dict:
    """The gated MLP layer and the loss heads (those `kt` has), as a kernelized model calls
    them; then this tree's custom ops, called eagerly."""
    one = torch.ones(())
    mlp, head = i.mlp, i.lm_head
    mlp_leaves = (i.h, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    swiglu = types.MethodType(kt.layers.SwiGLUMLP.forward, mlp)
    h2 = i.h.reshape(-1, i.h.shape[-1])
    loss_layers = sys.modules[kt.__name__ + ".loss_layers"]
    out = {
        "SwiGLUMLP (gated MLP)": _grad(lambda: (swiglu(i.h),), mlp_leaves, (i.gh,)),
        "fused_linear_cross_entropy": _grad(
            lambda: (kt.fused_linear_cross_entropy(i.h, head.weight, i.labels),),
            (i.h, head.weight),
            (one,),
        ),
        "ForCausalLM loss head": _grad(
            lambda: (loss_layers.fused_causal_lm_loss(i.head_model, i.h, i.labels, None, {}),),
            (i.h, head.weight),
            (one,),
        ),
    }
    if hasattr(kt, "fused_linear_logprob"):  # post-training's head: not at every revision
        out["log-prob head"] = _grad(
            lambda: (kt.fused_linear_logprob(i.h, head.weight, i.labels).log_probs,),
            (i.h, head.weight),
            (torch.ones(i.labels.shape),),
        )
    ops = {name: sys.modules.get(f"{kt.__name__}.{name}") for name in ("gated_mlp", "logprob")}
    if not hasattr(ops["gated_mlp"], "gated_mlp_fwd"):  # a revision before the custom ops
        return out
    w = tuple(m.weight for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    ce = sys.modules[kt.__name__ + ".cross_entropy"]
    flce = sys.modules[kt.__name__ + ".fused_linear_cross_entropy"]
    ce_args = (None, None, -100, 0.0, 0.0, None, "mean", False, False, False, True)
    flce_args = (None, None, -100, 0.0, 0.0, None, "mean", 0, False, False, False, False, False)
    out |= {
        "gated MLP via custom op": _grad(
            lambda: (ops["gated_mlp"].gated_mlp_fwd(i.h, *w, 0)[0],), mlp_leaves, (i.gh,)
        ),
        "cross_entropy via custom op": _grad(
            lambda: (ce.ce_fwd(i.logits, i.target, *ce_args)[0],), (i.logits,), (one,)
        ),
        "fused_linear_cross_entropy via custom op": _grad(
            lambda: (
                flce.flce_fwd(h2, head.weight, None, i.rows_target, *flce_args, True, True, False)[
                    0
                ],
            ),
            (i.h, head.weight),
            (one,),
        ),
        "log-prob head via custom op": _grad(
            lambda: (
                ops["logprob"].logprob_fwd(
                    h2, head.weight, None, i.rows_target, 1.0, None, 1.0, 0, -100, 0, 0, False
                )[0],
            ),
            (i.h, head.weight),
            (torch.ones(i.rows_target.shape),),
        ),
    }
    return out | dispatch_cases(kt, i)


def dispatch_cases(kt: types.ModuleType, i: Inputs) -> dict:
    """What a compiled graph pays per custom-op call on top of the op's Python body: the op
    called as Inductor's wrapper calls it (``torch.ops.NS.op.default``, no autograd: the graph
    holds the forward and the backward ops apart) next to the body called directly. Forward
    and backward ops of the gated MLP (two calls per layer and step) and the fused linear CE's
    forward (one per step)."""
    common = sys.modules[kt.__name__ + "._common"]
    ns = getattr(torch.ops, common.NAMESPACE)
    gm = sys.modules[kt.__name__ + ".gated_mlp"]
    flce = sys.modules[kt.__name__ + ".fused_linear_cross_entropy"]
    mlp, head = i.mlp, i.lm_head
    x = i.h.detach()
    w = tuple(m.weight.detach() for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    dy = i.gh
    with torch.no_grad():
        _, gate_up = gm._forward(x, *w, 0)
    h2, wt = x.reshape(-1, x.shape[-1]), head.weight.detach()
    flce_args = (None, None, -100, 0.0, 0.0, None, "mean", 0, False, False, False, False, False)
    opts = flce._op_options(-100, 0.0, 0.0, None, "mean", 0, None, False, False, False, False,
                            False)  # fmt: skip
    nograd = torch.no_grad()
    return {
        "gated MLP fwd, op call (compiled graph)": nograd(
            lambda: ns.gated_mlp_fwd.default(x, *w, 0)
        ),
        "gated MLP fwd, Python body": nograd(lambda: gm._forward(x, *w, 0)),
        "gated MLP bwd, op call (compiled graph)": nograd(
            lambda: ns.gated_mlp_bwd.default(dy, x, gate_up, *w, 0, True, True, True)
        ),
        "gated MLP bwd, Python body": nograd(
            lambda: gm._backward(dy, x, gate_up, *w, 0, (True, True, True), overwrite=False)
        ),
        "fused linear CE fwd, op call (compiled graph)": nograd(
            lambda: ns.flce_fwd.default(h2, wt, None, i.rows_target, *flce_args, True, True, False)
        ),
        "fused linear CE fwd, Python body": nograd(
            lambda: flce._forward(h2, wt, None, i.rows_target, opts, None, (True, True, False))
        ),
    }


# --- Timing --------------------------------------------------------------------------------


def profile_text(fn, calls: int, top: int = 15) -> str:
    fn()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    # The call counts read per fwd+bwd: say how many calls the profile covered.
    return f"({calls} fwd+bwd calls)\n" + s.getvalue().split("\n", 4)[-1].strip("\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", help="git revision to compare with, e.g. HEAD~3")
    p.add_argument("--calls", type=int, default=200, help="calls per round")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--profile", action="store_true", help="cProfile top-15 per op (this tree)")
    p.add_argument("--ops", help="comma-separated op names (default: all but the dispatch rows)")
    p.add_argument(
        "--dispatch", action="store_true", help="add the custom-op dispatch rows (this tree)"
    )
    args = p.parse_args()

    torch.set_num_threads(1)  # tiny tensors: no intra-op threads to wake
    inputs = Inputs()
    impls: dict[str, dict] = {}
    stubbed: dict[str, int] = {}
    tmp = tempfile.TemporaryDirectory()
    rev = None
    if args.baseline:
        rev = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", args.baseline],
            check=True, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
        base = load_training_kernels(variant_at(args.baseline, Path(tmp.name)))
        stubbed["baseline"] = stub_fast_launches(base)
        impls["baseline"] = cases(base, inputs)
    this = load_training_kernels()
    stubbed["this tree"] = stub_fast_launches(this)
    impls["this tree"] = cases(this, inputs)
    names = list(impls["this tree"])
    dispatch = [n for n in names if n.endswith(("Python body", "(compiled graph)"))]
    if not args.dispatch:
        names = [n for n in names if n not in dispatch]
    if args.ops:
        wanted = set(args.ops.split(",")) | (set(dispatch) if args.dispatch else set())
        names = [n for n in names if n in wanted or n.startswith(("autograd", "no-op"))]

    times: dict[tuple[str, str], list[float]] = {}
    for name in names:
        present = {impl: fns for impl, fns in impls.items() if name in fns}
        for fns in present.values():
            for _ in range(3):  # warm: first-call work (compiles, plans, checks) is not counted
                fns[name]()
        for _ in range(args.rounds):
            for impl, fns in present.items():
                times.setdefault((impl, name), []).append(per_call_us(fns[name], args.calls))

    print(BANNER)
    print(
        f"\nhost µs per forward + backward, median of {args.rounds} rounds of {args.calls} calls "
        f"(min in brackets)\n{time.strftime('%Y-%m-%d %H:%M')}, {cpu_model()} "
        f"({os.cpu_count()} CPUs), Python {platform.python_version()}, torch {torch.__version__}, "
        f"triton {triton.__version__}; fast_launch kernels stubbed: "
        + ", ".join(f"{k} {v}" for k, v in stubbed.items())
    )
    cols = list(impls)
    head = ["op"] + [f"baseline {rev}" if c == "baseline" else c for c in cols]
    if rev:
        head.append("change")
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for name in names:
        cells = [name]
        med = {}
        for impl in cols:
            t = times.get((impl, name))
            if t is None:  # not at that revision
                cells.append("—")
                continue
            med[impl] = statistics.median(t)
            cells.append(f"{med[impl]:.1f} ({min(t):.1f})")
        if rev:
            b, h = med.get("baseline"), med["this tree"]
            cells.append("—" if b is None else f"{(h - b) / b * 100:+.0f} %")
        print("| " + " | ".join(cells) + " |")

    if args.profile:
        for name in names:
            if name.startswith(("autograd", "no-op")):
                continue
            print(f"\n== cProfile, this tree: {name} (launches stubbed) ", end="")
            print(profile_text(impls["this tree"][name], calls=args.calls))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
