"""The overlap loop's one-step lag and the rows (issue 41, the dense half): a request that finishes
while its extra step (seed 001 §2.8.7) is still queued must not give its row away before that
step ran. The step's attention reads the request-to-token row in place; if a new request's
prefill rewrote it first, the extra token's KV is computed over the wrong tokens, and the tree,
which holds that token's KV from the finish on, serves it to every later hit.

The race is forced: each forward is held until the scheduler has scheduled the batch after it
(LateForwards), the worst case of a slow device. With --enable-mixed-chunk (finished requests
leave the running count before the next admission, so their rows can be handed on at once),
short requests on shared prefixes finish in pairs while new ones are admitted; then every
finished conversation is continued, so its hit runs through the extra token. The continuations
must equal a cold run. Without the rows' fence (ForwardFence) 20 forwards found a row of theirs
handed on, and a continuation's greedy token parted from the cold run's (logit gap 0.17)."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Dict, List, Tuple

from radixserve.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from greedy_testing import assert_same_greedy  # noqa: E402
from late_forwards import LateForwards  # noqa: E402

VOCAB_LO = 3  # ids 0-2 are the tiny model's special tokens
ARRIVALS = 2  # requests per step


def _first_turns(engine: Engine, rng: random.Random, steps: int = 24) -> Tuple[List[List[int]], List[Dict]]:
    """ARRIVALS requests a step (one of 3 shared prefixes + their own tokens), 3 output tokens
    each: pairs finish in the same step while the next pair's prefill, mixed with the running
    decodes, is scheduled (mixed chunk drops the finished ones from the running count before
    admitting, so their rows are handed on at once)."""
    systems = [[rng.randrange(VOCAB_LO, 8192) for _ in range(rng.randint(8, 30))] for _ in range(3)]
    prompts, states = [], []
    for _ in range(steps):
        batch = [rng.choice(systems) + [rng.randrange(VOCAB_LO, 8192) for _ in range(rng.randint(1, 12))]
                 for _ in range(ARRIVALS)]
        prompts += batch
        states += engine.submit(input_ids=batch, sampling_params={"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
        engine.step()
    while engine.scheduler.has_work():
        engine.step()
    return prompts, [{"output_ids": s.output_ids} for s in states]


def _continuations(rng: random.Random, prompts: List[List[int]], first: List[Dict]) -> List[List[int]]:
    """Each conversation's next turn: its prompt, its answer (the extra token last), new tokens."""
    return [p + o["output_ids"] + [rng.randrange(VOCAB_LO, 8192) for _ in range(3)] for p, o in zip(prompts, first)]


def _generate(engine: Engine, prompts: List[List[int]], max_new_tokens: int = 4) -> List[Dict]:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    return engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2,
                           progress=False)


def test_a_finished_rows_extra_step_runs_before_the_row_is_handed_on():
    engine = Engine(max_total_tokens=4096, max_running_requests=8, disable_overlap_schedule=False,
                    enable_mixed_chunk=True, chunked_prefill_size=256, test_check_memory=True)
    gate = LateForwards(engine.scheduler)
    rng = random.Random(5)
    prompts, first = _first_turns(engine, rng)
    assert gate.admitted_while_held >= 4  # the race was forced: prefills scheduled before a finished extra step ran ...
    assert gate.handed_on == 0  # ... and no forward found a row of its batch given to another request
    nexts = _continuations(rng, prompts, first)
    warm = _generate(engine, nexts)
    # every continuation hit its whole first turn, the extra token's KV included
    assert all(w["meta_info"]["cached_tokens"] >= len(p) + 3 for w, p in zip(warm, prompts)), \
        [(w["meta_info"]["cached_tokens"], len(p)) for w, p in zip(warm, prompts)]
    engine.scheduler.check_memory()
    engine.shutdown()
    cold_engine = Engine(max_total_tokens=4096, disable_radix_cache=True, disable_overlap_schedule=True)
    cold = _generate(cold_engine, nexts)
    cold_engine.shutdown()
    assert_same_greedy(warm, cold)
    for w, c in zip(warm, cold):  # the same KV, so the same logprobs (not only the same argmax)
        lw = [v for v, _, _ in w["meta_info"]["output_token_logprobs"]]
        lc = [v for v, _, _ in c["meta_info"]["output_token_logprobs"]]
        if w["output_ids"] == c["output_ids"]:
            assert max(abs(a - b) for a, b in zip(lw, lc)) < 1e-3, (lw, lc)
