"""Speculative decoding in the overlap loop (managers/spec_overlap.py, speculative/overlap_view.py):
the FutureMap's draft state, the slots reserved ahead, and the view a step runs on. End to end
(greedy outputs equal speculation off in the overlap loop, under retraction, chunking and paging,
with slot conservation after every step) is in test_speculative_{ngram,standalone,eagle}.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from radixserve.managers import spec_overlap
from radixserve.managers.overlap import FutureMap
from radixserve.mem_cache.chunk_cache import ChunkCache
from radixserve.mem_cache.kv_ledger import KVLedger
from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixserve.model_executor.forward_batch import ForwardMode, ModelWorkerBatch
from radixserve.speculative.overlap_view import decode_view


def test_future_map_gives_only_the_tokens_the_snapshot_lacks():
    fm = FutureMap(max_running_requests=4, chunked_prefill_size=None, context_len=64, device="cpu")
    idx = fm.alloc_future_indices(2)
    # request 0 committed 3 tokens reaching length 13; request 1 one token reaching 8
    fm.store_committed(idx, [[5, 6, 7], [9]], [13, 8])
    placeholders = -idx
    assert fm.resolve_future(placeholders).tolist() == [7, 9]  # the next input: the last token
    # the scheduler's snapshot had 10 and 7 tokens: all of the step's tokens are pending
    assert fm.resolve_committed(placeholders, [10, 7]) == [[5, 6, 7], [9]]
    # it processed that step before the snapshot (the placeholder stayed in the batch): none
    assert fm.resolve_committed(placeholders, [13, 8]) == [[], []]
    assert fm.resolve_committed(torch.tensor([4, 9]), [3, 3]) == [[], []]  # real tokens


def _req(rid: str, origin, output, row: int, kv: int):
    return SimpleNamespace(rid=rid, origin_input_ids=origin, output_ids=output, req_pool_idx=row,
                           kv_committed_len=kv, kv_allocated_len=0, sampling_params=None, grammar=None,
                           to_finish=None, lora_path=None, seqlen=lambda: len(origin) + len(output))


def test_slots_are_reserved_for_any_length_the_step_in_flight_leaves():
    """k = 2 drafts: a request with S known tokens gets slots up to position S + 2k, and the
    view of the next step finds its token and drafts' slots there whatever the step in flight
    committed (0 to k + 1 tokens)."""
    k, width = 2, 64
    pool = ReqToTokenPool(2, width)
    rows = pool.req_to_token_cpu  # on the CPU: the one table
    rows[0, :10] = torch.arange(10)  # request a: 10 tokens with KV, 11 known (the last has none)
    rows[1, :5] = torch.arange(100, 105)  # request b: prefill of 5 just launched (its token in flight)
    reqs = [_req("a", list(range(6)), list(range(5)), 0, kv=10), _req("b", list(range(5)), [], 1, kv=5)]

    allocator = TokenToKVPoolAllocator(1000, page_size=1)
    ledger = KVLedger(pool, allocator, ChunkCache(pool, allocator))
    batch = SimpleNamespace(reqs=reqs, spec_max_drafts=k, output_ids=torch.tensor([4, -3]),
                            ledger=ledger, req_pool_indices=torch.tensor([0, 1]))
    assert spec_overlap.new_slots_needed(reqs, k, width, page_size=1) == (11 + 2 * k + 1 - 10) + (5 + 2 * k + 1 - 5)
    free_before = allocator.available_size()
    spec_overlap.prepare_decode(batch)
    assert [r.kv_allocated_len for r in reqs] == [11 + 2 * k + 1, 5 + 2 * k + 1]
    assert allocator.available_size() == free_before - (11 + 2 * k + 1 - 10) - (5 + 2 * k + 1 - 5)  # the ledger reserved them
    inp = batch.spec_overlap_input
    assert inp.known_lens == [11, 5] and inp.windows.shape == (2, 2 * k + 2)
    assert inp.windows[0].tolist() == rows[0, 10:16].tolist()  # positions S-1 .. S+2k
    # The step in flight committed nothing new for a, and b's first token plus 2 more (a
    # speculative prefill commits one, but the view takes any count up to k + 1).
    wb = ModelWorkerBatch(forward_mode=ForwardMode.DECODE, input_ids=inp.input_ids, req_pool_indices=batch.req_pool_indices,
                          seq_lens=batch.seq_lens, out_cache_loc=batch.out_cache_loc, seq_lens_cpu=batch.seq_lens_cpu)
    view = decode_view(inp, [[], [7, 8, 9]], wb, SimpleNamespace(req_to_token_pool=pool), False, [0, 0], verify_width=1 + k)
    assert view.seq_lens_cpu == [11, 8] and view.input_ids.tolist() == [4, 9]
    assert view.reqs[1].output_ids == [7, 8, 9]
    # the last token goes at position seq_len - 1, its drafts after it: all reserved slots
    assert view.out_cache_loc.tolist() == [int(rows[0, 10]), int(rows[1, 7])]
    drafts = view.alloc_slots_after([11, 8], [11 + k, 8 + k])
    assert drafts.tolist() == rows[0, 11:13].tolist() + rows[1, 8:10].tolist()
    # past the verify: the spare reserved slots (EAGLE's scratch); freeing keeps them reserved
    spare = view.ledger.alloc_slots(2)
    assert set(spare.tolist()) <= set(rows[:, :16].flatten().tolist()) - set(drafts.tolist())
    view.ledger.free_slots(drafts)
