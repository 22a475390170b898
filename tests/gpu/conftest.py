"""tests/gpu runs only on a CUDA GPU, where Triton compiles for it, never under its interpreter.

Two things keep it from running, and each is decided once the whole collection is done:

- no CUDA GPU in this process (a CPU machine, or a CPU build of torch);
- Triton's CPU interpreter switched on: tests/kernels/conftest.py sets ``TRITON_INTERPRET=1``
  when pytest collects that folder, which in a run that collects both folders (the whole suite)
  happens after this folder's modules were imported, so a module-level ``skipif`` read at import
  never sees it. The GPU tests would then run their kernels through the interpreter (on the
  CPU, for hours at these shapes, proving nothing about the compiled path).

Then every test of the folder is skipped with that one plain reason, and one line at the end of
the run says so for the folder (pytest's summary lists skips only with `-rs`), instead of a line
per test. Run on a GPU in its own process: ``python -m pytest tests/gpu``.
tests/kernels/test_package.py checks the interpreter case and tests/test_suite_hygiene.py the
CPU case, each in a subprocess.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
INTERPRETER_REASON = "TRITON_INTERPRET is on in this process (tests/kernels switched it on)"
NO_CUDA_REASON = "no CUDA GPU in this process"
_not_run: list[tuple[int, str]] = []  # (count, reason) of this session


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _reason() -> str | None:
    """Why the GPU tests cannot run in this process, or None when they can."""
    if interpreting():
        return INTERPRETER_REASON
    import torch

    return None if torch.cuda.is_available() else NO_CUDA_REASON


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [item for item in items if HERE in Path(str(item.path)).resolve().parents]
    reason = _reason() if ours else None
    if reason is None:
        return
    # A skipif on the item itself is evaluated before the modules' own "no CUDA" skipifs.
    mark = pytest.mark.skipif(True, reason=reason)
    for item in ours:
        item.add_marker(mark)
    _not_run.append((len(ours), reason))


def pytest_terminal_summary(terminalreporter) -> None:
    for count, reason in _not_run:
        tests = "test" if count == 1 else "tests"
        terminalreporter.write_line(f"tests/gpu: {count} {tests} skipped: {reason}")
