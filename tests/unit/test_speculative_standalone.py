"""Issue 27, STANDALONE speculative decoding: a smaller draft model of the target's vocabulary
drafts a chain of --speculative-num-steps tokens per step (its KV in buffers of its own, indexed
by the target's slots), one target forward verifies them. Greedy outputs equal speculation off
(draft = the same model: every draft accepted; draft = a truncated copy: some rejected) under
chunked prefill, retraction, radix-cache hits, pages and n > 1; logprobs; the sampled
distribution equals speculation off; the draft's KV mirrors the target's at every held slot;
slot conservation after every step; the flags; the real SmolLM2."""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path
from typing import Dict

import pytest
import torch
from safetensors.torch import load_file, save_file
from scipy.stats import chi2_contingency

from radixserve.engine import Engine
from radixserve.server_args import ServerArgs
from radixserve.tiny_model import get_tiny_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from real_model import smollm2_gguf  # noqa: E402
from reference.hf_utils import make_hf_model_dir  # noqa: E402
from greedy_testing import assert_same_greedy, reference_alone, run_in_two_waves, with_repeats  # noqa: E402

VOCAB_LO = 3  # ids 0-2 are the tiny model's special tokens
NUM_STEPS = 3


def make_truncated_copy(src: Path, dst: Path, num_layers: int) -> Path:
    """An HF directory of `src`'s first `num_layers` layers (same embeddings, norm, tokenizer)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = num_layers
    for key in ("layer_types",):
        if isinstance(cfg.get(key), list):
            cfg[key] = cfg[key][:num_layers]
    cfg["max_window_layers"] = min(cfg.get("max_window_layers", num_layers), num_layers)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    keep = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        parts = name.split(".")
        if len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= num_layers:
            continue
        keep[name] = t.contiguous()
    save_file(keep, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def tiny_path() -> str:
    return str(get_tiny_model_path())


@pytest.fixture(scope="module")
def truncated_path(tmp_path_factory, tiny_path) -> str:
    return str(make_truncated_copy(Path(tiny_path), tmp_path_factory.mktemp("draft") / "tiny_2_layers", 2))


def spec_kw(draft: str, **kw) -> Dict:
    return dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=draft,
                speculative_num_steps=NUM_STEPS, **kw)


# ---- workload and reference --------------------------------------------------------------------
NUM_BASE = 8


def make_prompts(seed: int = 0):
    """8 random prompts, then 4 of them again (radix-cache hits of their prompt and output)."""
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(NUM_BASE):
        prompts.append([rng.randrange(VOCAB_LO, 8192) for _ in range(rng.randint(5, 70))])
        params.append({"max_new_tokens": rng.randint(6, 28), "temperature": 0})
    return with_repeats(prompts, params)


@pytest.fixture(scope="module")
def workload():
    return make_prompts()


@pytest.fixture(scope="module")
def reference(workload):
    return reference_alone(*workload)


def assert_draft_kv_mirrors_target(engine: Engine) -> None:
    """Draft = the same model: at every slot not free (the radix tree's tokens), the draft's KV
    equals the target's. A slot the target wrote and the draft did not (e.g. the last draft of a
    fully accepted chain) would hold zeros or stale values."""
    sched = engine.scheduler
    target = sched.tp_worker.model_runner.token_to_kv_pool
    draft = sched.spec_worker.draft_runner.token_to_kv_pool
    tree_slots = _tree_slots(sched.tree_cache)  # the engine is idle: every slot not free is the tree's
    assert len(tree_slots) == sched.max_total_num_tokens - sched.token_to_kv_pool_allocator.available_size() > 0
    for layer in range(target.layer_num):
        for a, b in ((target.k_buffer[layer], draft.k_buffer[layer]), (target.v_buffer[layer], draft.v_buffer[layer])):
            diff = (a[tree_slots].float() - b[tree_slots].float()).abs().max().item()
            assert diff < 1e-4, f"layer {layer}: the draft's KV differs from the target's by {diff}"


def _tree_slots(tree) -> torch.Tensor:
    out, stack = [], [tree.root_node]
    while stack:
        node = stack.pop()
        if node.value is not None and len(node.value):
            out.append(node.value.to(torch.int64))
        stack.extend(node.children.values())
    return torch.cat(out)


# ---- greedy equals speculation off --------------------------------------------------------------
CONFIGS = {
    "same_model": ("same", dict()),
    "truncated": ("truncated", dict()),
    "truncated_chunked_prefill_24": ("truncated", dict(chunked_prefill_size=24)),
    "truncated_forced_retract": ("truncated", dict(test_retract_interval=3)),
    "truncated_tiny_pool_retracts": ("truncated", dict(max_total_tokens=300, schedule_conservativeness=0.02,
                                                       chunked_prefill_size=32)),
    "same_model_page_size_4": ("same", dict(page_size=4, chunked_prefill_size=16)),
    # Decoding requests ride in prefill chunks: the draft's extend writes their KV too.
    "same_model_mixed_chunk": ("same", dict(enable_mixed_chunk=True, chunked_prefill_size=16)),
    "truncated_radix_disabled": ("truncated", dict(disable_radix_cache=True)),
    # The overlap loop: the draft model runs on the forward thread too (managers/spec_overlap.py).
    "same_model_overlap": ("same", dict(disable_overlap_schedule=False)),
    "truncated_overlap_tiny_pool_retracts": ("truncated", dict(disable_overlap_schedule=False, max_total_tokens=300,
                                                               schedule_conservativeness=0.02, chunked_prefill_size=32)),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_outputs_equal_speculation_off(name, workload, reference, tiny_path, truncated_path):
    draft, extra = CONFIGS[name]
    kw = dict(max_total_tokens=16384, test_check_memory=True, **spec_kw(tiny_path if draft == "same" else truncated_path))
    kw.update(extra)
    engine = Engine(**kw)
    prompts, params = workload
    results = run_in_two_waves(engine, prompts, params, NUM_BASE)
    assert_same_greedy(results, reference)
    engine.scheduler.check_memory()  # every slot back: free or in the tree
    metas = [r["meta_info"] for r in results]
    # (A request decoded only inside mixed batches had no verify step: no spec_* keys.)
    proposed = sum(m.get("spec_num_proposed_drafts", 0) for m in metas)
    correct = sum(m.get("spec_num_correct_drafts", 0) for m in metas)
    assert proposed > 0
    if draft == "same":  # the target's own argmax: every draft accepted
        assert correct == proposed
        if "mixed" not in name:  # (a mixed batch commits one token per decoding request)
            assert all(m["spec_accept_length"] > 2.0 for m in metas if m["completion_tokens"] > 2 * (NUM_STEPS + 1))
        if "radix_disabled" not in name:
            assert_draft_kv_mirrors_target(engine)
    else:  # two of four layers: some drafts right, some wrong
        assert 0 < correct < proposed
    if "radix_disabled" not in name and "tiny_pool" not in name:  # the repeats found their prompt in the tree
        assert all(m["cached_tokens"] > 0 for m in metas[NUM_BASE:])
    state = engine.scheduler.internal_state()
    assert state["spec_num_correct_drafts"] == correct
    if "retract" in name:
        assert state["num_retractions"] > 0
    if "chunked" in name or "mixed" in name:
        assert state["num_chunked_prefills"] > 0
    if "mixed" in name:
        assert state["num_mixed_batches"] > 0
    engine.shutdown()


def test_parallel_sampling_n_greater_than_one(truncated_path):
    """n = 3 samples of one prompt (greedy: three equal outputs, as without speculation), and
    seeded sampled ones with n = 2 equal speculation off's draws' lengths and the draft is used."""
    prompt = [7, 8, 9, 10, 11, 12, 13]
    sp = {"max_new_tokens": 16, "temperature": 0, "n": 3}
    off = Engine(max_total_tokens=4096).generate(input_ids=prompt, sampling_params=sp, progress=False)
    engine = Engine(max_total_tokens=4096, test_check_memory=True, **spec_kw(truncated_path))
    on = engine.generate(input_ids=prompt, sampling_params=sp, progress=False)
    assert len(on) == 3 and [r["output_ids"] for r in on] == [r["output_ids"] for r in off]
    assert all(r["meta_info"]["spec_num_proposed_drafts"] > 0 for r in on)
    engine.scheduler.check_memory()
    engine.shutdown()


def test_logprobs_of_accepted_tokens_equal_speculation_off(workload, reference, truncated_path):
    prompts, params = workload
    engine = Engine(max_total_tokens=16384, **spec_kw(truncated_path))
    got = run_in_two_waves(engine, prompts, params, NUM_BASE, return_logprob=True, top_logprobs_num=2)
    compared = 0
    for r, ref in zip(got, reference):
        if r["output_ids"] != ref["output_ids"]:
            continue  # a near-tie flipped (test_greedy_outputs_equal_speculation_off tells)
        lp, ref_lp = r["meta_info"]["output_token_logprobs"], ref["meta_info"]["output_token_logprobs"]
        assert [t[1] for t in lp] == r["output_ids"]
        assert max(abs(a[0] - b[0]) for a, b in zip(lp, ref_lp)) < 1e-4
        tops = [[t[1] for t in top] for top in r["meta_info"]["output_top_logprobs"]]
        assert tops == [[t[1] for t in top] for top in ref["meta_info"]["output_top_logprobs"]]
        compared += 1
    assert compared >= len(got) - 1
    assert sum(r["meta_info"]["spec_num_correct_drafts"] for r in got) > 0
    engine.shutdown()


def test_sampled_distribution_equals_speculation_off(tiny_path):
    """Short sampled requests (3 tokens, top_k 3: 27 outcomes), one seed each: the distribution
    of the outputs with speculation matches speculation off (chi-square on the contingency
    table). The draft is the target's argmax: accepted with the target's probability of it,
    rejected otherwise (then the token comes from the residual distribution)."""
    prompt = [5, 17, 99, 250, 1000, 17, 99]
    n = 900

    def params(first_seed: int):  # the two runs draw with different seeds: independent samples
        return [{"max_new_tokens": 3, "temperature": 1.0, "top_k": 3, "sampling_seed": first_seed + s} for s in range(n)]

    engine = Engine(max_total_tokens=16384)
    outs_off = [tuple(r["output_ids"]) for r in engine.generate(input_ids=[prompt] * n, sampling_params=params(0), progress=False)]
    engine.shutdown()
    engine = Engine(max_total_tokens=16384, test_check_memory=True, **spec_kw(tiny_path))
    on = engine.generate(input_ids=[prompt] * n, sampling_params=params(n), progress=False)
    engine.shutdown()
    outs_on = [tuple(r["output_ids"]) for r in on]
    metas = [r["meta_info"] for r in on]
    proposed = sum(m["spec_num_proposed_drafts"] for m in metas)
    correct = sum(m["spec_num_correct_drafts"] for m in metas)
    assert proposed == n  # every request drafts its second token (its third is its last: no room)
    assert 0.1 * proposed < correct < 0.9 * proposed
    keys = sorted(set(outs_off) | set(outs_on))
    table = [[outs_off.count(k) for k in keys], [outs_on.count(k) for k in keys]]
    # Outcomes too rare for the test are pooled.
    common = [j for j in range(len(keys)) if table[0][j] + table[1][j] >= 10]
    rare = [j for j in range(len(keys)) if j not in common]
    rows = [[r[j] for j in common] + [sum(r[j] for j in rare)] for r in table]
    rows = [r[:-1] for r in rows] if rows[0][-1] + rows[1][-1] == 0 else rows
    assert chi2_contingency(rows).pvalue > 1e-3


def test_requests_that_cannot_draft_decode_plainly_beside_drafting_ones(tiny_path):
    """A penalized request gets no drafts (its next token depends on the tokens before it) but
    shares verify forwards with one that drafts: both equal speculation off."""
    prompts = [[20, 21, 22, 23, 24, 25], [30, 31, 32, 33]]
    sps = [{"max_new_tokens": 20, "temperature": 0}, {"max_new_tokens": 20, "temperature": 0, "frequency_penalty": 1.0}]
    off = Engine(max_total_tokens=4096).generate(input_ids=prompts, sampling_params=sps, progress=False)
    engine = Engine(max_total_tokens=4096, test_check_memory=True, **spec_kw(tiny_path))
    on = engine.generate(input_ids=prompts, sampling_params=sps, progress=False)
    assert [r["output_ids"] for r in on] == [r["output_ids"] for r in off]
    assert on[0]["meta_info"]["spec_num_correct_drafts"] > 0
    assert on[1]["meta_info"]["spec_num_proposed_drafts"] == 0 and on[1]["meta_info"]["spec_verify_ct"] > 0
    engine.shutdown()


# ---- flags ---------------------------------------------------------------------------------------
def test_chain_flags_follow_sglang(tiny_path):
    """topk 1: num_draft_tokens = num_steps + 1 (given either way; SGLang adjusts a mismatch)."""
    a = ServerArgs(speculative_algorithm="standalone", speculative_draft_model_path=tiny_path)
    assert (a.speculative_num_steps, a.speculative_eagle_topk, a.speculative_num_draft_tokens) == (3, 1, 4)
    a = ServerArgs(speculative_algorithm="STANDALONE", speculative_draft_model_path=tiny_path, speculative_num_draft_tokens=6)
    assert (a.speculative_num_steps, a.speculative_num_draft_tokens) == (5, 6)
    a = ServerArgs(speculative_algorithm="STANDALONE", speculative_draft_model_path=tiny_path, speculative_num_steps=2,
                   speculative_num_draft_tokens=8)
    assert (a.speculative_num_steps, a.speculative_num_draft_tokens) == (2, 3)


@pytest.mark.parametrize("kw, message", [
    (dict(), "needs --speculative-draft-model-path"),
    (dict(speculative_draft_model_path="/nonexistent/draft"), "no such file"),
    (dict(speculative_draft_model_path="TINY", speculative_eagle_topk=4), "--speculative-eagle-topk"),
    (dict(speculative_draft_model_path="TINY", speculative_num_steps=0), "--speculative-num-steps"),
    (dict(speculative_draft_model_path="TINY", disable_overlap_schedule=False, enable_mixed_chunk=True), "--enable-mixed-chunk"),
    (dict(speculative_draft_model_path="TINY", tp_size=2), "--tp-size"),
    (dict(speculative_draft_model_path="TINY", is_embedding=True), "--is-embedding"),
    (dict(speculative_draft_model_path="TINY", disaggregation_mode="decode"), "--disaggregation-mode"),
])
def test_combinations_not_built_are_refused_at_start(kw, message, tiny_path):
    kw = {k: (tiny_path if v == "TINY" else v) for k, v in kw.items()}
    with pytest.raises(ValueError, match=message):
        ServerArgs(speculative_algorithm="STANDALONE", **kw)


def test_draft_of_another_vocabulary_is_refused_at_start(tmp_path):
    draft = make_hf_model_dir("qwen3", str(tmp_path / "vocab512"))  # 512 tokens, the tiny model has 8192
    with pytest.raises(ValueError, match="vocabulary of 512 tokens, the target's has 8192"):
        Engine(max_total_tokens=4096, **spec_kw(draft))


def test_draft_kv_is_counted_in_the_cpu_budget(tiny_path, truncated_path):
    """The pool's slots hold the target's KV and the draft's: one budget buys fewer slots."""
    budget = 64 * 1024**2
    off = Engine(device="cpu", cpu_kv_cache_bytes=budget)
    on = Engine(device="cpu", cpu_kv_cache_bytes=budget, **spec_kw(truncated_path))
    n_off, n_on = off.scheduler.max_total_num_tokens, on.scheduler.max_total_num_tokens
    # The tiny model has 4 layers, the truncated draft 2 (same heads): 2/3 of the slots.
    assert abs(n_on - n_off * 4 / 6) <= 1
    assert on.scheduler.spec_worker.draft_runner.token_to_kv_pool.size == n_on
    off.shutdown()
    on.shutdown()


# ---- the real model ------------------------------------------------------------------------------
def test_smollm2_greedy_outputs_equal_speculation_off():
    """The real SmolLM2-135M (float32), draft = the same GGUF: the tokens and logprobs of
    speculation off, every draft accepted."""
    from real_model import chat_prompt_ids

    path = str(smollm2_gguf())
    kw = dict(model_path=path, dtype="float32", max_total_tokens=2048)
    sp = {"max_new_tokens": 16, "temperature": 0}
    questions = ["What is the capital of France?", "Write a haiku about the sea."]
    engine = Engine(**kw)
    prompts = [chat_prompt_ids(engine.tokenizer, q) for q in questions]
    off = engine.generate(input_ids=prompts, sampling_params=[sp] * len(prompts), return_logprob=True, progress=False)
    engine.shutdown()
    engine = Engine(**kw, test_check_memory=True, **spec_kw(path))
    on = engine.generate(input_ids=prompts, sampling_params=[sp] * len(prompts), return_logprob=True, progress=False)
    engine.scheduler.check_memory()
    engine.shutdown()
    assert [r["output_ids"] for r in on] == [r["output_ids"] for r in off]
    for a, b in zip(on, off):
        lp_on, lp_off = a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
        assert max(abs(x[0] - y[0]) for x, y in zip(lp_on, lp_off)) < 1e-4
        m = a["meta_info"]
        assert m["spec_num_correct_drafts"] == m["spec_num_proposed_drafts"] > 0
