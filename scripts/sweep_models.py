"""Sweep every causal-LM model type transformers registers through the training kernels.

For each type in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: build a tiny random model, train a plain
copy and a copy after ``kernels.apply_training_kernels(model)`` 3 AdamW steps on the same
batches, and compare losses and gradient norms (fp32: 1e-4 relative, bf16: 2e-2). The kernels
come from a ``kernels serve`` mirror of hub_kernels/ on loopback. Writes the table to
docs/models.md (``--out``).

The types run in ``--jobs`` worker processes (one device shared), each handed the next type when
it reports the last, so one slow type does not hold a shard back. A type past ``--limit-s`` is a
row with that reason: the worker's own alarm stops it, and if the worker does not answer within
a grace period after that (stuck in native code) the parent takes its stack, kills it, writes the
row and starts a fresh worker. ``--deadline`` bounds the whole run: types not started in time
are rows saying so. Progress lines carry timestamps; the table names the commit.

    python scripts/sweep_models.py                                  # CPU, fp32
    python scripts/sweep_models.py --device cuda --dtype bf16 --out docs/models-h200.md --jobs 8
    python scripts/sweep_models.py --only llama,gemma2,phi3         # a few types
    python scripts/sweep_models.py --liger    # Liger's types: their rows, and docs/models-liger.md
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import queue
import signal
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.models.liger_patches import KINDS, LIGER_PATCHES, LIGER_VERSION  # noqa: E402

# Model types Liger patches (MODEL_TYPE_TO_APPLY_LIGER_FN) that transformers 5.24 ships as
# causal LMs: each must bind at least what Liger patches (norms, rotary, MLP/experts, loss).
LIGER_TYPES = frozenset(LIGER_PATCHES)
NORMS = {"RMSNorm", "GemmaRMSNorm", "RMSNormFloatWeight", "WeightlessRMSNorm", "LayerNorm"}
HEADS = {"ForCausalLM", "MoEForCausalLM", "CausalLMHead"}


def start_mirror() -> None:
    """Serve hub_kernels/ on loopback and point huggingface_hub and the cache at it."""
    from kernels.serve import MirrorServer, build_mirror

    work = Path(tempfile.mkdtemp(prefix="sweep-models-"))
    build_mirror(ROOT / "hub_kernels", work / "mirror", trusted_publishers=["kernels-lab"])
    server = MirrorServer(work / "mirror").start()
    os.environ.update(
        HF_ENDPOINT=server.url,
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HOME=str(work / "hf"),
        KERNELS_CACHE=str(work / "cache"),
        NO_PROXY="127.0.0.1,localhost",
    )


def _alarm(signum, frame):  # noqa: ARG001
    raise TimeoutError("over the per-type time limit")


# What a worker runs per type: the causal LM (this script) or the image-text model with images
# (scripts/sweep_vlm.py); `kind` may also name a "module:function" of the same signature.
RUNNERS = {"causal": "tests.models.registry:run_one", "vlm": "tests.models.vlm_registry:run_vlm"}


def run_type(model_type: str, device: str, dtype, limit_s: int, kind: str = "causal"):
    """One type's outcome, stopped by SIGALRM after `limit_s` (while Python code runs; 0: no
    alarm)."""
    import importlib

    from tests.models.registry import Outcome

    module, name = RUNNERS.get(kind, kind).split(":")
    run = getattr(importlib.import_module(module), name)
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(limit_s)
    try:
        return run(model_type, device=device, dtype=dtype)
    except TimeoutError:
        return Outcome(model_type, "skipped", reason=f"took over {limit_s} s here")
    finally:
        signal.alarm(0)


OUTCOME, READY, RETIRE = "OUTCOME ", "READY", "RETIRE"


def _device_broken(device: str) -> bool:
    """Whether this process's accelerator context is dead (a device-side assert is sticky:
    every later call fails, so the types after it would be charged with it)."""
    import torch

    if not device.startswith("cuda"):
        return False
    try:
        torch.cuda.synchronize()
        torch.ones(1, device=device).add_(1).item()
    except Exception:  # noqa: BLE001 - any failure here means the context is gone
        return True
    return False


def worker(device: str, dtype_name: str, limit_s: int, kind: str = "causal") -> int:
    """A sweep worker: reads model types from stdin, one a line, and answers each with an
    OUTCOME line (JSON) on stdout. The mirror comes from the parent's environment."""
    import bench_supervise

    bench_supervise.Watchdog("worker", period_s=0)  # SIGUSR1 dumps the stack before a kill
    warnings.filterwarnings("ignore")
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    dtype = torch.float32 if dtype_name == "fp32" else torch.bfloat16
    torch.empty(1, device=device)  # a device that refuses this process fails here, not per type
    print(READY, flush=True)
    for line in sys.stdin:
        model_type = line.strip()
        if not model_type:
            continue
        outcome = run_type(model_type, device, dtype, limit_s, kind)
        broken = _device_broken(device)
        if broken:  # said before the outcome, so the parent never hands this worker another
            print(RETIRE, flush=True)
        print(OUTCOME + json.dumps(dataclasses.asdict(outcome)), flush=True)
        if broken:
            return 0
    return 0


def outcome_line(outcome, done: int, total: int) -> str:
    return (
        f"[{done}/{total}] {outcome.model_type:28s} {outcome.status:8s} "
        f"loss {outcome.loss_diff:.1e} grad {outcome.grad_diff:.1e}  {outcome.seconds:5.1f}s  "
        f"{outcome.reason}"
    )


class _Terminated(Exception):
    """SIGTERM from an outer `timeout`: stop handing out types, write what was measured."""


def sweep(
    types: list[str],
    device: str,
    dtype_name: str,
    limit_s: int,
    jobs: int = 1,
    deadline_s: float | None = None,
    grace_s: float = 30.0,
    startup_s: float = 180.0,
    kind: str = "causal",
    on_outcome=None,
) -> list:
    """Every type's Outcome, in the order of `types`, from `jobs` worker processes.

    A type whose worker neither answers within `limit_s` + `grace_s` nor dies is a "skipped"
    row saying so and where the worker was stuck; a worker that dies is an "error" row with
    its last line; either way a fresh worker takes the next type. With `deadline_s`, types not
    started before it (less a margin) are "skipped" rows saying so. `kind` picks the runner
    (RUNNERS); `on_outcome(outcome)` is called as each type's row comes in (under a lock)."""
    from bench_supervise import Child, log, where_stuck

    from tests.models.registry import Outcome

    start = time.monotonic()
    pending = list(enumerate(types))
    results: dict[int, Outcome] = {}
    lock = threading.Lock()
    stop = threading.Event()
    active: set = set()  # the live workers, killed on SIGTERM
    failed_starts: list[str] = []  # why a worker slot gave up
    # the workers share the host's cores: each gets its part for torch's intra-op threads
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))
    cmd = [sys.executable, __file__, "--worker", "--device", device, "--dtype", dtype_name,
           "--limit-s", str(limit_s), "--kind", kind]  # fmt: skip

    def left() -> float:
        return float("inf") if deadline_s is None else deadline_s - (time.monotonic() - start)

    def record(index: int, outcome, worker_no: int) -> None:
        with lock:
            results[index] = outcome
            done = len(results)
            if on_outcome is not None:
                on_outcome(outcome)
        log(f"w{worker_no} " + outcome_line(outcome, done, len(types)))

    def drive(worker_no: int) -> None:
        child, answers = None, None
        while not stop.is_set():
            with lock:
                if not pending or left() < 15:
                    break
                index, model_type = pending.pop(0)
            if child is None:
                answers = queue.Queue()  # a killed worker's late lines cannot reach this one
                child = Child(cmd, env, on_stdout=answers.put, stdin=True)
                active.add(child)
                ready = _await(answers, child, min(startup_s, left()), lambda x: x == READY)
                if ready is None:  # this worker slot is out (the device refused a process?)
                    child.kill(dump_wait_s=0)
                    active.discard(child)
                    why = _last_line(child) or "no READY line"
                    with lock:
                        pending.insert(0, (index, model_type))  # the other workers take it
                        failed_starts.append(why)
                    log(f"w{worker_no} did not start: {why}")
                    return
            child.send(model_type)
            hard = min(limit_s + grace_s, max(left() - 5, 1))
            line = _await(answers, child, hard, lambda x: x.startswith(OUTCOME) or x == RETIRE)
            retire = line == RETIRE
            if retire:
                line = _await(answers, child, 30, lambda x: x.startswith(OUTCOME))
            if line is not None:
                outcome = Outcome(**json.loads(line[len(OUTCOME) :]))
                if retire:  # its device context is dead: a fresh worker takes the next type
                    if child.wait(30) is None:
                        child.kill(dump_wait_s=0)
                    active.discard(child)
                    child = None
            elif child.proc.poll() is not None:
                code = child.wait(5)
                outcome = Outcome(model_type, "error", reason=(
                    f"the worker exited ({code}) on this type: {_last_line(child)}"[:300]))  # fmt: skip
                child = None
            else:
                stack = child.kill()
                outcome = Outcome(model_type, "skipped", reason=(
                    f"killed after {hard:.0f} s (over the per-type limit of {limit_s} s), "
                    + where_stuck(stack, child)))  # fmt: skip
                child = None
            record(index, outcome, worker_no)
        if child is not None:
            child.proc.stdin.close()
            if child.wait(30) is None:
                child.kill(dump_wait_s=0)

    def on_sigterm(signum, frame):  # noqa: ARG001
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    threads = [threading.Thread(target=drive, args=(n,), daemon=True) for n in range(jobs)]
    log(f"sweeping {len(types)} model types with {jobs} worker(s), {limit_s} s per type")
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(1.0)
    except _Terminated:
        log("terminated (SIGTERM): writing what was measured")
        stop.set()
        for child in list(active):
            child.kill(dump_wait_s=0)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if stop.is_set():
        why = "terminated"
    elif failed_starts and left() > 0:
        why = f"no sweep worker left to run it ({len(failed_starts)} did not start: "
        why += f"{failed_starts[-1]})"
    else:
        why = f"--deadline of {deadline_s} s ran out"
    with lock:
        for index, model_type in enumerate(types):
            results.setdefault(index, Outcome(model_type, "skipped", reason=f"not run: {why}"))
        outcomes = [results[i] for i in range(len(types))]
    seconds = sorted(o.seconds for o in outcomes if o.seconds)
    if seconds:
        slowest = max(outcomes, key=lambda o: o.seconds)
        log(f"{len(types)} types in {time.monotonic() - start:.0f} s with {jobs} worker(s); "
            f"per type: median {seconds[len(seconds) // 2]:.1f} s, "
            f"p90 {seconds[int(len(seconds) * 0.9)]:.1f} s, total {sum(seconds):.0f} s, "
            f"slowest {slowest.model_type} {slowest.seconds:.1f} s")  # fmt: skip
    return outcomes


def _await(answers, child, timeout: float, accept) -> str | None:
    """The first line from `answers` that `accept`s within `timeout` seconds; None on the
    timeout or when the child exited first."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            line = answers.get(timeout=min(1.0, max(end - time.monotonic(), 0.01)))
        except queue.Empty:
            if child.proc.poll() is not None and answers.empty():
                return None
            continue
        if accept(line):
            return line
    return None


def _last_line(child) -> str:
    """The child's last stderr line that is not part of a faulthandler dump."""
    lines = [
        x.strip()
        for x in child.tail
        if x.strip() and not x.startswith(("  File ", "Thread 0x", "Current thread 0x"))
    ]
    return lines[-1][:200] if lines else ""


def read_table(path: Path) -> list:
    """The outcomes of an earlier run's table (for --update)."""
    from tests.models.registry import Outcome

    outcomes = []
    for line in path.read_text().splitlines():
        cells = [c.strip().replace("\\|", "|") for c in line.strip().strip("|").split(" | ")]
        if len(cells) != 6 or cells[0] in ("model type", "---|---|---|---|---|---"):
            continue
        model_type, status, bound, unbound, loss, grad = cells
        if status not in ("match", "mismatch", "skipped", "error"):
            continue
        outcome = Outcome(
            model_type,
            status,
            [b for b in bound.split(", ") if b],
            [],
            float(loss) if loss else float("nan"),
            float(grad) if grad else float("nan"),
        )
        if status in ("skipped", "error"):
            outcome.reason = unbound
        else:
            outcome.unbound = [u for u in unbound.split("; ") if u]
        outcomes.append(outcome)
    return outcomes


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def match_criterion(dtype_name: str) -> str:
    """What `match` means in a table of this sweep (fp32, or bf16 against float64)."""
    from tests.models.bf16_verdict import FACTOR

    if dtype_name == "fp32":
        return "`match`: every step's loss and gradient norm agree within 1e-4 relative."
    return (
        "`match`: in every step, the kernelized model's loss and whole gradient are no "
        f"further from float64 than {FACTOR}x the plain bf16 model's are, or within one bf16 "
        "rounding (2^-8); float64 is the plain model cast to float64 and loaded with each bf16 "
        "model's weights of that step (tests/models/bf16_verdict.py: two bf16 models can be "
        "further apart than either is from float64); a step where float64 makes other top-k "
        "picks (MoE routing) is left out and counted. The diff columns are plain vs ours; where "
        "they exceed 2e-2 the reason gives both distances to float64."
    )


def table(outcomes: list, device: str, dtype_name: str, commit: str = "") -> str:
    import torch
    import transformers

    built = [o for o in outcomes if o.status != "skipped"]
    good = [
        o for o in built if o.status == "match" and NORMS & set(o.bound) and HEADS & set(o.bound)
    ]
    liger = [o for o in outcomes if o.model_type in LIGER_TYPES]
    liger_built = [o for o in liger if o.status != "skipped"]
    liger_good = [o for o in liger_built if o.status == "match"]
    pct = 100.0 * len(good) / max(len(built), 1)
    criterion = match_criterion(dtype_name)
    lines = [
        "# Training kernels across transformers' causal LMs",
        "",
        f"Generated by `python scripts/sweep_models.py` on {datetime.date.today()} "
        f"({platform.machine()}, {device}, {dtype_name}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}"
        + (f"; commit {commit}" if commit else "")
        + ").",
        "",
        "Each model type in `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` is built as a tiny random model "
        "(hidden 64, 2 layers, 4 heads, vocab 256, 4 experts), then trained 3 AdamW steps as it "
        "is and after `kernels.apply_training_kernels(model)` (one line, no family table). "
        f"{criterion} Unbound modules keep their own forward; the reason is the one "
        "`kernels.last_report(model)` gives.",
        "",
        f"- {len(outcomes)} model types; {len(built)} build and train here; "
        f"{len(good)} of those ({pct:.0f} %) bind their norms and their loss head and match.",
        f"- Liger {LIGER_VERSION}'s causal-LM types: {len(liger_good)} of {len(liger_built)} that build here match "
        f"({', '.join(sorted(o.model_type for o in liger_built if o.status != 'match')) or 'no exceptions'}); "
        "what each binds next to what Liger patches: [models-liger.md](models-liger.md).",
        "",
        "| model type | status | bound | not bound (why) | loss rel diff | grad-norm rel diff |",
        "|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        bound = ", ".join(o.bound)
        unbound = "; ".join(o.unbound) if o.status != "skipped" else ""
        if o.reason:
            unbound = f"{unbound}; {o.reason}" if unbound else o.reason
        loss = "" if o.loss_diff != o.loss_diff else f"{o.loss_diff:.1e}"
        grad = "" if o.grad_diff != o.grad_diff else f"{o.grad_diff:.1e}"
        lines.append(
            f"| {o.model_type} | {o.status} | {_cell(bound)} | {_cell(unbound)} | {loss} | {grad} |"
        )
    return "\n".join(lines) + "\n"


def liger_table(outcomes: list) -> str:
    """docs/models-liger.md: per Liger model type, what Liger patches by default, what the
    training kernels bind on the same classes, and what Liger patches that they leave alone."""
    import transformers

    rows, gaps = [], 0
    for o in sorted(outcomes, key=lambda o: o.model_type):
        patches = LIGER_PATCHES.get(o.model_type)
        if patches is None:
            continue
        liger, ours, missing = [], [], []
        for kind in KINDS:
            for name in patches[kind]:
                liger.append(f"{kind}: {name}")
                if o.status == "skipped":
                    continue
                if name in o.classes:
                    ours.append(f"{name} → {o.classes[name]}")
                elif name in o.unbound_classes:
                    missing.append(f"{name}: {o.unbound_classes[name]}")
                else:
                    ours.append(f"{name}: not in this model")
        liger_names = {n for kind in KINDS for n in patches[kind]}
        beyond = sorted(f"{n} → {layer}" for n, layer in o.classes.items() if n not in liger_names)
        gaps += bool(missing) or o.status != "match"
        gap = "; ".join(missing) or ("none" if o.status == "match" else o.reason or o.status)
        if patches["note"]:
            liger.append(f"({patches['note']})")
        cells = [o.model_type, o.status, "; ".join(liger), "; ".join(ours), gap, "; ".join(beyond)]
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return (
        "\n".join(
            [
                f"# Training kernels vs Liger {LIGER_VERSION}, per model type",
                "",
                f"Generated by `python scripts/sweep_models.py --liger` on {datetime.date.today()} "
                f"(transformers {transformers.__version__}). One row per causal-LM model type that "
                f"Liger {LIGER_VERSION} patches (`MODEL_TYPE_TO_APPLY_LIGER_FN`) and transformers ships. "
                "*Liger patches*: the classes and functions its `apply_liger_kernel_to_*` replaces "
                "with its defaults (tests/models/liger_patches.py, checked against Liger's source "
                "by tests/models/test_liger_parity.py). *We bind*: the training-kernel layer that "
                "`kernels.apply_training_kernels(model)` binds to each of them in the tiny model of "
                "docs/models.md (`sweep`: that model's 3-step comparison). *Gap*: what Liger patches "
                "that stays unbound, with the report's reason. *Beyond Liger*: what we bind that "
                "Liger leaves alone.",
                "",
                f"- {len(rows)} model types; {len(rows) - gaps} bind everything Liger patches and match.",
                "",
                "| model type | sweep | Liger patches | we bind | gap | beyond Liger |",
                "|---|---|---|---|---|---|",
                *rows,
            ]
        )
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--only", default="", help="comma-separated model types")
    parser.add_argument("--out", default=str(ROOT / "docs" / "models.md"))
    parser.add_argument(
        "--limit-s",
        type=int,
        default=180,
        help="seconds per model type (0: no alarm in the worker, only the kill after --grace-s)",
    )
    parser.add_argument(
        "--grace-s",
        type=float,
        default=30.0,
        help="seconds past --limit-s before a worker that has not answered is killed",
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="worker processes (they share one device)"
    )
    parser.add_argument(
        "--deadline",
        type=float,
        help="seconds for the whole sweep; types not started in time are rows saying so",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    # a RUNNERS key, or "module:function" (tests/gpu/test_sweep_gpu.py's runner)
    parser.add_argument("--kind", default="causal", help=argparse.SUPPRESS)
    parser.add_argument(
        "--update", action="store_true", help="replace only the rows of the types run in --out"
    )
    parser.add_argument(
        "--liger",
        action="store_true",
        help="run Liger's model types, update their rows in --out, write --liger-out",
    )
    parser.add_argument("--liger-out", default=str(ROOT / "docs" / "models-liger.md"))
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.device, args.dtype, args.limit_s, args.kind)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    if args.liger:
        args.only, args.update = ",".join(sorted(LIGER_TYPES)), True

    from bench_supervise import git_commit, log

    commit = git_commit(ROOT)
    log(f"sweep at commit {commit}: {args.device}, {args.dtype}")
    warnings.filterwarnings("ignore")
    start_mirror()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = [t for t in args.only.split(",") if t] or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    outcomes = sweep(
        types, args.device, args.dtype, args.limit_s, args.jobs, args.deadline, args.grace_s
    )
    if args.liger:
        Path(args.liger_out).write_text(liger_table(outcomes))
        print(f"wrote {args.liger_out}")
    if args.update:
        fresh = {o.model_type: o for o in outcomes}
        outcomes = [fresh.pop(o.model_type, o) for o in read_table(Path(args.out))]
        outcomes += fresh.values()
    Path(args.out).write_text(table(outcomes, args.device, args.dtype, commit))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
