"""Does torch's CUDA embedding backward record into a CUDA graph and replay right? (GPU)

embedding.py's `embedding_bwd` (the compiled input embedding's backward) calls
aten.embedding_dense_backward; under torch.compile(mode="reduce-overhead") it is recorded into a
CUDA graph, which fails if the kernel syncs with the host and gives stale values if it sizes its
work from the ids on the host. This records it at Llama-3's V x H (8192 tokens), bf16 and fp32,
with and without a padding row, replays it with new ids and gradients, and compares with an eager
call. Output: docs/benchmarks/compile-h200-2026-12-02-s7/capture.txt.

    python scripts/probes/probe_embedding_capture_gpu.py
"""

import torch

V, H, N = 128256, 4096, 8192
for dt in (torch.bfloat16, torch.float32):
    for pad in (-1, 0):
        g = torch.randn(N, H, device="cuda", dtype=dt)
        ids = torch.randint(0, V, (N,), device="cuda")
        ids[:7] = 0
        ref = torch.ops.aten.embedding_dense_backward(g, ids, V, pad, False)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                torch.ops.aten.embedding_dense_backward(g, ids, V, pad, False)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                out = torch.ops.aten.embedding_dense_backward(g, ids, V, pad, False)
        except Exception as e:
            print(dt, pad, "capture FAILED:", type(e).__name__, str(e).splitlines()[0])
            continue
        ids.copy_(torch.randint(0, V, (N,), device="cuda"))
        g.copy_(torch.randn_like(g))
        graph.replay()
        torch.cuda.synchronize()
        ref = torch.ops.aten.embedding_dense_backward(g, ids, V, pad, False)
        print(
            dt,
            "pad",
            pad,
            "captured; replay with new ids/grads equal:",
            torch.equal(out, ref),
            "max diff",
            (out.float() - ref.float()).abs().max().item(),
        )
