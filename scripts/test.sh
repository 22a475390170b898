#!/usr/bin/env bash
# Install (scripts/setup.sh) and run the test suite. tests/gpu runs when .venv's torch has CUDA
# and a GPU is visible (setup.sh keeps a CUDA torch it finds); otherwise those tests skip.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -c 'import torch
cuda = torch.version.cuda and torch.cuda.is_available()
print("test: torch", torch.__version__, "- tests/gpu runs on", torch.cuda.get_device_name(0) if cuda else "nothing (no CUDA): it skips")'
.venv/bin/python -m pytest -q "$@"
