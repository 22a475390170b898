"""Compile time of a chain of fused add + RMSNorm ops by depth, with and without inductor_note.py.

    python scripts/probes/probe_inductor_note_depth.py [--limit 120]

Runs tests/kernels/test_inductor_note.py's chain (each layer's sum reaching the next op by two
paths, the last op lowered first at the end) with Inductor on the CPU, Inductor's graph log at
INFO (torch 2.13 builds the fallback note only for an enabled log; torch 2.11 always does), each
depth in a fresh process with an empty Inductor cache. "without the fix" leaves Inductor's own
note in place. One table: seconds to the compiled result, or the limit.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.kernels.test_inductor_note import CHAIN  # noqa: E402


def seconds(depth: int, fix: bool, limit: float) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "chain.py"
        script.write_text(CHAIN)
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(Path(tmp) / "inductor"),
                   TRITON_INTERPRET="0")  # fmt: skip
        argv = [sys.executable, str(script), str(ROOT), str(depth)]
        start = time.perf_counter()
        try:
            done = subprocess.run(argv + ([] if fix else ["without-fix"]), capture_output=True,
                                  text=True, env=env, timeout=limit)  # fmt: skip
        except subprocess.TimeoutExpired:
            return f"not done in {limit:.0f} s"
        took = time.perf_counter() - start
        return f"{took:.1f} s" if done.returncode == 0 else f"failed: {done.stderr[-200:]!r}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=float, default=120.0, help="seconds per compile")
    args = p.parse_args()
    import torch

    rows = [(d, False) for d in (8, 12, 16)] + [(d, True) for d in (8, 16, 24, 40)]
    print(f"{time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()} "
          f"({os.cpu_count()} CPUs), Python {platform.python_version()}, torch {torch.__version__}"
          "; whole process per row (imports included)\n")  # fmt: skip
    print("| depth (fused norms) | inductor_note | compile + first call |\n|---|---|---|")
    for depth, fix in rows:
        print(f"| {depth} | {'with the fix' if fix else 'without'} | "
              f"{seconds(depth, fix, args.limit)} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
