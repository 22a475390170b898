"""Shape sweeps for scripts/bench_kernels.py (``--sweep NAME``): each a list of cases, every one
run against all its peers (eager, torch.compile, F.rms_norm where it applies, Liger) in one run.

Each sweep is sized to finish in about four minutes on one H200 (torch.compile compiles every
shape once, which dominates the small shapes); the grids are representative rather than full
cartesian products, and capped so that all peers' inputs of one case fit the GPU together.

- norms, norms-large: RMSNorm over rows {1k, 4k, 16k} and {64k, 256k} x hidden {128, 1024,
  4096, 8192, 16384}, at most 2**30 elements (2 GiB of bf16) per tensor;
- addnorms: fused residual add + RMSNorm, and LayerNorm, on a sub-grid of the same;
- rope: batch, MHA and GQA heads, head_dim {64, 128, 256}, sequence {512 ... 32k};
- glu: SwiGLU and GeGLU act(a) * b over tokens x intermediate sizes of current models;
- ce: cross-entropy over the vocabularies of current models (32k ... 262k);
- flce: fused linear + cross-entropy over the same vocabularies (H 2048, 8192 tokens, plus the
  issue's anchor N16384 H1024 V151936);
- dtypes: a shape or two per op (not the fused linear loss), run with ``--dtype fp32|fp16``.
"""

from __future__ import annotations

from collections.abc import Callable

NORM_ROWS = [1024, 4096, 16384, 65536, 262144]
NORM_HIDDEN = [128, 1024, 4096, 8192, 16384]
MAX_ELEMS = 1 << 30

# (batch, q heads, kv heads, sequence, head_dim)
ROPE_SHAPES = [
    (1, 32, 32, 512, 128),  # MHA, short
    (16, 32, 8, 512, 128),  # GQA, many short sequences
    (1, 32, 8, 2048, 128),
    (8, 32, 8, 2048, 128),  # the anchor
    (4, 16, 16, 4096, 64),  # MHA, head_dim 64
    (2, 8, 4, 8192, 256),  # GQA, head_dim 256 (Gemma)
    (1, 32, 8, 16384, 128),  # the long-sequence anchor
    (1, 32, 8, 32768, 128),
    (1, 64, 8, 32768, 128),
]

# (tokens, intermediate): Qwen3-0.6B 3072, Llama-3.2-3B 8192, Llama-3-8B 14336, Qwen2.5-7B 18944
GLU_SHAPES = [(4096, 3072), (16384, 3072), (4096, 8192), (16384, 8192), (16384, 14336),
              (8192, 18944)]  # fmt: skip

# GPT-2 50257 (odd), Llama-2 32000, Llama-3 128256, Qwen 151936, Gemma-3 262144
VOCABS = [32000, 50257, 128256, 151936, 262144]


def _norm_grid(rows: list[int]) -> list:
    from bench_cases_elementwise import rms_norm_case

    return [rms_norm_case(m, n) for m in rows for n in NORM_HIDDEN if m * n <= MAX_ELEMS]


def norms() -> list:
    return _norm_grid(NORM_ROWS[:3])


def norms_large() -> list:
    return _norm_grid(NORM_ROWS[3:])


def addnorms() -> list:
    from bench_cases_elementwise import add_rms_norm_case, layer_norm_case

    grid = [(4096, 1024), (16384, 4096), (4096, 8192), (65536, 4096), (16384, 16384)]
    return [add_rms_norm_case(m, n) for m, n in grid] + [layer_norm_case(m, n) for m, n in grid]


def rope() -> list:
    from bench_cases_elementwise import rope_case

    return [rope_case(*shape) for shape in ROPE_SHAPES]


def glu() -> list:
    from bench_cases_elementwise import glu_case

    return [glu_case(m, n, "silu") for m, n in GLU_SHAPES] + [
        glu_case(m, n, "gelu_tanh") for m, n in GLU_SHAPES[::2]
    ]


def ce() -> list:
    from bench_cases_losses import ce_case

    return [ce_case(8192, v) for v in VOCABS] + [ce_case(2048, 151936), ce_case(16384, 128256)]


def flce() -> list:
    from bench_cases_losses import flce_case

    return [flce_case(8192, 2048, v) for v in VOCABS] + [
        flce_case(16384, 1024, 151936, target_ms=27.0)
    ]


def dtypes() -> list:
    """One or two shapes per op, for runs with ``--dtype fp32`` or ``--dtype fp16``: the bf16
    sweeps' anchors and a host-bound shape, every op but the fused linear loss."""
    from bench_cases_elementwise import (
        add_rms_norm_case,
        glu_case,
        layer_norm_case,
        rms_norm_case,
        rope_case,
    )
    from bench_cases_losses import ce_case

    return [
        rms_norm_case(4096, 1024),
        rms_norm_case(16384, 4096),
        rms_norm_case(4096, 16384),
        add_rms_norm_case(16384, 4096),
        layer_norm_case(16384, 4096),
        rope_case(8, 32, 8, 2048, 128),
        glu_case(16384, 8192, "silu"),
        glu_case(16384, 8192, "gelu_tanh"),
        ce_case(8192, 151936),
    ]


SWEEPS: dict[str, Callable[[], list]] = {
    "norms": norms,
    "norms-large": norms_large,
    "addnorms": addnorms,
    "rope": rope,
    "glu": glu,
    "ce": ce,
    "flce": flce,
    "dtypes": dtypes,
}
