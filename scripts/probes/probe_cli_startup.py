"""What a `kernels` CLI command costs before it does any work: wall time of a few commands
against a mirror address nobody serves (so each stops at its first request), and how much of
each is `import torch`. Run on the machine in question; prints one table.

    python scripts/probes/probe_cli_startup.py [--runs 3]

Commands that select a build variant (`pull`, `info`, `versions`, ...) import torch to describe
the machine; the ones that only read the cache do not. The import time comes from
`python -X importtime` (the cumulative microseconds of the top-level `torch` entry).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

COMMANDS = [
    ["--help"],
    ["ls"],
    ["pull", "kernels-lab/nope@v1"],
    ["versions", "kernels-lab/activation"],
    ["info", "kernels-lab/training@v1"],
]


def _torch_import_s(stderr: str) -> float | None:
    for line in stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[2].strip() == "torch":
            return int(parts[1]) / 1e6
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "KERNELS_"))}
        env |= {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": f"{tmp}/hf",
                "KERNELS_CACHE": f"{tmp}/cache", "HF_HUB_OFFLINE": "0"}  # fmt: skip
        rows = []
        for cmd in COMMANDS:
            argv = [sys.executable, "-m", "kernels", *cmd]
            walls = []
            for _ in range(args.runs):
                start = time.perf_counter()
                subprocess.run(argv, env=env, capture_output=True, check=False)
                walls.append(time.perf_counter() - start)
            probe = subprocess.run(
                [sys.executable, "-X", "importtime", "-m", "kernels", *cmd],
                env=env, capture_output=True, text=True, check=False,
            )  # fmt: skip
            rows.append((" ".join(cmd), statistics.median(walls), _torch_import_s(probe.stderr)))
    import platform
    from importlib.metadata import version

    print(
        f"python {platform.python_version()}, torch {version('torch')}, "
        f"kernels {version('kernels')}, {os.cpu_count()} CPUs, median of {args.runs} runs"
    )
    print(f"{'kernels ...':<36} {'wall s':>7} {'import torch s':>15}")
    for name, wall, torch_s in rows:
        print(f"{name:<36} {wall:>7.2f} {'-' if torch_s is None else f'{torch_s:.2f}':>15}")


if __name__ == "__main__":
    main()
