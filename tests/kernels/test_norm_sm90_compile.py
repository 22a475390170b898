"""Every listed norm-backward geometry compiles for an H200 (sm_90) on this CPU machine.

The interpreter runs the kernels' Python, not Triton's compiler, and accepts code the compiler
refuses (a jit function returning a tensor on one branch and a scalar on another did). This
compiles each geometry of the hidden-8192 and -16384 lists for RMSNorm and LayerNorm with
Triton's bundled ptxas, through scripts/probes/probe_norm_registers.py in a process of its own:
the interpreter, switched on for this one, cannot compile.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "scripts/probes/probe_norm_registers.py"
PTXAS = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton has no bundled ptxas")
def test_every_wide_row_geometry_compiles_for_sm90(kt):
    rn = sys.modules[f"{kt.__name__}.rms_norm"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns when unset; the JIT's default
    run = subprocess.run(
        [sys.executable, str(PROBE), "8192", "16384"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith(("| RMSNorm", "| Layer"))]
    expected = 2 * sum(len(rn.bwd_candidates(16384, n)) for n in (8192, 16384))
    assert len(rows) == expected, run.stdout
    # Each fits the shared memory an A100 grants one program (164 KiB), as stage_bytes plans.
    smem_kib = [float(line.split("|")[-3]) for line in rows]
    assert max(smem_kib) <= 164, run.stdout
