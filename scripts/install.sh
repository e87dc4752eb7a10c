#!/usr/bin/env bash
# Installs radixserve and its test tools into the current Python environment.
# torch: keep whatever build is installed (CPU or CUDA); where none is, take the CPU wheel
# of torch 2.13.0 (a bare "torch" requirement would download a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[test]"
