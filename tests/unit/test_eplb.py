"""EPLB (radixserve/eplb/) without a model: the placement algorithm (every logical expert placed,
the hottest ones copied, their copies on different ranks, the per-rank load balanced), a FusedMoE
whose redundant copies and re-placement leave its output unchanged (one rank: the moves are
reorders), and the flags refused with one line. The model against transformers with tp 2 / ep 2
is tests/reference/test_qwen3_moe.py's."""

from __future__ import annotations

import pytest
import torch

from radixserve.distributed.parallel_state import set_moe_ep_size
from radixserve.eplb.eplb_algorithms import rank_loads, rebalance_experts, replicate_experts, trivial_placement
from radixserve.eplb.eplb_manager import BalanceStats, EPLBManager, load_logical_count
from radixserve.layers.moe import FusedMoE
from radixserve.server_args import ServerArgs


def skewed_load(num_layers: int = 3, num_experts: int = 16, seed: int = 0) -> torch.Tensor:
    """Zipf-like: a few experts take most tokens, in a different order per layer."""
    g = torch.Generator().manual_seed(seed)
    base = (1000.0 / torch.arange(1, num_experts + 1) ** 1.2).round().to(torch.int64)
    return torch.stack([base[torch.randperm(num_experts, generator=g)] for _ in range(num_layers)])


def test_every_logical_expert_placed_and_each_rank_filled():
    load = skewed_load()
    p = rebalance_experts(load, num_physical=20, num_ranks=4)
    assert p.physical_to_logical_map.shape == (3, 20)
    assert (p.logical_count >= 1).all() and (p.logical_count.sum(-1) == 20).all()
    for layer in range(3):
        p2l = p.physical_to_logical_map[layer]
        assert set(p2l.tolist()) == set(range(16))
        for e in range(16):  # the inverse map lists exactly the slots holding e
            slots = p.logical_to_all_physical_map[layer, e]
            slots = slots[slots >= 0]
            assert sorted(slots.tolist()) == (p2l == e).nonzero().flatten().tolist()


def test_the_heaviest_experts_get_the_copies_on_different_ranks():
    load = skewed_load()
    p = rebalance_experts(load, num_physical=20, num_ranks=4)
    for layer in range(3):
        by_load = load[layer].argsort(descending=True)
        copies = p.logical_count[layer, by_load]
        assert (copies[:2] >= 2).all() and (copies[8:] == 1).all(), copies
        assert (copies[:-1] >= copies[1:]).all(), copies  # a heavier expert never has fewer copies
        p2l = p.physical_to_logical_map[layer].view(4, 5)  # [rank, its slots]
        for e in by_load[:2].tolist():
            ranks = (p2l == e).any(-1).nonzero().flatten().tolist()
            assert len(ranks) == int(p.logical_count[layer, e]), f"expert {e}'s copies share a rank: {p2l}"


def test_replication_follows_load_per_copy():
    load = torch.tensor([[100, 10, 10, 10]])
    assert replicate_experts(load, 7).tolist() == [[4, 1, 1, 1]]  # 25 per copy still beats 10


def test_rebalance_balances_the_ranks():
    load = skewed_load()
    trivial = trivial_placement(3, 16, 20)
    placed = rebalance_experts(load, 20, 4)
    before, after = BalanceStats.of(load, trivial, 4), BalanceStats.of(load, placed, 4)
    assert after.max_over_mean < before.max_over_mean
    assert after.worst_layer <= 1.15, rank_loads(load, placed, 4)
    # no redundancy: the packing alone still beats the trivial contiguous split
    assert BalanceStats.of(load, rebalance_experts(load, 16, 4), 4).max_over_mean < BalanceStats.of(load, trivial_placement(3, 16, 16), 4).max_over_mean


def test_packing_puts_each_expert_on_the_least_loaded_rank():
    """Heaviest first onto the lighter rank: 8+5+4+1 and 7+6+3+2, where turn-taking gives 20 / 16."""
    load = torch.tensor([[8, 7, 6, 5, 4, 3, 2, 1]])
    assert rank_loads(load, rebalance_experts(load, 8, 2), 2).tolist() == [[18.0, 18.0]]


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="do not split over"):
        rebalance_experts(skewed_load(), 18, 4)
    with pytest.raises(ValueError, match="cannot hold"):
        rebalance_experts(skewed_load(), 8, 4)


def _moe(num_redundant: int, seed: int = 0) -> FusedMoE:
    """A FusedMoE of 8 experts on one rank with num_redundant extra slots, its weights loaded
    per logical expert as a checkpoint does."""
    set_moe_ep_size(1, num_redundant)
    try:
        moe = FusedMoE(8, 32, 16)
    finally:
        set_moe_ep_size(1, 0)
    g = torch.Generator().manual_seed(seed)
    for e in range(8):
        for which, shape in (("w1", (16, 32)), ("w3", (16, 32)), ("w2", (32, 16))):
            param = moe.w2_weight if which == "w2" else moe.w13_weight
            moe.weight_loader(param, torch.randn(*shape, generator=g) / 4, (e, which))
    return moe


def _route(n: int = 24):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 32, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(n)])
    ids[: n // 2, 0] = 3  # expert 3 is hot
    return x, torch.softmax(torch.randn(n, 2, generator=g), -1), ids


def test_redundant_copies_and_rebalance_keep_the_output():
    plain, copies = _moe(0), _moe(4)
    assert copies.w13_weight.shape[0] == 12 and copies.dispatch_maps is not None
    assert torch.equal(copies.w13_weight[8], copies.w13_weight[0])  # the trivial location: slot 8 holds expert 0
    x, w, ids = _route()
    ref = plain.forward(x, w, ids)
    assert torch.allclose(copies.forward(x, w, ids), ref, atol=1e-6)
    load = torch.zeros(1, 8, dtype=torch.int64)
    load[0, 3], load[0, 5] = 1000, 400
    manager = EPLBManager([copies], 1, lambda: None, lambda t: t)
    manager.rebalance(load)
    assert int(copies.placement.logical_count[3]) >= 3  # the hot expert took most of the 4 copies
    for slot, e in enumerate(copies.placement.physical_to_logical_map.tolist()):
        assert torch.equal(copies.w13_weight[slot], plain.w13_weight[e]) and torch.equal(copies.w2_weight[slot], plain.w2_weight[e])
    phys = copies.to_physical(ids)
    hot = phys[ids == 3]
    assert len(set(hot.tolist())) == int(copies.placement.logical_count[3])  # its tokens spread over every copy
    assert torch.allclose(copies.forward(x, w, ids), ref, atol=1e-6)


def test_periodic_rebalance_every_n_passes_skips_an_empty_record():
    moe = _moe(4)
    counts = {"load": torch.zeros(1, 8, dtype=torch.int64)}
    manager = EPLBManager([moe], 1, lambda: counts["load"], lambda t: t, rebalance_num_iterations=2)
    for _ in range(2):
        manager.on_forward_pass_end()
    assert manager.num_rebalances == 0  # nothing recorded yet: the trivial placement stays
    counts["load"] = torch.tensor([[0, 0, 0, 0, 0, 900, 0, 0]])
    manager.on_forward_pass_end()
    assert manager.num_rebalances == 0  # pass 3 of every 2
    manager.on_forward_pass_end()
    assert manager.num_rebalances == 1 and moe.placement.physical_to_logical_map.tolist().count(5) == 5


def test_rebalance_moves_the_packed_experts_of_the_cpu_bf16_mode():
    """The CPU's bf16 mode: the packed stacks (the C++ MoE kernel's operands) are what moves."""
    from radixserve.layers.cpu_weight_only import weight_only_available

    if not weight_only_available(torch.bfloat16, "cpu"):
        pytest.fail("this test needs the C++ bf16 GEMM (a CPU with AVX512_BF16 or AVX2 + FMA)")
    plain, copies = _moe(0), _moe(4)
    for m in (plain, copies):
        m.w13_weight = torch.nn.Parameter(m.w13_weight.data.bfloat16(), requires_grad=False)
        m.w2_weight = torch.nn.Parameter(m.w2_weight.data.bfloat16(), requires_grad=False)
        assert m.pack_cpu_weight() and m._moe_kernel(torch.zeros(1, 32)) is not None
    x, w, ids = _route()
    ref = plain.forward(x, w, ids)
    load = torch.zeros(1, 8, dtype=torch.int64)
    load[0, 6] = 1000
    EPLBManager([copies], 1, lambda: None, lambda t: t).rebalance(load)
    assert copies.placement.physical_to_logical_map.tolist().count(6) == 5
    assert copies.weight_packed[0][0].data.data_ptr() == copies.w13_packed[0].data_ptr()  # views of the moved stack
    assert torch.allclose(copies.forward(x, w, ids), ref, atol=1e-5)
    assert torch.allclose(copies.forward_loop(x, w, copies.to_physical(ids)), ref, atol=1e-5)


def test_rebalance_without_a_record_or_with_a_wrong_shape_says_why(tmp_path):
    manager = EPLBManager([_moe(4)], 1, lambda: None, lambda t: t)
    with pytest.raises(ValueError, match="No expert load recorded"):
        manager.rebalance()
    with pytest.raises(ValueError, match=r"need \(1, 8\)"):
        manager.rebalance(torch.ones(2, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="No tokens were routed"):
        manager.rebalance(torch.zeros(1, 8, dtype=torch.int64))
    path = tmp_path / "dump.pt"
    torch.save({"logical_count": torch.arange(8)[None]}, path)
    assert load_logical_count(str(path)).tolist() == [list(range(8))]
    torch.save({"other": 1}, path)
    with pytest.raises(ValueError, match="not an expert distribution dump"):
        load_logical_count(str(path))


@pytest.mark.parametrize("flags, message", [
    (dict(ep_num_redundant_experts=2), "--ep-num-redundant-experts needs --ep-size > 1"),
    (dict(enable_eplb=True, tp_size=2), "--enable-eplb needs --ep-size > 1"),
    (dict(ep_num_redundant_experts=-1), "must be >= 0"),
    (dict(enable_eplb=True, tp_size=2, ep_size=2, eplb_rebalance_num_iterations=0), "must be >= 1"),
])
def test_bad_flag_combinations_are_refused_with_one_line(flags, message):
    with pytest.raises(ValueError, match=message) as e:
        ServerArgs(**flags)
    assert "\n" not in str(e.value)


def test_eplb_on_a_model_without_experts_is_refused_with_one_line(tmp_path):
    """The flags pass ServerArgs (they need --ep-size > 1, set after it here to stay on one
    process); the model runner refuses a dense model before serving it wrongly."""
    import transformers

    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.models.model_config import LoadError, ModelConfig

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(tmp_path))
    args = ServerArgs(model_path=str(tmp_path), dtype="float32", device="cpu", max_total_tokens=256, max_running_requests=2)
    args.enable_eplb = True
    with pytest.raises(LoadError, match="need a model with experts") as e:
        ModelRunner(ModelConfig.from_pretrained(str(tmp_path)), args, 0, 1)
    assert "\n" not in str(e.value)
