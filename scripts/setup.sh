#!/usr/bin/env bash
# Create .venv (if missing) with everything the demo and the tests need, CPU only.
# torch is pinned to the CPU build that lies on these machines (`pip install torch==2.13.0`);
# installing it first keeps pip from ever pulling a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test,sign]" "transformers==5.24.0" "triton==3.9.0" accelerate numpy ruff
