"""Gradient distance from float64 of the CPU DPO runs of tests/post_training/test_dpo_verdict.py,
with the kernels' torch path and with Triton's interpreter (TRITON_INTERPRET=1), one process
each: why that test pins TRITON_INTERPRET=0.

    python scripts/probes/probe_dpo_interpreter.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import pathlib, sys, tempfile, torch
sys.path[:0] = [{root!r}, {scripts!r}]
from tests.post_training import test_dpo_verdict as t
class Factory:
    def mktemp(self, name):
        return pathlib.Path(tempfile.mkdtemp(dir={tmp!r}))
import os, pytest
if os.environ["TRITON_INTERPRET"] == "1":  # the fixture pins the torch path: let this run keep it
    setenv = pytest.MonkeyPatch.setenv
    pytest.MonkeyPatch.setenv = lambda self, k, v, *a: None if k == "TRITON_INTERPRET" else setenv(self, k, v, *a)
runs = t.runs.__wrapped__(Factory())
for name, steps in runs.items():
    print(f"{{name:14s}}", " ".join(f"{{s.grad_dist:.2e}}" for s in steps))
"""


def main() -> int:
    print(f"python {sys.version.split()[0]}; gradient distance from float64 at steps 1-3")
    with tempfile.TemporaryDirectory() as tmp:
        code = CHILD.format(root=str(ROOT), scripts=str(ROOT / "scripts"), tmp=tmp)
        for interpret in ("0", "1"):
            env = {**os.environ, "TRITON_INTERPRET": interpret}
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                 text=True, cwd=ROOT)  # fmt: skip
            print(f"\nTRITON_INTERPRET={interpret}")
            print(out.stdout.strip() or out.stderr[-2000:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
