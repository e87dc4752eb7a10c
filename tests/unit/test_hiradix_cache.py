"""HiCache's host pool and HiRadixCache on small real pools: eviction to the host keeps the
node, a match returns the host continuation, load_back restores the same KV bytes, the host
pool evicts LRU host-only leaves, locks protect, and every host slot is accounted for."""

from __future__ import annotations

import random
from typing import List

import pytest
import torch

from radixserve.managers.schedule_batch import Req
from radixserve.managers.schedule_policy import AddReqResult, PrefillAdder
from radixserve.mem_cache.base_prefix_cache import MemoryLeakError
from radixserve.mem_cache.hiradix_cache import HiRadixCache
from radixserve.mem_cache.kv_ledger import KVLedger
from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from radixserve.mem_cache.memory_pool_host import MHATokenToKVPoolHost
from radixserve.sampling_params import SamplingParams

LAYERS, HEADS, DIM = 3, 2, 4


def make_cache(device_tokens: int = 64, host_tokens: int = 128, page_size: int = 1, policy: str = "write_through"):
    kv = MHATokenToKVPool(device_tokens, page_size, torch.float32, HEADS, DIM, LAYERS)
    alloc = TokenToKVPoolAllocator(device_tokens, page_size)
    cache = HiRadixCache(ReqToTokenPool(4, 256), alloc, kv, host_tokens, page_size, policy)
    return cache, kv, alloc


def kv_at(kv: MHATokenToKVPool, slots: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.stack([k[slots] for k in kv.k_buffer]), torch.stack([v[slots] for v in kv.v_buffer])])


def put(cache: HiRadixCache, kv: MHATokenToKVPool, key: List[int]) -> torch.Tensor:
    """Insert `key` with fresh slots holding random KV (computing only the uncached part);
    returns the KV of the whole key."""
    cached = cache.match_prefix(key)
    start = len(cached.device_indices)
    cache.inc_lock_ref(cached.last_device_node)
    need = len(key) - start
    if cache.token_to_kv_pool_allocator.available_size() < need:
        cache.evict(need - cache.token_to_kv_pool_allocator.available_size())
    slots = cache.token_to_kv_pool_allocator.alloc(need)
    cache.dec_lock_ref(cached.last_device_node)
    assert slots is not None
    for buf in (*kv.k_buffer, *kv.v_buffer):
        buf[slots] = torch.randn(need, HEADS, DIM)
    value = torch.cat([cached.device_indices, slots])
    dup = cache.insert(key, value)
    assert dup == start
    return kv_at(kv, value)


def scramble_free_slots(kv: MHATokenToKVPool, alloc: TokenToKVPoolAllocator) -> None:
    """Write noise into every free slot (a load that read stale device KV would show)."""
    free = torch.cat([alloc._pages_to_slots(alloc.free_pages)])
    for buf in (*kv.k_buffer, *kv.v_buffer):
        buf[free] = torch.randn(len(free), HEADS, DIM) * 100


def keys(n: int, seed: int) -> List[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


# ---- the host pool ---------------------------------------------------------------------------
def test_host_pool_copies_pages_both_ways_and_refuses_double_free():
    kv = MHATokenToKVPool(32, 4, torch.float32, HEADS, DIM, LAYERS)
    host = MHATokenToKVPoolHost(kv, 16, 4)
    dev = torch.arange(4, 12)
    for buf in (*kv.k_buffer, *kv.v_buffer):
        buf[dev] = torch.randn(8, HEADS, DIM)
    before = kv_at(kv, dev)
    slots = host.alloc(8)
    assert host.available_size() == 8 and host.alloc(12) is None
    host.backup_from_device(slots, dev)
    page = host.get_page_tensor(slots[:4])
    assert page.shape == (2, LAYERS, 4, HEADS, DIM) and torch.equal(page, before[:, :, :4])
    other = torch.arange(20, 28)
    host.load_to_device(other, slots)
    assert torch.equal(kv_at(kv, other), before)
    host.set_page_tensor(slots[4:], page)  # the storage tier writes a page back
    assert torch.equal(host.get_page_tensor(slots[4:]), page)
    host.free(slots)
    assert host.available_size() == 16
    with pytest.raises(RuntimeError, match="double free"):
        host.free(slots[:4])


# ---- HiRadixCache ------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 4])
def test_evicted_nodes_stay_on_host_and_load_back_gives_the_same_kv(page_size):
    cache, kv, alloc = make_cache(page_size=page_size)
    a, b = keys(16, 1), keys(16, 2)
    kv_ab = put(cache, kv, a + b)
    put(cache, kv, a + keys(8, 3))  # a second branch under a
    assert cache.host_pool.available_size() == 128 - 40  # write_through: backed up on insert
    assert cache.evict(64) == 40
    assert alloc.available_size() == 64 and cache.total_size() == 0 and cache.evictable_size() == 0
    cache.check_other_tiers()

    m = cache.match_prefix(a + b + [7] * page_size)
    assert len(m.device_indices) == 0 and m.last_device_node is cache.root_node
    assert m.host_hit_length == 32 and m.last_host_node.evicted

    scramble_free_slots(kv, alloc)
    loaded, node = cache.init_load_back(m.last_host_node, m.host_hit_length)
    assert node is m.last_host_node and len(loaded) == 32
    assert torch.equal(kv_at(kv, loaded), kv_ab)
    again = cache.match_prefix(a + b)
    assert torch.equal(again.device_indices, loaded) and again.host_hit_length == 0
    assert cache.evictable_size() == 32 and alloc.available_size() == 32
    cache.check_other_tiers()


def test_lru_device_eviction_moves_the_leaf_first_and_a_match_splits_host_nodes():
    cache, kv, alloc = make_cache()
    a, b = keys(16, 1), keys(16, 2)
    kv_ab = put(cache, kv, a + b)
    cache.match_prefix(a)  # a (now its own node) is more recent than b
    assert cache.evict(1) == 16  # the leaf b goes to the host; a stays on the device
    m = cache.match_prefix(a + b[:8])  # ends inside the host-only node: it is split
    assert len(m.device_indices) == 16 and m.host_hit_length == 8
    loaded, node = cache.init_load_back(m.last_host_node, m.host_hit_length)
    assert torch.equal(kv_at(kv, torch.cat([m.device_indices, loaded])), kv_ab[:, :, :24])
    m2 = cache.match_prefix(a + b)
    assert len(m2.device_indices) == 24 and m2.host_hit_length == 8
    cache.check_other_tiers()


def test_host_pool_evicts_the_least_recently_used_host_only_leaf():
    cache, kv, alloc = make_cache(device_tokens=64, host_tokens=32)
    x, y, z = keys(16, 1), keys(16, 2), keys(16, 3)
    put(cache, kv, x)
    cache.evict(64)
    put(cache, kv, y)
    cache.evict(64)  # x and y are host-only; the host pool is full
    assert cache.host_pool.available_size() == 0
    assert cache.match_prefix(x).host_hit_length == 16  # x is now more recent than y
    put(cache, kv, z)  # its backup needs room: y goes
    assert cache.match_prefix(y).host_hit_length == 0
    assert cache.match_prefix(x).host_hit_length == 16
    assert cache.match_prefix(z).host_hit_length == 0 and len(cache.match_prefix(z).device_indices) == 16
    cache.check_other_tiers()


def test_locked_nodes_are_not_evicted_and_load_back_fails_without_device_room():
    cache, kv, alloc = make_cache(device_tokens=32, host_tokens=64)
    a, b = keys(16, 1), keys(16, 2)
    put(cache, kv, a)
    cache.evict(32)  # a is host-only
    put(cache, kv, b + keys(16, 5))  # fills the device
    locked = cache.match_prefix(b + keys(16, 5)).last_device_node
    assert cache.inc_lock_ref(locked) == -32
    assert cache.evict(32) == 0 and cache.protected_size() == 32
    m = cache.match_prefix(a)
    loaded, node = cache.init_load_back(m.last_host_node, m.host_hit_length)
    assert len(loaded) == 0 and node is cache.root_node and m.last_host_node.evicted
    cache.dec_lock_ref(locked)
    loaded, node = cache.init_load_back(m.last_host_node, m.host_hit_length)  # now b can go to the host
    assert len(loaded) == 16 and node is m.last_host_node
    cache.inc_lock_ref(node)  # the request's lock: the loaded prefix is protected
    assert cache.protected_size() == 16 and cache.evictable_size() == 0
    cache.dec_lock_ref(node)
    cache.check_other_tiers()


@pytest.mark.parametrize("policy", ["write_back", "write_through_selective"])
def test_write_policies_back_up_at_eviction_or_at_the_second_hit(policy):
    cache, kv, alloc = make_cache(policy=policy)
    a = keys(16, 1)
    put(cache, kv, a)
    assert cache.host_pool.available_size() == 128  # no copy yet
    if policy == "write_through_selective":
        cache.insert(a, cache.match_prefix(a).device_indices)  # the second hit backs it up
        assert cache.host_pool.available_size() == 112
    cache.evict(16)
    m = cache.match_prefix(a)
    assert m.host_hit_length == 16 and cache.host_pool.available_size() == 112
    cache.check_other_tiers()


def test_a_node_without_host_copy_is_deleted_with_its_host_only_subtree():
    cache, kv, alloc = make_cache(policy="write_through_selective")
    a, b = keys(16, 1), keys(16, 2)
    put(cache, kv, a)
    put(cache, kv, a + b)  # second hit of a: backed up; b (first hit) is not
    cache.insert(a + b, cache.match_prefix(a + b).device_indices)  # now b too
    cache.evict(16)  # b to the host
    cache.evict(16)  # a to the host as well
    m = cache.match_prefix(a + b)
    assert m.host_hit_length == 32
    cache.init_load_back(m.last_host_node, 32)
    # a fresh branch c under a, inserted once: not backed up, so evicting it deletes it
    c = keys(16, 3)
    put(cache, kv, a + c)
    used = cache.host_pool.available_size()
    cache.evict(64)
    assert cache.match_prefix(a + c).host_hit_length == 16  # only a's part remains
    assert cache.host_pool.available_size() == used
    cache.check_other_tiers()


def test_evicting_a_node_without_host_copy_drops_its_host_only_subtree(monkeypatch):
    cache, kv, alloc = make_cache()
    a, b = keys(16, 1), keys(16, 2)
    with monkeypatch.context() as m:
        m.setattr(cache.host_pool, "alloc", lambda n: None)  # a's backup finds no host room
        put(cache, kv, a)
    a_slots = cache.match_prefix(a).device_indices
    b_slots = alloc.alloc(16)
    cache.insert(a + b, torch.cat([a_slots, b_slots]), chunked=True)  # no hit: no backup
    b_node = cache.match_prefix(a + b).last_device_node
    assert cache.write_backup(b_node) and cache.host_pool.available_size() == 112
    assert cache.evict(16) == 16 and b_node.evicted  # b: host-only under a, which has no copy
    assert cache.evict(16) == 16  # a goes from the tree, and b's host copy with it
    m = cache.match_prefix(a + b)
    assert len(m.device_indices) == 0 and m.host_hit_length == 0
    assert cache.host_pool.available_size() == 128 and alloc.available_size() == 64
    cache.check_other_tiers()


def test_conservation_check_catches_a_lost_host_slot():
    cache, kv, alloc = make_cache()
    put(cache, kv, keys(16, 1))
    cache.check_other_tiers()
    lost = cache.host_pool.alloc(8)  # taken by nobody
    with pytest.raises(MemoryLeakError, match="host pool leak"):
        cache.check_other_tiers(thorough=False)
    cache.host_pool.free(lost)
    node = cache.match_prefix(keys(16, 1)).last_device_node
    node.host_value = node.host_value + 16  # counts still add up, but pages do not
    with pytest.raises(MemoryLeakError, match="both free and held"):
        cache.check_other_tiers()


def test_the_storage_seam_is_called_and_its_pages_are_matched_as_storage_hits():
    cache, kv, alloc = make_cache(page_size=4)
    stored = keys(16, 9)
    page_kv = torch.randn(2, LAYERS, 4, HEADS, DIM)

    class FakeStorage:
        backed_up: List[int] = []

        def on_host_backup(self, tree, node):
            self.backed_up.append(len(node.host_value))

        def storage_hit(self, tree, last_host_node, key, extra_key):
            if key[:16] != stored:
                return 0
            host = tree.alloc_host(16)
            for i in range(4):
                tree.host_pool.set_page_tensor(host[4 * i: 4 * i + 4], page_kv)
            tree.insert_host_pages(last_host_node, stored, host, extra_key)
            return 16

    cache.set_storage(FakeStorage())
    put(cache, kv, keys(8, 1))
    assert FakeStorage.backed_up == [8]
    m = cache.match_prefix(stored + [1, 2, 3, 4])
    assert m.host_hit_length == 16 and len(m.device_indices) == 0
    loaded, _ = cache.init_load_back(m.last_host_node, m.host_hit_length)
    assert cache.loaded_storage_tokens == 16
    assert torch.equal(kv_at(kv, loaded[:4]), page_kv)
    cache.check_other_tiers()


# ---- the PrefillAdder's load-back accounting ---------------------------------------------------
def _adder(cache: HiRadixCache, rem_input_tokens: int) -> PrefillAdder:
    return PrefillAdder(1, KVLedger(cache.req_to_token_pool, cache.token_to_kv_pool_allocator, cache), None, 0.5, rem_input_tokens, None)


def _req(ids: List[int], max_new: int = 4) -> Req:
    sp = SamplingParams(max_new_tokens=max_new)
    sp.normalize()
    return Req("r", None, ids, sp)


def test_prefill_adder_loads_host_hits_back_and_counts_them_as_cached_not_as_input():
    cache, kv, alloc = make_cache(device_tokens=64, host_tokens=128)
    prefix = keys(40, 1)
    kv_prefix = put(cache, kv, prefix)
    cache.evict(64)
    req = _req(prefix + keys(8, 2))
    req.init_next_round_input(cache)
    assert req.host_hit_length == 40 and len(req.prefix_indices) == 0 and req.extend_input_len == 48
    # 48 tokens to extend, but the 40 loaded back are no input: a budget of 16 admits it.
    adder = _adder(cache, rem_input_tokens=16)
    assert adder.add_one_req(req) == AddReqResult.CONTINUE and adder.can_run_list == [req]
    assert len(req.prefix_indices) == 40 and req.extend_input_len == 8 and req.host_hit_length == 0
    assert torch.equal(kv_at(kv, req.prefix_indices), kv_prefix)
    assert req.last_node is req.last_host_node and req.last_node.lock_ref == 1  # locked for the request
    assert cache.protected_size() == 40 and adder.rem_input_tokens == 8
    req.count_cached_tokens(40)
    assert req.cached_tokens == 40 and req.cached_tokens_details == {"device": 0, "host": 40, "storage": 0}


def test_prefill_adder_says_no_token_when_host_hits_cannot_be_loaded():
    cache, kv, alloc = make_cache(device_tokens=64, host_tokens=128)
    prefix = keys(40, 1)
    put(cache, kv, prefix)
    cache.evict(64)
    other = keys(32, 3)
    put(cache, kv, other)
    holder = cache.match_prefix(other).last_device_node
    cache.inc_lock_ref(holder)  # a running request holds half the device pool
    req = _req(prefix + keys(8, 2), max_new=1)
    req.init_next_round_input(cache)
    # The 40 host tokens need device slots: 49 tokens do not fit the 32 free.
    assert _adder(cache, 1024).add_one_req(req) == AddReqResult.NO_TOKEN
    assert req.last_host_node.evicted and cache.protected_size() == 32
    cache.dec_lock_ref(holder)
    # Within the budget, a load that still finds no slots is NO_TOKEN too, and leaves nothing held.
    req.init_next_round_input(cache)
    alloc.alloc = lambda n: None
    assert _adder(cache, 1024).add_one_req(req) == AddReqResult.NO_TOKEN
    assert req.last_host_node.evicted and cache.protected_size() == 0 and len(req.prefix_indices) == 0
    cache.check_other_tiers()


def test_a_host_pool_larger_than_host_memory_is_refused_with_a_clear_message():
    kv = MHATokenToKVPool(16, 1, torch.float32, 8, 128, 32)  # 256 KiB per token
    with pytest.raises(ValueError, match="lower --hicache-ratio or --hicache-size"):
        MHATokenToKVPoolHost(kv, 10**9, 1)  # 256 TB


@pytest.mark.parametrize("kw, field", [
    (dict(hicache_ratio=float("nan")), "--hicache-ratio"),
    (dict(hicache_ratio=0), "--hicache-ratio"),
    (dict(hicache_size=-1), "--hicache-size"),
    (dict(hicache_size=float("inf")), "--hicache-size"),
    (dict(hicache_write_policy="sometimes"), "--hicache-write-policy"),
    (dict(disable_radix_cache=True), "--disable-radix-cache"),
])
def test_bad_hicache_flags_are_refused_naming_the_flag(kw, field):
    from radixserve.server_args import ServerArgs

    with pytest.raises(ValueError, match=field):
        ServerArgs(enable_hierarchical_cache=True, **kw)
