"""DPBudget (managers/dp_budget.py): each --load-balance-method picks the replica it names, a
request's data_parallel_rank overrides it, and a report replaces what was counted as sent."""

from __future__ import annotations

import pytest

from radixserve.managers.dp_budget import DPBudget
from radixserve.server_args import LOAD_BALANCE_METHODS, ServerArgs


def test_round_robin_takes_each_replica_in_turn():
    b = DPBudget(3, "round_robin")
    assert [b.choose(10) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert b.num_dispatched == [3, 2, 2]


def test_shortest_queue_counts_requests_sent_since_the_last_report():
    b = DPBudget(2, "shortest_queue")
    b.on_load(0, num_reqs=5, num_tokens=0)
    b.on_load(1, num_reqs=2, num_tokens=0)
    # replica 1 is shorter until three requests were sent to it (2 + 3 = 5), then ties go to 0
    assert [b.choose(1) for _ in range(5)] == [1, 1, 1, 0, 1]
    # replica 0 has 5 + 1 sent; replica 1 reports 3, which replaces the 4 counted as sent to it
    b.on_load(1, num_reqs=3, num_tokens=0)
    assert b.choose(1) == 1


def test_minimum_tokens_balances_tokens_not_requests():
    b = DPBudget(2, "minimum_tokens")
    assert b.choose(1000) == 0  # a long prompt
    # short prompts all go to the other replica until it holds as many tokens
    assert [b.choose(100) for _ in range(10)] == [1] * 10
    assert b.choose(100) == 0  # 1000 vs 1000: the tie goes to replica 0
    b.on_load(0, num_reqs=1, num_tokens=50)  # replica 0 finished most of its work
    assert b.choose(100) == 0
    # shortest_queue, given the same traffic, would alternate
    q = DPBudget(2, "shortest_queue")
    assert [q.choose(n) for n in (1000, 100, 100, 100)] == [0, 1, 0, 1]


def test_decode_round_robin_follows_the_bootstrap_room():
    b = DPBudget(4, "decode_round_robin")
    assert [b.choose(5, bootstrap_room=r) for r in (7, 3, 11, 4)] == [3, 3, 3, 0]
    assert [b.choose(5) for _ in range(3)] == [0, 1, 2]  # no room: in turn
    rr = DPBudget(4, "round_robin")
    assert [rr.choose(5, bootstrap_room=r) for r in (7, 3, 11)] == [0, 1, 2]


@pytest.mark.parametrize("method", LOAD_BALANCE_METHODS)
def test_data_parallel_rank_overrides_every_method(method):
    b = DPBudget(3, method)
    b.on_load(2, num_reqs=100, num_tokens=10_000)  # the busiest replica
    assert [b.choose(10, bootstrap_room=1, data_parallel_rank=2) for _ in range(3)] == [2, 2, 2]
    assert b.num_dispatched == [0, 0, 3]


def test_server_args_accept_the_four_methods_and_refuse_others():
    for method in LOAD_BALANCE_METHODS:
        ServerArgs(load_balance_method=method)
    with pytest.raises(ValueError, match="--load-balance-method must be one of"):
        ServerArgs(load_balance_method="random")


def test_vit_dp_spreads_image_requests_by_encoder_work_and_keeps_an_image_where_it_was_encoded():
    """Text and image requests interleaved: plain round robin would send every image to replica 0;
    image requests go to the replica sent the fewest patches, the same image again where it was."""
    b = DPBudget(2, "round_robin")
    picks = []
    for n in range(4):  # text, image, text, image, ... each image new, 100 patches
        picks.append(b.choose(10))
        picks.append(b.choose(10, image_hashes=[n], image_patches=100))
    assert picks[1::2] == [0, 1, 0, 1] and b.image_patches_sent == [200, 200]
    assert b.choose(10, image_hashes=[7, 2], image_patches=400) == 0  # image 2 was encoded on replica 0
    assert b.choose(10, image_hashes=[8], image_patches=50) == 1  # replica 1 has less encoder work now
    assert b.choose(10, image_hashes=[7], image_patches=400) == 0  # image 7 went with image 2
    assert DPBudget(2, "shortest_queue").choose(10, image_hashes=[1], image_patches=9) == 0  # other methods: theirs
