"""Multi-LoRA batching (issue 28, first increment: the CPU torch path).

Three PEFT adapters (ranks 4, 8, 16, different target modules, random non-zero A and B) are
written by the test in PEFT's format (adapter_config.json + adapter_model.safetensors, PEFT's
tensor names). The reference for each adapter is the base model with W + scaling * B @ A merged
into its checkpoint, served by a second Engine: a batch mixing base requests and all three
adapters must give, per request, that model's greedy tokens and logprobs."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixserve.engine import Engine
from radixserve.lora.lora import LoRAAdapter
from radixserve.mem_cache.kv_ledger import KVLedger
from radixserve.lora.lora_config import LoRAConfig, LoRAError
from radixserve.server_args import ServerArgs
from radixserve.tiny_model import get_tiny_model_path

sys.path.append(str(Path(__file__).resolve().parents[1] / "reference"))
from lora_utils import ADAPTERS, ENGINE_ARGS, PROMPTS, SAMPLING, base_weights, write_adapter, write_merged_model  # noqa: E402



@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = base_weights()
    return {name: write_adapter(root / name, r, alpha, targets, base, seed=i + 1)
            for i, (name, (r, alpha, targets)) in enumerate(ADAPTERS.items())}


def _run(engine: Engine, lora_paths: List[Optional[str]], prompts: List[str]) -> List[dict]:
    return engine.generate(prompts, dict(SAMPLING), return_logprob=True, lora_path=lora_paths, progress=False)


@pytest.fixture(scope="module")
def references(adapters, tmp_path_factory) -> Dict[Optional[str], List[dict]]:
    """Per adapter (None = base): the greedy outputs of the merged model for PROMPTS."""
    root = tmp_path_factory.mktemp("merged")
    refs = {}
    for name in [None, *ADAPTERS]:
        path = get_tiny_model_path() if name is None else write_merged_model(root / name, adapters[name])
        engine = Engine(str(path), **ENGINE_ARGS)
        try:
            refs[name] = engine.generate(PROMPTS, dict(SAMPLING), return_logprob=True, progress=False)
        finally:
            engine.shutdown()
    return refs


def _lora_engine(adapters: Dict[str, Path], **kwargs) -> Engine:
    return Engine(None, lora_paths=[f"{n}={p}" for n, p in adapters.items()], **{**ENGINE_ARGS, **kwargs})


def _assert_matches(out: dict, ref: dict, what: str) -> None:
    assert out["output_ids"] == ref["output_ids"], what
    got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    want = [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]]
    assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0), what


def _mixed_batch() -> List[tuple]:
    """(prompt index, adapter) pairs: every prompt under the base model and every adapter."""
    return [(i, name) for i in range(len(PROMPTS)) for name in [None, *ADAPTERS]]


def test_adapters_change_the_output(references):
    # Without this the comparisons below could pass with the delta never applied.
    for name in ADAPTERS:
        assert [r["output_ids"] for r in references[name]] != [r["output_ids"] for r in references[None]], name


@pytest.mark.parametrize("max_loras_per_batch,extra", [
    (8, {}),
    (2, {}),
    (2, {"chunked_prefill_size": 4, "enable_mixed_chunk": True}),  # prefill chunks with decodes in one forward
])
def test_mixed_batch_matches_merged_weights(adapters, references, max_loras_per_batch, extra):
    """Base requests and all three adapters in one batch; with 2 slots for 3 adapters, adapters
    are swapped in as slots free up and every request still completes with its own output."""
    engine = _lora_engine(adapters, max_loras_per_batch=max_loras_per_batch, **extra)
    manager = engine.scheduler.tp_worker.model_runner.lora_manager
    seen: List[set] = []
    prepare = manager.prepare_lora_batch

    def recording_prepare(forward_batch):
        seen.append({p for p in (forward_batch.lora_paths or []) if p is not None})
        return prepare(forward_batch)

    manager.prepare_lora_batch = recording_prepare
    try:
        pairs = _mixed_batch()
        outs = _run(engine, [name for _, name in pairs], [PROMPTS[i] for i, _ in pairs])
        for (i, name), out in zip(pairs, outs):
            _assert_matches(out, references[name][i], f"prompt {i} adapter {name}")
            assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert max(len(s) for s in seen) <= max_loras_per_batch  # admission kept every batch within the slots
        assert set().union(*seen) == set(ADAPTERS)
        if max_loras_per_batch == 2:
            assert manager.pool.num_swaps >= len(ADAPTERS)  # 3 adapters through 2 slots: a slot was reused
    finally:
        engine.shutdown()


def test_cache_isolation(adapters, references):
    """The same prompt under two adapters and the base, sent one after another: each gets its
    own output and none is reported as served from another's cached prefix."""
    engine = _lora_engine(adapters)
    try:
        for name in [None, "a4", "c16", None, "a4"]:
            out = _run(engine, [name], [PROMPTS[1]])[0]
            _assert_matches(out, references[name][1], f"adapter {name}")
            assert out["meta_info"]["cached_tokens"] == 0
    finally:
        engine.shutdown()


def test_radix_cache_keys_prefixes_by_adapter(adapters):
    """Radix cache on: a long prompt under a4, then c16, then the base model is never served from
    another's cached prefix, and each output is the one a fresh engine (no cache) gives; the same
    adapter again hits its own prefix and still gives its output."""
    prompt = " ".join(PROMPTS * 3)
    engine = _lora_engine(adapters)  # the reference: radix cache off, so nothing carries over
    try:
        fresh = {name: _run(engine, [name], [prompt])[0] for name in [None, "a4", "c16"]}
    finally:
        engine.shutdown()
    prompt_len = fresh[None]["meta_info"]["prompt_tokens"]
    assert prompt_len > 40

    engine = _lora_engine(adapters, disable_radix_cache=False)
    try:
        for name, hit in [("a4", False), ("c16", False), (None, False), ("a4", True), ("c16", True), (None, True)]:
            out = _run(engine, [name], [prompt])[0]
            _assert_matches(out, fresh[name], f"adapter {name}, prefix hit {hit}")
            # a hit covers the whole prompt but its last token (its logits give the first output)
            assert out["meta_info"]["cached_tokens"] == (prompt_len - 1 if hit else 0), (name, hit)
    finally:
        engine.shutdown()


def test_reloaded_adapter_name_does_not_reuse_old_prefixes(adapters, references):
    """Radix cache on: an adapter name unloaded and loaded again with other weights must not be
    served the KV its old weights computed (the unload drops the name's cached prefixes)."""
    engine = _lora_engine({"x": adapters["a4"]}, disable_radix_cache=False, max_lora_rank=16, lora_target_modules=["all"])
    try:
        for path, ref in [(adapters["a4"], references["a4"]), (adapters["c16"], references["c16"])]:
            if path != adapters["a4"]:
                assert engine.unload_lora_adapter("x").success
                assert engine.load_lora_adapter("x", str(path)).success
            _assert_matches(_run(engine, ["x"], [PROMPTS[1]])[0], ref[1], f"x = {path.name}")
        assert engine.scheduler.tree_cache.total_size() > 0  # the second run cached its own prefix
    finally:
        engine.shutdown()


def test_lpm_matches_prefixes_under_each_request_adapter():
    """The cache-aware policy (LPM) and its in-batch tree: a prefix cached or chosen this round
    under one adapter counts for requests of that adapter only."""
    from radixserve.managers.schedule_batch import Req
    from radixserve.managers.schedule_policy import IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD, SchedulePolicy
    from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
    from radixserve.mem_cache.radix_cache import RadixCache
    from radixserve.sampling_params import SamplingParams

    def req(rid: str, ids: List[int], lora: Optional[str]) -> Req:
        sp = SamplingParams(max_new_tokens=4)
        sp.normalize()
        return Req(rid, None, ids, sp, lora_path=lora)

    alloc = TokenToKVPoolAllocator(4096)
    cache = RadixCache(ReqToTokenPool(16, 1024), alloc)
    shared = list(range(1, 11))
    cache.insert(shared, alloc.alloc(len(shared)), extra_key="a")  # cached under adapter a only
    long_ids = list(range(100, 100 + IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD + 8))
    waiting = [req("base", shared + [50], None), req("b", shared + [51], "b"), req("a", shared + [52], "a"),
               req("first", long_ids + [1], "a"), req("same", long_ids + [2], "a"), req("other", long_ids + [3], "b")]
    SchedulePolicy("lpm", cache).calc_priority(waiting)
    prefix = {r.rid: len(r.prefix_indices) for r in waiting}
    assert prefix == {"base": 0, "b": 0, "a": 10, "first": 0, "same": 0, "other": 0}
    # "a" hits first; "same" shares a long prefix with "first" chosen this round under the same
    # adapter, so it waits for that prefix to be cached; "other" (adapter b) does not wait.
    assert [r.rid for r in waiting] == ["a", "base", "b", "first", "other", "same"]


def test_unknown_adapter_is_refused_by_name(adapters):
    engine = _lora_engine(adapters)
    try:
        with pytest.raises(ValueError, match="'nope' is not loaded"):
            engine.generate("hi", dict(SAMPLING), lora_path="nope", progress=False)
        assert engine.generate("hi", dict(SAMPLING), lora_path="a4", progress=False)["output_ids"]  # still serving
    finally:
        engine.shutdown()
    base = Engine(None, **ENGINE_ARGS)
    try:
        with pytest.raises(ValueError, match="without --enable-lora"):
            base.generate("hi", dict(SAMPLING), lora_path="a4", progress=False)
    finally:
        base.shutdown()


# ---- bad adapters: one line naming the file -------------------------------------------------
TINY_DIMS = {"q_proj": (256, 256), "k_proj": (256, 128), "v_proj": (256, 128), "o_proj": (256, 256),
             "gate_proj": (256, 768), "up_proj": (256, 768), "down_proj": (768, 256)}


def test_missing_files(tmp_path):
    with pytest.raises(LoRAError, match=f"{tmp_path}/adapter_config.json: no such file"):
        LoRAConfig.from_dir(str(tmp_path))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 4, "target_modules": ["q_proj"]}))
    config = LoRAConfig.from_dir(str(tmp_path))
    with pytest.raises(LoRAError, match=f"{tmp_path}/adapter_model.safetensors: no such file"):
        LoRAAdapter.load("x", config, TINY_DIMS, 4)


def test_rank_above_max(adapters):
    with pytest.raises(LoRAError, match=r"c16/adapter_config.json: rank r=16 is above --max-lora-rank 8"):
        LoRAConfig.from_dir(str(adapters["c16"]), max_lora_rank=8)
    with pytest.raises(LoRAError, match="rank r=16 is above --max-lora-rank 8"):  # at start, one line
        _lora_engine(adapters, max_lora_rank=8)


def test_target_module_the_model_lacks(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 4, "target_modules": ["c_attn"]}))
    with pytest.raises(LoRAError, match=r"adapter_config.json: target module 'c_attn' is not in the model"):
        LoRAConfig.from_dir(str(tmp_path))


def test_shapes_that_do_not_match(tmp_path):
    write_adapter(tmp_path, 4, 4.0, ["q_proj"], base_weights(), seed=0)
    tensors = load_file(str(tmp_path / "adapter_model.safetensors"))
    name = "base_model.model.model.layers.2.self_attn.q_proj.lora_B.weight"
    tensors[name] = torch.randn(100, 4)
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match=r"adapter_model.safetensors: layers.2.q_proj: shapes do not match"):
        LoRAAdapter.load("x", LoRAConfig.from_dir(str(tmp_path)), TINY_DIMS, 4)


def test_refused_combinations():
    for kwargs, what in [
        ({"disable_radix_cache": True, "is_embedding": True}, "--is-embedding"),
        ({"disable_radix_cache": True, "speculative_algorithm": "NGRAM"}, "--speculative-algorithm"),
        ({"disable_radix_cache": True, "device": "cuda"}, "CUDA graphs"),
    ]:
        with pytest.raises(ValueError, match="--enable-lora with") as e:
            ServerArgs(enable_lora=True, **kwargs)
        assert what in str(e.value) and "\n" not in str(e.value)
    # tp > 1 and the overlap loop run with LoRA: test_lora_tp_overlap.py
    assert ServerArgs(enable_lora=True, tp_size=2).overlap_schedule_enabled("cuda")
    assert not ServerArgs(enable_lora=True).disable_radix_cache  # prefixes are keyed by adapter


# ---- admission (seed 001 §14: can_run_lora_batch) -------------------------------------------
def _admission_round(running_adapters: List[Optional[str]], waiting_adapters: List[Optional[str]], limit: int) -> List[str]:
    """One PrefillAdder round over a FCFS waiting queue; the rids it admitted."""
    from radixserve.managers.schedule_batch import Req, ScheduleBatch
    from radixserve.managers.schedule_policy import PrefillAdder, SchedulePolicy
    from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
    from radixserve.mem_cache.radix_cache import RadixCache
    from radixserve.sampling_params import SamplingParams

    def req(rid: str, lora: Optional[str]) -> Req:
        sp = SamplingParams(max_new_tokens=4)
        sp.normalize()
        return Req(rid, None, [1, 2, 3], sp, lora_path=lora)

    alloc = TokenToKVPoolAllocator(4096)
    cache = RadixCache(ReqToTokenPool(16, 1024), alloc)
    policy = SchedulePolicy("fcfs", cache)
    policy.max_loras_per_batch = limit
    running = ScheduleBatch(reqs=[req(f"r{i}", a) for i, a in enumerate(running_adapters)], tree_cache=cache)
    adder = PrefillAdder(1, KVLedger(cache.req_to_token_pool, alloc, cache), running, 0.7, rem_input_tokens=10000, rem_chunk_tokens=None, policy=policy)
    waiting = [req(f"w{i}", a) for i, a in enumerate(waiting_adapters)]
    adder.add_waiting_reqs(waiting, lambda bs: 100, try_preemption=False, has_chunked_req=False)
    return [r.rid for r in adder.can_run_list]


def test_admission_fits_the_slots_and_skips_what_does_not_fit():
    # Running a and b fill 2 slots: base and a/b requests join; c waits.
    assert _admission_round(["a", "b"], [None, "a", "b"], limit=2) == ["w0", "w1", "w2"]
    # b takes the last slot; c waits, and the a request behind it (its adapter in the batch) joins
    assert _admission_round(["a"], ["b", "c", "a"], limit=2) == ["w0", "w2"]
    # issue 43 (SGLang's skip): c waits at the head of the queue for a slot while the requests
    # behind it that fit, an adapter already in the slots and the base model, are admitted
    assert _admission_round(["a", "b"], ["c", "a", None], limit=2) == ["w1", "w2"]
    assert _admission_round(["a", "b"], ["c", "d", None], limit=2) == ["w2"]  # d needs a slot too
    assert _admission_round(["a"], ["c", "a", None], limit=2) == ["w0", "w1", "w2"]
    assert _admission_round([], ["a", "b", "c"], limit=None) == ["w0", "w1", "w2"]  # LoRA off: no limit


def test_load_and_unload_at_run_time(adapters, references, tmp_path):
    engine = Engine(None, lora_paths=[f"a4={adapters['a4']}"], max_lora_rank=16, lora_target_modules=["all"],
                    **ENGINE_ARGS)
    try:
        with pytest.raises(ValueError, match="'c16' is not loaded"):
            engine.generate(PROMPTS[0], dict(SAMPLING), lora_path="c16", progress=False)
        out = engine.load_lora_adapter("c16", str(adapters["c16"]))
        assert out.success and out.loaded_adapters == {"a4": str(adapters["a4"]), "c16": str(adapters["c16"])}
        _assert_matches(_run(engine, ["c16"], [PROMPTS[0]])[0], references["c16"][0], "loaded at run time")

        bad = engine.load_lora_adapter("x", str(tmp_path / "nowhere"))
        assert not bad.success and "nowhere/adapter_config.json: no such file" in bad.error_message
        assert not engine.load_lora_adapter("c16", str(adapters["c16"])).success  # already loaded

        # Unload while a request uses it: the request finishes with its own output first.
        states = engine.submit(text=PROMPTS[2], sampling_params=dict(SAMPLING), return_logprob=True, lora_path="c16")
        engine.step()  # admitted and prefilled
        out = engine.unload_lora_adapter("c16")
        assert out.success and out.loaded_adapters == {"a4": str(adapters["a4"])}
        assert states[0].finished and states[0].output_ids == references["c16"][2]["output_ids"]
        with pytest.raises(ValueError, match="'c16' is not loaded"):
            engine.generate(PROMPTS[0], dict(SAMPLING), lora_path="c16", progress=False)
        _assert_matches(_run(engine, ["a4"], [PROMPTS[0]])[0], references["a4"][0], "a4 still served")
    finally:
        engine.shutdown()
