"""Builders for small kernel repos used as test fixtures (files for GitRepoWriter.commit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap


def metadata(name: str = "relu", *, version: int = 1, backend: str = "universal", **extra) -> str:
    data = {
        "name": name,
        "id": f"_{name.replace('-', '_')}_{backend}",
        "version": version,
        "license": "Apache-2.0",
        "backend": {"type": backend},
        "python-depends": [],
    }
    data.update(extra)
    return json.dumps(data)


def kernel_files(
    *,
    name: str = "relu",
    variant: str = "torch-universal",
    value: int = 1,
    version: int = 1,
    backend: str = "universal",
    extra: dict | None = None,
) -> dict[str, str | bytes]:
    """A variant whose module has `VALUE = value`, `relu(x)`, and a `layers.ReLU` layer."""
    base = f"build/{variant}"
    files: dict[str, str | bytes] = {
        f"{base}/metadata.json": metadata(name, version=version, backend=backend),
        f"{base}/__init__.py": textwrap.dedent(
            f"""\
            from . import layers
            from ._impl import relu

            VALUE = {value}
            VARIANT = {variant!r}
            """
        ),
        f"{base}/_impl.py": "def relu(x):\n    return x.clamp(min=0) if hasattr(x, 'clamp') else max(x, 0)\n",
        f"{base}/layers.py": textwrap.dedent(
            """\
            import torch


            class ReLU(torch.nn.Module):
                has_backward = True

                def forward(self, x):
                    return torch.relu(x)
            """
        ),
        "README.md": f"# {name}\n",
    }
    files.update(extra or {})
    return files


def run_python(
    code: str, *, env: dict | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter with this process's environment (plus `env`)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )
