"""scripts/liger_vlm.py: Liger's VLM patch in the strongest configuration that applies on this
transformers (needs liger-kernel; skipped without it). Patch-level only: Liger's norm and MLP
kernels do not run on the CPU (scripts/probes/probe_liger_vlm.py runs them on a GPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("liger_kernel")

# In a fresh process: Liger's patches and the placeholder module are process-wide.
CHILD = """
import sys, warnings
warnings.filterwarnings("ignore")
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/scripts"]
import liger_vlm
from tests.models.vlm_registry import build_vlm

model = build_vlm("qwen2_5_vl")
for config in ("default", "no-flce"):
    try:
        liger_vlm.apply(model, config)
        print("APPLIED", config)
    except ImportError as exc:
        print("RAISED", config, type(exc).__name__)
config, why = liger_vlm.apply_strongest(model)
print("STRONGEST", config, "|", why)
norms = {type(m).__name__ for m in model.modules() if "forward" in m.__dict__}
print("PATCHED", sorted(norms))
from liger_kernel.transformers.model.qwen2_5_vl import lce_forward
try:
    lce_forward(model)
except RuntimeError as exc:
    print("PLACEHOLDER", str(exc).split(" (")[0])
"""


def test_qwen2_5_vl_falls_back_to_its_module_patches():
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(ROOT)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    # 0.8.5 imports LigerQwen2_5_VLCausalLMOutputWithPast, which it defines only where
    # transformers has Qwen2_5_VLCausalLMOutputWithPast (5.24 does not)
    assert "RAISED default ImportError" in out and "RAISED no-flce ImportError" in out, out
    line = next(x for x in out.splitlines() if x.startswith("STRONGEST"))
    assert line.startswith("STRONGEST modules | no-flce raised ImportError"), line
    assert "<site>" in line and str(ROOT) not in line  # no path of this machine in a table
    patched = next(x for x in out.splitlines() if x.startswith("PATCHED"))
    assert "Qwen2_5_VLRMSNorm" in patched and "Qwen2MLP" in patched, patched
    # the fused-loss forward it imported is the placeholder, which never runs silently
    assert (
        "PLACEHOLDER liger_kernel.transformers.model.qwen2_5_vl.lce_forward is unavailable" in out
    )
