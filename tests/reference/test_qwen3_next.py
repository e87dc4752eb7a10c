"""Qwen3-Next (issue 41 step 2: GatedDeltaNet linear attention with its state pool) against
transformers on the same random weights, float32: logits of a ragged prefill (one request longer
than a delta-rule chunk), a chunked prefill that splits a linear-attention sequence (beside a new
request in the same batch), batched decode steps; the Engine's greedy tokens and logprobs under
both event loops; state slots conserved after finishes, aborts and retractions; what does not
combine refused at start. (The hybrid radix cache: test_hybrid_radix_cache.py.)

The weights are scaled so that transformers' own float32 logits are within ~2e-5 of its float64
ones (the decays exp(g) kept moderate: with A up to 16, as transformers initializes it, the
cumulative log decays of a 64-token chunk reach ~-1000 and float32 rounding alone moves the
logits by 2e-4, above the tolerance)."""

from __future__ import annotations

import random
from typing import List, Optional

import pytest
import torch
import transformers

from hf_utils import KVDriver, hf_logits, load_hf, make_runner

from radixserve import Engine
from radixserve.hf_transformers_utils import LoadError
from radixserve.layers.gated_delta_net import GatedDeltaNet
from radixserve.layers.moe import SparseMoeBlock
from radixserve.mem_cache.mamba_radix_cache import MambaRadixCache
from radixserve.mem_cache.mamba_pool import HybridReqToTokenPool, MambaPool, MambaStateShape
from radixserve.models.model_config import ModelConfig
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs

TOL = 1e-4
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              shared_expert_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, num_experts=8, num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=512,
              layer_types=LAYER_TYPES, mlp_only_layers=[2])  # layer 2: a dense MLP after linear attention

_rng = random.Random(0)
LONG = [_rng.randrange(512) for _ in range(100)]  # > one 64-token chunk of the delta rule
SHORT = [_rng.randrange(512) for _ in range(30)]
MID = [_rng.randrange(512) for _ in range(45)]


def randomize_(model: torch.nn.Module) -> None:
    """Random weights whose float32 logits transformers computes to ~2e-5 (module docstring)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # the router's too: well-separated expert choices
                p.normal_(0, p.shape[-1] ** -0.5 * (2.0 if name.endswith("mlp.gate.weight") else 1.0))
            elif name.endswith("A_log"):  # decay rates A in [0.05, 0.5] (see the module docstring)
                p.copy_(torch.empty_like(p).uniform_(0.05, 0.5).log())
            elif name.endswith("dt_bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "linear_attn.norm" in name:  # the gated norm's scale is its weight
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:  # the zero-centered norms: scale 1 + weight
                p.copy_(0.1 * torch.randn_like(p))


def make_next_dir(out_dir: str, seed: int = 0, config_class=transformers.Qwen3NextConfig, config: Optional[dict] = None,
                  **overrides) -> str:
    """A saved random model of config_class with `config` (default: Qwen3-Next's CONFIG; Qwen3.5's
    in test_qwen3_5.py)."""
    cfg = config_class(**{**(CONFIG if config is None else config), **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize_(model)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory):
    return make_next_dir(str(tmp_path_factory.mktemp("qwen3_next")))


@pytest.fixture(scope="module")
def hf(next_dir):
    return load_hf(next_dir)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def test_layers_and_pools_follow_the_config(next_dir):
    runner = make_runner(next_dir, max_running_requests=8)
    layers = runner.model.model.layers
    assert [isinstance(getattr(layer, "linear_attn", None), GatedDeltaNet) for layer in layers] == [True, False, True, True]
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == [True, True, False, True]
    assert all(layer.mlp.shared_expert is not None for layer in layers if isinstance(layer.mlp, SparseMoeBlock))
    assert runner.token_to_kv_pool.layer_num == 1  # the full-attention layer's KV only
    pool = runner.req_to_token_pool
    # a slot per row and as many again for the radix cache's snapshots
    assert isinstance(pool, HybridReqToTokenPool) and pool.mamba_pool.size == 2 * (runner.max_running_requests + 1)
    assert pool.mamba_pool.temporal_state.shape == (3, 19, 4, 16, 8)  # 3 linear layers, 18 slots + padding
    assert pool.mamba_pool.conv_state.shape == (3, 19, 3, 2 * 32 + 32)


def test_ragged_prefill_and_decode_match_transformers(next_dir, hf):
    runner = make_runner(next_dir, max_running_requests=8)
    rows = runner.req_to_token_pool.alloc(2)
    drv = KVDriver(runner, scatter_seed=1)
    la, lb = hf_logits(hf, LONG + [20, 21, 22]), hf_logits(hf, SHORT + [30, 31, 32])
    out = drv.extend(rows, [0, 0], [LONG, SHORT]).all_logits
    errs = [_max_err(out, torch.cat([la[:100], lb[:30]]))]
    lens = [100, 30]
    for t in range(3):
        out = drv.decode(rows, lens, [20 + t, 30 + t]).next_token_logits
        errs.append(_max_err(out, torch.stack([la[100 + t], lb[30 + t]])))
        lens = [n + 1 for n in lens]
    assert max(errs) <= TOL, errs


def test_chunked_prefill_continues_from_the_saved_state(next_dir, hf):
    """LONG in three chunks (37, 50, 13 tokens: none a multiple of the conv kernel or of a delta-rule
    chunk), the second one batched with the first chunk of another request (which must start from
    zeros, not from its slot's leftovers); then a decode step of both."""
    runner = make_runner(next_dir, max_running_requests=1, disable_radix_cache=True)  # 2 rows, 2 state slots
    pool = runner.req_to_token_pool
    stale = pool.alloc(2)  # leave states in both slots, then hand them to the requests below
    drv = KVDriver(runner)
    drv.extend(stale, [0, 0], [SHORT, MID])
    stale_slots = sorted(pool.mamba_index_cpu[r] for r in stale)
    pool.free(stale)
    rows = pool.alloc(2)
    assert sorted(pool.mamba_index_cpu[r] for r in rows) == stale_slots
    la, lm = hf_logits(hf, LONG + [7]), hf_logits(hf, MID + [9])
    errs = [_max_err(drv.extend(rows[:1], [0], [LONG[:37]]).all_logits, la[:37])]
    out = drv.extend(rows, [37, 0], [LONG[37:87], MID]).all_logits
    errs += [_max_err(out[:50], la[37:87]), _max_err(out[50:], lm[:45])]
    errs.append(_max_err(drv.extend(rows[:1], [87], [LONG[87:]]).all_logits, la[87:100]))
    out = drv.decode(rows, [100, 45], [7, 9]).next_token_logits
    errs.append(_max_err(out, torch.stack([la[100], lm[45]])))
    assert max(errs) <= TOL, errs


def _tp_rank(rank: int, addr: str, model_dir: str, out_path: str, ep_size: int) -> None:
    """One rank of --tp-size 2: a ragged prefill, a chunk continuing LONG, decode steps."""
    from radixserve.distributed.parallel_state import destroy_distributed_environment

    args = ServerArgs(model_path=model_dir, dtype="float32", device="cpu", max_total_tokens=2048,
                      max_running_requests=8, tp_size=2, ep_size=ep_size, dist_init_addr=addr)
    runner = ModelRunner(ModelConfig.from_pretrained(model_dir), args, rank, 2)
    rows = runner.req_to_token_pool.alloc(2)
    drv = KVDriver(runner, scatter_seed=1)
    out = [drv.extend(rows, [0, 0], [LONG[:60], SHORT]).all_logits, drv.extend(rows[:1], [60], [LONG[60:]]).all_logits]
    lens = [100, 30]
    for t in range(3):
        out.append(drv.decode(rows, lens, [20 + t, 30 + t]).next_token_logits)
        lens = [n + 1 for n in lens]
    gdn = next(layer.linear_attn for layer in runner.model.model.layers if layer.is_linear)
    torch.save({"logits": out, "temporal": tuple(runner.req_to_token_pool.mamba_pool.temporal_state.shape),
                "conv_dim": gdn.conv_dim, "heads": runner.model.model.layers[1].self_attn.num_heads}, f"{out_path}.{rank}")
    destroy_distributed_environment()


@pytest.mark.parametrize("ep_size", [1, 2], ids=["tp2", "tp2_ep2"])
def test_tensor_parallel_2_splits_the_heads(next_dir, hf, tmp_path, ep_size):
    """--tp-size 2: each rank holds half of the linear-attention heads (their projections, conv
    channels, decays and states) and half of the full-attention heads (with --ep-size 2 also half
    of the experts, whole), and the logits of a ragged prefill, a chunk that continues a
    linear-attention sequence and decode steps are still transformers'."""
    import multiprocessing as mp
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from processes import free_port, run_processes

    out = tmp_path / "tp2.pt"
    addr = f"127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    run_processes([ctx.Process(target=_tp_rank, args=(r, addr, next_dir, str(out), ep_size)) for r in range(2)])
    la, lb = hf_logits(hf, LONG + [20, 21, 22]), hf_logits(hf, SHORT + [30, 31, 32])
    ref = [torch.cat([la[:60], lb[:30]]), la[60:100]] + [torch.stack([la[100 + t], lb[30 + t]]) for t in range(3)]
    cfg = CONFIG
    for rank in range(2):
        res = torch.load(f"{out}.{rank}")
        heads = cfg["linear_num_value_heads"] // 2
        assert res["temporal"][2:] == (heads, cfg["linear_key_head_dim"], cfg["linear_value_head_dim"])
        assert res["conv_dim"] == (2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
                                   + cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]) // 2
        assert res["heads"] == cfg["num_attention_heads"] // 2
        errs = [_max_err(a, b) for a, b in zip(res["logits"], ref)]
        assert max(errs) <= TOL, (rank, errs)


def _greedy_reference(hf, prompt: List[int], ids: List[int]) -> torch.Tensor:
    return hf_logits(hf, prompt + ids)[len(prompt) - 1 : -1]


@pytest.mark.parametrize("loop", [dict(disable_overlap_schedule=True), dict(disable_overlap_schedule=False),
                                  dict(disable_overlap_schedule=True, enable_mixed_chunk=True)],
                         ids=["normal", "overlap", "mixed_chunk"])
def test_the_engine_greedy_matches_transformers(next_dir, hf, loop):
    engine = Engine(next_dir, dtype="float32", skip_tokenizer_init=True, chunked_prefill_size=16,
                    max_total_tokens=2048, test_check_memory=True, **loop)
    try:
        assert isinstance(engine.scheduler.tree_cache, MambaRadixCache)  # in both loops
        prompts = [LONG, SHORT, MID]
        outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 8, "temperature": 0},
                               return_logprob=True, progress=False)
        engine.scheduler.check_memory()
    finally:
        engine.shutdown()
    for prompt, out in zip(prompts, outs):
        ids = out["output_ids"]
        ref = _greedy_reference(hf, prompt, ids)
        assert ids == ref.argmax(-1).tolist()
        lp = torch.tensor([v for v, _, _ in out["meta_info"]["output_token_logprobs"]])
        assert (lp - torch.log_softmax(ref, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)).abs().max() <= TOL


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_state_slots_conserved_under_aborts_and_retractions(next_dir, hf, overlap):
    """3 state slots for 8 requests, a retraction every 3 decode steps, aborts of a chunked, a
    waiting and a running request: the slots pair with the rows after every step
    (--test-check-memory), all are free at the end, and the survivors' greedy tokens are still
    transformers' (a retracted request restarts its states from zeros)."""
    engine = Engine(next_dir, dtype="float32", skip_tokenizer_init=True, chunked_prefill_size=16,
                    max_total_tokens=2048, max_running_requests=3, test_retract_interval=3,
                    disable_overlap_schedule=not overlap, test_check_memory=True)
    sched = engine.scheduler
    pool = sched.req_to_token_pool.mamba_pool
    assert sched.max_running_requests == 3 and pool.size == 8  # 4 rows' slots + 4 for snapshots
    rng = random.Random(2)
    prompts = [LONG] + [[rng.randrange(512) for _ in range(rng.randint(5, 40))] for _ in range(7)]
    try:
        reqs = engine.submit(input_ids=prompts, sampling_params={"max_new_tokens": 10, "temperature": 0, "ignore_eos": True})
        engine.step()
        assert sched.chunked_req is not None and sched.chunked_req.rid == reqs[0].rid
        engine.abort(reqs[0].rid)  # chunked
        engine.abort(reqs[7].rid)  # waiting
        for _ in range(6):
            engine.step()
        running = [r.rid for r in sched.running_batch.reqs]
        assert running, "some requests should be decoding"
        engine.abort(running[0])  # running
        while sched.has_work():
            engine.step()
        snapshots = len(sched.tree_cache.all_mamba_values_flatten())
        assert pool.available_size() + snapshots == pool.size
        assert sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size
        sched.check_memory()
        assert sched.stats.num_retracted_reqs > 0
    finally:
        engine.shutdown()
    aborted = {reqs[0].rid, reqs[7].rid, running[0]}
    for prompt, r in zip(prompts, reqs):
        if r.rid in aborted:
            assert r.finished_reason["type"] == "abort"
            continue
        assert r.finished_reason == {"type": "length", "length": 10}
        assert r.output_ids == _greedy_reference(hf, prompt, r.output_ids).argmax(-1).tolist()


def test_state_pool_pairs_a_slot_with_each_row():
    shape = MambaStateShape(num_layers=2, conv_dim=8, conv_kernel=4, num_heads=2, head_k_dim=4, head_v_dim=4)
    pool = HybridReqToTokenPool(3, 16, MambaPool(3, shape, torch.float32))
    rows = pool.alloc(3)
    assert sorted(pool.mamba_index_cpu) == [1, 2, 3] and pool.alloc(1) is None
    assert pool.mamba_indices(torch.tensor(rows)).tolist() == [pool.mamba_index_cpu[r] for r in rows]
    pool.check_state_slots(rows)
    pool.free(rows[1])
    assert pool.mamba_pool.available_size() == 1 and pool.mamba_index_cpu[rows[1]] == 0
    pool.check_state_slots([rows[0], rows[2]])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(rows[1])
    pool.mamba_pool.free_slots.pop()  # lose a slot: the check names it
    with pytest.raises(RuntimeError, match="not conserved"):
        pool.check_state_slots([rows[0]])
    assert shape.bytes_per_slot(torch.float32) == 2 * (3 * 8 * 4 + 2 * 4 * 4 * 4)


@pytest.mark.parametrize("flags, what", [
    (dict(speculative_algorithm="NGRAM"), "--speculative-algorithm NGRAM"),  # (EAGLE / NEXTN chains run: test_qwen3_next_mtp.py)
    (dict(enable_hierarchical_cache=True), "--enable-hierarchical-cache"),
    (dict(pp_size=2), "--pp-size > 1"),
    (dict(enable_lora=True, lora_paths=[]), "--enable-lora"),
    (dict(disaggregation_mode="decode"), "--disaggregation-mode"),
    (dict(load_format="dummy"), "--load-format dummy"),
])
def test_what_does_not_combine_is_refused_at_start(next_dir, flags, what):
    args = ServerArgs(model_path=next_dir, dtype="float32", device="cpu", max_total_tokens=1024, **flags)
    with pytest.raises(LoadError) as e:
        ModelRunner(ModelConfig.from_pretrained(next_dir), args)
    msg = str(e.value)
    assert "\n" not in msg and f"does not run with {what} yet" in msg


def test_the_state_pool_comes_off_the_kv_budget(next_dir):
    budget = 8 * 2**20
    runner = make_runner(next_dir, max_total_tokens=None, cpu_kv_cache_bytes=budget, max_running_requests=16)
    state = runner.mamba_pool.mem_bytes()
    # two slots per row (its own, a snapshot's) + padding
    assert state == (2 * 17 + 1) * runner.model.mamba_state_shape().bytes_per_slot(torch.float32)
    per_token = 2 * 2 * 16 * 4  # K and V, 2 KV heads of 16 floats, one full-attention layer
    assert runner.max_total_num_tokens == (budget - state) // per_token


def test_cpu_bf16_mode_is_no_further_from_float32_than_transformers_bf16(next_dir, hf):
    """The CPU's bf16 mode (bf16 weights packed for the C++ GEMM, float32 activations and states):
    on a 100-token prefill, on average no further from float32 transformers than transformers' own
    bf16 run, and its argmax as often right (within 5%)."""
    from radixserve.layers.cpu_weight_only import weight_only_available

    if not weight_only_available(torch.bfloat16, "cpu"):
        pytest.fail("this test needs the C++ bf16 GEMM (a CPU with AVX512_BF16 or AVX2 + FMA)")
    runner = make_runner(next_dir, dtype="bfloat16", max_running_requests=4)
    assert runner.mamba_pool.temporal_state.dtype == torch.float32
    ours = KVDriver(runner).extend(runner.req_to_token_pool.alloc(1), [0], [LONG]).all_logits.float()
    ref = hf_logits(hf, LONG)
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(next_dir, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        theirs = hf16(torch.tensor([LONG])).logits[0].float()
    assert (ours - ref).abs().mean() <= (theirs - ref).abs().mean(), ((ours - ref).abs().mean(), (theirs - ref).abs().mean())
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= (theirs.argmax(-1) == ref.argmax(-1)).float().mean() - 0.05


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_state_slots_survive_a_storm_of_aborts_and_retractions(next_dir, hf, overlap):
    """24 requests arriving over time for 4 slots, a retraction every 2 decode steps, a third of
    them aborted at random moments (waiting, chunked or running): --test-check-memory pairs rows
    and slots after every step, all slots are free at the end, and every survivor's tokens are
    transformers' greedy ones."""
    engine = Engine(next_dir, dtype="float32", skip_tokenizer_init=True, chunked_prefill_size=24,
                    max_total_tokens=2048, max_running_requests=4, test_retract_interval=2,
                    disable_overlap_schedule=not overlap, test_check_memory=True)
    sched, rng = engine.scheduler, random.Random(5)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(3, 70))] for _ in range(24)]
    reqs, aborted = [], set()
    try:
        for i, prompt in enumerate(prompts):
            reqs += engine.submit(input_ids=prompt, sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
            for _ in range(rng.randint(0, 2)):
                engine.step()
            if rng.random() < 0.35:
                victim = rng.choice([r for r in reqs if not r.finished])  # in whatever state it is
                engine.abort(victim.rid)
                aborted.add(victim.rid)
        while sched.has_work():
            engine.step()
        assert sched.stats.num_retracted_reqs > 0
        pool = sched.req_to_token_pool.mamba_pool
        assert pool.available_size() + len(sched.tree_cache.all_mamba_values_flatten()) == pool.size
        sched.check_memory()
    finally:
        engine.shutdown()
    check_storm_survivors(hf, prompts, reqs, aborted, at_least=12)


def check_storm_survivors(hf, prompts: List[List[int]], reqs: list, aborted: set, at_least: int) -> None:
    """After a storm of aborts and retractions: enough requests were left to run to their end,
    and each one's greedy tokens are still transformers'."""
    survivors = [(p, r) for p, r in zip(prompts, reqs) if r.rid not in aborted]
    assert len(survivors) >= at_least
    for prompt, r in survivors:
        assert r.finished_reason == {"type": "length", "length": 6}
        assert r.output_ids == _greedy_reference(hf, prompt, r.output_ids).argmax(-1).tolist()


def test_a_state_pool_beyond_the_budget_is_refused_with_its_size(next_dir):
    with pytest.raises(RuntimeError, match="after the state pool's .* MB \\(lower --max-running-requests\\)"):
        make_runner(next_dir, max_total_tokens=None, cpu_kv_cache_bytes=2**20, max_running_requests=200)
