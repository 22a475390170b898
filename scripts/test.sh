#!/usr/bin/env bash
# Install (scripts/setup.sh) and run the test suite. tests/gpu runs when .venv's torch has CUDA
# and a GPU is visible (setup.sh keeps a CUDA torch it finds); otherwise those tests skip.
# Everything the tests write to a temporary folder (pytest's tmp_path, TMPDIR) lives in one
# folder that is removed on exit, so nothing is left in /tmp.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
scratch=$(mktemp -d "${TMPDIR:-/tmp}/kernels-test.XXXXXX")
# mktemp makes it 0700; the tests that act as another user (`nobody`) reach their shared folders
# through it, so others may pass through it (not list it).
chmod 0711 "$scratch"
trap 'rm -rf "$scratch"' EXIT
.venv/bin/python -c 'import torch
cuda = torch.version.cuda and torch.cuda.is_available()
print("test: torch", torch.__version__, "- tests/gpu runs on", torch.cuda.get_device_name(0) if cuda else "nothing (no CUDA): it skips")'
# One pytest worker per core, at most four (each holds torch and transformers); a test file stays
# on one worker (--dist loadfile), so module-scoped fixtures (the mirror servers) are made once.
# KERNELS_TEST_WORKERS=0 runs in this process instead.
workers=${KERNELS_TEST_WORKERS:-$(nproc 2>/dev/null || echo 2)}
[ "$workers" -gt 4 ] && workers=4
parallel=()
[ "$workers" -gt 0 ] && parallel=(-n "$workers" --dist loadfile)
TMPDIR=$scratch .venv/bin/python -m pytest -q --basetemp="$scratch/pytest" "${parallel[@]}" "$@"
