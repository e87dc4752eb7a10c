"""Shared by the attention-kernel tests: a ragged batch over a paged KV pool whose requests sit
on pages taken in a shuffled order, with garbage everywhere else so that a wrong slot shows."""

import random
from types import SimpleNamespace

import torch

from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool


def scattered_slots(seq_lens, page_size, num_pages, rng):
    """Slots of each request on pages taken in a shuffled order (page 0 is padding)."""
    pages = list(range(1, num_pages + 1))
    rng.shuffle(pages)
    out = []
    for n in seq_lens:
        need = -(-n // page_size)
        mine, pages = pages[:need], pages[need:]
        out.append(torch.tensor([p * page_size + o for p in mine for o in range(page_size)][:n], dtype=torch.int64))
    return out


def make_attention_batch(mode, prefix_lens, extend_lens, heads, kv_heads, head_dim, page_size, seed,
                         dtype=torch.float32, kv_dtype=None, device="cpu", sliding_window=None):
    """(forward batch, q, k, v, layer): request i has prefix_lens[i] tokens in the pool and
    extend_lens[i] new ones; q/k/v are the new tokens' [T, heads, head_dim] in `dtype`, the pool
    in `kv_dtype` (default: `dtype`); tensors on `device`, with the same values on every device
    (drawn on the CPU)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    bs = len(prefix_lens)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    num_pages = sum(-(-n // page_size) for n in seq_lens) + 3
    pool = MHATokenToKVPool(num_pages * page_size, page_size, kv_dtype or dtype, kv_heads, head_dim, 1, device)
    pool.k_buffer[0].copy_(torch.randn(pool.k_buffer[0].shape, generator=g))
    pool.v_buffer[0].copy_(torch.randn(pool.v_buffer[0].shape, generator=g))
    r2t = ReqToTokenPool(bs + 3, max(seq_lens) + 4, device)
    rows = list(range(bs + 3))
    rng.shuffle(rows)
    rows = rows[:bs]
    slots = scattered_slots(seq_lens, page_size, num_pages, rng)
    for row, s in zip(rows, slots):
        r2t.req_to_token[row, : len(s)] = s.to(device, torch.int32)
    fb = SimpleNamespace(
        forward_mode=mode,
        batch_size=bs,
        req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        seq_lens_cpu=seq_lens,
        out_cache_loc=torch.cat([s[p:] for s, p in zip(slots, prefix_lens)]).to(device),
        extend_seq_lens_cpu=list(extend_lens),
        extend_prefix_lens_cpu=list(prefix_lens),
        req_to_token_pool=r2t,
        token_to_kv_pool=pool,
        attn_metadata=None,
    )
    T = sum(extend_lens)
    q = torch.randn(T, heads, head_dim, generator=g).to(device, dtype)
    k = torch.randn(T, kv_heads, head_dim, generator=g).to(device, dtype)
    v = torch.randn(T, kv_heads, head_dim, generator=g).to(device, dtype)
    return fb, q, k, v, SimpleNamespace(layer_id=0, scaling=head_dim**-0.5, sliding_window_size=sliding_window)
