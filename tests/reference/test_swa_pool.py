"""The SWA pool (issue 42, --enable-hybrid-swa-memory) against transformers, float32, on a random
Gemma 3 (window 8, local and global layers): prompts several windows long, through chunked
prefill, with a SWA pool a few windows large (so windows are dropped, the tree's live nodes are
turned into tombstones, recomputed ones come back to life and requests are retracted), with slot
conservation checked on both pools after every step (--test-check-memory); then the radix
cache's prefix hits beyond the window, and a hit whose window was dropped (shortened, not
served from missing KV)."""

from __future__ import annotations

import random

import pytest
import torch

from hf_utils import hf_logits, load_hf
from test_gemma3 import CONFIGS, WINDOW, make_gemma3_dir

from radixserve import Engine

TOL = 1e-4
CHUNK = 16
# a few windows: 3 x window + a chunk + 8 is the least the server starts with (model_runner.init_swa_memory_pool)
SWA_SLOTS = 3 * WINDOW + CHUNK + 8 + 8
FULL_SLOTS = 4096


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return make_gemma3_dir(str(tmp_path_factory.mktemp("gemma3_swa")), seed=5, **CONFIGS["layer_types"])


@pytest.fixture(scope="module")
def hf(gemma3_dir):
    return load_hf(gemma3_dir)


@pytest.fixture(params=["normal", "overlap"])
def loop(request) -> str:
    """Both scheduler loops: the normal one (the CPU's default) and the overlap one (the GPU's),
    where the next batch is scheduled, and swa slots freed or moved, while a forward runs."""
    return request.param


def _engine(model_dir: str, swa: bool = True, loop: str = "normal", **kw) -> Engine:
    engine = Engine(model_dir, dtype="float32", skip_tokenizer_init=True, chunked_prefill_size=CHUNK,
                    max_total_tokens=FULL_SLOTS, enable_hybrid_swa_memory=swa,
                    swa_full_tokens_ratio=SWA_SLOTS / FULL_SLOTS, test_check_memory=True,
                    disable_overlap_schedule=loop != "overlap", **kw)
    assert engine.scheduler.enable_overlap == (loop == "overlap")
    return engine


def _check_against_hf(hf, prompt, out) -> None:
    ids = out["output_ids"]
    ref = hf_logits(hf, prompt + ids)[len(prompt) - 1 : -1]
    assert ids == ref.argmax(-1).tolist()
    lp = torch.tensor([v for v, _, _ in out["meta_info"]["output_token_logprobs"]])
    ref_lp = torch.log_softmax(ref, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
    assert (lp - ref_lp).abs().max().item() <= TOL


def _prompts(seed: int, lens) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lens]


def test_the_swa_pool_serves_as_transformers(gemma3_dir, hf, loop):
    prompts = _prompts(3, (9 * WINDOW, 5 * WINDOW + 3, 3 * WINDOW))
    engine = _engine(gemma3_dir, loop=loop)
    try:
        state = engine.scheduler.internal_state()  # what /get_server_info shows: both pools
        assert state["swa_max_total_num_tokens"] == SWA_SLOTS and state["max_total_num_tokens"] == FULL_SLOTS
        sp = {"max_new_tokens": 3 * WINDOW, "temperature": 0}
        outs = engine.generate(input_ids=prompts, sampling_params=[sp] * 3, return_logprob=True, progress=False)
        for p, out in zip(prompts, outs):
            _check_against_hf(hf, p, out)
        # Prefix hits beyond the window: each conversation goes on (its prompt, its answer, a new
        # tail of a chunk or more); the end of an answer is what the tree last got, still live.
        # Shortest first: the longest one's chunks, first in line, would drop the others' windows
        # from this small pool before their turn (admission stops on the SWA pool).
        longer = [p + o["output_ids"] + q for p, o, q in zip(prompts, outs, _prompts(4, (CHUNK + 5, 4, 2 * CHUNK)))][::-1]
        outs = engine.generate(input_ids=longer, sampling_params=[sp] * 3, return_logprob=True, progress=False)
        for p, out in zip(longer, outs):
            _check_against_hf(hf, p, out)
        assert max(o["meta_info"]["cached_tokens"] for o in outs) > 2 * WINDOW
        engine.scheduler.check_memory()  # idle: both pools' slots free or in the tree
    finally:
        engine.shutdown()


def test_a_hit_whose_window_was_dropped_is_shortened(gemma3_dir, hf, loop):
    prompt = _prompts(6, (6 * WINDOW,))[0]
    sp = {"max_new_tokens": 4, "temperature": 0}
    engine = _engine(gemma3_dir, loop=loop)
    try:
        engine.generate(input_ids=prompt, sampling_params=sp, progress=False)
        tree = engine.scheduler.tree_cache
        # The whole prompt is cached, for the full layers; its windowed layers' KV goes.
        assert tree.evict_swa(10**6) > 0 and tree.swa_evictable_size() == 0
        assert len(tree.match_prefix(prompt + [1]).device_indices) == 0
        out = engine.generate(input_ids=prompt + [7, 8, 9], sampling_params=sp, return_logprob=True, progress=False)
        assert out["meta_info"]["cached_tokens"] == 0  # recomputed, not read from dropped KV
        _check_against_hf(hf, prompt + [7, 8, 9], out)
        # That request's own KV is cached again, its last window live: the next hit is served.
        out = engine.generate(input_ids=prompt + [7, 8, 9, 10], sampling_params=sp, return_logprob=True, progress=False)
        assert out["meta_info"]["cached_tokens"] >= len(prompt) + 3 - 1 - WINDOW
        _check_against_hf(hf, prompt + [7, 8, 9, 10], out)
    finally:
        engine.shutdown()


def test_a_long_context_holds_its_window_only(gemma3_dir, hf, loop):
    """One request 25 windows long: its local layers' slots never exceed its window, the chunk in
    flight and the one before it (kept one forward late), while the full layers hold it all."""
    prompt = _prompts(8, (25 * WINDOW,))[0]
    engine = _engine(gemma3_dir, loop=loop, disable_radix_cache=True)  # the ChunkCache: no tree holds windows
    sched = engine.scheduler
    peaks = {"swa": 0, "full": 0}
    check = sched.check_slot_conservation

    def check_and_measure() -> None:  # after every step (--test-check-memory)
        check()
        peaks["swa"] = max(peaks["swa"], sched.ledger.get_swa_token_info()["swa_used_tokens"])
        peaks["full"] = max(peaks["full"], FULL_SLOTS - sched.internal_state()["available_tokens"])

    sched.check_slot_conservation = check_and_measure
    try:
        out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 2 * WINDOW, "temperature": 0},
                              return_logprob=True, progress=False)
        _check_against_hf(hf, prompt, out)
        assert peaks["full"] >= len(prompt) + WINDOW
        assert WINDOW <= peaks["swa"] <= WINDOW + 2 * CHUNK, peaks
        engine.scheduler.check_memory()
    finally:
        engine.shutdown()


def test_release_and_resume_of_the_kv_cache_covers_both_pools(gemma3_dir, hf):
    prompt = _prompts(9, (5 * WINDOW,))[0]
    engine = _engine(gemma3_dir)
    try:
        pool = engine.scheduler.ledger.kv_pool
        assert len(pool.k_buffer) == 4  # 2 full layers' and 2 windowed layers' buffers
        engine.release_memory_occupation(["kv_cache"])
        assert all(b.untyped_storage().nbytes() == 0 for b in (*pool.k_buffer, *pool.v_buffer))
        engine.resume_memory_occupation(["kv_cache"])
        out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": WINDOW, "temperature": 0},
                              return_logprob=True, progress=False)
        _check_against_hf(hf, prompt, out)
    finally:
        engine.shutdown()


def test_both_pools_are_conserved_under_a_storm_of_retractions_and_aborts(gemma3_dir, hf, loop):
    """24 requests on 3 shared prefixes several windows long (chunked, re-admitted after
    retractions: hits on their own prefixes), a retraction every 3 decode steps, a quarter aborted
    at random moments, a SWA pool of a few windows: both pools' slots are accounted for after
    every step (--test-check-memory), and every survivor's greedy tokens and logprobs are
    transformers'. In the overlap loop the stash, the evictions and the retractions of one
    schedule run while the forward scheduled before it is computing."""
    engine = _engine(gemma3_dir, loop=loop, test_retract_interval=3, max_running_requests=4)
    sched, rng = engine.scheduler, random.Random(11)
    prefixes = [[rng.randrange(512) for _ in range(n)] for n in (3 * WINDOW, 5 * WINDOW + 2, 2 * WINDOW + 5)]
    prompts = [rng.choice(prefixes) + [rng.randrange(512) for _ in range(rng.randint(1, 2 * WINDOW))] for _ in range(24)]
    sp = {"max_new_tokens": WINDOW + 2, "temperature": 0, "ignore_eos": True}
    reqs, aborted = [], set()
    try:
        for prompt in prompts:
            reqs += engine.submit(input_ids=prompt, sampling_params=sp, return_logprob=True)
            for _ in range(rng.randint(0, 3)):
                engine.step()
            if rng.random() < 0.25:
                victim = rng.choice([r for r in reqs if not r.finished])
                engine.abort(victim.rid)
                aborted.add(victim.rid)
        while sched.has_work():
            engine.step()
        assert sched.stats.num_retracted_reqs > 0 and sched.stats.cached_tokens > 0
        info = sched.ledger.get_swa_token_info()
        assert info["swa_available_tokens"] + info["swa_evictable_tokens"] == SWA_SLOTS
        sched.check_memory()
    finally:
        engine.shutdown()
    survivors = [(p, r) for p, r in zip(prompts, reqs) if r.rid not in aborted]
    assert len(survivors) >= 12
    for prompt, r in survivors:
        assert r.finished_reason == {"type": "length", "length": WINDOW + 2}
        lps = [(v, None, None) for v in r.logprobs["output_token_logprobs_val"]]
        _check_against_hf(hf, prompt, {"output_ids": r.output_ids, "meta_info": {"output_token_logprobs": lps}})


def _pools_of(engine: Engine) -> str:
    return "swa" if hasattr(engine.scheduler.ledger, "swa_room") and engine.scheduler.ledger.swa_room() is not None else "one"


@pytest.mark.parametrize("flags, pools, why", [
    (dict(), "swa", None),  # the default for a model with windowed layers
    (dict(enable_hybrid_swa_memory=False), "one", None),  # --disable-hybrid-swa-memory
    (dict(page_size=4), "one", "--page-size > 1"),
    (dict(chunked_prefill_size=-1), "one", "chunked prefill off"),
    (dict(swa_full_tokens_ratio=0.001), "one", "a SWA pool of 4 slots: it needs"),
])
def test_the_swa_pool_is_the_default_and_falls_back_to_one_pool_with_a_log_line(gemma3_dir, hf, caplog, flags, pools, why):
    """Not asked for, the SWA pool is on for a model with windowed layers where it runs; where it
    does not, one KV pool keeps every layer's KV, with one log line saying why, and serves as
    transformers. Asked for (--enable-hybrid-swa-memory), the same combination is refused."""
    prompt = _prompts(12, (5 * WINDOW,))[0]
    args = dict(dtype="float32", skip_tokenizer_init=True, chunked_prefill_size=CHUNK, max_total_tokens=FULL_SLOTS)
    with caplog.at_level("INFO"):
        engine = Engine(gemma3_dir, **{**args, **flags})
    try:
        assert _pools_of(engine) == pools
        lines = [r.getMessage() for r in caplog.records if "the SWA pool does not run with" in r.getMessage()]
        assert len(lines) == (why is not None) and all(why in line for line in lines), lines
        out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": WINDOW, "temperature": 0},
                              return_logprob=True, progress=False)
        _check_against_hf(hf, prompt, out)
    finally:
        engine.shutdown()
    if why is not None and "enable_hybrid_swa_memory" not in flags:
        with pytest.raises((ValueError, RuntimeError), match="--enable-hybrid-swa-memory does not run with"):
            Engine(gemma3_dir, **{**args, **flags, "enable_hybrid_swa_memory": True})


def _tp_rank(rank: int, addr: str, model_dir: str, out_path: str) -> None:
    """One rank of --tp-size 2 on the SWA pool (its default): a ragged prefill, a chunk, decodes."""
    from radixserve.distributed.parallel_state import destroy_distributed_environment
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.models.model_config import ModelConfig
    from radixserve.server_args import ServerArgs

    from hf_utils import KVDriver

    args = ServerArgs(model_path=model_dir, dtype="float32", device="cpu", max_total_tokens=1024,
                      max_running_requests=8, tp_size=2, dist_init_addr=addr, chunked_prefill_size=CHUNK)
    runner = ModelRunner(ModelConfig.from_pretrained(model_dir), args, rank, 2)
    rows = runner.req_to_token_pool.alloc(2)
    drv = KVDriver(runner, scatter_seed=1)
    long, short = _prompts(13, (5 * WINDOW, 2 * WINDOW))
    out = [drv.extend(rows, [0, 0], [long[:3 * WINDOW], short]).all_logits,
           drv.extend(rows[:1], [3 * WINDOW], [long[3 * WINDOW:]]).all_logits]
    lens = [len(long), len(short)]
    for t in range(3):
        out.append(drv.decode(rows, lens, [20 + t, 30 + t]).next_token_logits)
        lens = [n + 1 for n in lens]
    pool = runner.token_to_kv_pool
    torch.save({"logits": out, "swa": hasattr(pool, "swa_kv_pool"), "kv_heads": pool.head_num}, f"{out_path}.{rank}")
    destroy_distributed_environment()


def test_tensor_parallel_2_on_the_swa_pool(gemma3_dir, hf, tmp_path):
    """--tp-size 2 with the SWA pool (the default for this model): each rank's pools hold half of
    the KV heads, windowed layers' in the SWA pool, and the logits are transformers'."""
    import multiprocessing as mp
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from processes import free_port, run_processes

    out = tmp_path / "tp2.pt"
    addr = f"127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    run_processes([ctx.Process(target=_tp_rank, args=(r, addr, gemma3_dir, str(out))) for r in range(2)])
    long, short = _prompts(13, (5 * WINDOW, 2 * WINDOW))
    la, lb = hf_logits(hf, long + [20, 21, 22]), hf_logits(hf, short + [30, 31, 32])
    n, m = len(long), len(short)
    ref = [torch.cat([la[:3 * WINDOW], lb[:m]]), la[3 * WINDOW:n]] + [torch.stack([la[n + t], lb[m + t]]) for t in range(3)]
    for rank in range(2):
        res = torch.load(f"{out}.{rank}")
        assert res["swa"] and res["kv_heads"] == 1
        errs = [(a - b).abs().max().item() for a, b in zip(res["logits"], ref)]
        assert max(errs) <= TOL, (rank, errs)
