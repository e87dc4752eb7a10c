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
# xgrammar (structured output: json_schema / regex / ebnf). Not a dependency in pyproject.toml:
# its requirements include triton (~1 GB), used only by its CUDA kernel (CUDA builds of torch
# bring their own triton; on the CPU we never load it). So: xgrammar without its requirement
# list, plus exactly what it imports at run time besides torch/transformers/numpy (which we
# have): apache-tvm-ffi (its C++ binding) and pydantic. The pin keeps that list checked.
"$PY" -m pip install -q "apache-tvm-ffi>=0.1.11" "pydantic>=2" "typing-extensions>=4.9"
"$PY" -m pip install -q --no-deps "xgrammar==0.2.8"
