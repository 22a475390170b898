"""What Dynamo's guards cost a compiled training step, bound to the kernels and not (CPU).

Every call of a compiled model first checks its guards. This probe compiles one training step
(forward with labels, `backend="aot_eager"`, fullgraph) of a tiny Qwen3 at several depths, plain
and with the training kernels bound, and prints per model: the guard manager's node count, the
Python guard code parts, and the µs one guard check takes on its own locals (median of 5 runs of
200 checks). The per-layer slope separates what each decoder layer adds from the fixed part.
Last, the guard kinds the bound model adds per layer (its guard tree against the plain one's).

    python scripts/probes/probe_compile_guards_cpu.py [--layers 2,8,28] [--class-bound]

--class-bound adds a third model: the bound one with each instance-level forward moved onto a
per-module subclass (`module.__class__`), an experiment on what binding by class would save;
its loss must equal the bound model's.

--without-rope adds another: the bound one with its function bindings (RoPE: the attention's
two owner hooks and its bindings dict) removed, so transformers' own RoPE runs; what the RoPE
binding's guards cost. Its loss must be close to the bound model's (fp32 rounding apart).
"""

from __future__ import annotations

import argparse
import collections
import copy
import functools
import gc
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VARIANT = ROOT / "hub_kernels" / "kernels-lab" / "training" / "build" / "torch-universal"


def _model(layers: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3", vocab_size=1024, hidden_size=128, intermediate_size=256,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config).train()


def guard_facts(model, ids) -> dict:
    """Compile one step of `model`; its guard tree, node count, code parts and µs per check."""
    import torch
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    def make(m, x):
        def step():
            return m(input_ids=x, labels=x).loss

        return step

    torch._dynamo.reset()
    step = make(model, ids)
    torch.compile(step, backend="aot_eager", fullgraph=True)().backward()
    scope = dict(
        zip(step.__code__.co_freevars, (c.cell_contents for c in step.__closure__), strict=True)
    )
    (entry,) = _debug_get_cache_entry_list(step.__code__)
    check = functools.partial(entry.guard_manager.check, scope)
    assert check(), "the guards fail on the step's own locals"
    tree = str(entry.guard_manager)
    return {
        "tree": tree,
        "nodes": sum(1 for line in tree.splitlines() if "+-" in line),
        "code_parts": len(entry.guard_manager.code_parts),
        "check": check,
        "runs": [],
    }


def time_checks(f: dict, rounds: int, calls: int = 200) -> None:
    """µs per guard check, the garbage collector off; the median round counts. Run right after
    the compile: a later torch._dynamo.reset() leaves the entry's guards failing at once."""
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            t = time.perf_counter()
            passed = sum(bool(f["check"]()) for _ in range(calls))
            f["runs"].append((time.perf_counter() - t) / calls * 1e6)
            assert passed == calls, "a guard check failed: the timing would be of an early exit"
    finally:
        gc.enable()
    f["check_us"] = statistics.median(f["runs"])


def _kinds(tree: str) -> collections.Counter:
    """Guard lines with layer numbers and addresses blanked, so layers count as one kind."""
    out = collections.Counter()
    for line in tree.splitlines():
        if "+-" not in line:
            continue
        text = re.sub(r"\b\d+\b", "N", line.split("+-", 1)[1].strip())
        out[re.sub(r"0x[0-9a-f]+", "X", text)[:110]] += 1
    return out


def class_bound(model) -> int:
    """Move every instance-level bound forward onto a subclass of its module's class; how many."""
    moved = 0
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if forward is not None and hasattr(forward, "__func__"):
            cls = type(module)
            module.__class__ = type(f"Bound{cls.__name__}", (cls,), {"forward": forward.__func__})
            del module.__dict__["forward"]
            moved += 1
    return moved


def without_function_bindings(model) -> int:
    """Remove every owner's function bindings and its two hooks; how many owners."""
    from kernels.layers import funcs

    owners = 0
    for module in model.modules():
        if module.__dict__.pop(funcs._BINDINGS, None) is not None:
            funcs._set_owner_hooks(module, False)
            owners += 1
    return owners


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="2,8,28")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--class-bound", action="store_true", help="also a class-bound copy")
    p.add_argument(
        "--without-rope", action="store_true", help="also the bound copy less its RoPE binding"
    )
    args = p.parse_args()
    os.environ.setdefault("LOCAL_KERNELS", f"kernels-lab/training={VARIANT}")
    import kernels
    import torch
    import transformers

    depths = [int(x) for x in args.layers.split(",")]
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, CPU")
    rows, trees = {}, {}
    for layers in depths:
        torch.manual_seed(0)
        plain = _model(layers)
        bound = copy.deepcopy(plain)
        kernels.apply_training_kernels(bound)
        ids = torch.randint(0, 1024, (2, 32))
        models = [("plain", plain), ("bound", bound)]
        if args.class_bound:
            moved = copy.deepcopy(bound)
            count = class_bound(moved)
            same = torch.equal(
                moved(input_ids=ids, labels=ids).loss, bound(input_ids=ids, labels=ids).loss
            )
            assert same, "the class-bound copy computes another loss"
            print(f"{layers} layers: {count} forwards moved to their class, loss equal")
            models.append(("class-bound", moved))
        if args.without_rope:
            unbound = copy.deepcopy(bound)
            owners = without_function_bindings(unbound)
            torch.testing.assert_close(
                unbound(input_ids=ids, labels=ids).loss, bound(input_ids=ids, labels=ids).loss
            )
            print(f"{layers} layers: function bindings removed from {owners} owners, loss close")
            models.append(("bound less RoPE", unbound))
        for name, model in models:
            rows[(layers, name)] = guard_facts(model, ids)
            trees[(layers, name)] = rows[(layers, name)]["tree"]
            time_checks(rows[(layers, name)], args.rounds)
    print(f"{args.rounds} rounds of 200 checks right after each compile; median round [min-max]\n")
    print("| layers | model | guard nodes | code parts | µs per check |")
    print("|---|---|---|---|---|")
    for (layers, name), f in rows.items():
        print(f"| {layers} | {name} | {f['nodes']} | {f['code_parts']} "
              f"| {f['check_us']:.1f} [{min(f['runs']):.1f}-{max(f['runs']):.1f}] |")  # fmt: skip
    lo, hi = min(depths), max(depths)
    if hi > lo:
        print(f"\nper decoder layer, from {lo} to {hi} layers:")
        names = ("plain", "bound", "class-bound", "bound less RoPE")
        for name in [n for n in names if (lo, n) in rows]:
            a, b = rows[(lo, name)], rows[(hi, name)]
            us = (b["check_us"] - a["check_us"]) / (hi - lo)
            nodes = (b["nodes"] - a["nodes"]) / (hi - lo)
            print(f"  {name}: {nodes:.0f} guard nodes, {us:.1f} µs per check")
        extra = _kinds(trees[(hi, "bound")]) - _kinds(trees[(hi, "plain")])
        print(f"\nguard kinds the bound model adds at {hi} layers (count, kind):")
        for kind, count in extra.most_common(20):
            print(f"  {count:4d}  {kind}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
