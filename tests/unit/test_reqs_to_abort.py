"""Seed 001 §9.2 `reqs_to_abort`: a request that can never fit in the KV cache pool ends with a
clear abort instead of waiting or being retracted forever, and everyone else is served.

    prompt >= the pool                      refused at intake (400)
    prompt + max_new_tokens > the pool      admitted (its reserve capped at the pool), decodes
                                            until it alone fills the pool, then aborted (500)
"""

from __future__ import annotations

from typing import Dict, List

import pytest

from radixserve.engine import Engine

POOL = 256
MAX_STEPS = 2000  # far more than the work below needs: a request waiting forever fails, not hangs


def run_bounded(engine: Engine, input_ids: List[List[int]], sps: List[Dict]) -> List[Dict]:
    states = engine.submit(input_ids=input_ids, sampling_params=sps)
    for _ in range(MAX_STEPS):
        if all(s.finished for s in states):
            break
        engine.step()
    assert all(s.finished for s in states), [(s.rid, len(s.output_ids)) for s in states]
    return [engine.frontend.make_output(s) for s in states]


@pytest.mark.parametrize("radix", ["radix", "no_radix"])
def test_request_outgrowing_the_pool_is_aborted_and_others_served(loop, radix):
    engine = Engine(max_total_tokens=POOL, disable_radix_cache=radix == "no_radix", test_check_memory=True, **loop)
    try:
        assert engine.scheduler.max_total_num_tokens == POOL
        greedy = {"temperature": 0, "ignore_eos": True}
        too_long, small, prompt_too_long = [5] * 100, [7] * 50, [9] * (POOL + 10)
        outs = run_bounded(engine, [too_long, small, prompt_too_long],
                           [{"max_new_tokens": 300, **greedy}, {"max_new_tokens": 20, **greedy}, {"max_new_tokens": 2}])
        grown, served, refused = (o["meta_info"]["finish_reason"] for o in outs)
        assert grown["type"] == "abort" and "more KV cache than the whole pool" in grown["message"], grown
        # it ran until it alone filled the pool (its last token has no KV yet)
        assert len(too_long) + len(outs[0]["output_ids"]) in (POOL, POOL + 1)
        assert served == {"type": "length", "length": 20}
        assert refused["type"] == "abort" and refused["status_code"] == 400 and "does not fit" in refused["message"]
        # the engine keeps serving, and every slot came back
        again = run_bounded(engine, [small], [{"max_new_tokens": 8, **greedy}])
        assert again[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
        engine.wait_until_idle()
        engine.scheduler.check_memory()
    finally:
        engine.shutdown()
