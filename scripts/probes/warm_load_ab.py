"""Warm `get_kernel(version=1)` in a new process: this tree against an older commit, interleaved.

Both trees are imported through a path shim (loader/ as `kernels`, cache/ as `kernels.cache`)
from `git archive` copies, with bytecode written, against one `kernels serve` mirror of this
tree's hub_kernels/; each has its own warm cache. Prints the median and minimum call time
(after `import torch`, including the lazy import of `kernels.api`) and asserts zero requests.
On a shared machine the minimum is the steadier figure: other jobs only ever add time; the load
average before and after is printed so a noisy run can be told from a quiet one.

    python scripts/probes/warm_load_ab.py 55eda33 [--runs 20] [--locked]

With --locked it times `get_locked_kernel` from a kernels.lock (written once by this tree's
`kernels lock`) instead.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE = (
    "import time, torch; import kernels; t = time.perf_counter(); "
    "kernels.get_kernel('kernels-lab/activation', version=1); print(time.perf_counter() - t)"
)
LOCKED_CODE = (
    "import time, torch; import kernels; t = time.perf_counter(); "
    "kernels.get_locked_kernel('kernels-lab/activation', lockfile='project/kernels.lock'); "
    "print(time.perf_counter() - t)"
)
CLI = "import sys; from kernels.cli.main import main; sys.exit(main())"


def tree(rev: str, dest: Path) -> Path:
    """`git archive` of rev under dest, with the import shim; returns the shim folder."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    shim = dest / "_shim"
    shim.mkdir()
    (shim / "kernels").symlink_to(dest / "loader", target_is_directory=True)
    (dest / "loader" / "cache").symlink_to(dest / "cache", target_is_directory=True)
    return shim


def _loadavg() -> str:
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the older commit")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--locked", action="store_true", help="time get_locked_kernel instead")
    args = parser.parse_args()
    code = LOCKED_CODE if args.locked else CODE
    work = Path(tempfile.mkdtemp(prefix="warm-ab-"))
    shims = {args.base: tree(args.base, work / "base"), "HEAD": tree("HEAD", work / "head")}
    sys.path.insert(0, str(shims["HEAD"]))
    from kernels.serve import MirrorServer, build_mirror

    build_mirror(ROOT / "hub_kernels", work / "mirror", trusted_publishers=["kernels-lab"])
    server = MirrorServer(work / "mirror").start()
    envs = {}
    for name, shim in shims.items():
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("KERNELS_", "HF_")) and k != "PYTHONDONTWRITEBYTECODE"
        }
        env.update(
            PYTHONPATH=str(shim),
            HF_ENDPOINT=server.url,
            HF_HOME=str(work / name / "hf"),
            KERNELS_CACHE=str(work / name / "cache"),
            HF_HUB_DISABLE_TELEMETRY="1",
        )
        envs[name] = env
    if args.locked:
        project = work / "project"
        project.mkdir()
        (project / "pyproject.toml").write_text(
            '[tool.kernels.dependencies]\n"kernels-lab/activation" = 1\n'
        )
        lock = [sys.executable, "-c", CLI, "lock", str(project)]
        subprocess.run(lock, env=envs["HEAD"], check=True, cwd=work, capture_output=True)
    for env in envs.values():
        subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=work)  # cold
    times: dict[str, list[float]] = {name: [] for name in envs}
    load_before = _loadavg()
    for _ in range(args.runs):
        for name, env in envs.items():
            before = len(server.requests)
            out = subprocess.run(
                [sys.executable, "-c", code],
                env=env,
                check=True,
                capture_output=True,
                text=True,
                cwd=work,
            )
            assert len(server.requests) == before, f"{name}: a warm load made requests"
            times[name].append(float(out.stdout.strip().splitlines()[-1]))
    server.shutdown()
    print(f"load average before / after: {load_before} / {_loadavg()}")
    for name, values in times.items():
        print(
            f"{name:>10}: median {statistics.median(values) * 1e3:.1f} ms, "
            f"min {min(values) * 1e3:.1f} ms, {len(values)} runs, 0 requests"
        )
    ratio = statistics.median(times["HEAD"]) / statistics.median(times[args.base])
    low = min(times["HEAD"]) / min(times[args.base])
    print(f"HEAD / {args.base}: {ratio:.3f} (medians), {low:.3f} (minimums)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
