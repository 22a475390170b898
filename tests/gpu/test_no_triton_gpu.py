"""The training kernels on a CUDA GPU without Triton (issue 31): typed errors with the install
hint, never a raw ModuleNotFoundError from inside the kernel tree. The child process hides
Triton as a machine without it looks (``sys.modules["triton"] = None``). Run in its own process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"),
]

TREE = (
    Path(__file__).resolve().parents[2] / "hub_kernels/kernels-lab/training/build/torch-universal"
)

CHILD = r"""
import json, sys
sys.modules["triton"] = None
sys.modules["triton.language"] = None
import torch, kernels
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=128, vocab_size=256, head_dim=16)
out = {}
try:
    kernels.apply_training_kernels(LlamaForCausalLM(config).cuda())
except kernels.MissingDependency as exc:
    out["apply"] = [exc.message, exc.hint]
try:
    kernels.training_kernel_config(config)
except kernels.MissingDependency as exc:
    out["config"] = [exc.message, exc.hint]
training = kernels.get_kernel("kernels-lab/training", version=1)
try:
    training.rms_norm(torch.randn(4, 64, device="cuda"), torch.ones(64, device="cuda"), 1e-6)
except ModuleNotFoundError as exc:
    out["kernel"] = [type(exc).__name__, exc.message, exc.hint]
print(json.dumps(out))
"""


def test_without_triton_a_cuda_model_gets_typed_errors_with_the_install_hint(tmp_path):
    hint = "pip install 'kernels[training]' (or pip install triton)"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["LOCAL_KERNELS"] = f"kernels-lab/training={TREE}"
    out = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    need = "triton is not installed, and the training kernels need it on CUDA"
    assert result["apply"] == [need, hint]
    assert result["config"] == [need, hint]
    assert result["kernel"] == [
        "TritonMissing",
        "triton is not installed (needed for CUDA tensors)",
        hint,
    ]
