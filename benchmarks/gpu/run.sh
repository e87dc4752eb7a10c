#!/usr/bin/env bash
# Issue 8's GPU measurements, one model per call of the device tool (each fits in its 10 minutes):
#
#   bash benchmarks/gpu/run.sh qwen3-0.6b    # logits, one-batch (B = 1 32 128 256), offline (nano-vllm's
#                                            # setup, with transformers in the same run), device idle
#   bash benchmarks/gpu/run.sh llama-3-8b    # logits, one-batch (B = 1 32 128 256)
#
# Runs from the repository root with the machine's own torch/triton/transformers (no install: the
# device machine has no network; the server-only packages fastapi/uvicorn/pyzmq/xgrammar are not
# needed here). Results go to $OUT (the device tool brings them back) or benchmarks/gpu/results.
set -euo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
name="${1:?usage: run.sh qwen3-0.6b|llama-3-8b}"
res="${OUT:-benchmarks/gpu/results}"
mkdir -p "$res"
model="/tmp/$name"
rs() { python3 -m radixserve.cli "$@"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$res/gpu_$name.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$res/gpu_$name.txt"

[ -d "$model" ] || python3 benchmarks/gpu/gpu_checks.py make-model "$name" "$model"
python3 benchmarks/gpu/gpu_checks.py logits "$model" --output "$res/logits_$name.json" || echo "LOGITS CHECK FAILED"
rs bench one-batch --model-path "$model" --attention-backend triton --batch-sizes 1 32 128 256 \
  --input-len 512 --decode-steps 16 --output "$res/one_batch_$name.json"

if [ "$name" = qwen3-0.6b ]; then
  # nano-vllm's bench.py: 256 sequences, input and output lengths uniform in [100, 1024], ignore_eos.
  rs bench offline --model-path "$model" --skip-tokenizer-init --attention-backend triton \
    --num-prompts 256 --min-input-len 100 --max-input-len 1024 --min-output-len 100 --max-output-len 1024 \
    --hf-batch-size 64 --output "$res/offline_nano_vllm_$name.json"
  python3 benchmarks/gpu/gpu_checks.py idle "$model" --output "$res/idle_$name.json"
fi
