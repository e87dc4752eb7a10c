"""The SWA pool's memory side (issue 42; mem_cache/swa_memory_pool.py, swa_radix_cache.py,
swa_kv_ledger.py) without a model: the allocator's two free lists and its map, the tree's
tombstones and the match that stops where the window's KV was dropped, the swa lock of a
request's window across node splits, SWA eviction that frees window slots only, and the ledger
dropping a request's slots as its window moves on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from radixserve.mem_cache.base_prefix_cache import MemoryLeakError
from radixserve.mem_cache.kv_ledger import KVLedger
from radixserve.mem_cache.memory_pool import ReqToTokenPool
from radixserve.mem_cache.swa_kv_ledger import SWAKVLedger
from radixserve.mem_cache.swa_memory_pool import SWATokenToKVPoolAllocator
from radixserve.mem_cache.swa_radix_cache import SWARadixCache
from radixserve.server_args import ServerArgs

W = 4


def _pools(size: int = 64, size_swa: int = 32):
    alloc = SWATokenToKVPoolAllocator(size, size_swa)
    r2t = ReqToTokenPool(4, 128)
    tree = SWARadixCache(r2t, alloc, sliding_window_size=W)
    return alloc, r2t, tree


def test_allocator_maps_each_full_slot_to_a_swa_slot_and_frees_both():
    alloc, _, _ = _pools(16, 8)
    full = alloc.alloc(6)
    swa = alloc.full_to_swa_index_mapping[full]
    assert (swa > 0).all() and len(set(swa.tolist())) == 6
    assert alloc.available_size() == 10 and alloc.swa_available_size() == 2
    assert alloc.alloc(3) is None  # the SWA pool has 2 left: nothing is taken from either
    assert alloc.available_size() == 10
    alloc.free_swa(full[:4])  # the window moved past them: swa slots back, full slots kept
    assert alloc.swa_available_size() == 6 and alloc.available_size() == 10
    assert alloc.has_swa(full).tolist() == [False] * 4 + [True] * 2
    assert (alloc.translate_loc(full[:4]) == 0).all()  # the padding slot
    alloc.free(full)  # full slots, and the two swa slots still held
    assert alloc.available_size() == 16 and alloc.swa_available_size() == 8
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free(full[:1])


def _insert(tree, alloc, tokens, drop_first: int = 0):
    """Insert tokens whose first `drop_first` left their window (no swa slot)."""
    slots = alloc.alloc(len(tokens))
    alloc.free_swa(slots[:drop_first])
    tree.insert(tokens, slots)
    return slots


def test_insert_splits_tombstone_and_live_runs_and_match_needs_the_window():
    alloc, _, tree = _pools()
    _insert(tree, alloc, list(range(10)), drop_first=6)  # tokens 0-5 dropped, 6-9 live (W = 4)
    nodes = {len(n.key): n.swa_tombstone for n in tree._nodes()}
    assert nodes == {6: True, 4: False}
    tree.check_swa_nodes()
    assert tree.swa_evictable_size() == 4 and tree.evictable_size() == 10
    # The whole prefix is usable: the W tokens before its end are live.
    assert len(tree.match_prefix(list(range(10)) + [99]).device_indices) == 10
    # Ending at token 8 leaves 2 live tokens before it: not the window, so no usable hit.
    assert len(tree.match_prefix(list(range(8)) + [99]).device_indices) == 0
    # A short prefix, live from the root, is usable at any length.
    _insert(tree, alloc, [50, 51, 52])
    assert len(tree.match_prefix([50, 51, 99]).device_indices) == 2


def test_evict_swa_tombstones_unlocked_nodes_only_and_keeps_full_slots():
    alloc, _, tree = _pools()
    a = _insert(tree, alloc, list(range(8)))
    b = _insert(tree, alloc, [100 + i for i in range(8)])
    locked = tree.match_prefix([100 + i for i in range(8)]).last_device_node
    tree.inc_lock_ref(locked)  # a request holds b's window
    full_free, swa_free = alloc.available_size(), alloc.swa_available_size()
    assert tree.evict_swa(100) == 8  # only a's 8 swa slots could go
    assert alloc.available_size() == full_free and alloc.swa_available_size() == swa_free + 8
    assert not alloc.has_swa(a).any() and alloc.has_swa(b).all()
    assert tree.evictable_size() == 8 and tree.swa_evictable_size() == 0  # a still in the tree, for full layers
    assert len(tree.match_prefix(list(range(8)) + [1]).device_indices) == 0  # its window is gone
    tree.dec_lock_ref(locked)
    assert tree.swa_evictable_size() == 8 and tree.swa_protected_size() == 0
    assert tree.evict(16) == 16  # full eviction frees both (b's swa slots too)
    assert alloc.available_size() == 64 and alloc.swa_available_size() == 32


def test_the_swa_lock_covers_the_last_window_and_survives_splits():
    alloc, _, tree = _pools()
    _insert(tree, alloc, list(range(3)))
    _insert(tree, alloc, list(range(12)))  # nodes [0,1,2] and [3..11]
    node = tree.match_prefix(list(range(12)) + [99]).last_device_node
    tree.inc_lock_ref(node)  # window: the last 4 tokens, inside [3..11]; [0,1,2] stays SWA-evictable
    assert tree.swa_protected_size() == 9 and tree.swa_evictable_size() == 3
    tree.match_prefix(list(range(6)) + [99])  # splits [3..11] into [3,4,5] and [6..11] (a shorter hit)
    tree.dec_lock_ref(node)  # walks both parts, to the top of the window as locked
    assert tree.swa_protected_size() == 0 and tree.swa_evictable_size() == 12
    assert all(n.swa_lock_ref == 0 for n in tree._nodes())


def _ledger(size_swa: int = 32):
    alloc, r2t, tree = _pools(64, size_swa)
    return SWAKVLedger(r2t, alloc, tree, None, sliding_window_size=W), alloc


def test_a_decoding_request_keeps_its_window_only():
    ledger, alloc = _ledger()
    req = SimpleNamespace(req_pool_idx=None, kv_committed_len=0, kv_allocated_len=0,
                          prefix_indices=torch.empty(0, dtype=torch.int64), last_node=None, rid="r")
    req.req_pool_idx = ledger.alloc_rows(1)[0]
    slots = ledger.reserve([0], [10], [-1])  # a 10-token prefill
    ledger.req_to_token_pool.write((req.req_pool_idx, slice(0, 10)), slots)
    ledger.advance(req, 10)
    for n in range(10, 30):  # decode steps
        loc = ledger.reserve([n], [n + 1], [-1])
        ledger.req_to_token_pool.write((req.req_pool_idx, slice(n, n + 1)), loc)
        ledger.advance(req, n + 1)
        ledger.check_conserved([req])
    held = int(alloc.has_swa(ledger.row(req)[:30]).sum())
    # its window (W) and the two forwards the lag keeps (the overlap loop may still run one)
    assert W <= held <= W + 2, held
    assert alloc.available_size() == 64 - 30  # every full slot kept
    ledger.release(req)
    assert alloc.available_size() == 64 and alloc.swa_available_size() == 32
    ledger.check_idle(64)


def test_conservation_catches_a_dropped_window_slot():
    ledger, alloc = _ledger()
    req = SimpleNamespace(req_pool_idx=ledger.alloc_rows(1)[0], kv_committed_len=0, kv_allocated_len=0,
                          prefix_indices=torch.empty(0, dtype=torch.int64), last_node=None, rid="r")
    slots = ledger.reserve([0], [8], [-1])
    ledger.req_to_token_pool.write((req.req_pool_idx, slice(0, 8)), slots)
    ledger.advance(req, 8)
    ledger.check_conserved([req])
    alloc.free_swa(slots[-1:])  # a slot inside the window lost
    with pytest.raises(MemoryLeakError, match="inside its window"):
        ledger.check_conserved([req])


@pytest.mark.parametrize("flags, what", [
    (dict(page_size=4), "--page-size"),
    (dict(enable_hierarchical_cache=True), "--enable-hierarchical-cache"),
    (dict(speculative_algorithm="NGRAM"), "--speculative-algorithm"),
    (dict(attention_backend="triton"), "--attention-backend triton"),
    (dict(chunked_prefill_size=-1), "chunked prefill off"),
])
def test_what_the_swa_pool_does_not_run_with_is_refused_with_one_line(flags, what):
    with pytest.raises(ValueError) as e:
        ServerArgs(enable_hybrid_swa_memory=True, **flags).check()
    msg = str(e.value)
    assert msg.startswith("--enable-hybrid-swa-memory does not run with") and what in msg and "\n" not in msg
    # Not asked for (the default): no refusal; the model runner keeps one pool and says why.
    default = ServerArgs(**flags)
    default.check()
    assert default.enable_hybrid_swa_memory is None and what in default.hybrid_swa_memory_unsupported()


def test_the_flag_is_tri_state_on_the_command_line():
    import argparse
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    parse = lambda *a: ServerArgs.from_cli_args(parser.parse_args(list(a))).enable_hybrid_swa_memory  # noqa: E731
    assert parse() is None and parse("--enable-hybrid-swa-memory") is True and parse("--disable-hybrid-swa-memory") is False
    assert ServerArgs().hybrid_swa_memory_unsupported() is None


def test_the_swa_pool_runs_either_loop_by_the_device_default():
    args = ServerArgs(enable_hybrid_swa_memory=True)
    args.check()
    assert args.overlap_schedule_enabled("cuda") and not args.overlap_schedule_enabled("cpu")
    assert ServerArgs(enable_hybrid_swa_memory=True, disable_overlap_schedule=False).overlap_schedule_enabled("cpu")


def test_forward_locs_are_read_at_schedule_time_and_survive_later_frees():
    """A batch's windowed-layer slots (SWAForwardLocs) are the swa slots of each request's keys
    first..seq_len-1 (first = prefix_len - W + 1) as mapped when it was scheduled: freeing or
    moving them in the map afterwards (what the overlap loop's next schedule does while this
    forward runs) leaves the batch's copy as it was."""
    ledger, alloc = _ledger()
    rows = ledger.alloc_rows(2)
    a, b = ledger.reserve([0], [10], [-1]), ledger.reserve([0], [3], [-1])
    ledger.write_spans(rows, [0, 0], [10, 3], torch.cat([a, b]))
    new = ledger.reserve([10, 3], [11, 4], [-1, -1])  # a decode step for each
    ledger.write_at(torch.tensor(rows), torch.tensor([10, 3]), new)
    locs = ledger.swa_forward_locs(torch.tensor(rows), [10, 3], [11, 4], new)
    m = alloc.full_to_swa_index_mapping
    assert locs.lens.tolist() == [W, 4]  # a's last W keys; all 4 of b's
    assert locs.table[0].tolist() == m[torch.cat([a[-3:], new[:1]])].tolist()
    assert locs.table[1].tolist() == m[torch.cat([b, new[1:]])].tolist()
    assert locs.out_cache_loc.tolist() == m[new].tolist() and (locs.out_cache_loc > 0).all()
    before = locs.table.clone()
    alloc.free(torch.cat([a, b, new]))  # the map forgets them ...
    assert (m[torch.cat([a, b, new])] == 0).all()
    assert torch.equal(locs.table, before)  # ... the scheduled batch's copy does not
    # An extend: keys from prefix_len - W + 1 (the first query's window), 0-padded per row.
    ext = ledger.swa_forward_locs(torch.tensor(rows[:1]), [6], [10], torch.empty(0, dtype=torch.int64))
    assert ext.lens.tolist() == [10 - 3] and ext.table.shape == (1, 7)


def _adder(ledger, running, chunk=None, ratio=1.0):
    from radixserve.managers.schedule_policy import PrefillAdder
    return PrefillAdder(1, ledger, running, ratio, rem_input_tokens=10000, rem_chunk_tokens=chunk)


def _new_req(rid: str, n: int, max_new: int):
    from radixserve.managers.schedule_batch import Req
    from radixserve.sampling_params import SamplingParams
    sp = SamplingParams(max_new_tokens=max_new)
    sp.normalize()
    return Req(rid, None, [1000 + i for i in range(n)], sp)


def test_admission_stops_on_the_swa_pool_with_the_full_pool_wide_open():
    """A SWA pool of 32 slots beside 512 full ones (W = 4): each request takes its extend and a
    window there (6 + 4), so the fourth does not fit though the full pool has room for dozens;
    running requests reserve what their windows may still grow by (at most W each)."""
    from radixserve.managers.schedule_batch import ScheduleBatch
    from radixserve.managers.schedule_policy import AddReqResult
    alloc, r2t, tree = _pools(512, 32)
    ledger = SWAKVLedger(r2t, alloc, tree, None, sliding_window_size=W)
    empty = ScheduleBatch(reqs=[], tree_cache=tree)
    adder = _adder(ledger, empty)
    reqs = [_new_req(str(i), 6, 100) for i in range(4)]
    results = []
    for r in reqs:
        r.init_next_round_input(ledger)
        results.append(adder.add_one_req(r))
    assert results[:3] == [AddReqResult.CONTINUE] * 3 and adder.rem_swa_tokens == 32 - 3 * (6 + W)
    assert results[3] == AddReqResult.NO_TOKEN and adder.can_run_list == reqs[:3]
    assert adder.rem_total_tokens > 6 + 100  # the full pool would have taken it
    # Eight running requests with many tokens to go: a window each is reserved, so nothing new fits.
    running = ScheduleBatch(reqs=[_new_req(f"run{i}", 3, 100) for i in range(8)], tree_cache=tree)
    adder = _adder(ledger, running, ratio=0.5)
    assert adder.rem_swa_tokens == 32 - 8 * W and adder.budget_state() == AddReqResult.NO_TOKEN
    late = _new_req("late", 6, 100)
    late.init_next_round_input(ledger)
    assert adder.add_one_req(late) == AddReqResult.NO_TOKEN and adder.can_run_list == []
    # A plain ledger has no SWA budget.
    assert _adder(KVLedger(r2t, alloc.full, tree), empty).rem_swa_tokens is None
