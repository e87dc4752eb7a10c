#!/usr/bin/env bash
# Issue 37: the GPU checks in one call of the device tool (its 15 minutes in all, 10 a command),
# in order of value, each step cut off where the budget ends:
#
#   kernels  the Triton test modules on CUDA, compiled (RADIXSERVE_TEST_DEVICE=cuda)
#   parity   logits against transformers (float32 reference, bf16 noise floor), Qwen3-0.6B shape
#   mbu      decode step of a Llama-3-8B shape (dummy weights), batch 1 and 8, CUDA graphs on / off
#   serving  `bench serving` at 1 / 16 / 64 concurrent on the Qwen3-0.6B shape
#   paths    the LoRA, speculative (NGRAM, STANDALONE, EAGLE tree) and HiCache engine tests, on CUDA
#
# From the repository root, with the machine's own torch / triton / transformers; the server's
# packages travel as wheels in .whl (made as the device tool's README says: fastapi, starlette, pydantic,
# pydantic-core, annotated-types, typing-inspection, typing-extensions, uvicorn, pyzmq, gguf, xgrammar,
# opentelemetry-api, for Python 3.12):
#   device run: bash benchmarks/gpu/issue37.sh   (carry .whl; STEPS="mbu serving" runs only those)
# Each step's log and JSON go to $RES, packed into $OUT/results.tgz after every step.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-benchmarks/gpu/results}"
RES=/tmp/issue37
mkdir -p "$OUT" "$RES"
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-560} ))

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
rs() { python3 -m radixserve.cli "$@"; }
# pytest-timeout (in the device image) ends a hung test instead of the whole step
python3 -c "import pytest_timeout" 2>/dev/null && export PYTEST_TIMEOUT=90
pack() { tar czf "$OUT/results.tgz" -C "$RES" . ; }

# step NAME SECONDS: run the function NAME under a time limit (at most what is left), log to $RES/NAME.log.
step() {
  local name=$1 secs=$2
  local left=$(( DEADLINE - $(date +%s) - 5 ))
  if (( left < 20 )); then echo "=== $name: SKIPPED (budget spent)" | tee -a "$RES/summary.txt"; return; fi
  (( secs > left )) && secs=$left
  local t0=$(date +%s)
  timeout -k 5 "$secs" bash -c "$name" > "$RES/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $(( $(date +%s) - t0 )) s (limit $secs s)" | tee -a "$RES/summary.txt"
  tail -n 12 "$RES/$name.log"
  pack
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} > "$RES/machine.txt" 2>&1
cat "$RES/machine.txt"

kernels() {
  RADIXSERVE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -rfE \
    tests/unit/test_triton_kernels.py tests/unit/test_fused_kernels.py tests/unit/test_lora_kernels.py \
    tests/unit/test_spec_tree.py tests/unit/test_cuda_graph_runner.py tests/unit/test_triton_gguf.py \
    tests/unit/test_gdn_triton.py tests/unit/test_moe_triton.py
}
parity() {
  python3 benchmarks/gpu/gpu_checks.py make-model qwen3-0.6b /tmp/qwen3-0.6b &&
  python3 benchmarks/gpu/gpu_checks.py logits /tmp/qwen3-0.6b --output "$RES/logits_qwen3-0.6b.json" &&
  python3 benchmarks/gpu/gpu_checks.py logits /tmp/qwen3-0.6b --disable-cuda-graph --output "$RES/logits_qwen3-0.6b_eager.json"
}
mbu() {
  python3 benchmarks/gpu/gpu_checks.py mbu llama-3-8b --batch-sizes 1 8 --output "$RES/mbu_llama-3-8b.json"
}
serving() {
  [ -d /tmp/qwen3-0.6b ] || python3 benchmarks/gpu/gpu_checks.py make-model qwen3-0.6b /tmp/qwen3-0.6b
  rs serve --model-path /tmp/qwen3-0.6b --skip-tokenizer-init --port 30000 --attention-backend triton > "$RES/server.log" 2>&1 &
  local pid=$!
  for _ in $(seq 120); do
    curl -sf localhost:30000/health >/dev/null && break
    kill -0 $pid 2>/dev/null || { echo "server exited:"; tail -20 "$RES/server.log"; return 1; }
    sleep 1
  done
  for c in 1 16 64; do
    rs bench serving --port 30000 --dataset-name random-ids --random-input-len 512 --random-output-len 128 \
      --num-prompts $(( c == 1 ? 8 : 4 * c )) --max-concurrency $c --disable-tqdm --tag "c$c" \
      --output-file "$RES/serving_qwen3-0.6b.jsonl" | grep -E "Successful|throughput|Median (TTFT|TPOT)"
  done
  kill -TERM $pid; wait $pid || true  # 143: it stopped on the SIGTERM
}
paths() {
  # One pytest per file with -v: a run cut off by the time limit still names what failed.
  local f
  for f in test_lora test_hicache_engine test_speculative_eagle test_speculative_standalone test_speculative_ngram; do
    python3 -m pytest -v -p no:cacheprovider -rfE --tb=short -k "not smollm2" "tests/unit/$f.py" 2>&1 |
      grep --line-buffered -E "PASSED|FAILED|ERROR|^E |passed|failed"
  done
}

export RES
export -f rs kernels parity mbu serving paths
declare -A LIMIT=([kernels]=110 [parity]=100 [mbu]=120 [serving]=120 [paths]=170)
for s in ${STEPS:-kernels parity mbu serving paths}; do
  step "$s" "${LIMIT[$s]}"
  pkill -f "radixserve.cli serve" || true  # a server cut off by its time limit would hold GPU memory
done
cat "$RES/summary.txt"
