"""A deep chain of the norm ops compiles by Inductor in seconds (inductor_note.py).

Inductor's note on a custom op's first lowering printed each IR argument with all its producers;
through 28 layers of fused add + RMSNorm ops feeding each other (Qwen3-0.6B under
torch.compile on the H200, torch 2.11) that text grew as 2^layers and the compile never ended.
torch 2.11 builds the note even with the log off; later releases only for an enabled log, so the
test switches Inductor's graph log to INFO to take the same path. It runs in a fresh process with
an empty Inductor cache: each op's first lowering happens once per process, and a cached graph
skips lowering.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHAIN = """
import logging, sys
sys.path.insert(0, sys.argv[1])
import torch
from tests.gpu.variant import load_variant

kt = load_variant("_kt_inductor_note")
depth = int(sys.argv[2])
if sys.argv[3:] == ["without-fix"]:  # scripts/probes/probe_inductor_note_depth.py's baseline
    import importlib

    importlib.import_module("_kt_inductor_note.inductor_note").shorten_fallback_note = lambda: None
logging.getLogger("torch._inductor.graph").setLevel(logging.INFO)


def chain(h, r, w, m):
    for _ in range(depth):  # each layer's sum reaches the next op by two paths: r and h
        y, r = kt.fused_add_rms_norm(h, r, w, 1e-6)
        h = y @ m
    return kt.rms_norm(h, w, 1e-6)  # its first lowering comes last, behind the whole chain


h, r, m, w = torch.randn(4, 16), torch.randn(4, 16), torch.randn(16, 16) / 4, torch.rand(16) + 0.5
out = torch.compile(chain, fullgraph=True)(h, r, w, m)
torch.testing.assert_close(out, chain(h, r, w, m), rtol=1e-5, atol=1e-5)
print("compiled")
"""


def test_a_deep_chain_of_norm_ops_compiles_with_a_short_fallback_note(tmp_path):
    script = tmp_path / "chain.py"
    script.write_text(CHAIN)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), TRITON_INTERPRET="0")
    # 24 layers: with the old note, 2^24 copies of the first layer's text (16 layers did not
    # finish in 120 s on a 2-core CPU); with the short one, about 6 s.
    done = subprocess.run(
        [sys.executable, str(script), str(ROOT), "24"],
        capture_output=True, text=True, env=env, timeout=150, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled" in done.stdout
    log = done.stderr
    assert "Creating implicit fallback for" in log, "the note was not logged: the test is moot"
    # One line per argument: kind, name, size and dtype of the last op's input.
    assert "rms_norm_fwd.default" in log
    assert "args[0]: TensorBox buf" in log and "[4, 16] torch.float32" in log


def test_the_note_is_replaced_once_and_left_alone_where_torch_has_none(kt, monkeypatch):
    import importlib

    from torch._inductor import exc

    note = importlib.import_module(kt.__name__ + ".inductor_note")
    monkeypatch.setattr(exc.OperatorIssue, "operator_str", exc.OperatorIssue.operator_str)
    note.shorten_fallback_note()
    installed = exc.OperatorIssue.__dict__["operator_str"]
    note.shorten_fallback_note()  # a second trace: the same method stays
    assert exc.OperatorIssue.__dict__["operator_str"] is installed
    text = exc.OperatorIssue.operator_str("op", [1.5, [2, "x"]], {"k": None})
    assert text.splitlines() == ["  target: op", "  args[0]: 1.5", "  args[1]: [2, 'x']",
                                 "  kwargs: {k: None}"]  # fmt: skip
    monkeypatch.delattr(exc.OperatorIssue, "operator_str")  # a torch without the method
    note.shorten_fallback_note()
    assert not hasattr(exc.OperatorIssue, "operator_str")
