"""tests/gpu runs only where Triton compiles for the GPU, never under the CPU interpreter.

tests/kernels/conftest.py switches Triton to its CPU interpreter (``TRITON_INTERPRET=1``) when
pytest collects that folder. In a run that collects both folders (the whole suite) that happens
after this folder's modules were imported, so a module-level ``skipif`` read at import never sees
it, and the GPU tests would then run their kernels through the interpreter (on the CPU, for hours
at these shapes, proving nothing about the compiled path). So the decision is taken here, once the
whole collection is done: with the interpreter on, every test of this folder is skipped with a
reason that says what to do. Run this folder in its own process: ``python -m pytest tests/gpu``.
tests/kernels/test_package.py checks this in a subprocess that collects both folders.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
INTERPRETER_REASON = (
    "TRITON_INTERPRET is on in this process (tests/kernels switches it on): "
    "run tests/gpu in its own pytest process"
)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not interpreting():
        return
    # A skipif on the item itself is evaluated before the modules' "needs a CUDA GPU" skipif.
    mark = pytest.mark.skipif(True, reason=INTERPRETER_REASON)
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(mark)
