#!/usr/bin/env bash
# Create or update .venv with everything the demo and the tests need; print each step.
#
# torch: a Python (PYTHON, else python3) that already has a CUDA torch keeps it: .venv is made
# with --system-site-packages and neither torch nor triton is installed (so tests/gpu runs).
# Anywhere else the CPU build `torch==2.13.0` is installed first, which keeps pip from ever
# pulling a multi-GB CUDA build. KERNELS_TORCH=cpu forces the CPU build.
#
# A second run with nothing changed does nothing: .venv/kernels-setup.stamp holds a digest of
# pyproject.toml, this script, the interpreter and the torch mode; delete it to force a reinstall.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
START=$SECONDS
step() { printf 'setup [%3ss] %s\n' "$((SECONDS - START))" "$*"; }

torch_mode=cpu
# find_spec first: importing a torch costs seconds, and most interpreters have none.
if [ "${KERNELS_TORCH:-auto}" != cpu ] &&
  "$PY" -c 'import importlib.util as u, sys; sys.exit(0 if u.find_spec("torch") else 1)' 2>/dev/null &&
  "$PY" -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
  torch_mode=system
fi
stamp_want=$(
  { cat pyproject.toml scripts/setup.sh; "$PY" -VV; echo "$torch_mode"; } | sha256sum | cut -c1-64
)
stamp=.venv/kernels-setup.stamp
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$stamp_want" ] &&
  .venv/bin/python -c 'import importlib.util as u, kernels, sys
sys.exit(0 if u.find_spec("torch") and u.find_spec("transformers") else 1)' 2>/dev/null; then
  step ".venv is up to date (torch: $torch_mode); nothing to install"
  exit 0
fi

if [ "$torch_mode" = system ] && [ -f .venv/pyvenv.cfg ] &&
  grep -q 'include-system-site-packages = false' .venv/pyvenv.cfg; then
  step "recreating .venv: it was made for the CPU torch, and $PY has a CUDA torch"
  rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
  if [ "$torch_mode" = system ]; then
    step "creating .venv on $("$PY" -V), reusing its CUDA torch (--system-site-packages)"
    "$PY" -m venv --system-site-packages .venv
  else
    step "creating .venv on $("$PY" -V)"
    "$PY" -m venv .venv
  fi
fi
pip() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@"; }
if [ "$torch_mode" = cpu ]; then
  step "installing torch 2.13.0 (CPU build; the largest download)"
  pip "torch==2.13.0"
  triton="triton==3.9.0"
else
  step "keeping $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)') and its triton"
  triton=""
fi
step "installing transformers 5.24.0, ${triton:+$triton, }TRL 1.16, peft 0.21, test tools"
pip "transformers==5.24.0" ${triton:+"$triton"} accelerate numpy ruff "trl==1.16.0" "peft==0.21.2" datasets
step "installing kernels from this checkout (editable, with its test extras)"
# setuptools prints banners (e.g. "Editable installation") on success: show the log on failure only.
log=.venv/kernels-setup-pip.log
if ! pip -e ".[test,sign]" >"$log" 2>&1; then
  cat "$log" >&2
  echo "setup: installing kernels failed (log above)" >&2
  exit 1
fi
echo "$stamp_want" > "$stamp"
step "done: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__, "cuda" if torch.version.cuda else "cpu")')"
