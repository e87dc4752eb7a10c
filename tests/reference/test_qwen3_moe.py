"""Qwen3-MoE (issue 41, its first model with experts) against transformers on the same random
weights, float32: logits at every position of a ragged prefill, an extend after a cached prefix
and decode steps (with the router's renormalization on and off, a dense layer among the sparse
ones); tensor parallelism 2 (gloo) splitting every expert; the Engine's greedy tokens and
logprobs; and --load-format dummy naming and shaping every tensor as the checkpoint does."""

from __future__ import annotations

import multiprocessing as mp
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from hf_utils import KVDriver, hf_logits, load_hf, make_runner

from radixserve import Engine
from radixserve.layers.moe import FusedMoE, SparseMoeBlock
from radixserve.model_executor.model_loader import checkpoint_shapes
from radixserve.models.model_config import ModelConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from processes import free_port, run_processes  # noqa: E402

TOL = 1e-4
CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
              max_position_embeddings=512, mlp_only_layers=[1])  # layers 0 and 2 sparse, layer 1 dense
PROMPTS = [[5, 17, 200, 3, 99, 41, 7, 300, 12], [450, 2, 2, 61, 88, 130, 7, 9, 10, 11, 500, 42, 1, 77]]


def make_moe_dir(out_dir: str, seed: int = 0, **overrides) -> str:
    cfg = transformers.Qwen3MoeConfig(**{**CONFIG, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # the router's too: well-separated expert choices
                p.normal_(0, p.shape[-1] ** -0.5 * (2.0 if name.endswith("mlp.gate.weight") else 1.0))
            else:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module", params=[True, False], ids=["renormalized", "plain_topk"])
def moe_dir(request, tmp_path_factory):
    return make_moe_dir(str(tmp_path_factory.mktemp("qwen3_moe")), norm_topk_prob=request.param)


def _driver_logits(runner) -> list:
    """A ragged prefill, an extend after row 0's 9 cached tokens, then 4 decode steps."""
    drv = KVDriver(runner, scatter_seed=1)
    out = [drv.extend([0, 1], [0, 0], PROMPTS).all_logits]
    out.append(drv.extend([0], [9], [[13, 14, 15, 16, 17]]).all_logits)
    lens = [14, 14]
    for t in range(4):
        out.append(drv.decode([0, 1], lens, [20 + t, 30 + t]).next_token_logits)
        lens = [n + 1 for n in lens]
    return out


def _reference(hf) -> list:
    a = PROMPTS[0] + [13, 14, 15, 16, 17] + [20, 21, 22, 23]
    b = PROMPTS[1] + [30, 31, 32, 33]
    la, lb = hf_logits(hf, a), hf_logits(hf, b)
    out = [torch.cat([la[:9], lb[:14]]), la[9:14]]
    for t in range(4):
        out.append(torch.stack([la[14 + t], lb[14 + t]]))
    return out


def test_logits_match_transformers(moe_dir):
    runner = make_runner(moe_dir)
    layers = runner.model.model.layers
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == [True, False, True]
    ours, ref = _driver_logits(runner), _reference(load_hf(moe_dir))
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert a.shape == b.shape, i
        assert (a - b).abs().max().item() <= TOL, f"step {i}: {(a - b).abs().max().item():.2e}"


def test_decoder_sparse_step_keeps_dense_layers_between(tmp_path):
    model_dir = make_moe_dir(str(tmp_path / "step2"), decoder_sparse_step=2, mlp_only_layers=[])
    runner = make_runner(model_dir)
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in runner.model.model.layers] == [False, True, False]
    ours, ref = _driver_logits(runner), _reference(load_hf(model_dir))
    assert max((a - b).abs().max().item() for a, b in zip(ours, ref)) <= TOL


def _tp_rank(rank: int, addr: str, model_dir: str, out_path: str, ep_size: int = 1, dtype: str = "float32") -> None:
    from radixserve.distributed.parallel_state import destroy_distributed_environment
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    args = ServerArgs(model_path=model_dir, dtype=dtype, device="cpu", max_total_tokens=2048,
                      max_running_requests=8, tp_size=2, ep_size=ep_size, dist_init_addr=addr)
    runner = ModelRunner(ModelConfig.from_pretrained(model_dir), args, rank, 2)
    experts = runner.model.model.layers[0].mlp.experts
    logits = _driver_logits(runner)
    shape = tuple((experts.w13_packed if experts.w13_packed is not None else experts.w13_weight).shape)
    torch.save({"logits": logits, "w13": shape, "kernel": experts._moe_kernel(torch.zeros(1, 64)) is not None},
               f"{out_path}.{rank}")
    destroy_distributed_environment()


def test_tensor_parallel_2_splits_every_expert(moe_dir, tmp_path):
    ctx = mp.get_context("spawn")
    out = tmp_path / "tp2.pt"
    addr = f"127.0.0.1:{free_port()}"
    run_processes([ctx.Process(target=_tp_rank, args=(r, addr, moe_dir, str(out))) for r in range(2)])
    res = torch.load(f"{out}.0")
    assert res["w13"] == (8, 32, 64)  # each rank: half of each expert's 2 x 32 intermediate rows
    for a, b in zip(res["logits"], _reference(load_hf(moe_dir))):
        assert (a - b).abs().max().item() <= TOL


def _run_ep2(moe_dir: str, out: Path, dtype: str) -> list:
    ctx = mp.get_context("spawn")
    addr = f"127.0.0.1:{free_port()}"
    run_processes([ctx.Process(target=_tp_rank, args=(r, addr, moe_dir, str(out), 2, dtype)) for r in range(2)])
    return [torch.load(f"{out}.{r}") for r in range(2)]


def test_expert_parallel_2_places_whole_experts(moe_dir, tmp_path):
    """--tp-size 2 --ep-size 2: each rank holds 4 of the 8 experts whole (not half of each), and
    the logits are still transformers'."""
    ranks = _run_ep2(moe_dir, tmp_path / "ep2.pt", "float32")
    ref = _reference(load_hf(moe_dir))
    for res in ranks:
        assert res["w13"] == (4, 64, 64)
        for a, b in zip(res["logits"], ref):
            assert (a - b).abs().max().item() <= TOL


def test_expert_parallel_2_on_the_moe_kernel_matches_tensor_parallel(moe_dir, tmp_path):
    """The CPU's bf16 mode: EP's rank-local experts on the C++ MoE kernel (the pairs of the other
    rank's experts skipped) against one rank holding all of them."""
    ranks = _run_ep2(moe_dir, tmp_path / "ep2bf16.pt", "bfloat16")
    if not ranks[0]["kernel"]:
        pytest.skip("no C++ bf16 GEMM here (neither AVX512_BF16 nor AVX2): the experts run on the torch loop (the float32 test covers EP there)")
    runner = make_runner(moe_dir, dtype="bfloat16")
    assert runner.model.model.layers[0].mlp.experts.w13_packed.shape[0] == 8
    one = _driver_logits(runner)
    assert ranks[0]["w13"][0] == 4
    for a, b in zip(ranks[0]["logits"], one):
        assert (a - b).abs().max().item() <= 2e-2 * b.abs().max().item()


def test_the_engine_serves_it(moe_dir):
    hf = load_hf(moe_dir)
    engine = Engine(moe_dir, dtype="float32", skip_tokenizer_init=True, chunked_prefill_size=8)
    try:
        outs = engine.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": 6, "temperature": 0},
                               return_logprob=True, progress=False)
    finally:
        engine.shutdown()
    for prompt, out in zip(PROMPTS, outs):
        ids = out["output_ids"]
        ref = hf_logits(hf, prompt + ids)[len(prompt) - 1 : -1]
        assert ids == ref.argmax(-1).tolist()
        lp = torch.tensor([v for v, _, _ in out["meta_info"]["output_token_logprobs"]])
        assert (lp - torch.log_softmax(ref, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)).abs().max() <= TOL


def test_dummy_weights_name_and_shape_every_tensor_as_the_checkpoint(moe_dir):
    config = ModelConfig.from_pretrained(moe_dir)
    with safe_open(str(Path(moe_dir) / "model.safetensors"), "pt") as f:
        saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert checkpoint_shapes(config) == saved
    runner = make_runner(moe_dir, load_format="dummy")
    moe = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert len(moe) == 2 and all(m.w13_weight.abs().sum() > 0 and m.w2_weight.abs().sum() > 0 for m in moe)


def test_cpu_bf16_mode_packs_the_experts(moe_dir):
    """The CPU's bf16 mode: each expert's matrices packed for the C++ bf16 GEMM (the stacked
    float parameters freed), and the logits no further from float32 transformers than
    transformers' own bf16 run is (2x, as the dense models' bf16 test allows), on average: a
    routing choice that bf16 rounding flips moves a position's logits a lot, in either run."""
    from radixserve.layers.cpu_weight_only import weight_only_available

    if not weight_only_available(torch.bfloat16, "cpu"):
        pytest.fail("this test needs the C++ bf16 GEMM (a CPU with AVX512_BF16 or AVX2 + FMA)")
    runner = make_runner(moe_dir, dtype="bfloat16")
    experts = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert all(m.weight_packed is not None and m.w13_weight.numel() == 0 for m in experts)
    ids = PROMPTS[1] + PROMPTS[0]
    ours = KVDriver(runner).extend([0], [0], [ids]).all_logits.float()
    ref = hf_logits(load_hf(moe_dir), ids)
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        theirs = hf16(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().mean() <= 2 * (theirs - ref).abs().mean(), ((ours - ref).abs().mean(), (theirs - ref).abs().mean())
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= (theirs.argmax(-1) == ref.argmax(-1)).float().mean() - 0.05


def test_cpu_bf16_mode_moe_kernel_matches_the_torch_loop(moe_dir, monkeypatch):
    """In the CPU's bf16 mode the experts run in the C++ MoE kernel (one call per layer); the
    logits match those of the same model with the experts on the torch loop (bf16 GEMM per expert)
    to bf16-operand precision, and pick the same tokens."""
    from radixserve.layers.cpu_weight_only import weight_only_available

    if not weight_only_available(torch.bfloat16, "cpu"):
        pytest.fail("this test needs the C++ bf16 GEMM (a CPU with AVX512_BF16 or AVX2 + FMA)")
    runner = make_runner(moe_dir, dtype="bfloat16")
    ids = PROMPTS[1] + PROMPTS[0]
    calls = []
    kernel = FusedMoE._moe_kernel
    monkeypatch.setattr(FusedMoE, "_moe_kernel", lambda self, x: calls.append(kernel(self, x)) or calls[-1])
    ours = KVDriver(runner).extend([0], [0], [ids]).all_logits.float()
    assert len(calls) == 2 and all(ops is not None for ops in calls)  # both sparse layers took the kernel
    monkeypatch.setattr(FusedMoE, "_moe_kernel", lambda self, x: None)
    loop = KVDriver(runner).extend([0], [0], [ids]).all_logits.float()
    assert (ours - loop).abs().max().item() <= 2e-2 * loop.abs().max().item(), (ours - loop).abs().max().item()
    assert torch.equal(ours.argmax(-1), loop.argmax(-1))


def test_a_weight_update_naming_the_stacked_experts_is_refused(moe_dir):
    from radixserve.hf_transformers_utils import LoadError

    runner = make_runner(moe_dir)
    w13 = runner.model.model.layers[0].mlp.experts.w13_weight
    with pytest.raises(LoadError, match="each expert's gate_proj"):
        runner.model.load_weights([("model.layers.0.mlp.experts.w13_weight", w13.clone(), "update")], require_all=False)
    with pytest.raises(LoadError, match="no such expert"):
        runner.model.load_weights([("model.layers.1.mlp.experts.0.gate_proj.weight", torch.zeros(32, 64), "update")],
                                  require_all=False)


def _hf_expert_counts(hf, seqs: list, top_k: int) -> torch.Tensor:
    """[sparse layers, experts]: how often each layer's router picks each expert over seqs."""
    counts = None
    for seq in seqs:
        with torch.no_grad():
            out = hf(torch.tensor([seq]), output_router_logits=True)
        layers = [torch.bincount(logits.reshape(len(seq), -1).topk(top_k, dim=-1).indices.flatten(),
                                 minlength=logits.shape[-1]) for logits in out.router_logits]
        c = torch.stack(layers)
        counts = c if counts is None else counts + c
    return counts


def test_expert_distribution_record_counts_the_routers_choices(moe_dir, tmp_path, monkeypatch):
    """SGLang's /start_expert_distribution_record ... /dump: the dump's logical_count is, per MoE
    layer and expert, the (token, expert) pairs of every token the model ran while recording:
    the prompts and each generated token but the last, as transformers' routers pick them. Not
    counted before the start or after the stop; the dump is also SGLang's file."""
    monkeypatch.setenv("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR", str(tmp_path))
    engine = Engine(moe_dir, dtype="float32", skip_tokenizer_init=True, disable_radix_cache=True)
    params = {"max_new_tokens": 4, "temperature": 0}
    try:
        engine.generate(input_ids=[[1, 2, 3]], sampling_params=params, progress=False)  # before the start
        engine.start_expert_distribution_record()
        outs = engine.generate(input_ids=PROMPTS, sampling_params=params, progress=False)
        engine.stop_expert_distribution_record()
        engine.generate(input_ids=[[7, 8, 9]], sampling_params=params, progress=False)  # after the stop
        record = engine.dump_expert_distribution_record()
    finally:
        engine.shutdown()
    seqs = [p + o["output_ids"][:-1] for p, o in zip(PROMPTS, outs)]
    expected = _hf_expert_counts(load_hf(moe_dir), seqs, CONFIG["num_experts_per_tok"])
    got = torch.tensor(record["logical_count"])
    assert got.shape == (2, CONFIG["num_experts"])  # the two sparse layers
    assert torch.equal(got, expected), (got, expected)
    saved = torch.load(record["path"])
    assert Path(record["path"]).parent == tmp_path and torch.equal(saved["logical_count"], got)


def test_expert_distribution_record_is_refused_without_experts():
    engine = Engine(None, skip_tokenizer_init=True)  # the embedded tiny model: no experts
    try:
        with pytest.raises(ValueError, match="no experts"):
            engine.start_expert_distribution_record()
    finally:
        engine.shutdown()


def test_release_frees_the_packed_experts_and_resume_restores_them(moe_dir):
    """In the CPU's bf16 mode the experts live in the MoE kernel's packed stacks (not parameters):
    /release_memory_occupation frees those too, and the answers after the resume are the same."""
    engine = Engine(moe_dir, dtype="bfloat16", skip_tokenizer_init=True)
    params = {"max_new_tokens": 6, "temperature": 0}
    try:
        experts = engine.scheduler.tp_worker.model_runner.model.model.layers[0].mlp.experts
        if experts.w13_packed is None:
            pytest.skip("no C++ bf16 GEMM here (neither AVX512_BF16 nor AVX2): the experts stay parameters (released as every parameter is)")
        before = engine.generate(input_ids=PROMPTS, sampling_params=params, progress=False)
        engine.release_memory_occupation()
        assert experts.w13_packed.untyped_storage().nbytes() == 0 and experts.w2_packed.untyped_storage().nbytes() == 0
        engine.resume_memory_occupation()
        after = engine.generate(input_ids=PROMPTS, sampling_params=params, progress=False)
    finally:
        engine.shutdown()
    assert [o["output_ids"] for o in after] == [o["output_ids"] for o in before]


# EPLB (radixserve/eplb/): skewed loads, per MoE layer (layers 0 and 2), of the 8 experts
SKEWED = [[10, 600, 10, 10, 10, 10, 1000, 10], [10, 10, 1000, 10, 10, 600, 10, 10]]


def _eplb_rank(rank: int, addr: str, model_dir: str, out_path: str, dump_path: str) -> None:
    """tp 2 / ep 2 with 2 redundant expert slots (5 per rank), placed at start from a skewed dump,
    then re-placed at run time from the load recorded while serving the driver's steps."""
    from radixserve.distributed.parallel_state import destroy_distributed_environment
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    args = ServerArgs(model_path=model_dir, dtype="float32", device="cpu", max_total_tokens=2048, max_running_requests=8,
                      tp_size=2, ep_size=2, ep_num_redundant_experts=2, init_expert_location=dump_path, dist_init_addr=addr)
    runner = ModelRunner(ModelConfig.from_pretrained(model_dir), args, rank, 2)
    moe = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    placed = [m.placement.physical_to_logical_map.tolist() for m in moe]
    runner.expert_recorder.start()
    first = _driver_logits(runner)
    recorded = runner.expert_recorder.counts.clone()
    stats = runner.eplb_rebalance()
    replaced = [m.placement.physical_to_logical_map.tolist() for m in moe]
    torch.save({"first": first, "second": _driver_logits(runner), "placed": placed, "replaced": replaced,
                "recorded": recorded, "stats": stats, "slots": moe[0].w13_weight.shape[0]}, f"{out_path}.{rank}")
    destroy_distributed_environment()


def test_eplb_redundant_experts_and_a_rebalance_keep_transformers_logits(moe_dir, tmp_path):
    """--tp-size 2 --ep-size 2 --ep-num-redundant-experts 2 --init-expert-location <skewed dump>:
    the two hottest experts of each layer get a copy on each rank (one of them moved there from
    the other rank), the logits are transformers' (every token goes to one copy), and after a
    rebalance from the recorded load (weights moved between the ranks again) they still are."""
    dump = tmp_path / "skewed.pt"
    torch.save({"logical_count": torch.tensor(SKEWED)}, dump)
    ctx = mp.get_context("spawn")
    out, addr = tmp_path / "eplb.pt", f"127.0.0.1:{free_port()}"
    run_processes([ctx.Process(target=_eplb_rank, args=(r, addr, moe_dir, str(out), str(dump))) for r in range(2)])
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    assert ranks[0]["placed"] == ranks[1]["placed"] and ranks[0]["replaced"] == ranks[1]["replaced"]
    res = ranks[0]
    assert res["slots"] == 5
    for layer, hot in enumerate([(6, 1), (2, 5)]):
        p2l = res["placed"][layer]
        assert sorted(p2l) == sorted(list(range(8)) + list(hot))  # every expert once, the two hot ones twice
        for e in hot:
            assert e in p2l[:5] and e in p2l[5:], p2l  # a copy on each rank
    assert 6 in res["placed"][0][:5]  # expert 6 lived on rank 1 only (slots 5..9 in the trivial location)
    assert res["replaced"] != res["placed"]  # the served load is not the file's: the experts moved
    assert res["recorded"].sum() > 0 and res["stats"]["max_over_mean_after"] <= res["stats"]["max_over_mean_before"]
    ref = _reference(load_hf(moe_dir))
    for run in ("first", "second"):
        for i, (a, b) in enumerate(zip(res[run], ref)):
            assert (a - b).abs().max().item() <= TOL, f"{run} step {i}: {(a - b).abs().max().item():.2e}"
