"""L1 of seed 003: RadixCache (and ChunkCache), alone and driven like the scheduler does."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.mem_cache.chunk_cache import ChunkCache
from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixserve.mem_cache.radix_cache import RadixCache, TreeNode, kv_committed_len


@dataclass
class FakeReq:
    """Only the attributes the prefix caches may use."""

    origin_input_ids: List[int]
    output_ids: List[int] = field(default_factory=list)
    fill_ids: List[int] = field(default_factory=list)
    req_pool_idx: int = -1
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Optional[TreeNode] = None
    lora_path: Optional[str] = None  # the adapter: the namespace its prefixes are cached under


def make(page_size=1, num_pages=64, policy="lru", rows=8, ctx=256, disable=False, cls=RadixCache):
    alloc = TokenToKVPoolAllocator(num_pages * page_size, page_size=page_size)
    r2t = ReqToTokenPool(rows, ctx)
    if cls is ChunkCache:  # takes no options
        cache = ChunkCache(r2t, alloc)
    else:
        cache = cls(r2t, alloc, page_size=page_size, disable=disable, eviction_policy=policy)
    return cache, alloc, r2t


def t(xs):
    return torch.tensor(xs, dtype=torch.int64)


def node_at(cache, path):
    """The node reached from the root by following first tokens (or first pages)."""
    node = cache.root_node
    for k in path:
        node = node.children[k]
    return node


def check_counters(cache):
    """evictable + protected == total; both equal the sums over unlocked / locked nodes;
    evictable_leaves is exactly the set of unlocked childless nodes; child keys are right."""
    evictable = protected = 0
    leaves = set()
    stack = list(cache.root_node.children.items())
    while stack:
        k, node = stack.pop()
        assert len(node.key) == len(node.value) > 0
        assert len(node.key) % cache.page_size == 0
        assert k == cache._child_key(node.key, node.extra_key)
        # a namespace (adapter) is one subtree: a node's children share its extra_key
        assert node.parent is cache.root_node or node.extra_key == node.parent.extra_key
        assert node.lock_ref >= 0
        if node.lock_ref > 0:
            protected += len(node.key)
            assert node.parent is cache.root_node or node.parent.lock_ref >= node.lock_ref
        else:
            evictable += len(node.key)
            if not node.children:
                leaves.add(node)
        for ck, child in node.children.items():
            assert child.parent is node
            stack.append((ck, child))
    assert cache.evictable_size() == evictable
    assert cache.protected_size() == protected
    assert evictable + protected == cache.total_size() == len(cache.all_values_flatten())
    assert cache.evictable_leaves == leaves


# ---- insert / match / split ------------------------------------------------------------
def test_insert_match_page1():
    cache, _, _ = make()
    assert cache.insert([1, 2, 3], t([10, 11, 12])) == 0
    assert cache.insert([1, 2, 3, 4, 5], t([90, 91, 92, 13, 14])) == 3  # 90..92 are duplicates
    assert cache.total_size() == 5
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert m.device_indices.tolist() == [10, 11, 12, 13, 14]
    assert m.device_indices.dtype == torch.int64
    assert m.last_device_node.key == [4, 5]
    assert cache.match_prefix([9, 1]).device_indices.numel() == 0
    assert cache.match_prefix([9, 1]).last_device_node is cache.root_node
    assert cache.match_prefix([]).last_device_node is cache.root_node
    assert cache.insert([1, 2, 3, 4, 5], t([0, 0, 0, 0, 0])) == 5  # all there: nothing changes
    assert cache.match_prefix([1, 2, 3, 4, 5]).device_indices.tolist() == [10, 11, 12, 13, 14]
    assert cache.insert([]) == 0
    check_counters(cache)


def test_match_splits_node():
    cache, _, _ = make()
    cache.insert([1, 2, 3, 4, 5], t([10, 11, 12, 13, 14]))
    m = cache.match_prefix([1, 2, 7])
    assert m.device_indices.tolist() == [10, 11]
    # root -> [1, 2] -> [3, 4, 5]: the returned node covers exactly the match.
    head = node_at(cache, [1])
    assert m.last_device_node is head and head.key == [1, 2] and head.value.tolist() == [10, 11]
    tail = node_at(cache, [1, 3])
    assert tail.key == [3, 4, 5] and tail.value.tolist() == [12, 13, 14] and tail.parent is head
    assert cache.total_size() == 5
    check_counters(cache)
    # Matching the whole key again walks both nodes.
    assert cache.match_prefix([1, 2, 3, 4, 5]).device_indices.tolist() == [10, 11, 12, 13, 14]


def test_insert_splits_and_branches():
    cache, _, _ = make()
    cache.insert([1, 2, 3, 4], t([10, 11, 12, 13]))
    assert cache.insert([1, 2, 5, 6], t([20, 21, 22, 23])) == 2
    root = cache.root_node
    assert list(root.children) == [1]
    mid = node_at(cache, [1])
    assert mid.key == [1, 2] and sorted(mid.children) == [3, 5]
    assert node_at(cache, [1, 5]).value.tolist() == [22, 23]
    assert cache.match_prefix([1, 2, 5, 6]).device_indices.tolist() == [10, 11, 22, 23]
    assert cache.match_prefix([1, 2, 3, 9]).device_indices.tolist() == [10, 11, 12]
    assert cache.total_size() == 6
    check_counters(cache)
    text = cache.pretty_print()
    assert "#tokens: 6" in text


def test_insert_default_value_is_key():
    cache, _, _ = make()
    cache.insert([5, 6, 7])
    assert cache.match_prefix([5, 6, 7]).device_indices.tolist() == [5, 6, 7]


def test_match_page4():
    cache, _, _ = make(page_size=4)
    keys = list(range(100, 112))  # 3 pages
    vals = t(list(range(40, 52)))
    assert cache.insert(keys, vals) == 0
    # Only whole pages match: the key is truncated to a multiple of 4.
    assert cache.match_prefix(keys[:7]).device_indices.tolist() == list(range(40, 44))
    assert cache.match_prefix(keys[:3]).device_indices.numel() == 0
    assert cache.match_prefix(keys).device_indices.tolist() == list(range(40, 52))
    # A difference inside the second page: only the first page matches, split at 4.
    other = keys[:5] + [0] + keys[6:]
    m = cache.match_prefix(other)
    assert m.device_indices.tolist() == list(range(40, 44))
    assert m.last_device_node.key == keys[:4]
    assert sorted(cache.root_node.children) == [tuple(keys[:4])]
    assert list(m.last_device_node.children) == [tuple(keys[4:8])]
    # Inserting the variant shares one page and adds two.
    assert cache.insert(other, t(list(range(60, 72)))) == 4
    assert cache.match_prefix(other).device_indices.tolist() == list(range(40, 44)) + list(range(64, 72))
    assert cache.total_size() == 20
    check_counters(cache)
    with pytest.raises(AssertionError):
        cache.insert(keys[:6], t(list(range(6))))  # insert takes page-aligned keys


def test_first_page_tuple_keys_distinguish_pages():
    cache, _, _ = make(page_size=2)
    cache.insert([1, 2, 3, 4], t([10, 11, 12, 13]))
    cache.insert([1, 3, 5, 6], t([20, 21, 22, 23]))  # same first token, different first page
    assert sorted(cache.root_node.children) == [(1, 2), (1, 3)]
    assert cache.match_prefix([1, 3, 5, 6]).device_indices.tolist() == [20, 21, 22, 23]
    assert cache.match_prefix([1, 2, 3, 4]).device_indices.tolist() == [10, 11, 12, 13]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=10), min_size=1, max_size=12),
    st.lists(st.integers(0, 3), max_size=12),
    st.sampled_from([1, 2]),
)
def test_match_agrees_with_a_reference_model(inserted, query, page_size):
    """The tree behaves like a map (page-aligned token prefix -> slots of its last page)
    where the first insert of a prefix wins."""
    ps = page_size
    cache, _, _ = make(page_size=ps)
    ref: Dict[tuple, List[int]] = {}
    next_slot = 1000
    for key in inserted:
        key = key[: len(key) // ps * ps]
        vals = list(range(next_slot, next_slot + len(key)))
        next_slot += len(key)
        already = 0
        while already < len(key) and tuple(key[: already + ps]) in ref:
            already += ps
        assert cache.insert(key, t(vals)) == already
        for j in range(0, len(key), ps):
            ref.setdefault(tuple(key[: j + ps]), vals[j : j + ps])
        check_counters(cache)
    expect: List[int] = []
    while len(expect) + ps <= len(query) and tuple(query[: len(expect) + ps]) in ref:
        expect += ref[tuple(query[: len(expect) + ps])]
    assert cache.match_prefix(query).device_indices.tolist() == expect
    check_counters(cache)
    assert cache.total_size() == len(ref) * ps


# ---- locks and eviction ----------------------------------------------------------------
def _insert_allocated(cache, alloc, key):
    slots = alloc.alloc(len(key))
    assert cache.insert(key, slots) == 0
    return slots


def test_locks_protect_from_eviction():
    cache, alloc, _ = make(num_pages=32)
    a = _insert_allocated(cache, alloc, [1, 2, 3, 4])
    b_tail = alloc.alloc(2)
    assert cache.insert([1, 2, 5, 6], torch.cat([a[:2], b_tail])) == 2
    free0 = alloc.available_size()
    assert (cache.evictable_size(), cache.protected_size()) == (6, 0)

    node_a = cache.match_prefix([1, 2, 3, 4]).last_device_node
    assert cache.inc_lock_ref(node_a) == -4  # [3, 4] and the shared [1, 2]
    assert (cache.evictable_size(), cache.protected_size()) == (2, 4)
    check_counters(cache)
    assert cache.inc_lock_ref(node_a) == 0  # a second lock moves nothing
    assert node_a.lock_ref == 2 and node_a.parent.lock_ref == 2

    # Only [5, 6] can go.
    assert cache.evict(100) == 2
    assert alloc.available_size() == free0 + 2
    assert cache.total_size() == 4 and cache.evictable_size() == 0
    assert cache.match_prefix([1, 2, 3, 4]).device_indices.tolist() == a.tolist()
    check_counters(cache)

    assert cache.dec_lock_ref(node_a) == 0
    assert cache.dec_lock_ref(node_a) == 4
    assert (cache.evictable_size(), cache.protected_size()) == (4, 0)
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(node_a)
    # A leaf goes whole, and evict() stops once it has freed enough: [3, 4] only.
    assert cache.evict(1) == 2
    assert cache.match_prefix([1, 2, 3, 4]).device_indices.tolist() == a[:2].tolist()
    # Then [1, 2], a leaf now.
    assert cache.evict(1) == 2
    assert cache.total_size() == 0
    assert alloc.available_size() == 32
    check_counters(cache)


def test_lock_on_split_node_counts_for_both_halves():
    cache, alloc, _ = make()
    _insert_allocated(cache, alloc, [1, 2, 3, 4])
    node = cache.match_prefix([1, 2, 3, 4]).last_device_node
    cache.inc_lock_ref(node)
    cache.match_prefix([1, 2, 9])  # split the locked node
    head = node_at(cache, [1])
    assert head.key == [1, 2] and head.lock_ref == 1 and node.lock_ref == 1
    assert cache.protected_size() == 4
    check_counters(cache)
    assert cache.evict(10) == 0
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 4
    check_counters(cache)


def test_evict_cascades_to_parents():
    cache, alloc, _ = make()
    _insert_allocated(cache, alloc, [1, 2, 3])
    cache.insert([1, 2, 4], torch.cat([cache.match_prefix([1, 2]).device_indices, alloc.alloc(1)]))
    assert cache.total_size() == 4
    assert cache.evict(4) == 4
    assert cache.total_size() == 0 and not cache.root_node.children
    assert alloc.available_size() == 64
    check_counters(cache)


def test_evict_lru_order():
    cache, alloc, _ = make()
    a = _insert_allocated(cache, alloc, [1, 1, 1])
    b = _insert_allocated(cache, alloc, [2, 2, 2])
    c = _insert_allocated(cache, alloc, [3, 3, 3])
    cache.match_prefix([1, 1, 1])  # a is now the most recent; b the least
    free0 = alloc.available_size()
    assert cache.evict(1) == 3
    assert cache.match_prefix([2, 2, 2]).device_indices.numel() == 0
    assert alloc.available_size() == free0 + 3
    assert set(b.tolist()) <= set(alloc.free_pages.tolist())
    assert cache.evict(3) == 3  # then c
    assert cache.match_prefix([3, 3, 3]).device_indices.numel() == 0
    assert cache.match_prefix([1, 1, 1]).device_indices.tolist() == a.tolist()
    assert not set(c.tolist()) - set(alloc.free_pages.tolist())
    check_counters(cache)


def test_evict_lfu_order():
    cache, alloc, _ = make(policy="lfu")
    a = _insert_allocated(cache, alloc, [1, 1, 1])
    cache.insert([1, 1, 1], a)  # a second request cached the same prefix: hit_count 2
    b = _insert_allocated(cache, alloc, [2, 2, 2])  # newer, but hit once
    cache.match_prefix([2, 2, 2])
    assert node_at(cache, [1]).hit_count == 2 and node_at(cache, [2]).hit_count == 1
    assert cache.evict(1) == 3
    assert cache.match_prefix([2, 2, 2]).device_indices.numel() == 0
    assert cache.match_prefix([1, 1, 1]).device_indices.tolist() == a.tolist()
    assert set(b.tolist()) <= set(alloc.free_pages.tolist())

    # Same inputs under LRU evict the older one instead.
    cache, alloc, _ = make(policy="lru")
    a = _insert_allocated(cache, alloc, [1, 1, 1])
    cache.insert([1, 1, 1], a)
    _insert_allocated(cache, alloc, [2, 2, 2])
    cache.match_prefix([2, 2, 2])
    cache.evict(1)
    assert cache.match_prefix([1, 1, 1]).device_indices.numel() == 0


def test_lfu_ties_broken_by_access_time():
    cache, alloc, _ = make(policy="lfu")
    _insert_allocated(cache, alloc, [1])
    _insert_allocated(cache, alloc, [2])
    cache.match_prefix([1])  # equal hit counts: [2] is older
    cache.evict(1)
    assert cache.match_prefix([2]).device_indices.numel() == 0
    assert cache.match_prefix([1]).device_indices.numel() == 1


def test_unknown_policy():
    with pytest.raises(ValueError):
        make(policy="random")


def test_reset():
    cache, alloc, _ = make()
    node = cache.match_prefix([1, 2]).last_device_node
    _insert_allocated(cache, alloc, [1, 2, 3])
    cache.inc_lock_ref(cache.match_prefix([1, 2, 3]).last_device_node)
    cache.reset()
    assert cache.total_size() == 0 and cache.evictable_size() == 0 and cache.protected_size() == 0
    assert cache.match_prefix([1, 2, 3]).device_indices.numel() == 0
    assert not cache.root_node.children and node is not cache.root_node
    check_counters(cache)


# ---- namespaces: extra_key (the LoRA adapter; None = the base model) ----------------------
@pytest.mark.parametrize("page_size", [1, 4])
def test_same_tokens_under_two_extra_keys_do_not_match(page_size):
    cache, alloc, _ = make(page_size=page_size)
    key = list(range(1, 9))
    base, a = alloc.alloc(8), alloc.alloc(8)
    assert cache.insert(key, base) == 0
    assert cache.insert(key, a, extra_key="A") == 0  # nothing of it is cached under "A" yet
    for extra_key, slots in [(None, base), ("A", a)]:  # each key matches its own slots
        assert cache.match_prefix(key, extra_key).device_indices.tolist() == slots.tolist()
        assert cache.match_prefix(key[:6], extra_key).device_indices.tolist() == slots[: 6 // page_size * page_size].tolist()
    m = cache.match_prefix(key, "B")  # another adapter: no hit, not even a partial one
    assert m.device_indices.numel() == 0 and m.last_device_node is cache.root_node
    assert cache.total_size() == 16 and alloc.available_size() == alloc.size - 16
    check_counters(cache)  # the splits above stayed inside their namespace
    # A second insert under "A" dedupes against "A" only.
    assert cache.insert(key + [50] * page_size, torch.cat([a, alloc.alloc(page_size)]), extra_key="A") == 8
    assert cache.match_prefix(key + [50] * page_size).device_indices.tolist() == base.tolist()
    check_counters(cache)


def test_eviction_and_locks_across_extra_keys():
    cache, alloc, _ = make(num_pages=32)
    base = _insert_allocated(cache, alloc, [1, 2, 3, 4])
    a = alloc.alloc(4)
    assert cache.insert([1, 2, 3, 4], a, extra_key="A") == 0
    node_a = cache.match_prefix([1, 2, 3, 4], "A").last_device_node
    assert node_a.extra_key == "A" and node_a.parent is cache.root_node
    assert cache.inc_lock_ref(node_a) == -4  # locks "A"'s prefix only
    assert (cache.evictable_size(), cache.protected_size()) == (4, 4)
    check_counters(cache)

    assert cache.evict(100) == 4  # only the base prefix can go
    assert cache.match_prefix([1, 2, 3, 4]).device_indices.numel() == 0
    assert cache.match_prefix([1, 2, 3, 4], "A").device_indices.tolist() == a.tolist()
    assert set(base.tolist()) <= set(alloc.free_pages.tolist())
    check_counters(cache)

    assert cache.dec_lock_ref(node_a) == 4
    assert cache.evict(100) == 4
    assert cache.total_size() == 0 and not cache.root_node.children
    assert alloc.available_size() == alloc.size
    check_counters(cache)


def test_evict_extra_key_frees_that_namespace_only():
    """An unloaded adapter's prefixes are freed (its name may come back with other weights);
    the base model's and other adapters' stay, and so does anything still locked."""
    cache, alloc, _ = make(num_pages=64)
    base = _insert_allocated(cache, alloc, [1, 2, 3, 4])
    a = alloc.alloc(4)
    cache.insert([1, 2, 3, 4], a, extra_key="A")
    cache.insert([1, 2, 7, 8], torch.cat([a[:2], alloc.alloc(2)]), extra_key="A")  # a branch: 3 nodes
    b = alloc.alloc(4)
    cache.insert([1, 2, 3, 4], b, extra_key="B")
    assert cache.evict_extra_key("A") == 6
    assert cache.match_prefix([1, 2, 3, 4], "A").device_indices.numel() == 0
    assert cache.match_prefix([1, 2, 3, 4]).device_indices.tolist() == base.tolist()
    assert cache.match_prefix([1, 2, 3, 4], "B").device_indices.tolist() == b.tolist()
    assert alloc.available_size() + cache.total_size() == alloc.size and cache.total_size() == 8
    check_counters(cache)

    node_b = cache.match_prefix([1, 2, 3, 4], "B").last_device_node
    cache.insert([1, 2, 3, 4, 5, 6], torch.cat([b, alloc.alloc(2)]), extra_key="B")
    cache.inc_lock_ref(node_b)
    assert cache.evict_extra_key("B") == 2  # the unlocked tail only; the locked prefix stays
    assert cache.match_prefix([1, 2, 3, 4, 5, 6], "B").device_indices.tolist() == b.tolist()
    check_counters(cache)
    cache.dec_lock_ref(node_b)
    assert cache.evict_extra_key("B") == 4 and cache.evict_extra_key("nope") == 0
    assert cache.total_size() == 4 and alloc.available_size() == alloc.size - 4
    check_counters(cache)


@pytest.mark.parametrize("page_size", [1, 4])
def test_finished_requests_of_two_adapters_share_nothing(page_size):
    """The scheduler's path: a prompt finished under adapter "A" is no prefix hit for the same
    prompt under "B" or the base model; the same adapter again hits it."""
    cache, alloc, r2t = make(page_size=page_size, num_pages=128 // page_size)
    prompt = list(range(100, 117))
    aligned = (len(prompt) - 1) // page_size * page_size  # the last token is always computed
    a = _admit(cache, alloc, r2t, prompt, lora_path="A")
    a.output_ids = [1]
    cache.cache_finished_req(a)
    held = cache.total_size()
    for other in ["B", None]:
        req = _admit(cache, alloc, r2t, prompt, lora_path=other)
        assert req.prefix_indices.numel() == 0
        req.output_ids = [1]
        cache.cache_finished_req(req)  # cached under its own key: nothing is a duplicate
        assert cache.total_size() == held + len(prompt) // page_size * page_size
        held = cache.total_size()
    again = _admit(cache, alloc, r2t, prompt, lora_path="A")
    assert again.prefix_indices.tolist() == cache.match_prefix(prompt[:-1], "A").device_indices.tolist()
    assert len(again.prefix_indices) == aligned
    again.output_ids = [1]
    cache.cache_finished_req(again)
    assert cache.total_size() == held and cache.protected_size() == 0
    assert alloc.available_size() + cache.total_size() == alloc.size
    check_counters(cache)


# ---- cache_finished_req / cache_unfinished_req -----------------------------------------
def _admit(cache, alloc, r2t, prompt, chunk=None, lora_path=None):
    """What the scheduler does: match, lock, take a row, allocate the rest of the chunk."""
    req = FakeReq(origin_input_ids=list(prompt), lora_path=lora_path)
    m = cache.match_prefix(prompt[:-1], lora_path)
    req.prefix_indices, req.last_node = m.device_indices, m.last_device_node
    cache.inc_lock_ref(req.last_node)
    req.req_pool_idx = r2t.alloc(1)[0]
    n = len(prompt) if chunk is None else min(len(prompt), len(req.prefix_indices) + chunk)
    req.fill_ids = list(prompt[:n])
    _extend(alloc, r2t, req)
    return req


def _extend(alloc, r2t, req):
    """Allocate slots for fill_ids beyond prefix_indices and write the row."""
    p, s = len(req.prefix_indices), len(req.fill_ids)
    r2t.write((req.req_pool_idx, slice(0, p)), req.prefix_indices)
    last = int(r2t.req_to_token[req.req_pool_idx, p - 1]) if p else -1
    new = alloc.alloc_extend([p], [s], [last])
    assert new is not None
    r2t.write((req.req_pool_idx, slice(p, s)), new)


def _row(r2t, req, n):
    return r2t.req_to_token[req.req_pool_idx, :n].tolist()


def test_cache_finished_req_inserts_and_frees_row():
    cache, alloc, r2t = make(num_pages=32)
    req = _admit(cache, alloc, r2t, [1, 2, 3, 4])
    req.output_ids = [5, 6, 7]  # token 7 was sampled last and has no KV
    dec = alloc.alloc_decode([5], [0])
    r2t.write((req.req_pool_idx, 4), dec)
    dec = alloc.alloc_decode([6], [0])
    r2t.write((req.req_pool_idx, 5), dec)
    slots = _row(r2t, req, 6)
    assert kv_committed_len(req) == 6
    rows_free = r2t.available_size()
    cache.cache_finished_req(req)
    assert r2t.available_size() == rows_free + 1
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7]).device_indices.tolist() == slots
    assert alloc.available_size() + cache.total_size() == 32
    assert cache.evictable_size() == 6 and cache.protected_size() == 0
    check_counters(cache)


def test_cache_finished_req_frees_duplicates():
    cache, alloc, r2t = make(num_pages=32)
    a = _admit(cache, alloc, r2t, [1, 2, 3, 4, 5])
    b = _admit(cache, alloc, r2t, [1, 2, 3, 9])  # nothing cached yet: no sharing
    a.output_ids, b.output_ids = [8], [8]
    a_slots = _row(r2t, a, 5)
    cache.cache_finished_req(a)
    cache.cache_finished_req(b)  # [1, 2, 3] were cached by a meanwhile: b's copies are freed
    assert cache.total_size() == 6
    assert cache.match_prefix([1, 2, 3, 9]).device_indices.tolist()[:3] == a_slots[:3]
    assert alloc.available_size() + cache.total_size() == 32
    check_counters(cache)


def test_cache_finished_req_no_insert_and_abort_mid_prefill():
    cache, alloc, r2t = make(num_pages=32)
    seed = _admit(cache, alloc, r2t, [1, 2, 3, 4])
    seed.output_ids = [0]
    cache.cache_finished_req(seed)
    req = _admit(cache, alloc, r2t, [1, 2, 3, 4, 5, 6])
    assert len(req.prefix_indices) == 4 and cache.protected_size() == 4
    req.output_ids = [7]
    cache.cache_finished_req(req, is_insert=False)  # its own slots freed, the prefix kept
    assert cache.total_size() == 4 and cache.protected_size() == 0
    assert alloc.available_size() == 32 - 4

    # Aborted during chunked prefill (no output yet): the KV of fill_ids is released.
    req = _admit(cache, alloc, r2t, list(range(20, 40)), chunk=8)
    assert kv_committed_len(req) == 8
    cache.cache_finished_req(req)
    assert cache.total_size() == 12
    assert alloc.available_size() + cache.total_size() == 32
    check_counters(cache)


@pytest.mark.parametrize("page_size", [1, 4])
def test_cache_unfinished_req_chunked(page_size):
    cache, alloc, r2t = make(page_size=page_size, num_pages=64 // page_size * 2)
    prompt = list(range(100, 122))  # 22 tokens, chunks of 6
    req = _admit(cache, alloc, r2t, prompt, chunk=6)
    ps = page_size
    while True:
        cache.cache_unfinished_req(req, chunked=True)
        n = len(req.fill_ids)
        aligned = n // ps * ps
        # The tree holds the aligned part, locked for the request; the tail is its own.
        assert req.prefix_indices.tolist() == _row(r2t, req, n)
        assert cache.match_prefix(req.fill_ids).device_indices.tolist() == _row(r2t, req, aligned)
        assert cache.total_size() == aligned == cache.protected_size()
        assert req.last_node.lock_ref == 1
        check_counters(cache)
        if n == len(prompt):
            break
        req.fill_ids = prompt[: n + 6]
        _extend(alloc, r2t, req)
    req.output_ids = [1]
    cache.cache_finished_req(req)
    assert cache.protected_size() == 0
    assert cache.total_size() == len(prompt) // ps * ps
    assert alloc.available_size() + cache.total_size() == alloc.size
    check_counters(cache)


@pytest.mark.parametrize("page_size", [1, 4])
def test_cache_unfinished_req_frees_duplicates_from_another_request(page_size):
    """A's chunk covers tokens that B cached meanwhile: A's copies are freed and its row is
    re-pointed at B's slots; A keeps a lock on them."""
    ps = page_size
    cache, alloc, r2t = make(page_size=ps, num_pages=256 // ps)
    prompt = list(range(1, 31))
    a = _admit(cache, alloc, r2t, prompt, chunk=10)
    b = _admit(cache, alloc, r2t, prompt[:17] + [99, 98, 97])  # no hit: the tree is empty
    b.output_ids = [5]
    cache.cache_finished_req(b)  # now the tree has B's slots for prompt[:17] (aligned)
    b_slots = cache.match_prefix(prompt).device_indices.tolist()
    assert len(b_slots) == 17 // ps * ps

    free_before = alloc.available_size()
    a_first = _row(r2t, a, 10)
    cache.cache_unfinished_req(a, chunked=True)
    # A's aligned part of chunk 1 was a duplicate of B's: freed, row re-pointed.
    dup = 10 // ps * ps
    assert alloc.available_size() == free_before + dup
    assert _row(r2t, a, dup) == b_slots[:dup]
    assert _row(r2t, a, 10)[dup:] == a_first[dup:]  # the unaligned tail stays A's
    assert a.prefix_indices.tolist() == _row(r2t, a, 10)
    assert cache.protected_size() == dup
    check_counters(cache)

    # Next chunk: up to 20 tokens; B's 17 (aligned) cover part of it.
    a.fill_ids = prompt[:20]
    _extend(alloc, r2t, a)
    old = _row(r2t, a, 20)
    cache.cache_unfinished_req(a, chunked=True)
    shared = len(b_slots)
    assert _row(r2t, a, shared) == b_slots
    assert _row(r2t, a, 20)[shared:] == old[shared:]
    assert cache.protected_size() == 20 // ps * ps
    check_counters(cache)

    # Finish: decode two tokens, then cache.
    a.fill_ids = list(prompt)
    _extend(alloc, r2t, a)
    cache.cache_unfinished_req(a)
    a.output_ids = [7]
    for _ in range(2):
        kv = kv_committed_len(a)
        last = int(r2t.req_to_token[a.req_pool_idx, kv - 1])
        r2t.write((a.req_pool_idx, kv), alloc.alloc_decode([kv + 1], [last]))
        a.output_ids.append(8)
    cache.cache_finished_req(a)
    assert cache.protected_size() == 0
    assert alloc.available_size() + cache.total_size() == alloc.size
    full = prompt + [7, 8, 8]
    assert cache.match_prefix(full).device_indices.tolist()[:shared] == b_slots
    check_counters(cache)
    cache.evict(10**6)
    assert alloc.available_size() == alloc.size and cache.total_size() == 0


def test_disabled_radix_cache():
    cache, alloc, r2t = make(disable=True, num_pages=32)
    req = _admit(cache, alloc, r2t, [1, 2, 3, 4, 5, 6], chunk=3)
    assert len(req.prefix_indices) == 0
    cache.cache_unfinished_req(req, chunked=True)
    assert req.prefix_indices.tolist() == _row(r2t, req, 3)
    req.fill_ids = [1, 2, 3, 4, 5, 6]
    _extend(alloc, r2t, req)
    req.output_ids = [9]
    cache.cache_finished_req(req)
    assert alloc.available_size() == 32 and r2t.available_size() == r2t.size
    assert cache.total_size() == 0 and cache.evict(10) == 0
    assert cache.match_prefix([1, 2, 3]).device_indices.numel() == 0
    assert cache.insert([1, 2]) == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunk_cache(page_size):
    cache, alloc, r2t = make(page_size=page_size, num_pages=64, cls=ChunkCache)
    prompt = list(range(10, 25))
    req = _admit(cache, alloc, r2t, prompt, chunk=6)
    assert req.prefix_indices.numel() == 0 and req.last_node is not None
    while len(req.fill_ids) < len(prompt):
        cache.cache_unfinished_req(req, chunked=True)
        assert req.prefix_indices.tolist() == _row(r2t, req, len(req.fill_ids))
        req.fill_ids = prompt[: len(req.fill_ids) + 6]
        _extend(alloc, r2t, req)
    req.output_ids = [1, 2]
    last = int(r2t.req_to_token[req.req_pool_idx, len(prompt) - 1])
    r2t.write((req.req_pool_idx, len(prompt)), alloc.alloc_decode([len(prompt) + 1], [last]))
    # Another request with the same prompt shares nothing.
    other = _admit(cache, alloc, r2t, prompt)
    assert other.prefix_indices.numel() == 0
    cache.cache_finished_req(req)
    other.output_ids = [3]
    cache.cache_finished_req(other)
    assert alloc.available_size() == alloc.size and r2t.available_size() == r2t.size
    assert cache.total_size() == cache.evictable_size() == cache.protected_size() == 0
    assert cache.evict(100) == 0
    assert cache.inc_lock_ref(req.last_node) == 0 and cache.dec_lock_ref(req.last_node) == 0
    assert cache.all_values_flatten().numel() == 0


# ---- random operation sequences --------------------------------------------------------
class Simulation:
    """Requests with shared prefixes go through the scheduler's calls in random order:
    admit (match, lock, row, alloc, evicting under pressure), prefill chunks
    (cache_unfinished_req), decode steps, finish or abort (cache_finished_req), evict."""

    def __init__(self, page_size, seed, policy):
        self.rng = random.Random(seed)
        self.ps = page_size
        self.num_pages = 160 // page_size
        self.cache, self.alloc, self.r2t = make(
            page_size=page_size, num_pages=self.num_pages, policy=policy, rows=10, ctx=128
        )
        self.running: List[FakeReq] = []
        self.bases = [[self.rng.randrange(6) for _ in range(self.rng.randint(3, 30))] for _ in range(4)]
        self.history: List[Tuple[List[int], Optional[str]]] = []  # (tokens, adapter)
        self.stats = dict(admitted=0, rejected=0, finished=0, chunks=0, decodes=0, evicted=0, hit=0, adapter_hit=0)
        # A new request runs under the base model or one of two adapters (a separate stream of
        # random numbers, so the other choices stay those of the seed); a repeat or a follow-up
        # keeps its original's adapter.
        self.adapter_rng = random.Random(seed + 1000)

    # scheduler actions --------------------------------------------------------------
    def new_prompt(self) -> Tuple[List[int], Optional[str]]:
        rng = self.rng
        r = rng.random()
        if r < 0.1 and self.running:
            same = rng.choice(self.running)  # the same prompt again (n > 1)
            return list(same.origin_input_ids), same.lora_path
        lora_path = self.adapter_rng.choice([None, None, "A", "B"])
        if r < 0.25 and self.history:
            prompt, lora_path = rng.choice(self.history)  # a follow-up of an earlier request
            prompt = list(prompt) + [rng.randrange(6) for _ in range(rng.randint(1, 6))]
        elif r < 0.8:
            base = rng.choice(self.bases)
            prompt = base[: rng.randint(1, len(base))] + [rng.randrange(6) for _ in range(rng.randint(1, 20))]
        else:
            prompt = [rng.randrange(6) for _ in range(rng.randint(1, 40))]
        return prompt[:90], lora_path

    def ensure_free(self, pages_needed):
        short = pages_needed * self.ps - self.alloc.available_size()
        if short > 0:
            self.stats["evicted"] += self.cache.evict(short)
        return self.alloc.available_size() >= pages_needed * self.ps

    def admit(self):
        if self.r2t.available_size() == 0:
            return
        prompt, lora_path = self.new_prompt()
        req = FakeReq(origin_input_ids=prompt, lora_path=lora_path)
        m = self.cache.match_prefix(prompt[:-1], lora_path)
        req.prefix_indices, req.last_node = m.device_indices, m.last_device_node
        self.cache.inc_lock_ref(req.last_node)
        self.stats["hit"] += len(req.prefix_indices)
        self.stats["adapter_hit"] += len(req.prefix_indices) if lora_path is not None else 0
        chunk = self.rng.choice([4, 7, 16, 1000])
        p = len(req.prefix_indices)
        s = min(len(prompt), p + chunk)
        if not self.ensure_free(-(-s // self.ps) - p // self.ps):
            self.cache.dec_lock_ref(req.last_node)  # cannot admit now
            self.stats["rejected"] += 1
            return
        req.req_pool_idx = self.r2t.alloc(1)[0]
        req.fill_ids = prompt[:s]
        _extend(self.alloc, self.r2t, req)
        self.running.append(req)
        self.stats["admitted"] += 1

    def step(self, req):
        """One forward of this request: its current chunk was computed."""
        prompt = req.origin_input_ids
        if not req.output_ids:
            if len(req.fill_ids) < len(prompt):
                self.cache.cache_unfinished_req(req, chunked=True)
                self.stats["chunks"] += 1
                p = len(req.prefix_indices)
                s = min(len(prompt), p + self.rng.choice([3, 8, 16]))
                if not self.ensure_free(-(-s // self.ps) - (-(-p // self.ps))):
                    return self.finish(req)  # abort under memory pressure
                req.fill_ids = prompt[:s]
                _extend(self.alloc, self.r2t, req)
            else:
                req.output_ids.append(self.rng.randrange(6))  # prefill done, token sampled
                if self.rng.random() < 0.6:  # optional: share the prompt before finishing
                    self.cache.cache_unfinished_req(req)
        else:
            kv = kv_committed_len(req)
            if kv + 1 >= self.r2t.max_context_len or self.rng.random() < 0.15:
                return self.finish(req)
            need = 1 if kv % self.ps == 0 else 0
            if not self.ensure_free(need):
                return self.finish(req)  # a stand-in for retraction
            last = int(self.r2t.req_to_token[req.req_pool_idx, kv - 1])
            slot = self.alloc.alloc_decode([kv + 1], [last])
            self.r2t.write((req.req_pool_idx, kv), slot)
            req.output_ids.append(self.rng.randrange(6))
            self.stats["decodes"] += 1

    def finish(self, req):
        self.running.remove(req)
        self.cache.cache_finished_req(req, is_insert=self.rng.random() < 0.9)
        self.history.append((req.origin_input_ids + req.output_ids, req.lora_path))
        self.stats["finished"] += 1

    def run_step(self):
        r = self.rng.random()
        if r < 0.3 or not self.running:
            self.admit()
        elif r < 0.95:
            self.step(self.rng.choice(self.running))
        else:
            self.stats["evicted"] += self.cache.evict(self.rng.randint(1, 40))

    # invariants ---------------------------------------------------------------------
    def walk(self, tokens, extra_key):
        """Slots and nodes along `tokens` under `extra_key` in the tree, splitting nothing."""
        node, slots, nodes, i = self.cache.root_node, [], [], 0
        while i < len(tokens):
            child = node.children.get(self.cache._child_key(tokens[i:], extra_key))
            assert child is not None, "a locked prefix is missing from the tree"
            n = min(len(child.key), len(tokens) - i)
            assert child.key[:n] == tokens[i : i + n]
            slots += child.value[:n].tolist()
            nodes.append(child)
            node, i = child, i + n
        return slots, nodes

    def check(self):
        cache, ps = self.cache, self.ps
        check_counters(cache)

        # lock_ref of each node == number of running requests locking it or a descendant.
        expected: Dict[int, int] = {}
        for req in self.running:
            node = req.last_node
            while node is not cache.root_node:
                expected[node.id] = expected.get(node.id, 0) + 1
                node = node.parent
                assert node is not None, "a request's last_node left the tree"
        stack = list(cache.root_node.children.values())
        while stack:
            node = stack.pop()
            assert node.lock_ref == expected.pop(node.id, 0)
            stack.extend(node.children.values())
        assert not expected

        # Every page is in exactly one place: free, in the tree, or private to one request.
        free = self.alloc.free_pages.tolist()
        tree_slots = cache.all_values_flatten().tolist()
        tree = [s // ps for s in tree_slots[::ps]]
        assert len(set(tree_slots)) == len(tree_slots)
        if ps > 1:  # tree values are whole pages, in order
            for i, s in enumerate(tree_slots):
                assert s % ps == i % ps and s // ps == tree_slots[i - i % ps] // ps
        owned = set(free)
        assert len(owned) == len(free)
        assert not owned & set(tree)
        owned |= set(tree)
        for req in self.running:
            row = self.r2t.req_to_token[req.req_pool_idx]
            kv = len(req.fill_ids) if not req.output_ids else kv_committed_len(req)
            prot = len(req.prefix_indices) // ps * ps
            # The locked prefix: the tree's slots for exactly these tokens.
            tokens = (req.origin_input_ids + req.output_ids)[:prot]
            slots, nodes = self.walk(tokens, req.lora_path)
            assert row[:prot].tolist() == slots
            assert all(n.lock_ref > 0 and n.extra_key == req.lora_path for n in nodes)
            assert req.prefix_indices.tolist() == row[: len(req.prefix_indices)].tolist()
            private = row[prot:kv].tolist()
            assert len(set(private)) == len(private)
            pages = {s // ps for s in private}
            assert len(pages) == -(-(kv - prot) // ps)
            assert not owned & pages, "a slot is held twice"
            owned |= pages
        assert 0 not in owned
        assert len(owned) == self.num_pages  # nothing leaked
        assert self.alloc.available_size() + cache.total_size() + sum(
            (-(-(kv_len - prot) // ps)) * ps
            for kv_len, prot in (
                (len(r.fill_ids) if not r.output_ids else kv_committed_len(r), len(r.prefix_indices) // ps * ps)
                for r in self.running
            )
        ) == self.alloc.size

    def drain(self):
        for req in list(self.running):
            if not req.output_ids and len(req.fill_ids) == len(req.origin_input_ids):
                req.output_ids.append(0)
            self.finish(req)
        self.check()
        assert self.cache.protected_size() == 0
        self.cache.evict(10**9)
        assert self.cache.total_size() == 0
        assert self.alloc.available_size() == self.alloc.size
        assert self.r2t.available_size() == self.r2t.size


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_random_operations_keep_invariants(page_size, policy):
    sim = Simulation(page_size, seed=7 * page_size + (policy == "lfu"), policy=policy)
    for _ in range(2500):
        sim.run_step()
        sim.check()
    s = sim.stats
    # The run exercised what it is meant to: sharing, chunking, pressure and eviction.
    assert s["finished"] > 100 and s["chunks"] > 100 and s["decodes"] > 300
    assert s["hit"] > 500 and s["evicted"] > 100 and s["rejected"] > 0, s
    assert s["adapter_hit"] > 100, s  # prefixes were shared within adapters too
    sim.drain()
