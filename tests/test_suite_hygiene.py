"""What a plain `pytest` run leaves and says (issue 31): no temp folder left behind, on a
machine without CUDA one line for the GPU tests instead of a skip line each, and Triton's
interpreter only where tests/kernels asks for it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_run_without_cuda_leaves_nothing_and_says_why_once(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTEST_ADDOPTS")}
    env.update(TMPDIR=str(scratch), CUDA_VISIBLE_DEVICES="")  # no GPU, whatever the machine
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        + [f"--basetemp={tmp_path / 'basetemp'}", "tests/gpu/test_losses_gpu.py"]
        + ["tests/test_import_graph.py::test_circles_are_found"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "1 passed" in out.stdout and "skipped" in out.stdout, out.stdout
    gpu = [line for line in out.stdout.splitlines() if line.startswith("tests/gpu:")]
    assert len(gpu) == 1 and gpu[0].endswith(" skipped: no CUDA GPU in this process"), gpu
    assert "SKIPPED" not in out.stdout  # no line per test
    assert sorted(p.name for p in scratch.iterdir()) == []  # no kernels-tests-* folder


def test_kernels_take_their_torch_path_outside_tests_kernels():
    """tests/conftest.py: outside tests/kernels the kernels dispatch to their torch formulas even
    in a run that switched the interpreter on (tests/kernels/test_package.py runs this test in
    such a run), while Triton still decorates for the interpreter."""
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
    triton = sys.modules.get("triton")
    if triton is None:
        return  # nothing imported Triton: nothing to decorate
    import triton.language.standard as standard

    if type(standard.sum).__name__ == "InterpretedFunction":  # imported under the interpreter

        @triton.jit
        def probe(x):
            pass

        assert type(probe).__name__ == "InterpretedFunction"  # a kernel imported now, too


def test_the_gpu_folder_alone_on_a_machine_without_cuda_exits_zero(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTEST_ADDOPTS")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu/test_relu2_gpu.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:]
