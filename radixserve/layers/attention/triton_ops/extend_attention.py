"""Extend (prefill) attention with a cached prefix, over the paged pool.

Request b's new tokens (rows extend_start[b] .. + extend_len[b] of q/k/v) attend to
  1. its cached prefix: positions 0..prefix_len-1, KV read from the pool through
     req_to_token[req_pool_indices[b]] (any page size: one slot lookup per token), and
  2. its own new tokens, causally, read straight from the fresh k/v (not from the pool).
Grid (batch, q_head, query block); GQA maps q head h to kv head h // (heads / kv_heads).
One online softmax runs over both parts (flash-attention style).

batch_invariant=True (--enable-deterministic-inference): every key, the new tokens' too (stored
before this kernel runs), is read from the pool in blocks of BLOCK_N absolute positions from 0, and
the query blocks are cut on absolute positions too (a token is always the same row of its block:
tl.dot need not give a row the same bits at another row), so a query's result does not depend on
where its request's cached prefix ends (a prefix hit, a chunk boundary) or on the other requests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _online_softmax_step(qk, v, acc, l_i, m_i, INPUT_PRECISION: tl.constexpr):
    """Fold one block of keys (scores qk, -inf where not seen; values v) into the running
    softmax: rescale what is summed so far to the new row maximum, add this block."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp(qk - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return acc, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    O,
    K_Buf,
    V_Buf,
    Req_to_token,
    Req_pool_indices,
    Prefix_lens,
    Extend_lens,
    Extend_start,
    sm_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_buf_t,
    stride_buf_h,
    stride_r2t,
    head_dim,
    kv_group: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # > 0: query at position p sees keys p - W + 1 .. p only
    ALL_FROM_POOL: tl.constexpr,  # batch-invariant: one pass over the pool's keys, blocks on absolute positions
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    kv_h = h // kv_group
    ext_len = tl.load(Extend_lens + b).to(tl.int32)
    prefix_len = tl.load(Prefix_lens + b).to(tl.int32)
    if ALL_FROM_POOL:  # query blocks on absolute positions too: a token is row (position % BLOCK_M) of its block
        row0 = (prefix_len // BLOCK_M + mb) * BLOCK_M - prefix_len  # the block's first row, relative (may be < 0)
    else:
        row0 = mb * BLOCK_M
    if row0 < ext_len:
        start = tl.load(Extend_start + b).to(tl.int64)
        req = tl.load(Req_pool_indices + b).to(tl.int64)

        offs_m = row0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = (offs_m >= 0) & (offs_m < ext_len)
        mask_d = offs_d < head_dim
        q_ptrs = Q + (start + offs_m[:, None]) * stride_qt + h * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)

        # Finite start so a fully masked block gives exp(-inf) = 0, never nan.
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        if ALL_FROM_POOL:  # keys 0 .. prefix_len + the block's last query, causal on absolute positions
            q_pos = prefix_len + offs_m
            n_keys = prefix_len + tl.minimum(ext_len, row0 + BLOCK_M)
            for n0 in range(0, n_keys, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                mask_n = offs_n < n_keys
                slots = tl.load(Req_to_token + req * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
                kv_off = slots[:, None] * stride_buf_t + kv_h * stride_buf_h + offs_d[None, :]
                kv_mask = mask_n[:, None] & mask_d[None, :]
                k = tl.load(K_Buf + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
                qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * sm_scale
                seen = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
                if SLIDING_WINDOW > 0:
                    seen = seen & (offs_n[None, :] > q_pos[:, None] - SLIDING_WINDOW)
                qk = tl.where(seen, qk, -float("inf"))
                v = tl.load(V_Buf + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
                acc, l_i, m_i = _online_softmax_step(qk, v, acc, l_i, m_i, INPUT_PRECISION)
        else:
            # 1. the cached prefix, through req_to_token
            for n0 in range(0, prefix_len, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                mask_n = offs_n < prefix_len
                slots = tl.load(Req_to_token + req * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
                kv_off = slots[:, None] * stride_buf_t + kv_h * stride_buf_h + offs_d[None, :]
                kv_mask = mask_n[:, None] & mask_d[None, :]
                k = tl.load(K_Buf + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
                qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * sm_scale
                seen = mask_n[None, :]
                if SLIDING_WINDOW > 0:  # positions: prefix key n, query prefix_len + m
                    seen = seen & (offs_n[None, :] > prefix_len + offs_m[:, None] - SLIDING_WINDOW)
                qk = tl.where(seen, qk, -float("inf"))
                v = tl.load(V_Buf + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
                acc, l_i, m_i = _online_softmax_step(qk, v, acc, l_i, m_i, INPUT_PRECISION)

            # 2. the new tokens, causal, from the fresh k/v
            end = tl.minimum(ext_len, row0 + BLOCK_M)
            for n0 in range(0, end, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                mask_n = offs_n < ext_len
                kv_mask = mask_n[:, None] & mask_d[None, :]
                k = tl.load(K + (start + offs_n[:, None]) * stride_kt + kv_h * stride_kh + offs_d[None, :],
                            mask=kv_mask, other=0.0).to(q.dtype)
                qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * sm_scale
                causal = (offs_m[:, None] >= offs_n[None, :]) & mask_n[None, :]
                if SLIDING_WINDOW > 0:
                    causal = causal & (offs_n[None, :] > offs_m[:, None] - SLIDING_WINDOW)
                qk = tl.where(causal, qk, -float("inf"))
                v = tl.load(V + (start + offs_n[:, None]) * stride_vt + kv_h * stride_vh + offs_d[None, :],
                            mask=kv_mask, other=0.0).to(q.dtype)
                acc, l_i, m_i = _online_softmax_step(qk, v, acc, l_i, m_i, INPUT_PRECISION)

        out = acc / l_i[:, None]
        o_ptrs = O + (start + offs_m[:, None]) * stride_ot + h * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def extend_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_start: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    block_m: int = 32,
    block_n: int = 32,
    sliding_window: int = 0,
    batch_invariant: bool = False,
) -> None:
    """q, o: [T, heads, D]; k, v: [T, kv_heads, D] (the new tokens, request after request);
    k_buf/v_buf: [slots, kv_heads, D] contiguous; req_to_token [R, max_ctx] int32;
    req_pool_indices, prefix_lens, extend_lens, extend_start: [bs] int tensors on the device.
    sliding_window > 0: each query attends to the sliding_window keys up to itself (masked: the
    blocks before the window are still read). batch_invariant: every key from the pool, in blocks
    on absolute positions (the new tokens' K/V must be stored there already)."""
    T, H, D = q.shape
    bs = req_pool_indices.shape[0]
    if T == 0 or bs == 0:
        return
    kv_heads = k.shape[1]
    assert H % kv_heads == 0 and k_buf.is_contiguous()
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and o.stride(2) == 1
    # float32 stays IEEE (tf32 would miss the 1e-3 parity with the torch reference);
    # bf16/fp16 take triton's default.
    precision = "ieee" if q.dtype == torch.float32 else None
    # batch_invariant: query blocks on absolute positions, so a request's tokens may span one more
    grid = (bs, H, triton.cdiv(max_extend_len, block_m) + (1 if batch_invariant else 0))
    _extend_kernel[grid](
        q, k, v, o, k_buf, v_buf, req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_start,
        sm_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1),
        k_buf.stride(0), k_buf.stride(1), req_to_token.stride(0), D,
        kv_group=H // kv_heads, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(D)), INPUT_PRECISION=precision, SLIDING_WINDOW=sliding_window,
        ALL_FROM_POOL=batch_invariant,
    )
