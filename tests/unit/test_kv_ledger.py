"""Issue 40: the KV ledger, the one owner of rows, slots and tree locks (mem_cache/kv_ledger.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from radixserve.mem_cache.base_prefix_cache import MemoryLeakError
from radixserve.mem_cache.kv_ledger import KVLedger
from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixserve.mem_cache.radix_cache import RadixCache

PS, TOTAL = 4, 64


def _ledger() -> KVLedger:
    r2t, alloc = ReqToTokenPool(4, 64), TokenToKVPoolAllocator(TOTAL, page_size=PS)
    return KVLedger(r2t, alloc, RadixCache(r2t, alloc, page_size=PS))


def _req(ledger: KVLedger, n: int) -> SimpleNamespace:
    """A request whose row holds n tokens' slots, no tree prefix."""
    req = SimpleNamespace(req_pool_idx=ledger.alloc_rows(1)[0], kv_committed_len=0, kv_allocated_len=0,
                          prefix_indices=torch.empty(0, dtype=torch.int64), last_node=None)
    slots = ledger.reserve([0], [n], [-1])
    ledger.write_spans([req.req_pool_idx], [0], [n], slots)
    ledger.advance(req, n)
    return req


def test_commit_frees_the_whole_pages_past_the_kept_tokens():
    ledger = _ledger()
    req = _req(ledger, 13)  # 4 pages
    assert ledger.available_size() == TOTAL - 16
    ledger.commit(req, 6)  # page 2 (tokens 4..7) stays: token 5 is in it
    assert ledger.available_size() == TOTAL - 8
    assert (req.kv_committed_len, req.kv_allocated_len) == (6, 0)
    ledger.check_conserved([req])
    ledger.release(req)
    assert req.req_pool_idx is None and ledger.available_size() == TOTAL
    ledger.check_idle(TOTAL)


def test_reserved_ahead_slots_go_back_on_commit():
    ledger = _ledger()
    req = _req(ledger, 4)
    more = ledger.reserve([4], [12], [int(ledger.row(req)[3])])
    ledger.req_to_token_pool.write_spans([req.req_pool_idx], [4], [8], more)
    req.kv_allocated_len = 12
    ledger.check_conserved([req])
    ledger.commit(req, 5)
    assert ledger.available_size() == TOTAL - 8
    ledger.release(req)
    ledger.check_idle(TOTAL)


def test_conservation_check_catches_a_lost_slot():
    ledger = _ledger()
    req = _req(ledger, 8)
    ledger.advance(req, 4)  # the ledger no longer knows of the second page
    with pytest.raises(MemoryLeakError):
        ledger.check_conserved([req])


def test_reserve_raises_when_out_of_memory():
    ledger = _ledger()
    with pytest.raises(RuntimeError, match="out of memory"):
        ledger.reserve([0], [TOTAL + PS], [-1])


def test_lock_keeps_a_prefix_from_eviction():
    ledger = _ledger()
    key = list(range(8))
    ledger.tree_cache.insert(key, ledger.alloc_slots(8))
    node = ledger.tree_cache.match_prefix(key).last_device_node
    assert ledger.budget() == TOTAL
    with ledger.locked(node):
        assert ledger.budget() == TOTAL - 8
        assert not ledger.make_room(TOTAL)
    assert ledger.make_room(TOTAL)


def test_reserve_ahead_continues_the_last_page_and_records_the_reserved_length():
    """The speculative overlap loop's window (managers/spec_overlap.py): slots for positions up to
    the target, written into the row; the paged reserve fills the last held page first."""
    ledger = _ledger()
    a, b = _req(ledger, 6), _req(ledger, 8)
    free = ledger.available_size()
    ledger.reserve_ahead([a, b], [11, 5])  # b already holds more than its target: nothing for it
    assert (a.kv_allocated_len, b.kv_allocated_len) == (11, 8)
    assert ledger.available_size() == free - PS  # a's page 2 (tokens 8..11); tokens 6, 7 are in page 1
    row = ledger.row(a)[:11].tolist()
    assert row[6] == row[5] + 1 and row[7] == row[5] + 2  # the same page as token 5
    assert len(set(row)) == 11
    ledger.check_conserved([a, b])
    ledger.commit(a, a.kv_committed_len)  # the window goes back, the committed pages stay
    assert a.kv_allocated_len == 0 and ledger.available_size() == free
    ledger.release(a)
    ledger.release(b)
    ledger.check_idle(TOTAL)


def test_row_writes_and_match_go_through_the_ledger():
    ledger = _ledger()
    req = _req(ledger, 4)
    slots = ledger.reserve([4], [6], ledger.last_locs([req], [4]))
    ledger.write_row(req, 4, slots[:1])
    ledger.write_at(torch.tensor([req.req_pool_idx]), torch.tensor([5]), slots[1:])
    assert ledger.row(req)[4:6].tolist() == slots.tolist()
    ledger.advance(req, 6)
    req.origin_input_ids, req.output_ids, req.fill_ids = list(range(6)), [], list(range(6))
    req.last_node = ledger.tree_cache.root_node
    ledger.cache_finished_req(req)  # the row's KV into the tree, the row free
    assert ledger.free_rows() == 4
    match = ledger.match(list(range(6)))
    assert match.device_indices.tolist() == ledger.rows_cpu[0, :4].tolist()  # whole pages only
