"""The training kernels without Triton installed (issue 31): the CPU needs none of it.

The child process hides Triton the way a machine without it looks (``sys.modules["triton"] =
None``: ``import triton`` raises ModuleNotFoundError and ``importlib.util.find_spec`` answers
None), then binds the training kernels to a tiny model and trains it on the torch formulas. A
call that would need Triton (here Triton's interpreter; on a GPU, any CUDA tensor) raises the
kernels' typed TritonMissing (a ModuleNotFoundError) with the install hint; on a GPU,
apply_training_kernels says so before binding (tests/gpu/test_no_triton_gpu.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "hub_kernels" / "kernels-lab" / "training" / "build" / "torch-universal"

CHILD = r"""
import json, os, sys
sys.modules["triton"] = None  # as if not installed
sys.modules["triton.language"] = None
import torch
import kernels
from transformers import Qwen3Config, Qwen3ForCausalLM

def tiny():
    config = Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, vocab_size=256, head_dim=16)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).float()

reference, model = tiny(), tiny()
report = kernels.apply_training_kernels(model)
ids = torch.randint(0, 256, (2, 12))
losses = []
for m in (reference, model):
    m.train()
    out = m(input_ids=ids, labels=ids)
    out.loss.backward()
    losses.append(out.loss.item())
grads = max(
    float((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-12))
    for p, q in zip(model.parameters(), reference.parameters())
)
training = kernels.get_kernel("kernels-lab/training", version=1)
os.environ["TRITON_INTERPRET"] = "1"  # the interpreter needs Triton, as CUDA tensors do
try:
    training.rms_norm(torch.randn(4, 8), torch.ones(8), 1e-6)
    error = None
except ImportError as exc:
    error = {"type": type(exc).__name__, "module_not_found": isinstance(exc, ModuleNotFoundError),
             "message": exc.message, "hint": exc.hint, "str": str(exc)}
print(json.dumps({
    "bound": sum(e.status == "bound" for e in report),
    "losses": losses,
    "grads": grads,
    "triton_imported": sys.modules.get("triton") is not None,
    "error": error,
}))
"""


def test_cpu_training_needs_no_triton_and_a_gpu_call_says_what_to_install(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["LOCAL_KERNELS"] = f"kernels-lab/training={TREE}"
    out = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bound"] >= 10, result  # norms, rotary, MLPs and the head of a 2-layer Qwen3
    plain, ours = result["losses"]
    assert abs(plain - ours) <= 1e-5 * abs(plain), result
    assert result["grads"] < 1e-4, result
    assert not result["triton_imported"]
    assert result["error"] == {
        "type": "TritonMissing",
        "module_not_found": True,
        "message": "triton is not installed (needed for Triton's interpreter (TRITON_INTERPRET=1))",
        "hint": "pip install 'kernels[training]' (or pip install triton)",
        "str": "triton is not installed (needed for Triton's interpreter (TRITON_INTERPRET=1))\n"
        "hint: pip install 'kernels[training]' (or pip install triton)",
    }


def test_op_modules_import_triton_only_through_the_guard():
    """A new op module that imports triton itself would bring back the raw ModuleNotFoundError
    on machines without it: every module but _triton.py goes through `from ._triton import`."""
    direct = re.compile(r"^\s*(import triton\b|from triton\b)", re.M)
    offenders = [
        p.name
        for p in sorted(TREE.glob("*.py"))
        if p.name != "_triton.py" and direct.search(p.read_text())
    ]
    assert offenders == []


def test_the_training_extra_declares_triton():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(req.replace(" ", "").startswith("triton>=") for req in extras["training"])
