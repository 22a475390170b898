"""scripts/bench_vlm.py end to end on the CPU with --smoke (the tiny model, one process per
setup, the kernels from its own `kernels serve` mirror): the table's rows, what ours bound, and
a setup that fails (Liger not installed here) as a row with its reason, not a crash."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.sweep import sweep_param

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "setups",
    ["eager,ours", sweep_param("eager,ours,liger", what="the Liger row", id="with-liger")],
)
def test_smoke_run_writes_one_table_with_every_setup(tmp_path, setups):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_vlm.py"), "--smoke", "--family",
         "qwen2_5_vl", "--setups", setups, "--steps", "2", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    md = (tmp_path / "vlm-qwen2_5_vl.md").read_text()
    rows = {line.split(" | ")[0][2:]: line for line in md.splitlines() if line.startswith("| ")}
    assert "error" not in rows["eager"] and "error" not in rows["ours"], md
    assert " ms | " in rows["ours"] and "positions per step" in md
    # the eager and kernelized losses agree (the tiny model in bf16: the loss column's diff)
    assert float(rows["ours"].split(" | ")[6]) < 1e-2, rows["ours"]
    bound = next(line for line in md.splitlines() if line.startswith("ours bound:"))
    for layer in ("MultimodalRotaryEmbedding", "vision_rotary_pos_emb", "CausalLMHead"):
        assert layer in bound, bound
    if "liger" not in setups:
        return
    liger = [name for name in rows if name.startswith("liger")]
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        assert liger == ["liger (auto)"], rows
        assert "error: ModuleNotFoundError: No module named 'liger_kernel'" in rows[liger[0]]
        return
    # Liger 0.8.5's Qwen2.5-VL fused-loss module does not import on transformers 5.24: the
    # strongest patch that runs is its module patches, and the table says so
    ran = [name for name in liger if "error" not in rows[name]]
    assert len(ran) == 1 and " ms | " in rows[ran[0]], md
    assert ran[0] in {"liger (default)", "liger (no-flce)", "liger (modules)"}, ran
    assert f"{ran[0]}: Liger" in md, md  # the note under the table names the configuration
