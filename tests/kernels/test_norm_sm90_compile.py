"""Every listed norm-backward geometry compiles for an H200 (sm_90) on this CPU machine.

The interpreter runs the kernels' Python, not Triton's compiler, and accepts code the compiler
refuses (a jit function returning a tensor on one branch and a scalar on another did). This
compiles the geometries of the hidden-8192 and -16384 lists for RMSNorm and LayerNorm with
Triton's bundled ptxas, through scripts/probes/probe_norm_registers.py in a process of its own:
the interpreter, switched on for this one, cannot compile.

The default run compiles one geometry per kernel specialisation the lists hold (BLOCK_M,
PREFETCH, ACC_2D, RELOAD, STAGES): the one with the most warps, whose reductions take the most
shared memory. The geometries that differ from it only in warps compile under KERNELS_SWEEP=1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from tests.sweep import sweep_only

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "scripts/probes/probe_norm_registers.py"
PTXAS = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
WIDTHS = (8192, 16384)
SPECIALISED = ("BLOCK_M", "PREFETCH", "ACC_2D", "RELOAD", "STAGES")

# The probe's own functions, for the chosen geometries only: argv is width:index,... pairs.
_SOME = """
import sys
sys.path.insert(0, sys.argv[1])
import probe_norm_registers as probe
kt = probe.load_training_kernels()
rn = sys.modules[kt.__name__ + ".rms_norm"]
ln = sys.modules[kt.__name__ + ".layer_norm"]
for pair in sys.argv[2].split(","):
    n, i = (int(v) for v in pair.split(":"))
    cfg = rn.bwd_candidates(probe.ROWS, n)[i]
    for op, stats, mod in (("RMSNorm", probe.rms_stats, rn), ("LayerNorm", probe.ln_stats, ln)):
        print(f"| {op} | {n} | {i} | {stats(mod, n, cfg)['smem_kib']:.0f} |", flush=True)
"""


def _probe(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns when unset; the JIT's default
    run = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def _rows(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith(("| RMSNorm", "| Layer"))]


def representatives(rn) -> list[tuple[int, int]]:
    """(width, index in bwd_candidates) of the most-warps geometry of each specialisation."""
    best: dict[tuple, tuple[int, int, int]] = {}
    for n in WIDTHS:
        for i, cfg in enumerate(rn.bwd_candidates(16384, n)):
            key = (n, *(cfg[k] for k in SPECIALISED))
            if key not in best or cfg["num_warps"] > best[key][0]:
                best[key] = (cfg["num_warps"], n, i)
    return sorted((n, i) for _, n, i in best.values())


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton has no bundled ptxas")
def test_each_wide_row_specialisation_compiles_for_sm90(kt):
    rn = sys.modules[f"{kt.__name__}.rms_norm"]
    # Today six: register prefetch, STAGES without and with RELOAD (8192); plain, RELOAD alone
    # and RELOAD with STAGES (16384); of the lists' eleven geometries.
    chosen = representatives(rn)
    pairs = ",".join(f"{n}:{i}" for n, i in chosen)
    rows = _rows(_probe("-c", _SOME, str(PROBE.parent), pairs))
    assert len(rows) == 2 * len(chosen), rows
    # Each fits the shared memory an A100 grants one program (164 KiB), as stage_bytes plans.
    smem_kib = [float(line.split("|")[-2]) for line in rows]
    assert max(smem_kib) <= 164, rows


@sweep_only("every warp count of each wide-row geometry")
@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton has no bundled ptxas")
def test_every_wide_row_geometry_compiles_for_sm90(kt):
    rn = sys.modules[f"{kt.__name__}.rms_norm"]
    stdout = _probe(str(PROBE), *map(str, WIDTHS))
    rows = _rows(stdout)
    expected = 2 * sum(len(rn.bwd_candidates(16384, n)) for n in WIDTHS)
    assert len(rows) == expected, stdout
    smem_kib = [float(line.split("|")[-3]) for line in rows]
    assert max(smem_kib) <= 164, stdout


# Compiles each forward kernel of rms_norm with and without masks (EVEN), with a residual and the
# rstd store (every branch of either), for sm_90; one line per compile.
_FORWARD = """
import sys
sys.path[:0] = sys.argv[1:3]
from bench_harness import load_training_kernels
from sass import sass_opcodes
rn = sys.modules[load_training_kernels().__name__ + ".rms_norm"]
types = {"X": "*bf16", "R": "*bf16", "W": "*bf16", "Y": "*bf16", "S": "*bf16", "RSTD": "*fp32",
         "eps": "fp32", "offset": "fp32"}
for cfg in ({"BLOCK_M": 2, "num_warps": 4}, {"BLOCK_M": 1, "num_warps": 8, "LOOP": 2048}):
    kernel = rn.fwd_kernel(cfg)
    width = {"LOOP": cfg["LOOP"]} if "LOOP" in cfg else {"BLOCK_N": 1024}
    for even in (False, True):
        constants = dict(BLOCK_M=cfg["BLOCK_M"], **width, MODE=rn.LLAMA, RESIDUAL=True,
                         HAS_W=True, HAS_OFFSET=False, STATS=True, EVEN=even)
        ops = sass_opcodes(kernel.fn, types, constants, cfg["num_warps"])
        print(f"| fwd | {kernel.fn.__name__} | {even} | {len(ops)} |")
"""


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton has no bundled ptxas")
def test_each_forward_specialisation_compiles_for_sm90(kt):
    """Both forward kernels (whole rows, and two passes over chunks) compile with and without
    masks (EVEN): the interpreter ran an EVEN variant the compiler refused (a jit function
    returning from inside a constexpr branch)."""
    stdout = _probe("-c", _FORWARD, str(ROOT / "scripts"), str(PROBE.parent))
    rows = [line for line in stdout.splitlines() if line.startswith("| fwd")]
    assert len(rows) == 4, stdout
