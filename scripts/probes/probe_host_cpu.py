"""Host (Python) time per forward + backward of the training kernels' eager GPU paths, on the CPU.

    python scripts/probes/probe_host_cpu.py [--baseline REV] [--calls 200] [--rounds 9]
                                            [--profile] [--ops rms_norm,rope,...]

What runs is the code a GPU training step runs, called the way a kernelized model calls it
(``layers.RMSNorm.forward`` bound on a LlamaRMSNorm, the fused add + RMSNorm, LayerNorm, the
rotary layer, silu_mul / gelu_mul with ``in_place=True`` as the MLP layers pass, cross_entropy),
forward and ``torch.autograd.grad``, with CPU tensors standing in for CUDA ones:

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
    p.add_argument("--ops", help="comma-separated op names (default: all)")
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
    if args.ops:
        wanted = set(args.ops.split(","))
        names = [n for n in names if n in wanted or n.startswith(("autograd", "no-op"))]

    times: dict[tuple[str, str], list[float]] = {}
    for name in names:
        for fns in impls.values():
            for _ in range(3):  # warm: first-call work (compiles, plans, checks) is not counted
                fns[name]()
        for _ in range(args.rounds):
            for impl, fns in impls.items():
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
            t = times[(impl, name)]
            med[impl] = statistics.median(t)
            cells.append(f"{med[impl]:.1f} ({min(t):.1f})")
        if rev:
            b, h = med["baseline"], med["this tree"]
            cells.append(f"{(h - b) / b * 100:+.0f} %")
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
