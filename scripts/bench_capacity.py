"""How much fits on one GPU: the largest batch (at seq 2048) and the longest sequence (batch 1)
that train one step without running out of memory, per setup, measured in one run.

Same model, setups and loading as scripts/bench_train.py (eager, torch.compile, Liger, this
project via KernelConfig from a `kernels serve` mirror). Each setup runs in its own process: the
optimizer state is created by a small first step, then each probe is one full training step
(forward, backward, AdamW) at the probed shape. A size grows by doubling until a step runs out of
memory, then the gap is halved `--bisect` times; the table shows the largest size that trained
and the smallest that did not. torch.compile runs with dynamic=True here, so that each probe does
not compile the model again.

Usage (GPU): python scripts/bench_capacity.py --out DIR [--setups eager,liger,ours,compile]
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_train  # noqa: E402

# Where each search starts (a size every setup trains at), per mode.
START = {"batch": 8, "seq": 16384}


def _search(fits, start: int, step: int, bisect: int, limit: int) -> dict:
    """Double from `start` until `fits` fails, then halve the gap `bisect` times (multiples of
    `step`). Returns the largest size that fitted and the smallest that did not."""
    ok, bad, probes = None, None, []
    size = start
    while size <= limit:
        fitted = fits(size)
        probes.append([size, fitted])
        if not fitted:
            bad = size
            break
        ok, size = size, size * 2
    if ok is None:  # even the start failed: halve down
        size = start // 2
        while size >= step and ok is None:
            fitted = fits(size)
            probes.append([size, fitted])
            ok, bad = (size, bad) if fitted else (None, size)
            size //= 2
    for _ in range(bisect):
        if ok is None or bad is None:
            break
        mid = (ok + bad) // 2 // step * step
        if mid in (ok, bad):
            break
        fitted = fits(mid)
        probes.append([mid, fitted])
        ok, bad = (mid, bad) if fitted else (ok, mid)
    return {"fits": ok, "oom": bad, "probes": probes}


def child(args) -> dict:
    import torch

    model, _, _ = bench_train.load_for_training(args.child, args.model_dir, "cuda")
    step_model = torch.compile(model, dynamic=True) if args.child == "compile" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    vocab = model.config.vocab_size
    peaks: dict[str, float] = {}

    def train_step(batch: int, seq: int) -> bool:
        ids = None
        try:
            torch.cuda.reset_peak_memory_stats()
            ids = torch.randint(0, vocab, (batch, seq), device="cuda")
            loss = step_model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            opt.zero_grad(set_to_none=True)
            loss = ids = None
            gc.collect()
            torch.cuda.synchronize()
            peaks[f"{batch}x{seq}"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.empty_cache()

    t0 = time.perf_counter()
    assert train_step(1, 256), "a 1x256 step must fit"  # creates the AdamW state
    out = {"setup": args.child}
    out["batch"] = _search(lambda b: train_step(b, 2048), START["batch"], 1, args.bisect, 4096)
    out["seq"] = _search(lambda s: train_step(1, s), START["seq"], 1024, args.bisect, 1 << 21)
    out["peaks_gib"] = peaks
    out["seconds"] = time.perf_counter() - t0
    return out


def _cell(r: dict) -> str:
    if r["fits"] is None:
        return "nothing fits"
    return f"{r['fits']:,}" + (f" (OOM at {r['oom']:,})" if r["oom"] else " (search limit)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child")
    p.add_argument("--model-dir")
    p.add_argument("--setups", default="eager,liger,ours,compile")
    p.add_argument("--bisect", type=int, default=3, help="halvings of the gap after doubling")
    p.add_argument("--timeout", type=int, default=170, help="seconds per setup")
    p.add_argument("--out", help="folder for capacity.json and capacity.md")
    args = p.parse_args()
    if args.child:
        bench_train.emit_result(child(args))
        return 0
    work = Path(tempfile.mkdtemp(prefix="bench-capacity-"))
    bench_train.save_model(work / "model", tiny=False)
    server, env = bench_train.start_mirror(work)
    rows = []
    try:
        for setup in args.setups.split(","):
            cmd = [sys.executable, __file__, "--child", setup, "--model-dir", str(work / "model"),
                   "--bisect", str(args.bisect)]  # fmt: skip
            try:
                proc = subprocess.run(
                    cmd, env=env, capture_output=True, text=True, timeout=args.timeout
                )
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                err = (proc.stderr.strip().splitlines() or ["?"])[-1][:200]
            except subprocess.TimeoutExpired:
                line, err = None, f"no result within {args.timeout} s"
            rows.append(json.loads(line[7:]) if line else {"setup": setup, "error": err})
            print(f"{setup}: {rows[-1]}", flush=True)
            if args.out:  # after each setup, so that a run cut short keeps what it measured
                Path(args.out).mkdir(parents=True, exist_ok=True)
                (Path(args.out) / "capacity.json").write_text(json.dumps(rows, indent=1))
    finally:
        server.terminate()
    import torch

    lines = [
        f"{time.strftime('%Y-%m-%d')}, {torch.cuda.get_device_name()}, torch {torch.__version__}. "
        "Qwen3-0.6B shape, bf16, sdpa, AdamW(fused); one full training step per probe.",
        "",
        "| setup | largest batch at seq 2048 | longest sequence at batch 1 (tokens) |",
        "|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['setup']} | error: {r['error']} | |")
        else:
            lines.append(f"| {r['setup']} | {_cell(r['batch'])} | {_cell(r['seq'])} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "capacity.json").write_text(json.dumps(rows, indent=1))
        (out / "capacity.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
