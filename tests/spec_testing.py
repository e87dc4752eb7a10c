"""Shared by the speculative decoding tests: greedy outputs compared with speculation off (near-
ties allowed to diverge), a workload run in two waves (the second hits the first's prefixes), and
the sampling rows of a few plain requests (for the acceptance rules)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, List

from radixserve.sampling.sampling_batch_info import SamplingBatchInfo
from radixserve.sampling_params import SamplingParams

NEAR_TIE = 1e-4


def assert_same_greedy(results: List[Dict], reference: List[Dict]) -> None:
    """Equal to the reference (run with top-2 logprobs), except after a position where its top
    two logits are a near-tie."""
    for i, (got, ref) in enumerate(zip(results, reference)):
        a, b = got["output_ids"], ref["output_ids"]
        for k, (x, y) in enumerate(zip(a, b)):
            if x != y:
                top2 = ref["meta_info"]["output_top_logprobs"][k]
                gap = top2[0][0] - top2[1][0]
                assert gap < NEAR_TIE, f"request {i} diverged at token {k} with logit gap {gap}"
                break
        else:
            assert len(a) == len(b), f"request {i}: {len(a)} tokens vs {len(b)}"


def run_in_two_waves(engine, prompts, params, num_base: int, **kw) -> List[Dict]:
    """The first num_base prompts together, then the rest (repeats that find the first wave's
    prompts and outputs in the prefix cache)."""
    out = engine.generate(input_ids=prompts[:num_base], sampling_params=params[:num_base], progress=False, **kw)
    return out + engine.generate(input_ids=prompts[num_base:], sampling_params=params[num_base:], progress=False, **kw)


def sampling_info(n: int, vocab: int, **sp) -> SamplingBatchInfo:
    """The SamplingBatchInfo of n requests with the same sampling params and no output yet."""
    reqs = []
    for _ in range(n):
        params = SamplingParams(**sp)
        params.normalize()
        reqs.append(SimpleNamespace(sampling_params=params, output_ids=[], origin_input_ids=[1], eos_token_ids=set()))
    return SamplingBatchInfo.from_reqs(reqs, vocab)
