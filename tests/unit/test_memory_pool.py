"""L2 and L3 of seed 003: ReqToTokenPool, TokenToKVPoolAllocator, MHATokenToKVPool."""

import os
import random

import pytest
import torch

from radixserve.mem_cache.mamba_pool import HybridReqToTokenPool, MambaPool, MambaStateShape
from radixserve.mem_cache.memory_pool import (
    ForwardFence, MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator, zeros_on_demand,
)
from radixserve.utils import trim_heap, zero_pages_lazily


# ---- TokenToKVPoolAllocator ------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 16])
def test_alloc_free_available(page_size):
    size = 8 * page_size
    a = TokenToKVPoolAllocator(size, page_size=page_size)
    assert a.available_size() == size

    x = a.alloc(3 * page_size)
    assert x.dtype == torch.int64 and len(x) == 3 * page_size
    assert a.available_size() == size - 3 * page_size
    # Slots lie on whole pages, never on the padding page 0, and inside the KV buffers.
    assert (x >= page_size).all() and (x < size + page_size).all()
    pages = x // page_size
    assert torch.bincount(pages).max().item() in (0, page_size)
    assert len(set(x.tolist())) == len(x)

    y = a.alloc(5 * page_size)
    assert a.available_size() == 0
    assert not set(x.tolist()) & set(y.tolist())

    a.free(x)
    assert a.available_size() == 3 * page_size
    z = a.alloc(3 * page_size)
    assert sorted(z.tolist()) == sorted(x.tolist())

    a.free(torch.cat([y, z]))
    assert a.available_size() == size
    a.free(torch.empty(0, dtype=torch.int64))  # freeing nothing is fine
    assert a.available_size() == size


@pytest.mark.parametrize("page_size", [1, 16])
def test_exhaustion_returns_none(page_size):
    a = TokenToKVPoolAllocator(4 * page_size, page_size=page_size)
    assert a.alloc(5 * page_size) is None
    assert a.available_size() == 4 * page_size  # a failed alloc takes nothing
    got = a.alloc(4 * page_size)
    assert got is not None
    assert a.alloc(page_size) is None
    assert a.alloc_extend([0], [1], [-1]) is None
    assert a.alloc_decode([1], [-1]) is None


@pytest.mark.parametrize("page_size", [1, 16])
def test_alloc_zero(page_size):
    a = TokenToKVPoolAllocator(4 * page_size, page_size=page_size)
    x = a.alloc(0)
    assert x is not None and x.numel() == 0
    assert a.available_size() == 4 * page_size


@pytest.mark.parametrize("page_size", [1, 16])
def test_double_free_raises(page_size):
    a = TokenToKVPoolAllocator(4 * page_size, page_size=page_size)
    x = a.alloc(2 * page_size)
    a.free(x)
    with pytest.raises(RuntimeError, match="double free"):
        a.free(x)
    with pytest.raises(RuntimeError, match="double free"):
        a.free(x[:1])  # never allocated since (back in the free list)
    # The padding slot 0 is never allocated, so freeing it is an error too.
    with pytest.raises(RuntimeError):
        a.free(torch.tensor([0]))
    assert a.available_size() == 4 * page_size


def test_free_int32_indices():
    # Rows of req_to_token are int32; freeing a slice of one must work.
    a = TokenToKVPoolAllocator(8)
    x = a.alloc(4)
    a.free(x.to(torch.int32))
    assert a.available_size() == 8


@pytest.mark.parametrize("page_size", [1, 16])
def test_free_group_batches(page_size):
    a = TokenToKVPoolAllocator(8 * page_size, page_size=page_size)
    x = a.alloc(2 * page_size)
    y = a.alloc(3 * page_size)
    a.free_group_begin()
    a.free(x)
    a.free(y)
    a.free(torch.empty(0, dtype=torch.int64))
    assert a.available_size() == 3 * page_size  # nothing returned until the group ends
    a.free_group_end()
    assert a.available_size() == 8 * page_size
    # An empty group is fine, and free() works normally afterwards.
    a.free_group_begin()
    a.free_group_end()
    z = a.alloc(page_size)
    a.free(z)
    assert a.available_size() == 8 * page_size


@pytest.mark.parametrize("page_size", [1, 16])
def test_free_group_double_free_raises(page_size):
    a = TokenToKVPoolAllocator(8 * page_size, page_size=page_size)
    x = a.alloc(2 * page_size)
    a.free_group_begin()
    a.free(x)
    a.free(x[:1])
    with pytest.raises(RuntimeError, match="double free"):
        a.free_group_end()


def test_paged_free_of_partial_page_frees_the_page():
    a = TokenToKVPoolAllocator(4 * 16, page_size=16)
    x = a.alloc(16)
    a.free(x[3:5])  # any slot of a page returns the whole page
    assert a.available_size() == 4 * 16
    with pytest.raises(RuntimeError, match="double free"):
        a.free(x[10:11])


def test_clear():
    a = TokenToKVPoolAllocator(64, page_size=16)
    a.alloc(48)
    a.clear()
    assert a.available_size() == 64
    assert len(a.alloc(64)) == 64


def _check_paged_layout(slots_per_req, page_size):
    """Each request's position i lies on the page of its position i // ps * ps, pages are
    never shared between requests, and no slot is handed out twice."""
    owner = {}
    all_slots = []
    for r, slots in enumerate(slots_per_req):
        for i, s in enumerate(slots):
            page = s // page_size
            assert s % page_size == i % page_size, f"req {r} pos {i}: slot {s} misaligned"
            if i % page_size:
                assert page == slots[i - 1] // page_size
            assert owner.setdefault(page, r) == r, f"page {page} shared by reqs {owner[page]} and {r}"
            all_slots.append(s)
    assert len(all_slots) == len(set(all_slots))
    assert all(s >= page_size for s in all_slots)


def test_alloc_extend_paged_fills_last_page():
    ps = 16
    a = TokenToKVPoolAllocator(32 * ps, page_size=ps)
    # Two requests extend from scratch: 20 tokens (2 pages) and 5 tokens (1 page).
    out = a.alloc_extend([0, 0], [20, 5], [-1, -1])
    assert len(out) == 25
    assert a.available_size() == (32 - 3) * ps
    r0, r1 = out[:20].tolist(), out[20:].tolist()
    # Now extend request 0 from 20 to 40 and request 1 from 5 to 9 (stays inside its page).
    out2 = a.alloc_extend([20, 5], [40, 9], [r0[-1], r1[-1]])
    assert len(out2) == 24
    assert a.available_size() == (32 - 4) * ps  # req 0 needed one new page, req 1 none
    r0 += out2[:20].tolist()
    r1 += out2[20:].tolist()
    assert r0[20:32] == list(range(r0[19] + 1, r0[19] + 13))  # rest of page 2 first
    assert r1[5:9] == list(range(r1[4] + 1, r1[4] + 5))
    _check_paged_layout([r0, r1], ps)

    # Decode: token 40 of request 0 (40 % 16 == 8: same page as token 39) and token 9 of
    # request 1; then request 1 up to token 15 (the last slot of its page), then token 16
    # (a new page).
    d = a.alloc_decode([41, 10], [r0[-1], r1[-1]])
    assert a.available_size() == (32 - 4) * ps
    assert d.tolist() == [r0[-1] + 1, r1[-1] + 1]
    r0.append(d[0].item())
    r1.append(d[1].item())
    while len(r1) < 16:
        r1.append(a.alloc_decode([len(r1) + 1], [r1[-1]]).item())
    assert a.available_size() == (32 - 4) * ps
    d = a.alloc_decode([17], [r1[-1]])
    assert a.available_size() == (32 - 5) * ps
    r1.append(d.item())
    _check_paged_layout([r0, r1], ps)


def test_alloc_extend_page1():
    a = TokenToKVPoolAllocator(64, page_size=1)
    out = a.alloc_extend([0, 3], [5, 7], [-1, 10])
    assert len(out) == 9 and len(set(out.tolist())) == 9
    d = a.alloc_decode([6, 8], [0, 0])
    assert len(d) == 2 and not set(d.tolist()) & set(out.tolist())
    assert a.available_size() == 64 - 11


@pytest.mark.parametrize("page_size", [1, 16])
def test_random_extend_decode_free_never_gives_a_slot_twice(page_size):
    rng = random.Random(1234 + page_size)
    num_pages = 40
    a = TokenToKVPoolAllocator(num_pages * page_size, page_size=page_size)
    reqs = {}  # id -> list of slots, position i at index i
    next_id = 0
    for _ in range(600):
        op = rng.random()
        if op < 0.3:
            # New requests extend from scratch (batch of 1..3).
            n = rng.randint(1, 3)
            lens = [rng.randint(1, 3 * page_size + 3) for _ in range(n)]
            out = a.alloc_extend([0] * n, lens, [-1] * n)
            if out is None:
                continue
            off = 0
            for ln in lens:
                reqs[next_id] = out[off : off + ln].tolist()
                off += ln
                next_id += 1
        elif op < 0.55 and reqs:
            ids = rng.sample(sorted(reqs), k=min(len(reqs), rng.randint(1, 3)))
            pre = [len(reqs[i]) for i in ids]
            ext = [p + rng.randint(1, 2 * page_size) for p in pre]
            out = a.alloc_extend(pre, ext, [reqs[i][-1] for i in ids])
            if out is None:
                continue
            off = 0
            for i, p, s in zip(ids, pre, ext):
                reqs[i] += out[off : off + s - p].tolist()
                off += s - p
        elif op < 0.8 and reqs:
            ids = sorted(reqs)
            out = a.alloc_decode([len(reqs[i]) + 1 for i in ids], [reqs[i][-1] for i in ids])
            if out is None:
                continue
            for i, s in zip(ids, out.tolist()):
                reqs[i].append(s)
        elif reqs:
            i = rng.choice(sorted(reqs))
            a.free(torch.tensor(reqs.pop(i)))
        # Invariants: layout, and free + held pages == all pages.
        if page_size > 1:
            _check_paged_layout(list(reqs.values()), page_size)
        held = {s // page_size for slots in reqs.values() for s in slots}
        flat = [s for slots in reqs.values() for s in slots]
        assert len(flat) == len(set(flat))
        assert a.available_size() + len(held) * page_size == num_pages * page_size
        assert not held & set(a.free_pages.tolist())
    for slots in reqs.values():
        a.free(torch.tensor(slots))
    assert a.available_size() == num_pages * page_size


# ---- ReqToTokenPool --------------------------------------------------------------------
def test_req_to_token_pool_alloc_free():
    p = ReqToTokenPool(size=4, max_context_len=32)
    assert p.req_to_token.shape == (4, 32) and p.req_to_token.dtype == torch.int32
    rows = p.alloc(3)
    assert len(rows) == 3 and len(set(rows)) == 3 and p.available_size() == 1
    assert p.alloc(2) is None
    assert p.available_size() == 1
    last = p.alloc(1)
    assert p.available_size() == 0 and last[0] not in rows
    p.write((rows[0], slice(0, 4)), torch.tensor([5, 6, 7, 8], dtype=torch.int64))
    assert p.req_to_token[rows[0], :4].tolist() == [5, 6, 7, 8]
    p.free(rows[0])
    p.free(rows[1:])
    assert p.available_size() == 3
    again = p.alloc(3)
    assert sorted(again) == sorted(rows)
    p.clear()
    assert p.available_size() == 4


# ---- MHATokenToKVPool ------------------------------------------------------------------
def test_a_row_freed_while_batches_are_in_flight_waits_for_them():
    """The overlap loop's fence: a row (and a hybrid row's state slot) freed while batches are in
    flight is handed out again only once those batches are done; the idle checks count it free."""
    shape = MambaStateShape(num_layers=1, conv_dim=2, conv_kernel=2, num_heads=1, head_k_dim=1, head_v_dim=1)
    for pool in (ReqToTokenPool(3, 8), HybridReqToTokenPool(3, 8, MambaPool(3, shape, torch.float32))):
        fence = ForwardFence()
        pool.fence = fence
        a, b, c = pool.alloc(3)
        fence.launched = 2  # batches 1 and 2 in flight (both read row a)
        pool.free(a)
        assert pool.available_size() == 0 and pool.deferred_size() == 1 and pool.alloc(1) is None
        if isinstance(pool, HybridReqToTokenPool):
            assert pool.mamba_index_cpu[a] != 0 and pool.mamba_pool.available_size() == 0  # its slot waits too
        fence.done = 1  # batch 2 still in flight
        assert pool.available_size() == 0
        fence.done = 2
        assert pool.deferred_size() == 0 and pool.alloc(1) == [a]
        pool.free([a, b, c])  # nothing in flight: back at once
        assert pool.available_size() == 3


def test_mha_kv_pool_set_get():
    page_size = 4
    pool = MHATokenToKVPool(
        size=32, page_size=page_size, dtype=torch.float32, head_num=2, head_dim=8, layer_num=3
    )
    assert pool.get_key_buffer(0).shape == (32 + page_size, 2, 8)
    loc = torch.tensor([4, 9, 35])  # includes the highest slot a page_size-4 allocator gives
    k = torch.randn(3, 2, 8, dtype=torch.float64)
    v = torch.randn(3, 2, 8)
    pool.set_kv_buffer(1, loc, k, v)
    assert pool.get_key_buffer(1).dtype == torch.float32
    torch.testing.assert_close(pool.get_key_buffer(1)[loc], k.float())
    torch.testing.assert_close(pool.get_value_buffer(1)[loc], v)
    assert pool.get_key_buffer(0).abs().sum() == 0  # other layers untouched
    assert pool.get_value_buffer(2).abs().sum() == 0
    assert MHATokenToKVPool.bytes_per_token(2, 8, 3, torch.float16) == 2 * 2 * 8 * 3 * 2


def test_allocator_slots_fit_kv_buffers():
    for page_size in (1, 4, 16):
        size = 8 * page_size
        a = TokenToKVPoolAllocator(size, page_size=page_size)
        pool = MHATokenToKVPool(size, page_size, torch.float32, 1, 1, 1)
        x = a.alloc(size)
        assert x.max().item() < pool.get_key_buffer(0).shape[0]


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="resident memory read from Linux's /proc")
def test_cpu_pools_are_resident_only_as_far_as_they_are_used():
    # Sized as for Qwen2.5-1.5B at -c 8192: req_to_token 2049 x 32768 int32 (256 MB), KV 8192 slots of
    # 28 layers x 2 heads x 128 fp16 (224 MB). torch.zeros would make all 480 MB resident at once.
    before = _rss_mb()
    req = ReqToTokenPool(2049, 32768)
    kv = MHATokenToKVPool(8192, 1, torch.float16, head_num=2, head_dim=128, layer_num=28)
    assert _rss_mb() - before < 48
    idx = req.alloc(1)
    req.write((idx[0], slice(0, 300)), torch.arange(1, 301, dtype=torch.int32))
    loc = torch.arange(1, 301)
    for layer in range(28):
        kv.set_kv_buffer(layer, loc, torch.ones(300, 2, 128), torch.ones(300, 2, 128))
    assert _rss_mb() - before < 64  # a 300-token request touches a few pages of each
    assert req.req_to_token[idx[0], :301].tolist() == list(range(1, 301)) + [0]  # zeros where never written
    assert kv.get_key_buffer(27)[loc].eq(1).all() and kv.get_value_buffer(3)[8000:].eq(0).all()
    assert all(t.untyped_storage().resizable() for t in (req.req_to_token, kv.get_key_buffer(0)))  # the memory saver's


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="madvise zeroing is Linux's")
def test_zero_pages_lazily_zeroes_exactly_the_tensor():
    buf = torch.ones(2_000_003, dtype=torch.int32)
    view = buf[7:-5]  # starts and ends inside pages: those partial pages are written, the rest given back
    assert zero_pages_lazily(view)
    assert view.eq(0).all() and buf[:7].eq(1).all() and buf[-5:].eq(1).all()
    assert zeros_on_demand((3, 5), torch.float16).eq(0).all()


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="resident memory read from Linux's /proc")
def test_trim_heap_gives_freed_heap_memory_back():
    # 64 KiB blocks come from the heap (under glibc's mmap threshold); the last one stays allocated,
    # so the 128 MiB freed below it cannot go back by shrinking the heap's top: only malloc_trim does it
    import ctypes

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    blocks = [libc.malloc(64 * 1024) for _ in range(2049)]
    for b in blocks:
        ctypes.memset(b, 1, 64 * 1024)
    for b in blocks[:-1]:
        libc.free(ctypes.c_void_p(b))
    before = _rss_mb()
    assert trim_heap()
    assert before - _rss_mb() > 100
    libc.free(ctypes.c_void_p(blocks[-1]))
