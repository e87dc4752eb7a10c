"""HiCache's storage tier end to end on the tiny model (offline Engine, the scheduler's real
path): a restarted engine on the same `file` directory, and a second engine on the same
Mooncake master, get their prefixes from storage (cached_tokens_details["storage"]) with the
greedy outputs of an engine without any cache tier; POST /clear_hicache_storage_backend's
handler empties the store, and answers with a reason where no storage tier is configured."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from radixserve.engine import Engine
from radixserve.protocol import ClearHiCacheReqInput

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from greedy_testing import assert_same_greedy  # noqa: E402
from mooncake_master import MooncakeMaster  # noqa: E402

VOCAB_LO, PAGE = 3, 4
NUM_PROMPTS, PREFIX_LEN = 4, 96


@pytest.fixture(scope="module")
def workload():
    rng = random.Random(7)
    prompts = [[rng.randrange(VOCAB_LO, 8192) for _ in range(PREFIX_LEN + rng.randint(1, 9))] for _ in range(NUM_PROMPTS)]
    return prompts, [{"max_new_tokens": 6, "temperature": 0} for _ in prompts]


@pytest.fixture(scope="module")
def reference(workload):
    engine = Engine(max_total_tokens=4096, page_size=PAGE, disable_radix_cache=True)
    out = run(engine, workload)
    engine.shutdown()
    return out


def run(engine: Engine, workload) -> List[Dict]:
    prompts, params = workload
    return engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2,
                           progress=False)


def storage_engine(backend: str, extra: Dict, **kw) -> Engine:
    return Engine(max_total_tokens=1024, page_size=PAGE, enable_hierarchical_cache=True, hicache_ratio=2,
                  hicache_storage_backend=backend, hicache_storage_backend_extra_config=extra,
                  test_check_memory=True, **{"hicache_storage_prefetch_policy": "wait_complete", **kw})


def tier(engine: Engine):
    return engine.scheduler.tree_cache.storage


def storage_tokens(results: List[Dict]) -> int:
    return sum(r["meta_info"]["cached_tokens_details"]["storage"] for r in results)


def test_a_restarted_engine_gets_its_prefixes_from_the_file_store(tmp_path, workload, reference, loop):
    extra = {"path": str(tmp_path), "prefetch_threshold": 16}
    first = storage_engine("file", extra, **loop)
    assert_same_greedy(run(first, workload), reference)
    assert tier(first).controller.wait_backups(30)
    assert tier(first).controller.counters.pages_written >= NUM_PROMPTS * PREFIX_LEN // PAGE
    first.shutdown()

    second = storage_engine("file", extra, **loop)  # empty device and host pools, the same directory
    results = run(second, workload)
    assert_same_greedy(results, reference)
    assert storage_tokens(results) >= NUM_PROMPTS * PREFIX_LEN * 0.9
    assert sum(r["meta_info"]["cached_tokens"] for r in results) == sum(
        sum(r["meta_info"]["cached_tokens_details"].values()) for r in results)
    second.scheduler.check_memory()  # host slots the storage tier filled are all accounted for

    handler = second.scheduler.hicache  # what POST /clear_hicache_storage_backend reaches
    assert handler.tier is tier(second)
    reply = handler.clear_hicache_storage(ClearHiCacheReqInput(query_id="q"))
    assert reply.success and reply.query_id == "q" and not list(tmp_path.glob("*.bin"))
    second.shutdown()


def test_a_weight_update_empties_the_store(tmp_path, workload):
    """Pages hold KV of the weights they were computed with: after a weight update none of them
    may load again (here, in this engine or in a restarted one)."""
    from radixserve.tiny_model import get_tiny_model_path

    engine = storage_engine("file", {"path": str(tmp_path), "prefetch_threshold": 16})
    run(engine, workload)
    assert tier(engine).controller.wait_backups(30) and list(tmp_path.glob("*.bin"))
    ok, message = engine.update_weights_from_disk(get_tiny_model_path())
    assert ok, message
    assert not list(tmp_path.glob("*.bin"))
    engine.shutdown()


def test_a_second_engine_on_the_same_mooncake_master_gets_the_first_ones_prefixes(workload, reference):
    # Reads run while other requests' forwards do (per request prefetch): on a loaded CPU a read can
    # outlast a 50 ms lease (LEASE_EXPIRED, a miss); nothing is cleared here, so a longer lease.
    master = MooncakeMaster(lease_ms=2000)
    extra = {**master.extra_config(), "prefetch_threshold": 16}
    first = storage_engine("mooncake", extra)  # its pages live in its segment: it stays up
    assert_same_greedy(run(first, workload), reference)
    assert tier(first).controller.wait_backups(30)
    second = storage_engine("mooncake", extra)
    results = run(second, workload)
    assert_same_greedy(results, reference)
    assert storage_tokens(results) >= NUM_PROMPTS * PREFIX_LEN * 0.9
    for e in (second, first):
        tier(e).controller.shutdown()  # closes the clients while the master is up
        e.shutdown()
    master.kill()


def test_clearing_without_a_storage_tier_says_how_to_configure_one():
    engine = Engine(max_total_tokens=256, enable_hierarchical_cache=True)
    reply = engine.scheduler.hicache.clear_hicache_storage(ClearHiCacheReqInput())
    assert not reply.success and "--hicache-storage-backend" in reply.message
    engine.shutdown()


KILLED_MASTER_RUN = """
import json, os, random, sys, time
sys.path.insert(0, sys.argv[1])
from greedy_testing import assert_same_greedy
from mooncake_master import MooncakeMaster
from radixserve.engine import Engine
rng = random.Random(7)
prompts = [[rng.randrange(3, 8192) for _ in range(96 + rng.randint(1, 9))] for _ in range(4)]
params = [{"max_new_tokens": 6, "temperature": 0} for _ in prompts]
def run(engine):
    return engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2, progress=False)
master = MooncakeMaster()
engine = Engine(max_total_tokens=1024, page_size=4, enable_hierarchical_cache=True, hicache_storage_backend="mooncake",
                hicache_storage_backend_extra_config={**master.extra_config(), "prefetch_threshold": 16},
                hicache_storage_prefetch_policy="wait_complete", test_check_memory=True)
controller = engine.scheduler.tree_cache.storage.controller
first = run(engine)  # an empty store: computed from scratch, the reference
controller.wait_backups(30)
written, lookups = controller.counters.pages_written, controller.counters.lookups
master.kill()
time.sleep(2.5)  # past MISS_REMEMBERED_S: the first run's misses are asked again
while engine.scheduler.has_work():  # the last batch's bookkeeping
    engine.step()
assert engine.flush_cache()  # device and host tiers empty: every prefix is looked up in storage
second = run(engine)  # the master is dead: misses, recomputed
assert sum(r["meta_info"]["cached_tokens"] for r in first) == 0
assert_same_greedy(second, first)
engine.scheduler.check_memory()
out = {"written": written, "lookups_after_kill": controller.counters.lookups - lookups, "storage": sum(r["meta_info"]["cached_tokens_details"]["storage"] for r in second),
       "cached": sum(r["meta_info"]["cached_tokens"] for r in second)}
print("RESULT " + json.dumps(out), flush=True)
os._exit(0)  # a client of a dead master takes a minute to close
"""


def test_a_killed_mooncake_master_mid_run_costs_recomputation_not_a_wrong_answer_or_a_hang():
    """In a process of its own (a Mooncake client of a dead master is slow to shut down)."""
    import json
    import subprocess

    proc = subprocess.run([sys.executable, "-c", KILLED_MASTER_RUN, str(Path(__file__).resolve().parents[1])],
                          capture_output=True, text=True, timeout=300)
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and result, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(result[0][len("RESULT "):])
    assert out["written"] > 0 and out["lookups_after_kill"] >= 4, out  # the dead store was asked
    assert out["storage"] == 0 and out["cached"] == 0, out  # and everything was recomputed


@pytest.mark.parametrize("policy", ["wait_complete", "timeout"])
def test_only_the_request_whose_prefetch_runs_waits(tmp_path, workload, reference, policy):
    """Seed 003 §24: a request's prefetch starts when it is queued, and with a blocking policy only
    that request stays in the waiting queue while storage is slow: a request behind it is admitted
    and served meanwhile; once its pages arrive it gets its prefix from storage."""
    import threading

    extra = {"path": str(tmp_path), "prefetch_threshold": 16}
    first = storage_engine("file", extra)
    run(first, workload)
    assert tier(first).controller.wait_backups(30)
    first.shutdown()

    # timeout: a bound far above the test's time, so only the prefetch's end releases the request
    slow_extra = dict(extra, prefetch_timeout_base=60) if policy == "timeout" else extra
    second = storage_engine("file", slow_extra, hicache_storage_prefetch_policy=policy)
    try:
        backend = tier(second).controller.backend
        storage_open, real_get = threading.Event(), backend.get
        backend.get = lambda keys: (storage_open.wait(20), real_get(keys))[1]  # a slow store
        prompts, params = workload
        stored = second.submit(input_ids=prompts[0], sampling_params=params[0], return_logprob=True,
                               top_logprobs_num=2)[0]
        other = second.submit(input_ids=list(range(3, 40)), sampling_params={"max_new_tokens": 6, "temperature": 0})[0]
        for _ in range(500):
            if other.finished:
                break
            second.step()
        sched = second.scheduler
        assert other.finished and other.finished_reason == {"type": "length", "length": 6}
        assert not stored.output_ids and [r.rid for r in sched.waiting_queue] == [stored.rid]
        assert stored.rid in sched.hicache.prefetching
        storage_open.set()
        second.wait_until_idle()
        out = second.frontend.make_output(stored)
        assert out["meta_info"]["cached_tokens_details"]["storage"] >= PREFIX_LEN // PAGE * PAGE - PAGE
        assert_same_greedy([out], [reference[0]])
        assert not sched.hicache.prefetching
        sched.check_memory()
    finally:
        second.shutdown()
