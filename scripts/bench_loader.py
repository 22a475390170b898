"""Loader benchmark: this package vs the reference `kernels` 0.17.2, against the same local Hub.

Both run against one `kernels serve` mirror built from hub_kernels/ (kernels-lab/activation,
branch v1), each from its own virtualenv, each scenario in fresh processes and fresh caches.
Requests are counted at the server. Prints one table; `--out FILE` also writes it as markdown
with the date, machine and versions.

    python scripts/bench_loader.py --ours .venv/bin/python --reference .venv-ref/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPO = "kernels-lab/activation"
# Children run outside the checkout: the repo root holds this project's editable-install
# metadata, which the reference's interpreter would otherwise report as its own version.
CWD = tempfile.gettempdir()
WARM_RUNS = 9

LOAD = """
import json, sys, time
import torch
t0 = time.perf_counter()
import kernels
t1 = time.perf_counter()
try:
    k = kernels.get_kernel(%(repo)r, version=1)
    t2 = time.perf_counter()
    ok = bool((k.silu_and_mul(torch.ones(2, 4)) > 0).all())
    again = []
    for _ in range(%(again)d):
        a = time.perf_counter(); kernels.get_kernel(%(repo)r, version=1); again.append(time.perf_counter() - a)
    print(json.dumps({"ok": ok, "import_s": t1 - t0, "load_s": t2 - t1, "again_s": again,
                      "file": getattr(k, "__file__", ""), "value": float(k.silu_and_mul(torch.full((1, 2), 2.0)).sum())}))
except Exception as exc:
    print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:150]}",
                      "load_s": time.perf_counter() - t1}))
"""


class Server:
    def __init__(self, python: str, mirror: Path):
        # The request log is readable over HTTP only with this token.
        self.token = {"X-Mirror-Token": secrets.token_hex(16)}
        self.python, self.mirror = python, mirror
        self.url = self._start("0")

    def _start(self, port: str) -> str:
        self.proc = subprocess.Popen(
            [self.python, "-m", "kernels.cli.main", "serve", str(self.mirror), "--port", port],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "KERNELS_SERVE_TOKEN": self.token["X-Mirror-Token"]},
        )
        return self.proc.stdout.readline().strip().rsplit(" ", 1)[-1]

    def restart(self) -> None:
        """Serve again at the same URL (after `stop`): the Hub came back."""
        self._start(self.url.rsplit(":", 1)[-1])

    def take_requests(self) -> list:
        log = urllib.request.Request(f"{self.url}/_mirror/requests", headers=self.token)
        with urllib.request.urlopen(log) as r:
            data = json.loads(r.read())
        urllib.request.urlopen(
            urllib.request.Request(
                f"{self.url}/_mirror/requests/reset", method="POST", headers=self.token
            )
        ).read()
        return [x for x in data["requests"] if "agent-harnesses" not in str(x)]

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=10)


def env_for(work: Path, url: str, **extra) -> dict:
    # PYTHONDONTWRITEBYTECODE (set in some sandboxes) would make this project's freshly
    # installed modules recompile in every process, while pip precompiled the reference's.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KERNELS_", "HF_")) and k != "PYTHONDONTWRITEBYTECODE"
    }
    env.update(
        HF_ENDPOINT=url,
        HF_HOME=str(work / "hf-home"),
        KERNELS_CACHE=str(work / "cache"),
        # Telemetry stays on: with HF_HUB_DISABLE_TELEMETRY=1 the reference sends a user agent
        # ending in "; ", which huggingface_hub 2.x's HTTP client refuses, so it cannot make any
        # request at all. Its once-a-day telemetry GET goes to HF_ENDPOINT and is not counted.
        NO_PROXY="127.0.0.1,localhost",
    )
    env.update(extra)
    return env


def load(python: str, env: dict, again: int = 0) -> dict:
    code = LOAD % {"repo": REPO, "again": again}
    out = subprocess.run(
        [python, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=CWD,
    )
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"ok": False, "error": (out.stderr.strip().splitlines() or ["?"])[-1][:150]}


def timed(cmd: list[str], env: dict, n: int = 5) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(cmd, env=env, capture_output=True, check=False, cwd=CWD)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def import_time(python: str, env: dict, n: int = 7) -> float:
    code = "import time; t = time.perf_counter(); import kernels; print(time.perf_counter() - t)"
    values = []
    for _ in range(n):
        out = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, cwd=CWD)
        values.append(float(out.stdout.strip()))
    return statistics.median(values)


def tamper(work: Path) -> bool:
    """Change the bytes of the cached __init__.py (whatever layout the cache uses)."""
    for root in (work / "cache", work / "hf-home"):
        for path in root.rglob("__init__.py"):
            real = path.resolve()
            if "activation" not in str(path) and "trees" not in str(path):
                continue
            os.chmod(real, 0o644)
            text = real.read_text()
            real.write_text(
                text.replace(
                    "return torch.nn.functional.silu(a) * b",
                    "return 100 * torch.nn.functional.silu(a) * b",
                    1,
                )
            )
            return True
    return False


def measure(name: str, python: str, mirror: Path, base: Path) -> dict:
    server = Server(sys.executable, mirror)  # the same server for both: this project's mirror
    row: dict = {"impl": name}
    try:
        work = base / name
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        env = env_for(work, server.url)
        row["import_s"] = import_time(python, env)
        kernels_cli = str(Path(python).parent / "kernels")
        row["help_s"] = timed([kernels_cli, "--help"], env)
        server.take_requests()
        cold = load(python, env)
        row["cold_s"], row["cold_req"], row["cold_ok"] = (
            cold.get("load_s"),
            len(server.take_requests()),
            cold.get("ok"),
        )
        # Warm: the median of WARM_RUNS new processes (one sample swings with the machine's
        # load by more than the differences this row is read for); requests are per load.
        warms = [load(python, env) for _ in range(WARM_RUNS)]
        row["warm_ok"] = all(w.get("ok") for w in warms)
        row["warm_req"] = len(server.take_requests()) / WARM_RUNS
        row["warm_s"] = statistics.median(w.get("load_s") or 0 for w in warms)
        row["warm_total_s"] = statistics.median(
            (w.get("import_s") or 0) + (w.get("load_s") or 0) for w in warms
        )
        row["cold_total_s"] = (cold.get("import_s") or 0) + (cold.get("load_s") or 0)
        repeat = load(python, env, again=5)
        row["again_ms"] = statistics.median(repeat.get("again_s") or [float("nan")]) * 1e3
        row["again_req_per_call"] = (
            (len(server.take_requests()) - row["warm_req"]) / 5 if repeat.get("ok") else None
        )
        # offline after an online version=1 load
        off = load(python, env_for(work, server.url, HF_HUB_OFFLINE="1"))
        row["offline"] = "works" if off.get("ok") else f"fails: {off.get('error', '')[:70]}"
        # Hub unreachable, kernel cached
        # The same endpoint goes away (records are kept per endpoint, so another URL would be
        # another Hub with nothing cached for it).
        server.stop()
        down = load(python, env_for(work, server.url, KERNELS_RESOLVE_TTL="0"))
        server.restart()
        row["down"] = (
            f"works ({down['load_s']:.2f} s)"
            if down.get("ok")
            else f"fails after {down.get('load_s', 0):.1f} s: {down.get('error', '')[:60]}"
        )
        # tampered cached file
        if tamper(work):
            t = load(python, env)
            if not t.get("ok"):
                row["tamper"] = f"error: {t.get('error', '')[:60]}"
            elif t.get("value", 0) > 50:
                row["tamper"] = "imported silently"
            else:
                row["tamper"] = "refetched, clean bytes imported"
        server.take_requests()
        # 8 processes cold, one shared fresh cache
        work8 = base / f"{name}-8"
        shutil.rmtree(work8, ignore_errors=True)
        work8.mkdir()
        env8 = env_for(work8, server.url)
        code = LOAD % {"repo": REPO, "again": 0}
        procs = [
            subprocess.Popen(
                [python, "-c", textwrap.dedent(code)],
                env=env8,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=CWD,
            )
            for _ in range(8)
        ]
        oks = 0
        for p in procs:
            out, _ = p.communicate(timeout=300)
            try:
                oks += bool(json.loads(out.decode().strip().splitlines()[-1]).get("ok"))
            except (ValueError, IndexError):
                pass
        reqs = server.take_requests()
        gets = [r for r in reqs if r[0] == "GET" and "/resolve/" in r[1]]  # (method, path)
        row["eight_req"], row["eight_ok"], row["eight_file_gets"] = len(reqs), oks, len(gets)
    finally:
        server.stop()
    return row


def version_of(python: str, module: str) -> str:
    code = f"import importlib.metadata as m; print(m.version('{module}'))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=CWD)
    return out.stdout.strip() or "?"


def table(rows: list[dict]) -> str:
    ours, ref = (
        next(r for r in rows if r["impl"] == n) for n in ("this project", "reference 0.17.2")
    )

    def s(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    lines = [
        "| measure | reference kernels 0.17.2 | this project | target |",
        "|---|---|---|---|",
        f"| `import kernels` | {s(ref['import_s'], '.3f')} s | {s(ours['import_s'], '.3f')} s | ≤ 0.08 s |",
        f"| `kernels --help` | {s(ref['help_s'], '.3f')} s | {s(ours['help_s'], '.3f')} s | ≤ 0.2 s |",
        f"| cold `get_kernel(version=1)`, new process: call / import + call / requests | {s(ref['cold_s'], '.3f')} s / {s(ref['cold_total_s'], '.3f')} s / {ref['cold_req']} | {s(ours['cold_s'], '.3f')} s / {s(ours['cold_total_s'], '.3f')} s / {ours['cold_req']} | |",
        f"| warm `get_kernel(version=1)`, new process (median of {WARM_RUNS}): call / import + call / requests per load | {s(ref['warm_s'], '.3f')} s / {s(ref['warm_total_s'], '.3f')} s / {s(ref['warm_req'], '.0f')} | {s(ours['warm_s'], '.3f')} s / {s(ours['warm_total_s'], '.3f')} s / {s(ours['warm_req'], '.0f')} | 0 requests |",
        f"| same call again in the same process: time / requests per call | {s(ref['again_ms'], '.2f')} ms / {s(ref['again_req_per_call'], '.0f')} | {s(ours['again_ms'], '.3f')} ms / {s(ours['again_req_per_call'], '.0f')} | < 1 ms, 0 |",
        f"| 8 processes cold-start the same kernel: requests (file GETs), processes ok | {ref['eight_req']} ({ref['eight_file_gets']}), {ref['eight_ok']}/8 | {ours['eight_req']} ({ours['eight_file_gets']}), {ours['eight_ok']}/8 | independent of the process count; each file once |",
        f"| offline (`HF_HUB_OFFLINE=1`) after an online `version=1` load | {ref['offline']} | {ours['offline']} | works |",
        f"| Hub unreachable, kernel cached | {ref['down']} | {ours['down']} | loads from cache, one notice |",
        f"| tampered cached file | {ref.get('tamper', 'n/a')} | {ours.get('tamper', 'n/a')} | never imported |",
    ]
    return "\n".join(lines)


def _loadavg() -> str:
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ours", default=str(ROOT / ".venv/bin/python"))
    parser.add_argument("--reference", default=str(ROOT / ".venv-ref/bin/python"))
    parser.add_argument("--out", help="write the table as markdown here")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-loader-"))
    load_before = _loadavg()
    from kernels.serve import build_mirror

    mirror = base / "mirror"
    build_mirror(ROOT / "hub_kernels", mirror, trusted_publishers=["kernels-lab"])
    rows = [
        measure("reference 0.17.2", args.reference, mirror, base),
        measure("this project", args.ours, mirror, base),
    ]
    text = table(rows)
    header = (
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.node() and 'this CI-class machine'} "
        f"({os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}), CPU only. "
        f"Versions: reference kernels {version_of(args.reference, 'kernels')} with huggingface_hub "
        f"{version_of(args.reference, 'huggingface_hub')}; this project kernels {version_of(args.ours, 'kernels')} "
        f"with huggingface_hub {version_of(args.ours, 'huggingface_hub')}; torch "
        f"{version_of(args.ours, 'torch')}. Server: `kernels serve` on 127.0.0.1 over hub_kernels/; "
        "requests counted at the server (telemetry excluded). Times are wall time of the call after "
        f"`import torch`; `import kernels`, `--help` and the warm load are medians of 7, 5 and "
        f"{WARM_RUNS} runs. Load average (1 min) at the start / end: {load_before} / "
        f"{_loadavg()} (other jobs on the machine add to every time)."
    )
    print(header + "\n\n" + text)
    if args.out:
        Path(args.out).write_text(
            "# Loader benchmark\n\n"
            "Command: `python scripts/bench_loader.py --out docs/benchmarks/loader.md` "
            "(reference venv: `python -m venv .venv-ref && .venv-ref/bin/pip install torch==2.13.0 kernels==0.17.2`).\n\n"
            + header
            + "\n\n"
            + text
            + "\n"
        )
    shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
