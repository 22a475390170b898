"""pytest plugin for scripts/liger_tests.py: Liger's tests call this package's kernels.

Loaded with ``-p liger_tests_plugin`` before the test files are imported; it replaces these
names in the installed liger_kernel's modules (the tests import them from there):

| Liger's name (module) | replaced by |
|---|---|
| `LigerRopeFunction` (ops), `liger_rotary_pos_emb` (transformers.rope) | `apply_rotary_pos_emb`; a 2-D cos/sin table ([T, D], Liger's vision form) is one batch row |
| `LigerSiLUMulFunction` (ops) | `silu_mul`; Liger's multipliers as silu(a * g) * b * d around it |
| `LigerGELUMulFunction` (ops) | `gelu_mul(a, b, "tanh")` |
| `LigerLayerNormFunction` (ops) | `layer_norm` |
| `LigerSwiGLUMLP`, `LigerGEGLUMLP`, `LigerPhi3SwiGLUMLP` (transformers.swiglu / .geglu) | transformers' LlamaMLP / Phi3MLP with our `SwiGLUMLP` / `GeGLUMLP` / `FusedSwiGLUMLP` forward bound, as kernelize binds them |
| `LigerExperts` (transformers.swiglu) | transformers' MixtralExperts with our `MoEExperts` forward |
| `LigerLayerNorm` (transformers.layer_norm) | Liger's module (its init) with `layer_norm` as forward |

Liger's test_rope passes `device=` to transformers' `LlamaRotaryEmbedding`, which transformers 5
no longer takes: the reference class gets that argument back (nothing else changes).

Liger's functional wrappers (`liger_rope`, `liger_swiglu`, `liger_geglu`, `liger_layer_norm`)
stay Liger's: the tests compare them with the Function classes, so those tests check ours
against Liger. Names not listed (Mixtral's legacy block-sparse MLP, Falcon-H1's and Gemma 4's
MLP classes) stay Liger's; their tests run Liger's code, and tests.jsonl says so per test.

Per test it records the outcome, the call's duration, which of our entry points ran, and the
Triton kernels compiled meanwhile (a first call's compile and tuning land in its test); per
entry point and argument signature, the first call's wall time (synchronised).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

OUT = Path(os.environ.get("LIGER_TESTS_OUT", "."))
_current: dict = {"ours": set(), "compiles": 0}
_first_calls: dict[tuple, float] = {}
_records: list[dict] = []


def _signature(args) -> tuple:
    return tuple(
        (tuple(a.shape), str(a.dtype).replace("torch.", ""))
        if isinstance(a, torch.Tensor)
        else type(a).__name__
        for a in args
    )


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def recorded(name: str, fn):
    """fn, noting each call in the running test and timing its first call per signature."""

    def call(*args, **kwargs):
        _current["ours"].add(name)
        key = (name, _signature(args))
        if key in _first_calls:
            return fn(*args, **kwargs)
        _sync()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        _sync()
        _first_calls[key] = time.perf_counter() - start
        return out

    return call


def _count_compile(*_args, **_kwargs):
    _current["compiles"] += 1


def substitutes(kt) -> dict[str, dict[str, object]]:
    """{liger module: {name: replacement}}."""
    from transformers.models.llama.modeling_llama import LlamaMLP
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    from transformers.models.phi3.modeling_phi3 import Phi3MLP

    layers = kt.layers
    moe = sys.modules[kt.__name__ + ".moe"]

    def rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        if cos.dim() == 2:  # Liger's vision table [T, D]: one row for every batch entry
            cos, sin = cos[None], sin[None]
        return kt.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)

    def silu_mul(a, b, gate_multiplier=1.0, down_multiplier=1.0):
        a = a if gate_multiplier == 1.0 else a * gate_multiplier
        out = kt.silu_mul(a, b)
        return out if down_multiplier == 1.0 else out * down_multiplier

    def function(name, fn):
        return type(name, (), {"apply": staticmethod(recorded(name, fn))})

    def module(name, base, forward):
        bound = recorded(name, lambda self, *a: forward(self, *a))
        return type(name, (base,), {"forward": lambda self, *a: bound(self, *a)})

    import liger_kernel.transformers.layer_norm as liger_ln

    def ln_forward(self, x):
        return kt.layer_norm(x, self.weight, self.bias, self.variance_epsilon)

    return {
        "liger_kernel.ops": {
            "LigerRopeFunction": function("LigerRopeFunction", rope),
            "LigerSiLUMulFunction": function("LigerSiLUMulFunction", silu_mul),
            "LigerGELUMulFunction": function(
                "LigerGELUMulFunction", lambda a, b: kt.gelu_mul(a, b, "tanh")
            ),
            "LigerLayerNormFunction": function("LigerLayerNormFunction", kt.layer_norm),
        },
        "liger_kernel.transformers.rope": {
            "liger_rotary_pos_emb": recorded("liger_rotary_pos_emb", rope),
        },
        "liger_kernel.transformers.swiglu": {
            "LigerSwiGLUMLP": module("LigerSwiGLUMLP", LlamaMLP, layers.SwiGLUMLP.forward),
            "LigerPhi3SwiGLUMLP": module(
                "LigerPhi3SwiGLUMLP", Phi3MLP, layers.FusedSwiGLUMLP.forward
            ),
            "LigerExperts": module("LigerExperts", MixtralExperts, moe.MoEExperts.forward),
        },
        "liger_kernel.transformers.geglu": {
            "LigerGEGLUMLP": module("LigerGEGLUMLP", LlamaMLP, layers.GeGLUMLP.forward),
        },
        "liger_kernel.transformers.layer_norm": {
            "LigerLayerNorm": module("LigerLayerNorm", liger_ln.LigerLayerNorm, ln_forward),
        },
    }


def _rotary_reference_takes_device() -> None:
    """Liger's test_rope builds its reference as `LlamaRotaryEmbedding(config=..., device=...)`;
    transformers 5 dropped `device` (the forward moves inv_freq to the input's device). Give the
    reference that argument back, unchanged otherwise, so the test file runs as Liger wrote it."""
    import inspect

    from transformers.models.llama import modeling_llama

    base = modeling_llama.LlamaRotaryEmbedding
    if "device" in inspect.signature(base.__init__).parameters:
        return

    class LlamaRotaryEmbedding(base):
        def __init__(self, config, device=None):
            super().__init__(config)
            if device is not None:
                self.to(device)

    modeling_llama.LlamaRotaryEmbedding = LlamaRotaryEmbedding


def pytest_configure(config):
    import importlib

    from bench_harness import load_training_kernels

    _rotary_reference_takes_device()

    kt = load_training_kernels()
    for module_name, names in substitutes(kt).items():
        module = importlib.import_module(module_name)
        for name, value in names.items():
            setattr(module, name, value)
    try:  # Triton 3.4+: a hook after each compile (the count is informative only)
        import triton

        triton.knobs.runtime.jit_post_compile_hook = _count_compile
    except (ImportError, AttributeError):
        pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current["ours"], _current["compiles"] = set(), 0
    yield


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _records.append({
            "test": report.nodeid,
            "outcome": report.outcome,
            "seconds": round(report.duration, 3),
            "ours": sorted(_current["ours"]),
            "triton_compiles": _current["compiles"],
        })  # fmt: skip


def pytest_sessionfinish(session, exitstatus):
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "tests.jsonl", "w") as fh:
        for record in _records:
            fh.write(json.dumps(record) + "\n")
    counts: dict[str, int] = {}
    for r in _records:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    liger_only = [r["test"] for r in _records if not r["ours"] and r["outcome"] != "skipped"]
    slowest = sorted(_records, key=lambda r: -r["seconds"])[:15]
    firsts = sorted(_first_calls.items(), key=lambda kv: -kv[1])[:25]
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    lines = [
        f"# Liger's tests against this package's kernels ({gpu}, torch {torch.__version__})",
        "",
        ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + f" (pytest exit {exitstatus})",
        "",
        f"Slowest test: {slowest[0]['seconds']:.1f} s" if slowest else "No test ran.",
        f"Slowest first call of one of our entry points: {firsts[0][1]:.2f} s" if firsts else "",
        "",
        "## Slowest tests (call phase, compile and tuning of first calls included)",
        "",
        "| test | outcome | s | Triton compiles | our entry points |",
        "|---|---|---|---|---|",
        *(
            f"| {r['test']} | {r['outcome']} | {r['seconds']:.2f} | {r['triton_compiles']} | "
            f"{', '.join(r['ours'])} |"
            for r in slowest
        ),  # fmt: skip
        "",
        "## Slowest first calls (entry point, argument shapes and dtypes)",
        "",
        "| entry point | arguments | s |",
        "|---|---|---|",
        *(f"| {name} | {sig} | {s:.2f} |" for (name, sig), s in firsts),
        "",
        f"## Tests that ran none of our entry points ({len(liger_only)}): Liger's own code",
        "",
        *(f"- {t}" for t in liger_only),
    ]
    (OUT / "summary.md").write_text("\n".join(lines) + "\n")
