"""What each setup keeps for the backward on Phi-3-mini, per decoder layer, counted on the CPU.

Phi-3-mini-4k's real widths (hidden 3072, intermediate 8192, 32 heads of 96, vocabulary 32064)
with 2 layers and a few dozen tokens, bf16, sdpa. The sliding window is set one below the
sequence, as 2047 is below the benchmark's 2048, so the same kind of mask is built.

- saved: every tensor autograd saves (``saved_tensors_hooks``), by the module that was running
  (layers.1.* of the 2-layer model is one decoder layer) and by its storage: a view saved keeps
  its whole base alive, so storages are counted once, with the bytes of the storage.
  eager builds transformers' KV cache in training; its copies of k and v are what sdpa saves.
- live/peak: a tensor-registry probe of storages (tests/kernels/_live_bytes.py) over the forward
  and over the backward, with the op at each peak.

Setups: eager (transformers as is) and ours (kernels.apply_training_kernels from the variant
folder, Triton kernels in the interpreter); candidates: ours-vcopy (sdpa gets a copy of v, see
copy_sliced_value), ours-menorm (MemoryEfficientRMSNorm for the norms), ours-menorm-vcopy,
ours-cache (transformers' KV cache left on, whose copies of k and v sdpa then saves).
Liger's Triton kernels do not run on the CPU; its column in
docs/benchmarks/training-h200-2026-12-01/phi3-memory.md is from reading its source.

Usage: TRITON_INTERPRET=1 python scripts/probes/probe_phi3_memory.py [--seq 64] [--json OUT]
       [--setups eager,ours,ours-vcopy,ours-cache,ours-menorm,ours-menorm-vcopy]
Each setup runs in its own process (bindings patch classes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VARIANT = ROOT / "hub_kernels/kernels-lab/training/build/torch-universal"
REPO = "kernels-lab/training"
GPU_TOKENS = 4 * 2048  # the H200 run's batch


def build(layers: int, seq: int):
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_train import phi3_config

    config = phi3_config(False)
    config.num_hidden_layers = layers
    config.sliding_window = seq - 1
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    return model.train()


def bind(model, setup: str) -> None:
    if setup.startswith("ours"):
        os.environ["LOCAL_KERNELS"] = f"{REPO}={VARIANT}"
        import kernels

        kernels.apply_training_kernels(model)
        if "-menorm" in setup:  # the norm that keeps its output (saved by the next linear anyway)
            kernels.apply_kernels(model, {"RMSNorm": f"{REPO}:MemoryEfficientRMSNorm"})
    if "-vcopy" in setup:
        copy_sliced_value()


def copy_sliced_value() -> None:
    """The candidate fix, tried here only: sdpa gets a copy of v when v is a slice of a wider
    buffer (Phi-3's qkv_proj output), so what sdpa saves no longer pins q's and k's thirds of
    that buffer. Without a KV cache (ours drops it in training) nothing else copies v."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def forward(module, query, key, value, *args, **kwargs):
        if value.untyped_storage().nbytes() > value.numel() * value.element_size():
            value = value.contiguous()
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS.register("sdpa", forward)


def _storage(t):
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def saved_by_module(model, ids, **kw) -> dict:
    """{module path: {storage: [bytes, shape, dtype]}} of the tensors autograd saves; the
    module is the innermost non-Linear module running (Linear hooks would change our path)."""
    import torch

    stack: list[str] = []
    preexisting = {_storage(p)[0] for p in model.parameters()} | {
        _storage(b)[0] for b in model.buffers()
    }
    handles = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) or name == "":
            continue
        # hooks that return None: a returned value would replace the input or output
        handles.append(mod.register_forward_pre_hook(lambda m, a, n=name: stack.append(n) and None))
        handles.append(mod.register_forward_hook(lambda m, a, o: stack.pop() and None))
    owner: dict[int, tuple[str, int, tuple, str]] = {}

    def pack(t):
        ptr, nbytes = _storage(t)
        if ptr not in preexisting and ptr not in owner and nbytes:
            owner[ptr] = (stack[-1] if stack else "top", nbytes, tuple(t.shape), str(t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=ids, **kw)
    for h in handles:
        h.remove()
    by_module: dict[str, list] = defaultdict(list)
    for mod, nbytes, shape, dtype in owner.values():
        by_module[mod].append([nbytes, list(shape), dtype])
    del out
    return {"saved": dict(by_module)}


def live_and_peaks(model, ids, **kw) -> dict:
    sys.path.insert(0, str(ROOT / "tests/kernels"))
    from _live_bytes import LiveBytes

    class Tracked(LiveBytes):
        at = ""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = self.peak
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if self.peak > before:
                self.at = str(func)
            return out

    with Tracked() as fwd:
        loss = model(input_ids=ids, labels=ids, **kw).loss
        end_of_forward = fwd.live
    fwd_peak, fwd_at = fwd.peak, fwd.at
    with Tracked() as bwd:
        loss.backward()
    del loss
    grads = sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)
    return {
        "end_of_forward": end_of_forward,
        "forward_peak": fwd_peak,
        "forward_peak_op": fwd_at,
        # the backward's tracker starts at 0 with the forward's storages uncounted: its peak
        # is what the backward allocates above what the forward left (grads included)
        "backward_peak_above_forward": bwd.peak,
        "backward_peak_op": bwd.at,
        "param_grads": grads,
    }


def child(setup: str, layers: int, seq: int) -> dict:
    import torch

    model = build(layers, seq)
    bind(model, setup)
    ids = torch.randint(
        0, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(1)
    )
    # "-cache": ours with transformers' KV cache left on, as eager and Liger run
    kw = {"use_cache": True} if "-cache" in setup else {}
    saved = saved_by_module(model, ids, **kw)
    model.zero_grad(set_to_none=True)
    return {
        "setup": setup,
        "layers": layers,
        "seq": seq,
        **saved,
        **live_and_peaks(model, ids, **kw),
    }


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def report(results: list[dict]) -> str:
    """Per-layer table (layers.1.* of the 2-layer run), scaled to the H200 batch's tokens, and
    the whole-model numbers."""
    lines = []
    for r in results:
        if r["layers"] != 2:
            continue
        scale = GPU_TOKENS / r["seq"]
        lines.append(f"\n## {r['setup']}: saved per decoder layer (layers.1), scaled x{scale:g}")
        lines.append("| module | storages: MiB (shape of the first view saved) | MiB |")
        lines.append("|---|---|---|")
        total = 0.0
        for mod, items in sorted(r["saved"].items()):
            if not mod.startswith("model.layers.1"):
                continue
            per = 0.0
            desc = []
            for nbytes, shape, dtype in sorted(items, key=lambda i: -i[0]):
                # a [.., T, T] storage (the mask) grows with T², not T: left at the CPU size
                quad = len(shape) >= 2 and shape[-1] == shape[-2] == r["seq"]
                size = nbytes * (1 if quad else scale)
                per += size
                kind = dtype.replace("torch.", "") + (", T², not scaled" if quad else "")
                desc.append(f"{_mib(size)} ({shape} {kind})")
            total += per
            name = mod.replace("model.layers.1.", "")
            lines.append(f"| {name} | {'; '.join(desc)} | {_mib(per)} |")
        lines.append(f"| **layer total** | | **{_mib(total)}** |")
    lines.append("\n## whole model (CPU sizes, MiB)")
    lines.append(
        "| setup | layers | end of forward | forward peak (op) | backward peak above (op) |"
    )
    lines.append("|---|---|---|---|---|")
    for r in results:
        lines.append(
            f"| {r['setup']} | {r['layers']} | {_mib(r['end_of_forward'])} "
            f"| {_mib(r['forward_peak'])} ({r['forward_peak_op']}) "
            f"| {_mib(r['backward_peak_above_forward'])} ({r['backward_peak_op']}) |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--setups", default="eager,ours")
    p.add_argument("--layers", default="2", help="the per-layer tables read layers.1")
    p.add_argument("--json", help="write the raw results here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        setup, layers = args.child.split(":")
        print("RESULT " + json.dumps(child(setup, int(layers), args.seq)), flush=True)
        return
    env = dict(os.environ, TRITON_INTERPRET="1")
    results = []
    for setup in args.setups.split(","):
        for layers in args.layers.split(","):
            cmd = [sys.executable, __file__, "--seq", str(args.seq), "--child", f"{setup}:{layers}"]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{setup}:{layers} failed:\n{out.stderr[-3000:]}")
            results.append(json.loads(line[len("RESULT ") :]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    import platform
    import time

    import torch
    import transformers
    import triton

    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, CPU ({platform.machine()}), "
        f"torch {torch.__version__}, transformers {transformers.__version__}, triton "
        f"{triton.__version__} (interpreter), Phi-3-mini widths, 2 layers, 1x{args.seq} tokens, bf16"
    )
    print(report(results))


if __name__ == "__main__":
    main()
