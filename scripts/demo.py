"""The main job on the embedded default: load this project's kernels from a local Hub mirror.

1. Build a mirror from hub_kernels/ with `kernels mirror build` (one git repo per kernel, `v1`).
2. Start `kernels serve` on it (127.0.0.1, a free port) and point HF_ENDPOINT at it.
3. Load `kernels-lab/activation` with `get_kernel(version=1)` exactly as a user would from the Hub,
   in a fresh process with an empty cache: print what was resolved and how many requests it took.
4. Load it again in a new process (warm): print its request count (0) and its time.
5. Bind the training kernels' RMSNorm to a tiny Qwen3 model on the CPU and run a training step.

Usage: python scripts/demo.py [--keep DIR]   (DIR keeps the mirror and the cache for inspection;
without it they live in a temporary folder that is removed on exit)
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LOAD = """
import json, time, torch
t0 = time.perf_counter()
import kernels
t1 = time.perf_counter()
kernel = kernels.get_kernel("kernels-lab/activation", version=1)
t2 = time.perf_counter()
record = next(k for k in kernels.get_loaded_kernels() if k.module is kernel)
x = torch.randn(4, 8)
y = kernel.silu_and_mul(x)
ok = torch.allclose(y, torch.nn.functional.silu(x[:, :4]) * x[:, 4:])
t3 = time.perf_counter()
kernels.get_kernel("kernels-lab/activation", version=1)
t4 = time.perf_counter()
print(json.dumps({
    "repo": record.repo_info.repo_id, "commit": record.repo_info.revision,
    "variant": record.variant, "path": str(record.path), "module": kernel.__name__,
    "import_s": t1 - t0, "load_s": t2 - t1, "again_ms": (t4 - t3) * 1e3, "output_ok": ok,
}))
"""

TRAIN = """
import torch, kernels
from transformers import Qwen3Config, Qwen3ForCausalLM
torch.manual_seed(0)
config = Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128, vocab_size=256, head_dim=16)
model = Qwen3ForCausalLM(config)
report = kernels.apply_kernels(model, {"RMSNorm": "kernels-lab/training@v1:RMSNorm"}, mode=kernels.Mode.TRAINING)
print(report)
model.train()
ids = torch.randint(0, 256, (2, 16))
loss = model(input_ids=ids, labels=ids).loss
loss.backward()
print(f"training step on the CPU: loss {loss.item():.4f}, grad norm "
      f"{torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item():.4f}")
"""


# The mirror's request log is readable over HTTP only with this token (KERNELS_SERVE_TOKEN).
LOG_TOKEN = secrets.token_hex(16)


def requests_made(url: str) -> list:
    token = {"X-Mirror-Token": LOG_TOKEN}
    with urllib.request.urlopen(
        urllib.request.Request(f"{url}/_mirror/requests", headers=token)
    ) as response:
        data = json.loads(response.read())
    reset = urllib.request.Request(f"{url}/_mirror/requests/reset", method="POST", headers=token)
    urllib.request.urlopen(reset).read()
    return [r for r in data["requests"] if "agent-harnesses" not in str(r)]


def _interrupted(returncode: int) -> bool:
    """A child that Ctrl-C stopped (it shares the terminal's process group): the demo stops too,
    with its one line, not the child's traceback."""
    return returncode in (-signal.SIGINT, 128 + signal.SIGINT)


def run(code: str, env: dict) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True
    )
    if _interrupted(out.returncode):
        raise KeyboardInterrupt
    if out.returncode != 0:
        sys.stderr.write(out.stderr)
        raise SystemExit(f"demo step failed (exit {out.returncode})")
    return out.stdout


def main() -> int:
    # each line as it is made, also into a pipe: a reader (a CI log, a test) sees the progress
    sys.stdout.reconfigure(line_buffering=True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", help="keep the mirror and cache in this folder")
    args = parser.parse_args()
    if args.keep:
        work = Path(args.keep)
        work.mkdir(parents=True, exist_ok=True)
        return demo(work)
    with tempfile.TemporaryDirectory(prefix="kernels-demo-") as tmp:
        return demo(Path(tmp))


def kernels_cli(*args: str) -> str:
    """Run the `kernels` command line as a user would (`python -m kernels` is the same)."""
    out = subprocess.run([sys.executable, "-m", "kernels", *args], capture_output=True, text=True)
    if _interrupted(out.returncode):
        raise KeyboardInterrupt
    if out.returncode != 0:
        sys.stderr.write(out.stderr)
        raise SystemExit(f"kernels {' '.join(args)} failed (exit {out.returncode})")
    return out.stdout


def demo(work: Path) -> int:
    mirror = work / "mirror"
    print(f"$ kernels mirror build hub_kernels {mirror} --trust kernels-lab")
    build = ("mirror", "build", str(ROOT / "hub_kernels"), str(mirror), "--trust", "kernels-lab")
    print(textwrap.indent(kernels_cli(*build), "  "))

    server = subprocess.Popen(
        [sys.executable, "-m", "kernels", "serve", str(mirror), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "KERNELS_SERVE_TOKEN": LOG_TOKEN},
        # Its own session: Ctrl-C stops the demo, whose `finally` stops the server, rather than
        # the server vanishing under a request the demo is making.
        start_new_session=True,
    )
    try:
        line = server.stdout.readline().strip()  # "serving DIR on http://127.0.0.1:PORT"
        url = line.rsplit(" ", 1)[-1]
        print(line)
        env = dict(os.environ)
        env.update(
            HF_ENDPOINT=url,
            HF_HUB_DISABLE_TELEMETRY="1",
            KERNELS_CACHE=str(work / "cache"),
            HF_HOME=str(work / "hf-home"),
        )
        env.pop("HF_HUB_OFFLINE", None)
        requests_made(url)

        cold = json.loads(run(LOAD, env))
        cold_requests = requests_made(url)
        print("\ncold load: get_kernel('kernels-lab/activation', version=1), empty cache")
        print(
            f"  repo     {cold['repo']}\n  commit   {cold['commit']}\n  variant  {cold['variant']}"
        )
        print(f"  cache    {cold['path']}\n  module   {cold['module']}")
        print(
            f"  requests {len(cold_requests)}, load {cold['load_s'] * 1e3:.1f} ms, output correct: {cold['output_ok']}"
        )

        warm = json.loads(run(LOAD, env))
        warm_requests = requests_made(url)
        print("\nwarm load: the same call in a new process")
        print(
            f"  requests {len(warm_requests)}, load {warm['load_s'] * 1e3:.1f} ms, "
            f"`import kernels` {warm['import_s'] * 1e3:.1f} ms"
        )
        print(f"  same call again in that process: {warm['again_ms']:.3f} ms")

        print("\nbind: the training kernels' RMSNorm on a tiny Qwen3 (CPU), one training step")
        t = time.perf_counter()
        print(textwrap.indent(run(TRAIN, env).rstrip(), "  "))
        print(f"  ({time.perf_counter() - t:.1f} s including torch and transformers imports)")
        train_requests = requests_made(url)
        print(f"  requests {len(train_requests)} (first load of kernels-lab/training)")
        if warm_requests:
            print("FAIL: the warm load made requests:", warm_requests)
            return 1
        return 0
    finally:
        server.terminate()
        server.wait(timeout=10)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C: the `finally` above stopped the server; one line, no stack
        print("\ndemo: interrupted", file=sys.stderr)
        sys.exit(130)
