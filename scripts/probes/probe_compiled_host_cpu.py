"""Host time of one compiled RMSNorm call, ours against torch's (the bench's --cudagraphs rows).

    python scripts/probes/probe_compiled_host_cpu.py [--stub-bodies] [--shape 8x128] [--calls 200]
                                  [--rounds 7] [--backends eager,aot_eager,replay-stub,inductor]
    python scripts/probes/probe_compiled_host_cpu.py --device cuda   # adds reduce-overhead

rms_norm_case's peers (scripts/bench_cases_elementwise.py): F.rms_norm on two leaves, the
LlamaRMSNorm module (the 'eager' / 'torch.compile' rows) and ours (layers.RMSNorm.forward bound on
it); fwd under no_grad and fwd + autograd.grad, as is and in torch.compile(dynamic=False) per
backend, at a tiny shape (time per call = host time). On the CPU ours' custom ops run torch
formulas; the "op call" / "body" rows time one op as Inductor's code calls it and its body alone.
"replay-stub": aot_eager whose graphs hand back their first outputs without running (what a
CUDA-graph replay leaves: guards, Dynamo/AOT wrappers, autograd). --stub-bodies: ours' op bodies
only allocate (the GPU path less its launch). Prints per peer graphs, breaks, guards and µs to check
them, graph inputs; cProfiles of the last backend; a µs table last.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import statistics
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the bench harness
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_cases_elementwise import _closures as closures  # noqa: E402 - the bench's (fwd, fwd_bwd)
from bench_harness import load_training_kernels, per_call_us  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402
from torch._dynamo.eval_frame import _debug_get_cache_entry_list  # noqa: E402
from torch._functorch.aot_autograd import make_boxed_func  # noqa: E402


def peers(kt, m: int, n: int, dev: str, dt: torch.dtype) -> dict:
    """name -> builder of (zero-argument call, leaves), as rms_norm_case builds them."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    def randn(*shape):
        return torch.randn(*shape, device=dev, dtype=dt, requires_grad=True)

    def module(bind):
        mod, x = LlamaRMSNorm(n, eps=1e-6).to(dev, dt), randn(m, n)
        if bind:
            mod.forward = types.MethodType(kt.layers.RMSNorm.forward, mod)
        return (lambda: mod(x)), [x, mod.weight]

    def functional():
        w, x = randn(n), randn(m, n)
        return (lambda: F.rms_norm(x, (n,), w, 1e-6)), [x, w]

    return {"F.rms_norm": functional, "LlamaRMSNorm": lambda: module(False),
            "ours": lambda: module(True)}  # fmt: skip


def aot_backend(seen: dict | None = None):
    """aot_eager that records each AOT graph's input count in `seen`; without `seen`, the
    "replay-stub": after its first call a graph hands back that call's outputs (fresh tensors
    over the same storage, as a CUDA-graph replay does) without running."""

    def compiler(kind):
        def compile_(gm, example_inputs):
            if seen is not None:
                seen[kind] = len(gm.graph.find_nodes(op="placeholder"))
                return make_boxed_func(gm.forward)
            kept = []

            def replay(*args):
                kept[:] = kept or [gm(*args)]  # the graph runs once
                return [o.detach() if isinstance(o, torch.Tensor) else o for o in kept[0]]

            return make_boxed_func(replay)

        return compile_

    return aot_autograd(fw_compiler=compiler("aot fwd"), bw_compiler=compiler("aot bwd"),
                        inference_compiler=compiler("aot inference"))  # fmt: skip


def graph_facts(fn, leaves) -> dict:
    """Dynamo graphs, breaks, guards (and µs to check them), inputs; AOT graphs' inputs."""
    explained = torch._dynamo.explain(fn)()
    facts = {"graphs": explained.graph_count, "breaks": explained.graph_break_count,
             "dynamo inputs": [len(g.graph.find_nodes(op="placeholder"))
                               for g in explained.graphs]}  # fmt: skip
    torch._dynamo.reset()
    seen: dict = {}
    compiled = torch.compile(fn, backend=aot_backend(seen), dynamic=False)
    fwd, fwd_bwd = closures(compiled, leaves, False)
    fwd(), fwd_bwd()
    facts |= seen
    cells = (c.cell_contents for c in fn.__closure__)
    scope = dict(zip(fn.__code__.co_freevars, cells, strict=True))
    for entry in _debug_get_cache_entry_list(fn.__code__):
        check = functools.partial(entry.guard_manager.check, scope)
        mode = "grad" if '"grad_mode":true' in str(entry.guard_manager) else "no_grad"
        with torch.set_grad_enabled(mode == "grad"):
            assert check(), "guards fail on the call's own locals"
            facts[f"guards ({mode})"] = len(entry.guard_manager.code_parts)
            us = statistics.median(per_call_us(check, 2000) for _ in range(5))
            facts[f"guard check µs ({mode})"] = round(us, 2)
    torch._dynamo.reset()
    return facts


def host_us(f, calls: int, rounds: int, dev: str) -> float:
    """Median over rounds of µs per call (synchronised around each round on a GPU)."""
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    [f() for _ in range(10)]  # warm: compiles, plans, CUDA-graph records
    return statistics.median((sync(), per_call_us(f, calls), sync())[1] for _ in range(rounds))


def op_rows(kt, m, n, dev, dt) -> tuple:
    """Ours' custom ops as Inductor's wrapper calls them, next to their Python bodies."""
    rn = sys.modules[kt.__name__ + ".rms_norm"]
    ns = getattr(torch.ops, sys.modules[kt.__name__ + "._common"].NAMESPACE)
    x, w = torch.randn(m, n, device=dev, dtype=dt), torch.randn(n, device=dev, dtype=dt)
    num = (0.0, 0)
    y, rstd = rn._forward_any(x, w, 1e-6, num)
    return (
        ("rms_norm_fwd op call", lambda: ns.rms_norm_fwd.default(x, w, 1e-6, False, False)),
        ("rms_norm_fwd body", lambda: rn._forward_any(x, w, 1e-6, num)),
        ("rms_norm_bwd op call",
         lambda: ns.rms_norm_bwd.default(y, x, w, rstd, False, True, False, dt)),
        ("rms_norm_bwd body", lambda: rn._backward_any(y, x, w, rstd, num, True, False, dt)),
    )  # fmt: skip


def stub_bodies(kt) -> None:
    """Ours' op bodies only allocate their outputs (~ the GPU path's plan lookup, no launch)."""
    rn = sys.modules[kt.__name__ + ".rms_norm"]
    rn._forward_any = lambda x, w, *_: (torch.empty_like(x), x.new_empty(x.shape[:-1]))
    rn._backward_any = lambda dy, x, w, *_, **__: (torch.empty_like(x), torch.empty_like(w))


def profile(f, calls: int, top: int) -> str:
    """cProfile of `calls` calls: the `top` functions by cumulative time, per call."""
    for _ in range(5):
        f()
    pr = cProfile.Profile()
    pr.runcall(lambda: [f() for _ in range(calls)])
    rows = sorted(pstats.Stats(pr).stats.items(), key=lambda kv: -kv[1][3])[2 : 2 + top]
    lines = ["calls/call  own µs  cum µs  function"]
    for (file, line, name), (_, nc, tt, ct, _) in rows:
        where = f"{Path(file).parent.name}/{Path(file).name}:{line}" if line else "~"
        lines.append(f"{nc / calls:10.1f} {tt / calls * 1e6:7.1f} {ct / calls * 1e6:7.1f}  "
                     f"{name} ({where})")  # fmt: skip
    return "\n".join(lines)


def compiled(fn, backend: str):
    if backend == "reduce-overhead":
        return torch.compile(fn, mode="reduce-overhead", dynamic=False)
    return torch.compile(fn, backend=aot_backend() if backend == "replay-stub" else backend,
                         dynamic=False)  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--backends", help="default: eager,aot_eager,replay-stub,inductor")
    p.add_argument("--shape", default="8x128")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--stub-bodies", action="store_true", help="ours' op bodies: allocations only")
    args = p.parse_args()
    dev = args.device
    dt = torch.float32 if dev == "cpu" else torch.bfloat16
    backends = (args.backends or "eager,aot_eager,replay-stub,inductor"
                + (",reduce-overhead" if dev == "cuda" else "")).split(",")  # fmt: skip
    m, n = map(int, args.shape.split("x"))
    torch.set_num_threads(1)
    kt = load_training_kernels()
    if args.stub_bodies:
        stub_bodies(kt)
    builders = peers(kt, m, n, dev, dt)

    stubbed = ", ours' op bodies stubbed" if args.stub_bodies else ""
    print(f"torch {torch.__version__}, {dev}, {dt}, x {m}x{n}{stubbed}")
    for name, build in builders.items():
        print(f"\n== {name}: compile facts (aot_eager) ==")
        for k, v in graph_facts(*build()).items():
            print(f"  {k}: {v}")

    table: dict = {}
    stats = torch._dynamo.utils.counters["stats"]
    for backend in backends:
        for name, build in builders.items():
            fn, leaves = build()
            graphs, before = backend == "reduce-overhead", stats["unique_graphs"]
            fwd, fwd_bwd = closures(fn if backend == "eager" else compiled(fn, backend), leaves,
                                    graphs)  # fmt: skip
            label = "as is" if backend == "eager" else f"compiled {backend}"
            times = [host_us(f, args.calls, args.rounds, dev) for f in (fwd, fwd_bwd)]
            table[(label, name)] = (*times, stats["unique_graphs"] - before)
            if name != "LlamaRMSNorm" and backend == backends[-1]:
                for what, f in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                    print(f"\n== cProfile of {name} ({label}), {what}, per call ==")
                    print(profile(f, args.calls, args.top))
            torch._dynamo.reset()
    with torch.no_grad():
        ops = {k: host_us(f, args.calls, args.rounds, dev) for k, f in op_rows(kt, m, n, dev, dt)}

    graph_counts = torch._dynamo.utils.counters["inductor"].items()
    print("\ncudagraph counters:", {k: v for k, v in graph_counts if "cudagraph" in k} or "none")
    print(f"\nhost µs per call, median of {args.rounds} rounds of {args.calls} calls ({dev}, "
          f"x {m}x{n} {dt}{stubbed})\n\n| call | peer | fwd | fwd+bwd | graphs compiled |\n"
          "|---|---|---|---|---|")  # fmt: skip
    for (label, name), (a, b, g) in table.items():
        print(f"| {label} | {name} | {a:.1f} | {b:.1f} | {g if label != 'as is' else ''} |")
    for k, v in ops.items():
        print(f"| {k} (no_grad) | ours | {v:.1f} | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
