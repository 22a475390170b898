"""Break the code on purpose, one small named break at a time, and show that the tests fail.

Each mutation names a file, an exact piece of its current text, what replaces it, and the narrow
pytest selection that is meant to catch it. The script copies the working tree (tracked and
untracked, not ignored, files) into a scratch directory, checks that ``import kernels`` resolves
there, runs every selection once unbroken (it must pass, or a failure would prove nothing), then
applies each mutation alone, runs its selection and restores the file. It prints one table:
mutation, tests run, caught or SURVIVED, and exits 1 if any mutation survives, 2 if a mutation
no longer applies (its text is not found exactly once) or the baseline fails.

    python scripts/mutation_check.py              # CPU selections (tests/kernels run on
                                                   # Triton's interpreter), a few minutes
    python scripts/mutation_check.py --gpu        # tests/gpu selections, on a CUDA machine
    python scripts/mutation_check.py --list       # the mutations, nothing run
    python scripts/mutation_check.py --only NAME  # one or more by name
    python scripts/mutation_check.py --output docs/benchmarks/mutation-check.md

How the copy imports itself: setuptools maps loader/ -> ``kernels`` and cache/ -> ``kernels.cache``
(package-dir), which an editable install pins to the original tree. The scratch copy gets a
``_shim/kernels`` link to its loader/ (and loader/cache -> cache/), put first on PYTHONPATH; that
wins over the editable finder, which sits after the path finder, in this process's pytest and in
every subprocess the tests start. No bytecode is written, so a restored file is never shadowed by
the mutated one's .pyc.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAINING = "hub_kernels/kernels-lab/training/build/torch-universal"
KT = "tests/kernels"
GPU_KERNELS = "tests/gpu/test_training_kernels_gpu.py"
GPU_LOSSES = "tests/gpu/test_losses_gpu.py"


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One break: `old` (exactly once in `path`) becomes `new`; `cpu`/`gpu` are the pytest
    arguments whose run must fail with it (empty: no selection on that side)."""

    name: str
    stands_for: str
    path: str
    old: str
    new: str
    cpu: tuple[str, ...] = ()
    gpu: tuple[str, ...] = ()


MUTATIONS = [
    Mutation(
        "triton-path-off",
        "issue 20.1: tensors routed to the torch fallback (CPU: the interpreter path off)",
        f"{TRAINING}/_common.py",
        '    return t.is_cuda or (t.device.type == "cpu" and interpreting())\n',
        "    return t.is_cuda\n",
        cpu=(f"{KT}/test_package.py::test_every_op_launches_its_triton_kernels",),
    ),
    Mutation(
        "triton-path-off-cuda",
        "issue 20.1: CUDA tensors routed to the torch fallback",
        f"{TRAINING}/_common.py",
        '    return t.is_cuda or (t.device.type == "cpu" and interpreting())\n',
        '    return t.device.type == "cpu" and interpreting()\n',
        gpu=(GPU_KERNELS, GPU_LOSSES),
    ),
    Mutation(
        "rms-bwd-config-ignored",
        "issue 20.1: a tuned launch config handed to a path that ignores it",
        f"{TRAINING}/rms_norm.py",
        "        programs, rows_per_program = _bwd_programs(m, cfg, self.device)\n",
        "        cfg = bwd_candidates(m, n)[0]\n"
        "        programs, rows_per_program = _bwd_programs(m, cfg, self.device)\n",
        cpu=(f"{KT}/test_rms_norm.py::test_every_backward_candidate",),
        gpu=(f"{GPU_KERNELS}::test_rms_norm_every_candidate",),
    ),
    Mutation(
        "ce-config-ignored",
        "issue 20.1: CE launch configs ignored (test_ce_options_every_launch_shape)",
        f"{TRAINING}/cross_entropy.py",
        "    cfg = config or default_config(vocab, logits.device)\n",
        "    cfg = default_config(vocab, logits.device)\n",
        gpu=(f"{GPU_LOSSES}::test_ce_options_every_launch_shape",),
    ),
    Mutation(
        "tuning-skips-candidates",
        "issue 20.1: a tuned candidate never launched",
        f"{TRAINING}/_common.py",
        "    for cfg in candidates[1:]:  # compile and warm the others",
        "    for cfg in candidates[1:2]:  # compile and warm the others",
        gpu=(f"{GPU_KERNELS}::test_tuning_launches_every_candidate",),
    ),
    Mutation(
        "rms-norm-dw-dropped",
        "issue 20.2: every RMSNorm weight gradient zeroed",
        f"{TRAINING}/rms_norm.py",
        # _backward_any: the one backward both the eager autograd function and the custom op
        # (and the fused add + RMSNorm) go through, Triton or torch path alike.
        "        return backward(dy, x, weight, rstd, gemma, compute_dw, None, from_y, x_dtype, ds, in_place)\n"
        "    return _torch_backward(dy, x, weight, rstd, gemma, compute_dw, from_y, x_dtype, ds, in_place)\n",
        "        dx, dw = backward(dy, x, weight, rstd, gemma, compute_dw, None, from_y, x_dtype, ds, in_place)\n"
        "    else:\n"
        "        dx, dw = _torch_backward(dy, x, weight, rstd, gemma, compute_dw, from_y, x_dtype, ds, in_place)\n"
        "    return dx, torch.zeros_like(dw)\n",
        cpu=("tests/test_training_integration.py", "-k", "liger_style"),
        gpu=(GPU_KERNELS, "-k", "first_step_gradients"),
    ),
    Mutation(
        "rope-bwd-cos-scaled-bt8",
        "issue 20.3: RoPE backward's cos scaled by 1.0004 at 8 tokens per program only",
        f"{TRAINING}/rope.py",
        "            s1, s2 = -s2, -s1\n",
        "            s1, s2 = -s2, -s1\n"
        "            if BLOCK_T == 8:\n"
        "                c1 = c1 * 1.0004\n"
        "                c2 = c2 * 1.0004\n",
        cpu=(f"{KT}/test_rope.py", "-k", "every_launch_candidate"),
        gpu=(f"{GPU_KERNELS}::test_rope_every_candidate",),
    ),
    Mutation(
        "rope-bwd-dk-doubled-bt8",
        "issue 20.3: RoPE's k gradient doubled at 8 tokens per program only",
        f"{TRAINING}/rope.py",
        "        _store_rotated(pko, k1, k2, c1, c2, s1, s2, km, HALF)\n",
        "        if BACKWARD and BLOCK_T == 8:\n"
        "            k1 = k1 * 2.0\n"
        "            k2 = k2 * 2.0\n"
        "        _store_rotated(pko, k1, k2, c1, c2, s1, s2, km, HALF)\n",
        cpu=(f"{KT}/test_rope.py", "-k", "every_launch_candidate"),
        gpu=(f"{GPU_KERNELS}::test_rope_every_candidate",),
    ),
    Mutation(
        "rms-norm-fp16-dx-via-bf16",
        "issue 20.4: RMSNorm's fp16 dx rounded through bf16 in the kernel",
        f"{TRAINING}/rms_norm.py",
        "        tl.store(dx_ptr, dx.to(DX.dtype.element_ty), mask=mask)\n",
        "        if DX.dtype.element_ty == tl.float16:\n"
        "            dx = dx.to(tl.bfloat16).to(tl.float32)\n"
        "        tl.store(dx_ptr, dx.to(DX.dtype.element_ty), mask=mask)\n",
        cpu=(f"{KT}/test_rms_norm.py", "-k", "test_forward_and_grads and float16 and not bfloat16"),
        gpu=(GPU_KERNELS, "-k", "rms_norm_real_shapes and float16 and not bfloat16"),
    ),
    Mutation(
        "norm-output-scaled",
        "issue 20.5: the RMSNorm layer's output scaled by 1.5 (Trainer test)",
        f"{TRAINING}/layers.py",
        "        return rms_norm(hidden_states, self.weight, _eps(self))\n",
        "        return rms_norm(hidden_states, self.weight, _eps(self)) * 1.5\n",
        cpu=("tests/test_training_integration.py::test_trainer_keeps_the_kernels_through_train",),
    ),
    Mutation(
        "flce-dw-doubled",
        "issue 20.5: the fused loss's weight gradient doubled (compiled-model test)",
        f"{TRAINING}/fused_linear_cross_entropy.py",
        # the custom op's backward: what a compiled model runs (issue 30)
        "        dw = _scaled(dw, g_total, dw.dtype) if need_w else None\n",
        "        dw = _scaled(dw, g_total * 2, dw.dtype) if need_w else None\n",
        cpu=(f"{KT}/test_loss_layers.py::test_under_torch_compile",),
    ),
    Mutation(
        "rotary-left-unbound",
        "issue 20.5: a function layer recorded as bound but never run (rotary gradients test)",
        "loader/layers/funcs.py",
        "    owner.__dict__[_BINDINGS] = {**current, type(func): layer}\n"
        "    _set_owner_hooks(owner, True)\n",
        "    owner.__dict__[_BINDINGS] = {**current, type(func): layer}\n",
        cpu=("tests/layers/test_layers_functions.py::test_rotary_kernel_has_gradients",),
    ),
    Mutation(
        "metadata-bool-guard-removed",
        "issue 20.5: metadata.json accepts `true` as an int field (a missing input guard)",
        "loader/metadata.py",
        "            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):\n",
        "            if not isinstance(value, kind):\n",
        cpu=(
            "tests/reliability/test_fuzz.py::test_metadata_json",
            "tests/reliability/test_fuzz.py::test_metadata_version_true_is_refused",
        ),
    ),
    Mutation(
        "gpu-interpreter-guard-removed",
        "issue 20.6: tests/gpu run under the interpreter a whole-suite run switched on",
        "tests/gpu/conftest.py",
        "    if interpreting():\n        return INTERPRETER_REASON\n",
        "",
        cpu=(
            f"{KT}/test_package.py::test_gpu_tests_skip_in_a_run_that_switches_the_interpreter_on",
        ),
    ),
    Mutation(
        "torch-path-outside-tests-kernels-removed",
        "issue 31.4: tests outside tests/kernels run their bound kernels interpreted again",
        "tests/conftest.py",
        '    monkeypatch.setenv("TRITON_INTERPRET", "0")\n',
        "",
        cpu=(
            f"{KT}/test_package.py::test_gpu_tests_skip_in_a_run_that_switches_the_interpreter_on",
        ),
    ),
    Mutation(
        "bundled-digest-unchecked",
        "issue 31.1: a bundled file of the right size but other bytes is installed",
        "loader/bundled.py",
        "        if len(data) != entry.size or hashlib.sha256(data).hexdigest() != entry.sha256:\n",
        "        if len(data) != entry.size:\n",
        cpu=("tests/test_bundled.py", "-k", "refused"),
    ),
    Mutation(
        "bundled-replaces-a-named-version",
        "issue 31.1: version=2 falls back to the bundled v1",
        "loader/training/entry.py",
        "        if repo != TRAINING_REPO or version not in (None, 1):\n",
        "        if repo != TRAINING_REPO:\n",
        cpu=("tests/test_bundled.py", "-k", "named"),
    ),
    Mutation(
        "triton-missing-unchecked",
        "issue 31.2: without Triton, the interpreter or a CUDA tensor reaches a stand-in kernel",
        f"{TRAINING}/_common.py",
        "        if not HAVE_TRITON:\n",
        "        if False:\n",
        cpu=("tests/test_no_triton.py",),
    ),
    Mutation(
        "cache-under-a-file-unsaid",
        "issue 31.5: KERNELS_CACHE under a file reads as a permission problem again",
        "loader/guard.py",
        "    for path in (root, *root.parents):\n",
        "    for path in ():\n",
        cpu=("tests/test_cli_hints.py", "-k", "under_a_file"),
    ),
]


# Skipped when the tree is not a git checkout (e.g. a copy of it on the GPU machine).
NOT_COPIED = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache"}


def tree_files(root: Path) -> list[str]:
    """Tracked and untracked-but-not-ignored files of the working tree (what git would see);
    without git, every file outside NOT_COPIED and *.egg-info folders."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root, check=True, capture_output=True,
        )  # fmt: skip
        listed = [p for p in out.stdout.decode().split("\0") if p and (root / p).is_file()]
        if listed:  # empty when root is an ignored folder inside another repository
            return listed
    except (OSError, subprocess.CalledProcessError):
        pass
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in NOT_COPIED and not d.endswith(".egg-info")]
        files += [str(Path(dirpath, f).relative_to(root)) for f in filenames]
    return files


def make_scratch(root: Path, dest: Path) -> dict[str, str]:
    """Copy the tree into `dest`, link the import shim; returns the environment to run in."""
    for rel in tree_files(root):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)
    shim = dest / "_shim"
    shim.mkdir()
    (shim / "kernels").symlink_to(dest / "loader", target_is_directory=True)
    (dest / "loader" / "cache").symlink_to(dest / "cache", target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    # The caller's own PYTHONPATH (e.g. wheels unpacked on a GPU machine) stays, after the copy.
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(shim), str(dest), *inherited])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    probe = subprocess.run(
        [sys.executable, "-c", "import kernels, kernels.cache; print(kernels.__file__); "
         "print(kernels.cache.__file__)"],
        cwd=dest, env=env, check=True, capture_output=True, text=True,
    )  # fmt: skip
    for line in probe.stdout.split():
        if not Path(line).is_relative_to(dest):
            raise SystemExit(f"the scratch copy imports kernels from {line}, not from {dest}")
    return env


def pytest(args: tuple[str, ...], cwd: Path, env: dict[str, str], timeout: int) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *args]
    try:
        done = subprocess.run(
            cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {timeout} s"
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    summary = lines[-1] if lines else done.stderr.strip()[-200:]
    # The failing test's id (pytest's -ra summary line), without its message.
    failed = [
        line[len("FAILED ") :].split(" - ")[0] for line in lines if line.startswith("FAILED ")
    ]
    return done.returncode, summary + (f"; {failed[0]}" if failed else "")


def apply(dest: Path, m: Mutation) -> str:
    """Write the mutated file; returns the original text. Fails loudly if `old` is stale."""
    path = dest / m.path
    text = path.read_text()
    count = text.count(m.old)
    if count != 1:
        raise SystemExit(
            f"mutation {m.name}: its text is found {count} times in {m.path} (must be once); "
            "update scripts/mutation_check.py to the current code"
        )
    path.write_text(text.replace(m.old, m.new))
    return text


def versions() -> str:
    parts = [f"Python {platform.python_version()}"]
    for name in ("torch", "triton", "transformers"):
        try:
            module = __import__(name)
            parts.append(f"{name} {module.__version__}")
        except ImportError:
            parts.append(f"{name} absent")
    return ", ".join(parts)


def commit(root: Path) -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        head = ""
    if not head:
        return "unknown (not a git checkout)"
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=root, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    return head + (" (with uncommitted changes)" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="run the tests/gpu selections")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these mutations only")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unbroken run")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per pytest run")
    parser.add_argument("--output", type=Path, help="also write the report (markdown) here")
    args = parser.parse_args(argv)

    side = "gpu" if args.gpu else "cpu"
    chosen = [m for m in MUTATIONS if getattr(m, side)]
    if args.only:
        unknown = set(args.only) - {m.name for m in MUTATIONS}
        if unknown:
            parser.error(f"unknown mutations: {', '.join(sorted(unknown))}")
        chosen = [m for m in chosen if m.name in args.only]
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:32} {m.path}\n{'':32} {m.stands_for}")
            print(f"{'':32} cpu: {' '.join(m.cpu) or '-'}\n{'':32} gpu: {' '.join(m.gpu) or '-'}")
        return 0

    header = [
        f"# Mutation check ({side.upper()})",
        "",
        f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- commit: {commit(ROOT)}",
        f"- versions: {versions()}",
        f"- machine: {platform.machine()}, {os.cpu_count()} CPUs",
        f"- command: `python scripts/mutation_check.py{' --gpu' if args.gpu else ''}`",
        "",
    ]
    print("\n".join(header), flush=True)
    with tempfile.TemporaryDirectory(prefix="mutation-check-") as tmp:
        dest = Path(tmp) / "tree"
        env = make_scratch(ROOT, dest)
        if not args.no_baseline:
            # One run of every selection, unbroken: each must pass for its failure to count.
            for selection in dict.fromkeys(getattr(m, side) for m in chosen):
                rc, last = pytest(selection, dest, env, args.timeout)
                if rc != 0:
                    print(f"baseline fails for `{shlex.join(selection)}` ({last}): fix that first")
                    return 2
            print(f"baseline: all {len(chosen)} selections pass unbroken\n", flush=True)
        rows = [
            "| mutation | stands for | file | tests run | result | s |",
            "|---|---|---|---|---|---|",
        ]
        print("\n".join(rows), flush=True)
        survived = []
        for m in chosen:
            original = apply(dest, m)
            start = time.monotonic()
            try:
                rc, last = pytest(getattr(m, side), dest, env, args.timeout)
            finally:
                (dest / m.path).write_text(original)
            # 1: tests failed. Anything else (passed, errors, no tests, timeout) is not a catch.
            caught = rc == 1
            if not caught:
                survived.append(m.name)
            result = f"caught ({last})" if caught else f"**SURVIVED** (exit {rc}: {last})"
            row = (
                f"| {m.name} | {m.stands_for} | {m.path} | `{shlex.join(getattr(m, side))}` | "
                f"{result} | {time.monotonic() - start:.0f} |"
            )
            rows.append(row)
            print(row, flush=True)
    summary = f"\n{len(chosen) - len(survived)} of {len(chosen)} mutations caught" + (
        f"; survived: {', '.join(survived)}" if survived else ""
    )
    print(summary)
    if args.output:
        args.output.write_text("\n".join(header + rows) + "\n" + summary + "\n")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
