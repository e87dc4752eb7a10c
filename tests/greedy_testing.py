"""Shared by the scheduler and speculative decoding tests: each request's greedy output alone (the
reference), outputs compared with it (near-ties allowed to diverge), a workload run in two waves
(the second hits the first's prefixes), and the sampling rows of a few plain requests (for the
acceptance rules)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, List, Tuple

from radixserve.sampling.sampling_batch_info import SamplingBatchInfo
from radixserve.sampling_params import SamplingParams

NEAR_TIE = 1e-4


def reference_alone(prompts, params, **engine_kw) -> List[Dict]:
    """Each request run alone on a fresh Engine, with its top-2 logprobs to tell near-ties."""
    from radixserve.engine import Engine

    engine = Engine(**{"max_total_tokens": 16384, **engine_kw})
    out = [engine.generate(input_ids=[p], sampling_params=[sp], return_logprob=True, top_logprobs_num=2, progress=False)[0]
           for p, sp in zip(prompts, params)]
    engine.shutdown()
    return out


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


def with_repeats(prompts: List[List[int]], params: List[Dict]) -> Tuple[List[List[int]], List[Dict]]:
    """The workload followed by every other request of it again (the second wave's cache hits)."""
    return prompts + [list(p) for p in prompts[::2]], params + [dict(sp) for sp in params[::2]]


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
