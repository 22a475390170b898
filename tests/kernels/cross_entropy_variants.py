"""The cross-entropy kernel variants that the CPU tests run, by name.

Each is a `CEConfig` field set (None: the shipped `default_config`). A test takes one through the
`ce_variant` fixture below, which patches the module's `default_config`, so `cross_entropy`
and `fused_linear_cross_entropy` both run it. Sizes are for the interpreter's small rows
(V 1000 / 1531): several chunks per row, the aligned-read path (neither is a multiple of 16),
tiles of one and of several rows, and every schedule option of the lean kernel.
"""

from __future__ import annotations

import importlib
import os

import pytest

CE_VARIANTS = {
    "default": None,
    # several chunks (and two tile rows per block in fp32), the task queue
    "lean-queue": dict(chunk=512, block=256, num_warps=4, lean=True, queue=True),
    # two blocks of 2-4 tile rows per chunk; programs by id, write right after the reduce
    "lean-queue-pid-lag1-reverse-evict": dict(
        chunk=1024,
        block=512,
        num_warps=4,
        lean=True,
        queue=True,
        ticket=False,
        lag=1,
        reverse=True,
        evict=True,
    ),  # fmt: skip
    # a reduce task and a write task per program
    "lean-queue-pair": dict(chunk=512, block=256, num_warps=4, lean=True, queue=True, pair=True),
    # the whole row in one chunk: no partials, no waiting (the spin schedule's one-chunk case)
    "lean-one-chunk": dict(chunk=2048, block=1024, num_warps=4, lean=True, spin=True),
}


# The default run takes the shipped config and one lean schedule; the other lean schedules (all
# opt-in, none shipped) run with KERNELS_CE_VARIANTS=all or KERNELS_SOAK=1 (they triple the CE and
# FLCE tests' time on a 2-core machine).
ALL_VARIANTS = os.environ.get("KERNELS_CE_VARIANTS") == "all" or os.environ.get(
    "KERNELS_SOAK", ""
).strip() not in ("", "0")
_EVERY_RUN = ("default", "lean-queue")
_opt_in = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not ALL_VARIANTS, reason="opt-in lean CE schedule: set KERNELS_CE_VARIANTS=all"
    ),
]


@pytest.fixture(
    params=[
        name if name in _EVERY_RUN else pytest.param(name, marks=_opt_in) for name in CE_VARIANTS
    ]
)
def ce_variant(request, kt, monkeypatch):
    """Run the test with one CE variant as the default launch config; yields its name."""
    spec = CE_VARIANTS[request.param]
    if spec is not None:
        ce = importlib.import_module(f"{kt.__name__}.cross_entropy")
        cfg = ce.CEConfig(**spec)
        monkeypatch.setattr(ce, "default_config", lambda vocab, device: cfg)
    return request.param
