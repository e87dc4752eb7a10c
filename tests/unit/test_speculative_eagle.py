"""Issue 27, EAGLE speculative decoding: a draft head on the target's hidden states drafts a token
tree (--speculative-eagle-topk branches, --speculative-num-steps levels), verified in one target
forward under the tree mask. Greedy outputs equal speculation off (a random head on the tiny
model, whose drafts are rejected; a head that is nearly its target, whose drafts are accepted)
under chunked prefill, retraction, radix-cache hits and pages; logprobs; the sampled
distribution equals speculation off; slot conservation after every step; the flags; SmolLM2."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Dict

import pytest
from scipy.stats import chi2_contingency

from radixserve.engine import Engine
from radixserve.models.model_config import ModelConfig
from radixserve.server_args import ServerArgs
from radixserve.tiny_model import get_tiny_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eagle_head import make_copy_pair, make_random_eagle_head  # noqa: E402
from real_model import chat_prompt_ids, smollm2_gguf  # noqa: E402
from greedy_testing import assert_same_greedy, reference_alone, run_in_two_waves, with_repeats  # noqa: E402

TREE = dict(speculative_num_steps=3, speculative_eagle_topk=3, speculative_num_draft_tokens=6)
CHAIN = dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)


def eagle_kw(head: str, shape: Dict, **kw) -> Dict:
    return dict(speculative_algorithm="EAGLE", speculative_draft_model_path=head, **shape, **kw)


@pytest.fixture(scope="module")
def random_head(tmp_path_factory) -> str:
    cfg = ModelConfig.from_pretrained(str(get_tiny_model_path())).hf_config
    return make_random_eagle_head(cfg, str(tmp_path_factory.mktemp("eagle") / "random"))


@pytest.fixture(scope="module")
def copy_pair(tmp_path_factory):
    return make_copy_pair(str(tmp_path_factory.mktemp("eagle_copy")))


# ---- workload and reference (the tiny model) ---------------------------------------------------
NUM_BASE = 8


def make_prompts(vocab: int = 8192, seed: int = 0):
    """8 random prompts, then 4 of them again (radix-cache hits of their prompt and output)."""
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(NUM_BASE):
        prompts.append([rng.randrange(3, vocab) for _ in range(rng.randint(5, 60))])
        params.append({"max_new_tokens": rng.randint(6, 24), "temperature": 0})
    return with_repeats(prompts, params)


@pytest.fixture(scope="module")
def workload():
    return make_prompts()


@pytest.fixture(scope="module")
def reference(workload):
    return reference_alone(*workload)


CONFIGS = {
    "tree": (TREE, dict()),
    "chain": (CHAIN, dict()),
    "tree_chunked_prefill_16": (TREE, dict(chunked_prefill_size=16)),
    "tree_forced_retract": (TREE, dict(test_retract_interval=3)),
    "tree_page_size_4": (TREE, dict(page_size=4, chunked_prefill_size=32)),
    "tree_radix_disabled": (TREE, dict(disable_radix_cache=True)),
    "tree_mixed_chunk": (TREE, dict(enable_mixed_chunk=True, chunked_prefill_size=32)),
    # The overlap loop: the tree's scratch slots come from those reserved ahead (overlap_view.py).
    "tree_overlap": (TREE, dict(disable_overlap_schedule=False)),
    "tree_overlap_forced_retract_page_size_4": (TREE, dict(disable_overlap_schedule=False, test_retract_interval=3,
                                                           page_size=4, chunked_prefill_size=32)),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_outputs_equal_speculation_off(name, random_head, workload, reference):
    shape, extra = CONFIGS[name]
    prompts, params = workload
    engine = Engine(max_total_tokens=16384, test_check_memory=True, **eagle_kw(random_head, shape, **extra))
    results = run_in_two_waves(engine, prompts, params, NUM_BASE)
    assert_same_greedy(results, reference)
    engine.scheduler.check_memory()  # every slot back: free or in the tree; the scratch slots too
    metas = [r["meta_info"] for r in results]
    if name != "tree_mixed_chunk":  # there, a request may decode only inside prefill batches
        assert all(m["spec_verify_ct"] >= 1 for m in metas if m["completion_tokens"] > 1)
    proposed = engine.scheduler.internal_state()["spec_num_proposed_drafts"]
    assert proposed >= sum(m.get("spec_verify_ct", 0) for m in metas)  # every step verified drafts
    if "retract" in name:
        assert engine.scheduler.internal_state()["num_retractions"] > 0
    engine.shutdown()


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_a_head_that_knows_its_target_gets_its_drafts_accepted(shape, copy_pair):
    """The draft pipeline end to end (the head's KV, positions, tree forwards, the state carried
    between steps): with a head that is nearly its target, most drafts are accepted, and the
    outputs still equal speculation off."""
    target, head = copy_pair
    prompts, params = make_prompts(vocab=512, seed=1)
    kw = dict(model_path=target, skip_tokenizer_init=True)
    reference = reference_alone(prompts, params, **kw)
    engine = Engine(max_total_tokens=16384, test_check_memory=True, **kw, **eagle_kw(head, shape))
    results = run_in_two_waves(engine, prompts, params, NUM_BASE)
    assert_same_greedy(results, reference)
    metas = [r["meta_info"] for r in results if r["meta_info"]["completion_tokens"] > 4]
    assert sum(m["spec_accept_length"] for m in metas) / len(metas) > 2.0
    engine.shutdown()


def test_logprobs_equal_speculation_off(copy_pair):
    target, head = copy_pair
    prompts, params = make_prompts(vocab=512, seed=2)
    kw = dict(model_path=target, skip_tokenizer_init=True)
    reference = reference_alone(prompts[:4], params[:4], **kw)
    engine = Engine(max_total_tokens=16384, **kw, **eagle_kw(head, TREE))
    got = engine.generate(input_ids=prompts[:4], sampling_params=params[:4], return_logprob=True, top_logprobs_num=2,
                          progress=False)
    for g, r in zip(got, reference):
        assert g["output_ids"] == r["output_ids"]
        for (lp, tok, _), (rlp, rtok, _) in zip(g["meta_info"]["output_token_logprobs"], r["meta_info"]["output_token_logprobs"]):
            assert tok == rtok and lp == pytest.approx(rlp, abs=1e-4)
        assert [[t[1] for t in top] for top in g["meta_info"]["output_top_logprobs"]] == \
            [[t[1] for t in top] for top in r["meta_info"]["output_top_logprobs"]]
    engine.shutdown()


def test_sampled_distribution_equals_speculation_off(copy_pair):
    """Three tokens after one prompt at temperature 1, over many seeds: the joint distribution of
    the first two tokens with EAGLE's tree is that of speculation off (chi-square)."""
    target, head = copy_pair
    prompt = [7, 100, 42, 3, 99, 250, 17, 8]
    n = 300
    params = [{"max_new_tokens": 3, "temperature": 1.0, "top_k": 4, "sampling_seed": s} for s in range(n)]
    counts = []
    for spec in (dict(), eagle_kw(head, TREE)):
        engine = Engine(model_path=target, skip_tokenizer_init=True, max_total_tokens=16384, **spec)
        outs = engine.generate(input_ids=[prompt] * n, sampling_params=params, progress=False)
        if spec:
            assert sum(o["meta_info"]["spec_accept_length"] for o in outs) / n > 1.2  # drafts were accepted
        counts.append([tuple(o["output_ids"][:2]) for o in outs])
        engine.shutdown()
    keys = sorted(set(counts[0]) | set(counts[1]))
    table = [[c.count(k) for k in keys] for c in counts]
    # pairs seen rarely pooled into one column (chi-square wants expected counts of ~5)
    big = [j for j in range(len(keys)) if table[0][j] + table[1][j] >= 10]
    rest = [j for j in range(len(keys)) if j not in big]
    rows = [[r[j] for j in big] + [sum(r[j] for j in rest)] for r in table]
    assert chi2_contingency(rows).pvalue > 1e-3


# ---- flags ---------------------------------------------------------------------------------------
def test_eagle_flags_and_defaults(random_head):
    args = ServerArgs(speculative_algorithm="eagle", speculative_draft_model_path=random_head)
    # SGLang's defaults when none of the three is given
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (5, 4, 8)
    chain = ServerArgs(speculative_algorithm="EAGLE", speculative_draft_model_path=random_head,
                       speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=9)
    assert chain.speculative_num_draft_tokens == 4  # a chain verifies num_steps + 1 tokens


@pytest.mark.parametrize("kw,message", [
    (dict(speculative_draft_model_path=None), "needs --speculative-draft-model-path"),
    (dict(speculative_draft_model_path="/nonexistent/eagle"), "no such file"),
    (dict(speculative_eagle_topk=0), "--speculative-eagle-topk must be >= 1"),
    (dict(disable_overlap_schedule=False, enable_mixed_chunk=True), "--enable-mixed-chunk"),
    (dict(tp_size=2), "--tp-size"),
])
def test_combinations_not_built_are_refused_at_start(kw, message, random_head):
    kw = {"speculative_draft_model_path": random_head, **kw}
    if "speculative_eagle_topk" in kw:
        kw.update(speculative_num_steps=3, speculative_num_draft_tokens=4)
    with pytest.raises(ValueError, match=message):
        ServerArgs(speculative_algorithm="EAGLE", **kw)


def test_a_head_of_another_width_or_a_full_model_is_refused(tmp_path):
    cfg = dict(ModelConfig.from_pretrained(str(get_tiny_model_path())).hf_config, hidden_size=128)
    head = make_random_eagle_head(cfg, str(tmp_path / "narrow"))
    with pytest.raises(ValueError, match="hidden size 128, the target's is 256"):
        Engine(**eagle_kw(head, CHAIN))
    with pytest.raises(ValueError, match="is not an EAGLE head"):
        Engine(**eagle_kw(str(get_tiny_model_path()), CHAIN))


# ---- the real model ------------------------------------------------------------------------------
def test_smollm2_greedy_outputs_equal_speculation_off(tmp_path):
    """SmolLM2-135M (the CPU's bf16 mode) with a random head: the tokens of speculation off."""
    path = str(smollm2_gguf())
    head = make_random_eagle_head(ModelConfig.from_pretrained(path).hf_config, str(tmp_path / "smol_head"))
    kw = dict(model_path=path, dtype="bfloat16", max_total_tokens=2048)
    sp = {"max_new_tokens": 12, "temperature": 0}
    questions = ["What is the capital of France?", "Write a haiku about the sea."]
    engine = Engine(**kw)
    prompts = [chat_prompt_ids(engine.tokenizer, q) for q in questions]
    off = engine.generate(input_ids=prompts, sampling_params=[sp] * 2, progress=False)
    engine.shutdown()
    engine = Engine(test_check_memory=True, **kw, **eagle_kw(head, TREE))
    on = engine.generate(input_ids=prompts, sampling_params=[sp] * 2, progress=False)
    assert [o["output_ids"] for o in on] == [o["output_ids"] for o in off]
    engine.shutdown()
