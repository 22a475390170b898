#!/usr/bin/env bash
# Install (scripts/setup.sh) and run the test suite on the CPU (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q "$@"
