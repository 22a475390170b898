"""How a compiled Qwen3 calls SDPA, on the CPU (issue 30's question: why the compiled graph's
attention took twice the GPU time on the H200).

Prints, for a tiny Qwen3 (plain, and with the training kernels bound through LOCAL_KERNELS from
this checkout): the SDPA call Dynamo traces (its mask and is_causal) against the one eager makes,
and how many SDPA forward / backward ops AOTAutograd's min-cut partition (Inductor's default)
puts in the forward and the backward graph: a forward op in the backward graph is a recompute.

    python scripts/probes/probe_compile_sdpa.py
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import min_cut_rematerialization_partition

VARIANT = (
    Path(__file__).resolve().parents[2] / "hub_kernels/kernels-lab/training/build/torch-universal"
)


def _shown(kwargs: dict) -> dict:
    return {k: v if isinstance(v, (bool, float, int, type(None))) else type(v).__name__
            for k, v in kwargs.items()}  # fmt: skip


def _model(bound: bool):
    import kernels
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=256)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    if bound:
        kernels.apply_training_kernels(model)
    return model


def _report(bound: bool, ids: torch.Tensor) -> None:
    model = _model(bound)
    traced, graphs = [], {"forward": Counter(), "backward": Counter()}

    def dynamo(gm, example):
        traced.extend(
            _shown(dict(n.kwargs)) for n in gm.graph.nodes if "scaled_dot" in str(n.target)
        )

        def counting(tag):
            def compiler(g, ex):
                graphs[tag].update(str(n.target) for n in g.graph.nodes
                                   if n.op == "call_function" and "scaled_dot" in str(n.target))  # fmt: skip
                return g.forward

            return compiler

        return aot_module_simplified(gm, example, fw_compiler=counting("forward"),
                                     bw_compiler=counting("backward"),
                                     partition_fn=min_cut_rematerialization_partition)  # fmt: skip

    torch.compile(model, backend=dynamo)(input_ids=ids, labels=ids).loss.backward()
    eager, original = [], F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        eager.append(_shown(kwargs))
        return original(*args, **kwargs)

    F.scaled_dot_product_attention = spy
    try:
        model(input_ids=ids, labels=ids)
    finally:
        F.scaled_dot_product_attention = original
    name = "bound" if bound else "plain"
    print(f"{name}: compiled call {traced[0]}")
    print(f"{name}: eager call    {eager[0]}")
    print(
        f"{name}: forward graph {dict(graphs['forward'])}; backward graph {dict(graphs['backward'])}"
    )


def main() -> int:
    os.environ["LOCAL_KERNELS"] = f"kernels-lab/training={VARIANT}"
    ids = torch.randint(0, 256, (1, 32))
    print(f"torch {torch.__version__}")
    for bound in (False, True):
        _report(bound, ids)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
