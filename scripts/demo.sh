#!/usr/bin/env bash
# Install (scripts/setup.sh) and run the main job: load this project's kernels from a local mirror.
# The mirror and the cache live in a temporary folder that is removed at the end, even on
# Ctrl-C (`--keep DIR` keeps them in DIR instead).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
scratch=$(mktemp -d "${TMPDIR:-/tmp}/kernels-demo.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
TMPDIR=$scratch .venv/bin/python scripts/demo.py "$@"
