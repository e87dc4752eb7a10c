"""release_memory_occupation / resume_memory_occupation on the offline Engine (the scheduler's own
handlers): the KV pool and the weights (in the CPU's bf16 mode their packed copies too) are really
freed: their storages are empty and the process's resident memory drops by about their size; after
the resume greedy outputs and logprobs are exactly those of before. Requests meanwhile get 503,
a release while requests run is refused, the radix cache is flushed, and bad input is refused."""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import Dict, List

import pytest
import torch

from radixserve.engine import Engine
from radixserve.layers.linear import PackedWeight
from radixserve.model_executor.memory_saver import unique_storages
from radixserve.tiny_model import get_tiny_model_path

# A dummy-weight Qwen3 of ~21M parameters (84 MB in float32, 42 MB in bf16) with the tiny model's
# tokenizer: big enough for its release to show in the resident memory.
BIG_CONFIG = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, tie_word_embeddings=False)
KV_TOKENS = 8192  # 64 MB of KV in float32, 32 MB in fp16 (the bf16 mode's KV cache)
SAMPLING = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
RSS_SHARE = 0.8  # of the bytes freed, at least this much leaves the resident set


@pytest.fixture(scope="module")
def big_model_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("big_dummy")
    tiny = get_tiny_model_path()
    for f in os.listdir(tiny):
        if not f.endswith(".safetensors"):
            shutil.copy(os.path.join(tiny, f), out / f)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(BIG_CONFIG)
    cfg["layer_types"] = ["full_attention"] * BIG_CONFIG["num_hidden_layers"]
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def _prompts(n: int = 4) -> List[List[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, 8192) for _ in range(24)]
    return [shared + [rng.randrange(3, 8192) for _ in range(rng.randint(2, 40))] for _ in range(n)]


def _run(engine: Engine) -> List[Dict]:
    return engine.generate(input_ids=_prompts(), sampling_params=SAMPLING, return_logprob=True, progress=False)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _storages(engine: Engine, tag: str) -> List[torch.UntypedStorage]:
    adapter = engine.scheduler.memory_saver.adapter
    return unique_storages(adapter.kv_cache_tensors() if tag == "kv_cache" else adapter.weight_tensors())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_release_frees_the_pool_and_the_weights_and_resume_restores_them_exactly(big_model_dir, dtype):
    engine = Engine(big_model_dir, load_format="dummy", dtype=dtype, max_total_tokens=KV_TOKENS,
                    max_running_requests=16, context_length=1024)
    runner = engine.scheduler.tp_worker.model_runner
    packed = [m.weight_packed.data for m in runner.model.modules() if isinstance(getattr(m, "weight_packed", None), PackedWeight)]
    assert bool(packed) == runner.weight_only  # bf16 on a CPU with the C++ GEMM: packed copies
    before = _run(engine)
    kv_storages, weight_storages = _storages(engine, "kv_cache"), _storages(engine, "weights")
    kv_bytes = sum(s.nbytes() for s in kv_storages)
    weight_bytes = sum(s.nbytes() for s in weight_storages)
    assert kv_bytes > 20 * 2**20 and weight_bytes > 20 * 2**20
    if packed:  # the packed copies are part of what goes
        assert {p.untyped_storage().data_ptr() for p in packed} <= {s.data_ptr() for s in weight_storages}

    for s in kv_storages:  # pool pages get memory when first written (zeros_on_demand): write them all, as a
        torch.empty(0, dtype=torch.uint8).set_(s, 0, (s.nbytes(),)).add_(0)  # server that used its whole pool
    rss_before = _rss()
    engine.release_memory_occupation()
    rss_released = _rss()
    freed = rss_before - rss_released
    assert all(s.nbytes() == 0 for s in kv_storages + weight_storages)
    assert all(p.untyped_storage().nbytes() == 0 for p in packed)
    assert freed > RSS_SHARE * (kv_bytes + weight_bytes), (freed, kv_bytes, weight_bytes)
    assert engine.get_server_info()["released_memory_tags"] == ["kv_cache", "weights", "cuda_graph"]

    refused = engine.generate(input_ids=_prompts(1)[0], sampling_params=SAMPLING)
    reason = refused["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 503 and "resume_memory_occupation" in reason["message"]

    engine.resume_memory_occupation()
    assert _rss() - rss_released > RSS_SHARE * (kv_bytes + weight_bytes)  # resident again
    assert sum(s.nbytes() for s in kv_storages) == kv_bytes and sum(s.nbytes() for s in weight_storages) == weight_bytes
    after = _run(engine)
    for a, b in zip(before, after):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
    assert after[0]["meta_info"]["cached_tokens"] == 0  # the radix cache was flushed with the pool
    engine.scheduler.check_memory()
    assert engine.get_server_info()["released_memory_tags"] == []


def test_tags_one_at_a_time():
    engine = Engine(max_total_tokens=2048, max_running_requests=8, context_length=512, dtype="float32")
    before = _run(engine)
    assert engine.scheduler.tree_cache.evictable_size() > 0
    engine.release_memory_occupation(["kv_cache"])
    assert engine.scheduler.tree_cache.evictable_size() == 0  # flushed with the pool
    assert all(s.nbytes() == 0 for s in _storages(engine, "kv_cache"))
    assert all(s.nbytes() > 0 for s in _storages(engine, "weights"))
    engine.release_memory_occupation(["weights"])
    engine.resume_memory_occupation(["kv_cache"])
    # The weights are still away: still 503.
    out = engine.generate(input_ids=[5, 6, 7], sampling_params=SAMPLING)
    assert out["meta_info"]["finish_reason"]["status_code"] == 503
    engine.resume_memory_occupation(["weights"])
    assert [r["output_ids"] for r in _run(engine)] == [r["output_ids"] for r in before]
    engine.scheduler.check_memory()


def test_release_is_refused_while_requests_run_and_allowed_after_a_retract_pause():
    engine = Engine(max_total_tokens=2048, max_running_requests=8, context_length=512, dtype="float32",
                    test_check_memory=True)
    ref = [r["output_ids"] for r in _run(engine)]
    states = engine.submit(input_ids=_prompts(), sampling_params=SAMPLING)
    for _ in range(3):
        engine.step()
    with pytest.raises(ValueError, match="request\\(s\\) are running: pause with mode abort or retract"):
        engine.release_memory_occupation()
    assert engine.get_server_info()["released_memory_tags"] == []
    engine.pause_generation("retract")  # running requests give their KV back and wait
    engine.release_memory_occupation()
    for _ in range(3):
        engine.step()  # paused: the waiting requests are neither run nor refused
    assert not any(s.finished for s in states)
    engine.resume_memory_occupation()
    engine.continue_generation()
    engine.wait_until_idle()
    assert [s.output_ids for s in states] == ref
    engine.scheduler.check_memory()


def test_bad_input_is_refused_and_changes_nothing():
    engine = Engine(max_total_tokens=2048, max_running_requests=8, context_length=512)
    with pytest.raises(ValueError, match="Unknown memory tag"):
        engine.release_memory_occupation(["kv_cache", "gpu"])
    with pytest.raises(ValueError, match="Nothing to resume"):
        engine.resume_memory_occupation()
    engine.release_memory_occupation(["kv_cache"])
    with pytest.raises(ValueError, match="Already released"):
        engine.release_memory_occupation(["kv_cache"])
    with pytest.raises(ValueError, match="not released"):
        engine.resume_memory_occupation(["weights"])
    assert engine.get_server_info()["released_memory_tags"] == ["kv_cache"]
    engine.resume_memory_occupation()
    out = engine.generate(input_ids=[5, 6, 7], sampling_params=SAMPLING)
    assert out["meta_info"]["finish_reason"]["type"] == "length"
