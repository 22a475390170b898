"""Two questions about the compiled graphs of a bound model, answered on the CPU from the graphs
themselves (Llama-3-8B's compiled step holds 0.5 GiB more than eager's on the H200; which of
these could be it?):

1. Does Inductor's backward of the fused loss head (`flce_fwd`) scale the saved d(hidden) and
   d(weight) by grad_output in place, or into new buffers the size of the weight? Printed: the
   backward's output code lines that allocate, reuse or call kernels, in fp32 and bf16.
2. Does the traced attention of a bound GQA Llama (8 query heads, 2 key/value heads) repeat k and
   v (`repeat_kv`'s expand + reshape), or pass them to SDPA as they are, with no mask? Printed:
   the forward graph's attention call and any expand/repeat node.

    python scripts/probes/probe_compiled_graph_cpu.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the bench harness
import torch  # noqa: E402
from bench_harness import load_training_kernels  # noqa: E402
from torch._inductor.utils import run_and_get_code  # noqa: E402


def loss_head_backward(kt, dtype: torch.dtype) -> list[str]:
    """The lines of Inductor's backward code for the loss head that allocate or reuse buffers
    and call kernels."""
    w = torch.randn(4096, 256, dtype=dtype, requires_grad=True)
    x = torch.randn(64, 256, dtype=dtype, requires_grad=True)
    t = torch.randint(0, 4096, (64,))
    step = torch.compile(lambda x, w, t: kt.fused_linear_cross_entropy(x, w, t), fullgraph=True)

    def run():
        step(x, w, t).backward()

    _, codes = run_and_get_code(run)
    backward = codes[-1]  # forward first, then backward
    keep = ("reuse", "empty_strided", "cpp_fused", "return (")
    body = backward[backward.index("def call(") :]
    return [ln.strip() for ln in body.splitlines() if any(k in ln for k in keep)]


def gqa_attention_forward() -> list[str]:
    """The forward graph's attention and repeat/expand nodes of a bound GQA Llama."""
    import kernels
    from torch._functorch.aot_autograd import aot_module_simplified
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=8, vocab_size=256,
                      attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).train()
    kernels.apply_training_kernels(model)
    graphs = []

    def backend(gm, inputs):
        def keep(g, _):
            graphs.append(g)
            return g.forward

        return aot_module_simplified(gm, inputs, fw_compiler=keep, bw_compiler=lambda g, _: g)

    ids = torch.randint(0, 256, (2, 16))
    torch.compile(model, backend=backend, fullgraph=True)(input_ids=ids, labels=ids).loss.backward()
    keep = ("scaled_dot_product", "expand", "repeat")
    return [ln.strip()[:200] for ln in graphs[0].code.splitlines() if any(k in ln for k in keep)]


def main() -> int:
    torch.set_num_threads(1)
    kt = load_training_kernels()
    print(f"torch {torch.__version__}, CPU\n")
    for dtype in (torch.float32, torch.bfloat16):
        print(f"== 1. the loss head's compiled backward, {dtype} (V 4096, H 256, N 64) ==")
        lines = loss_head_backward(kt, dtype)
        print("\n".join(lines))
        fresh = [ln for ln in lines if "empty_strided" in ln and "(4096, 256)" in ln]
        print(
            f"-> new weight-sized buffers: {len(fresh)}; reused: {sum('reuse' in ln for ln in lines)}\n"
        )
    print("== 2. a bound GQA Llama's traced attention (8 query heads, 2 key/value heads) ==")
    lines = gqa_attention_forward()
    print("\n".join(lines))
    sdpa = [ln for ln in lines if "scaled_dot_product" in ln and "=" in ln and "(" in ln]
    repeats = [ln for ln in lines if "expand" in ln or "repeat" in ln]
    print(f"-> SDPA calls: {len(sdpa)}; expand/repeat nodes: {len(repeats)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
