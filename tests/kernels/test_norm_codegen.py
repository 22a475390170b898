"""What the RMSNorm forward compiles to for sm_90 (Triton's bundled ptxas and nvdisasm, no GPU):
a 16-bit norm without an offset multiplies x̂ by the weight in packed bf16, with no conversion
from fp32 per element. A run-time `+ offset` there cost 2-10 % of the kernel's time on the H200
(docs/benchmarks/compile-h200-2026-12-03-s11/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("geometry", [(2, 1024, 4), (1, 8192, 4)], ids=str)
def test_llama_forward_multiplies_the_weight_in_bf16(geometry):
    pytest.importorskip("triton")
    # The interpreter (set for this folder) replaces compiled kernels: compile in a fresh process.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import json, sys, collections; sys.path.insert(0, 'scripts/probes');"
        "from probe_norm_fwd_sass import opcodes;"
        f"print(json.dumps(collections.Counter(opcodes(*{geometry}, has_offset=False))))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if run.returncode and "nvdisasm" in run.stderr + run.stdout and "No such file" in run.stderr:
        pytest.skip("this Triton has no bundled nvdisasm")
    assert run.returncode == 0, run.stderr[-2000:]
    ops = json.loads(run.stdout.strip().splitlines()[-1])
    assert ops.get("F2F.BF16.F32", 0) == 0, ops
    assert ops.get("HMUL2.BF16_V2", 0) + ops.get("HFMA2.MMA.BF16_V2", 0) > 0, ops
