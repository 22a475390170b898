"""One rank of a distributed CPU test: ``python -m tests.distributed.worker SPEC OUT``.

Joins the process group (gloo, or KERNELS_TEST_BACKEND) from the environment (launch.py sets it), runs each scenario of the JSON
list SPEC with the function of its "kind" in scenarios.py, and saves its result as
``OUT/<name>.rank<r>.pt``. Leaves with os._exit: tearing gloo down while DTensor meshes and
DeepSpeed still hold it can abort a rank after its work is done.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main(spec: str, out: str) -> int:
    import torch
    import torch.distributed as dist

    print(f"imports: {time.process_time():.1f} s CPU", flush=True)
    torch.set_num_threads(1)
    backend = os.environ.get("KERNELS_TEST_BACKEND", "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    from tests.distributed import scenarios

    rank = dist.get_rank()
    for scenario in json.loads(Path(spec).read_text()):
        start = time.process_time()
        result = getattr(scenarios, scenario["kind"])(out=Path(out), **scenario)
        print(f"{scenario['name']}: {time.process_time() - start:.1f} s CPU", flush=True)
        torch.save(result, Path(out) / f"{scenario['name']}.rank{rank}.pt")
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main(*sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
