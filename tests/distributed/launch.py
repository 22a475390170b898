"""Run scenarios on several CPU ranks (gloo), one process per rank, and collect their results.

`run_ranks(world, scenarios, tmp)` starts `world` processes of ``python -m
tests.distributed.worker`` with the torch.distributed environment (RANK, WORLD_SIZE, a free
loopback port), waits for all of them, and returns ``{scenario name: [rank 0's result, ...]}``
(each a dict of tensors and numbers that the worker saved). The kernels come from this checkout
through LOCAL_KERNELS; Triton's interpreter runs them when a scenario list asks for it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
KERNEL_REPO = ROOT / "hub_kernels" / "kernels-lab" / "training"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    world: int,
    scenarios: list[dict],
    tmp: Path,
    *,
    interpret: bool = True,
    timeout: int = 900,
    backend: str = "gloo",
) -> dict[str, list[dict]]:
    """Run `scenarios` (dicts with at least "name" and "kind") on `world` ranks (`backend`
    "nccl": one GPU per rank)."""
    tmp.mkdir(parents=True, exist_ok=True)
    spec = tmp / "scenarios.json"
    spec.write_text(json.dumps(scenarios))
    env = dict(
        os.environ,
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        OMP_NUM_THREADS="1",
        LOCAL_KERNELS=f"kernels-lab/training={KERNEL_REPO}",
        DS_ACCELERATOR="cpu",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        KERNELS_TEST_BACKEND=backend,
    )
    env["TRITON_INTERPRET"] = "1" if interpret else "0"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    procs = []
    for rank in range(world):
        log = open(tmp / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        cmd = [sys.executable, "-m", "tests.distributed.worker", str(spec), str(tmp)]
        env_r = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
        procs.append((subprocess.Popen(cmd, env=env_r, cwd=ROOT, stdout=log, stderr=log), log))
    codes = []
    try:
        for proc, _log in procs:
            codes.append(proc.wait(timeout=timeout))
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    if any(codes):
        tails = "\n".join(
            f"--- rank {r} (exit {c}) ---\n{(tmp / f'rank{r}.log').read_text()[-4000:]}"
            for r, c in enumerate(codes)
        )
        raise AssertionError(f"a rank failed:\n{tails}")
    return {
        s["name"]: [torch.load(tmp / f"{s['name']}.rank{r}.pt") for r in range(world)]
        for s in scenarios
    }
