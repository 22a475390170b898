"""torch.compile over models bound to the training kernels: graph breaks, recompiles, values and
held memory, per family, on the CPU (no GPU needed: the same graph is traced on every device).

    python scripts/probes/probe_compile.py --out docs/benchmarks/compile-cpu-DATE
    python scripts/probes/probe_compile.py --families llama --steps 5      # quicker

For each family a tiny random model (2 layers, sdpa or the family's attention) is bound with
``kernels.apply_training_kernels`` (this tree's kernels through LOCAL_KERNELS) and:

1. ``torch._dynamo.explain`` of the forward with labels (the fused loss head included): graphs,
   graph breaks and their reasons, and the custom ops of this package the graph calls;
2. ``torch.compile(model, fullgraph=True, backend=aot_eager)`` trained for --steps AdamW steps
   of one shape: graphs compiled (1 = no recompile), every recompile reason Dynamo logs;
3. the same over varying sequence lengths, by Dynamo's default (automatic dynamic shapes) and
   with the length marked dynamic (``torch._dynamo.mark_dynamic``);
4. loss and gradients of the first compiled step against eager (kernels bound, same weights);
5. bytes held between forward and backward: eager (every storage the forward allocates that is
   still alive after it) against compiled (the forward graph's outputs: the loss and the saved
   tensors), without parameters and inputs.

The kernels run their torch formulas inside the custom ops here (no TRITON_INTERPRET), so a
step takes milliseconds. The aot_eager backend runs Dynamo and AOTAutograd (graph breaks,
guards, the saved-tensor choice) without Inductor's C++ build. Writes per family
``<family>.log`` (explain output and recompile reasons) and ``README.md`` (the table).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.metadata
import logging
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VARIANT = ROOT / "hub_kernels/kernels-lab/training/build/torch-universal"
os.environ["LOCAL_KERNELS"] = f"kernels-lab/training={VARIANT}"
os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests/kernels"))  # the live-storage probe, the graph backend

import torch  # noqa: E402
from _graph_code import Counting  # noqa: E402
from functorch.compile import make_boxed_func  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402
from torch._dynamo.backends.debugging import aot_eager  # noqa: E402

# family -> (transformers model type, attention)
FAMILIES = {
    "qwen3": ("qwen3", "sdpa"),
    "llama": ("llama", "sdpa"),
    "gemma2": ("gemma2", "eager"),  # softcapped attention logits: eager (as transformers asks)
    "gemma3": ("gemma3_text", "sdpa"),
    "qwen3_moe": ("qwen3_moe", "sdpa"),
}
OPS = ("flce_fwd", "ce_fwd", "rms_norm_fwd", "add_rms_norm_fwd", "layer_norm_fwd", "rope",
       "gated_mlp_fwd", "glu_fwd", "act_fwd", "moe_experts_fwd", "embedding_fwd")  # fmt: skip


def build(model_type: str, attn: str):
    """(model, eager twin with the same weights, bound layer names), both bound, train mode."""
    import kernels

    from tests.models.registry import causal_lm_class, tiny_config

    config = tiny_config(model_type)
    torch.manual_seed(0)
    model = causal_lm_class(model_type)._from_config(config, attn_implementation=attn).train()
    twin = copy.deepcopy(model)
    report = kernels.apply_training_kernels(model)
    kernels.apply_training_kernels(twin)
    bound = sorted({e.layer_name for e in report if e.status == "bound"})
    return model, twin, bound


class Recorder(logging.Handler):
    """Keeps the messages of Dynamo's recompile log."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def portable(text: str) -> str:
    """`text` without this machine's paths: the repository and site-packages by name."""
    text = text.replace(str(ROOT), "<repo>")
    return text.replace(str(Path(torch.__file__).resolve().parents[1]), "<site-packages>")


def explained(explain, code: str) -> str:
    """explain's summary (its guards left out: long and machine-specific) and the graphs."""
    lines = [
        f"Graph Count: {explain.graph_count}",
        f"Graph Break Count: {explain.graph_break_count}",
        f"Op Count: {explain.op_count}",
        "Break Reasons:",
    ]
    for reason in explain.break_reasons:
        lines.append(f"  {reason.reason}")
        lines += [f"    {frame}" for frame in reason.user_stack or []]
    if not explain.break_reasons:
        lines.append("  (none)")
    lines += ["Graph code (forward, as Dynamo captured it):", code]
    return portable("\n".join(lines))


def loss_step(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach()


def train(model, lengths: list[int], mark: bool, recorder: Recorder) -> tuple[int, list[str]]:
    """(graphs compiled, recompile reasons) over AdamW steps, one batch per length."""
    torch._dynamo.reset()
    recorder.lines.clear()
    backend = Counting()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    for length in lengths:
        ids = torch.randint(0, model.config.vocab_size, (2, length), generator=gen)
        if mark:
            torch._dynamo.mark_dynamic(ids, 1)
        loss_step(compiled, ids)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return len(backend.graphs), list(recorder.lines)


def held_bytes(model, twin, ids) -> tuple[int, int]:
    """(eager, compiled) bytes held between forward and backward, parameters and inputs aside."""
    from _live_bytes import LiveBytes

    with LiveBytes() as probe:
        loss = twin(input_ids=ids, labels=ids).loss
        eager = probe.live
    del loss
    held: list[int] = []

    def forward(gm, _inputs):
        mine = set()
        for node in gm.graph.nodes:
            if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor):
                mine.add(id(node.meta["val"].untyped_storage()))
        sizes = {}
        for out in next(n for n in gm.graph.nodes if n.op == "output").args[0]:
            val = getattr(out, "meta", {}).get("val")
            if isinstance(val, torch.Tensor) and id(val.untyped_storage()) not in mine:
                sizes[id(val.untyped_storage())] = val.untyped_storage().nbytes()
        held.append(sum(sizes.values()))
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=forward, bw_compiler=lambda gm, _: gm.forward)
    torch.compile(model, backend=backend, fullgraph=True)(input_ids=ids, labels=ids)
    return eager, held[0]


def probe(family: str, steps: int, lengths: list[int], recorder: Recorder) -> tuple[dict, str]:
    model_type, attn = FAMILIES[family]
    model, twin, bound = build(model_type, attn)
    ids = torch.randint(
        0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1)
    )
    log = [f"# {family}: tiny {model_type} ({model.config.num_hidden_layers} layers, hidden "
           f"{model.config.hidden_size}), attention {attn}", f"bound: {', '.join(bound)}", ""]  # fmt: skip

    torch._dynamo.reset()
    explain = torch._dynamo.explain(lambda i: model(input_ids=i, labels=i).loss)(ids)
    code = "\n".join(g.code for g in explain.graphs)
    ops = {op: code.count(f".{op}.") for op in OPS if code.count(f".{op}.")}
    log += ["## torch._dynamo.explain (forward with labels)", explained(explain, code), ""]

    # values: one compiled step against eager, same weights and batch
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=aot_eager, fullgraph=True)
    loss_c, loss_e = loss_step(compiled, ids), loss_step(twin, ids)
    grad_diff = max(
        (p.grad - q.grad).abs().max().item()
        for p, q in zip(model.parameters(), twin.parameters(), strict=True)
        if p.grad is not None
    )
    model.zero_grad(set_to_none=True)
    twin.zero_grad(set_to_none=True)

    one, reasons_one = train(model, [16] * steps, False, recorder)
    auto, reasons_auto = train(model, lengths, False, recorder)
    marked, reasons_marked = train(model, lengths, True, recorder)
    for title, reasons in (
        (f"{steps} steps of one shape", reasons_one),
        (f"lengths {lengths}, automatic dynamic", reasons_auto),
        (f"lengths {lengths}, marked dynamic", reasons_marked),
    ):
        log += [f"## recompiles: {title}", *(portable(r) for r in reasons or ["(none)"]), ""]
    eager_held, compiled_held = held_bytes(model, twin, ids)
    row = {
        "family": family,
        "graphs": explain.graph_count,
        "breaks": explain.graph_break_count,
        "ops": ops,
        "one_shape": one,
        "auto": auto,
        "marked": marked,
        "loss_diff": abs(loss_c - loss_e).item(),
        "grad_diff": grad_diff,
        "eager_held": eager_held,
        "compiled_held": compiled_held,
    }
    return row, "\n".join(log) + "\n"


def table(rows: list[dict], steps: int, lengths: list[int]) -> str:
    lines = [
        "| family | graphs | graph breaks | ops in the graph | compiles, "
        f"{steps} steps of one shape | compiles, {len(lengths)} lengths (automatic / marked "
        "dynamic) | loss, max grad diff vs eager | held bytes eager / compiled |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ops = ", ".join(f"{k} x{v}" for k, v in r["ops"].items())
        lines.append(
            f"| {r['family']} | {r['graphs']} | {r['breaks']} | {ops} | {r['one_shape']} | "
            f"{r['auto']} / {r['marked']} | {r['loss_diff']:.1e}, {r['grad_diff']:.1e} | "
            f"{r['eager_held']} / {r['compiled_held']} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lengths", default="8,12,16,24,9,31,40")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    lengths = [int(v) for v in args.lengths.split(",")]
    recorder = Recorder()
    torch._logging.set_logs(recompiles=True)
    logging.getLogger("torch._dynamo").addHandler(recorder)
    versions = ", ".join(
        f"{name} {importlib.metadata.version(name)}" for name in ("torch", "transformers", "triton")
    )
    header = (
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, CPU "
        f"({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs), {versions}; "
        "backend aot_eager, the kernels' torch formulas inside the custom ops."
    )
    rows = []
    for family in args.families.split(","):
        row, log = probe(family, args.steps, lengths, recorder)
        rows.append(row)
        print(log, flush=True)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{family}.log").write_text(header + "\n\n" + log)
    text = f"{header}\n\n{table(rows, args.steps, lengths)}\n"
    print(text)
    if args.out:
        (args.out / "README.md").write_text(
            "# torch.compile with the training kernels bound: graph breaks and recompiles (CPU)\n\n"
            "Made by `python scripts/probes/probe_compile.py --out <this folder>` (see its docstring). "
            "Per family: `<family>.log` holds the `torch._dynamo.explain` output and every "
            "recompile reason Dynamo logged.\n\n" + text
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
