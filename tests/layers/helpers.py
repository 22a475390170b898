"""Small kernel repos and tiny models for the layer-binding tests.

`kernel_files()` returns the files of a kernel repo ({repo path: text}) whose `layers` module
holds test layers; `write_repo()` puts them in a folder (a local kernel repo), and
`hub.writer(...).commit(files, branch="v1")` publishes them. Every layer counts its calls in
`layers.CALLS` (a Counter keyed by class name). A `salt` makes the content, and so the imported
module, unique to one test, so counts never leak between tests.
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections import Counter
from pathlib import Path

import torch

LAYERS = '''
import collections

import torch
import torch.nn.functional as F
from torch import nn

CALLS = collections.Counter()


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RMSNorm(nn.Module):
    """Qwen3/Llama RMSNorm through torch's fused rms_norm (a different code path)."""

    has_backward = True

    def forward(self, hidden_states):
        CALLS["RMSNorm"] += 1
        out = F.rms_norm(hidden_states.float(), self.weight.shape, eps=self.variance_epsilon)
        return self.weight * out.to(hidden_states.dtype)


class RMSNormNoBackward(nn.Module):
    has_backward = False

    def forward(self, hidden_states):
        CALLS["RMSNormNoBackward"] += 1
        with torch.no_grad():
            out = F.rms_norm(hidden_states.float(), self.weight.shape, eps=self.variance_epsilon)
        return self.weight * out.to(hidden_states.dtype)


class RMSNormCompile(nn.Module):
    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states):
        CALLS["RMSNormCompile"] += 1
        out = F.rms_norm(hidden_states.float(), self.weight.shape, eps=self.variance_epsilon)
        return self.weight * out.to(hidden_states.dtype)


class Rotary(nn.Module):
    has_backward = True

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        CALLS["Rotary"] += 1
        cos = cos.unsqueeze(unsqueeze_dim)
        sin = sin.unsqueeze(unsqueeze_dim)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class SiLU(nn.Module):
    has_backward = True

    def forward(self, input):
        CALLS["SiLU"] += 1
        return input * torch.sigmoid(input)


class WithInit(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, hidden_states):
        return hidden_states


class WithHelper(nn.Module):
    def helper(self, x):
        return x

    def forward(self, hidden_states):
        return hidden_states


class WrongArity(nn.Module):
    def forward(self, hidden_states, residual):
        return hidden_states + residual


class WrongKind(nn.Module):
    def forward(self, *hidden_states):
        return hidden_states[0]


class TrainingNoBackward(nn.Module):
    has_backward = False

    def forward(self, hidden_states):
        return hidden_states


def not_a_layer(x):
    return x
'''


def metadata(name: str, *, backend: str = "universal", version: int = 1) -> str:
    return json.dumps(
        {
            "name": name,
            "id": f"_{name.replace('-', '_')}_{backend}",
            "version": version,
            "license": "Apache-2.0",
            "backend": {"type": backend},
            "python-depends": [],
        }
    )


def kernel_files(
    name: str = "testlayers",
    *,
    salt: str = "",
    variant: str = "torch-universal",
    backend: str = "universal",
    version: int = 1,
    extra: dict[str, str] | None = None,
    init: str = "from . import layers\n",
) -> dict[str, str]:
    """The files of a kernel repo with the test layers in `build/<variant>/layers.py`."""
    base = f"build/{variant}"
    files = {
        f"{base}/metadata.json": metadata(name, backend=backend, version=version),
        f"{base}/__init__.py": f"# {salt}\n{init}",
        f"{base}/layers.py": LAYERS,
    }
    for path, text in (extra or {}).items():
        files[f"{base}/{path}"] = textwrap.dedent(text)
    return files


def write_repo(root: Path, files: dict[str, str]) -> Path:
    """Write `files` under `root` (a local kernel repo) and return `root`."""
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def calls_of(layer_cls: type) -> Counter:
    """The call counter of the kernel that defines `layer_cls`."""
    return sys.modules[layer_cls.__module__].CALLS


def tiny_qwen3(seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=1000,
        head_dim=16,
    )
    return Qwen3ForCausalLM(config).eval()


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=1000,
        head_dim=16,
    )
    return LlamaForCausalLM(config).eval()


def tokens(seed: int = 1, batch: int = 2, length: int = 8) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (batch, length), generator=generator)


# Counts in a 2-layer tiny Qwen3/Llama: 4 norms per layer + the final norm, one rotary and one
# activation per layer.
NORMS = 9
ROTARIES = 2
ACTIVATIONS = 2
