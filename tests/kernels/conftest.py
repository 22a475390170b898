"""Fixtures for the CPU correctness tests of the training kernels (hub_kernels/kernels-lab/training).

Triton's interpreter runs the kernels on CPU tensors. It must be switched on before triton is
first imported, so this module sets TRITON_INTERPRET=1 at import time; run tests/gpu in its own
pytest process.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import itertools  # noqa: E402
import zlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.gpu.variant import VARIANT  # noqa: E402, F401
from tests.gpu.variant import load_variant as _load_by_path

_counter = itertools.count()


def _check_interpreter() -> None:
    import triton.language.standard as standard

    if type(standard.sum).__name__ != "InterpretedFunction":
        raise pytest.UsageError(
            "triton was imported before tests/kernels/conftest.py set TRITON_INTERPRET=1; "
            "run tests/kernels in its own pytest process or export TRITON_INTERPRET=1"
        )


def load_variant(name: str | None = None):
    """Import the training kernel variant folder as a fresh package (a unique name each call)."""
    _check_interpreter()
    return _load_by_path(name or f"_kernels_training_test{next(_counter)}")


@pytest.fixture(scope="session")
def kt():
    """The kernel package under test (switch to the project loader here, in one place)."""
    return load_variant()


@pytest.fixture
def torch_path(kt, monkeypatch):
    """The kernels' torch formulas instead of Triton's interpreter for this test: for tests of
    what a layer does around its kernels (caches, masks, hooks, compile, FSDP, labels), whose
    kernels other tests check interpreted. Only for `kt`'s kernels: that package was imported
    with the interpreter on (this fixture asks for it first), so nothing is decorated anew; a
    kernel loaded through the loader during the test would be, so such tests do not use this."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh inputs per test: seeded from the test id, or from KERNEL_TEST_SEED when set."""
    seed = int(os.environ.get("KERNEL_TEST_SEED", zlib.crc32(request.node.nodeid.encode())))
    torch.manual_seed(seed)
    print(f"seed={seed} (rerun with KERNEL_TEST_SEED={seed})")
    return seed


@pytest.fixture
def local_kernels(monkeypatch):
    """apply_training_kernels loads this tree's training kernels (LOCAL_KERNELS), with Dynamo's
    caches emptied before and after (the tests that compile bound models)."""
    monkeypatch.setenv("LOCAL_KERNELS", f"kernels-lab/training={VARIANT}")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def inductor_slot_emptied():
    """Inductor's post-grad custom pass slot empty and Dynamo's caches cleared for the test,
    both restored after it (the tests of the kernels' compile passes)."""
    from torch._inductor import config

    saved = config.post_grad_custom_post_pass
    config.post_grad_custom_post_pass = None
    torch._dynamo.reset()
    yield
    config.post_grad_custom_post_pass = saved
    torch._dynamo.reset()
