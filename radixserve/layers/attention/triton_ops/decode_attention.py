"""Split-KV decode attention over the paged pool (one query token per request).

Stage 1: grid (batch, q_head, split), or with GQA (batch, kv_head, split) serving the
kv head's query heads together: each program attends its query to one contiguous share
of the request's KV (slots read through req_to_token) and writes its partial output
(normalized by its own softmax sum) and its log-sum-exp.
Stage 2: grid (batch, q_head): merges the splits with their log-sum-exps.
Splitting the KV keeps the GPU busy at small batch sizes with long contexts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_stage1(
    Q,
    K_Buf,
    V_Buf,
    Req_to_token,
    Req_pool_indices,
    Seq_lens,
    Mid_O,  # [bs, heads, splits, D] float32
    Mid_LSE,  # [bs, heads, splits] float32
    sm_scale,
    stride_qt,
    stride_qh,
    stride_buf_t,
    stride_buf_h,
    stride_r2t,
    stride_mid_b,
    stride_mid_h,
    stride_mid_s,
    head_dim,
    kv_group: tl.constexpr,
    num_splits: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    kv_h = h // kv_group
    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    req = tl.load(Req_pool_indices + b).to(tl.int64)
    split_len = tl.cdiv(seq_len, num_splits)
    start = s * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    q = tl.load(Q + b * stride_qt + h * stride_qh + offs_d, mask=mask_d, other=0.0).to(tl.float32)

    if end > start:  # an empty split writes nothing; stage 2 skips it the same way
        m_i = tl.full([], -float("inf"), tl.float32)
        l_i = tl.full([], 0.0, tl.float32)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            slots = tl.load(Req_to_token + req * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
            kv_off = slots[:, None] * stride_buf_t + kv_h * stride_buf_h + offs_d[None, :]
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(K_Buf + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
            qk = tl.sum(q[None, :] * k, 1) * sm_scale
            qk = tl.where(mask_n, qk, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 0))
            p = tl.exp(qk - m_new)
            alpha = tl.exp(m_i - m_new)
            v = tl.load(V_Buf + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
            l_i = l_i * alpha + tl.sum(p, 0)
            m_i = m_new
        mid = b * stride_mid_b + h * stride_mid_h + s * stride_mid_s
        tl.store(Mid_O + mid + offs_d, acc / l_i, mask=mask_d)
        tl.store(Mid_LSE + (b * tl.num_programs(1) + h) * num_splits + s, m_i + tl.log(l_i))


@triton.jit
def _decode_stage1_grouped(
    Q,
    K_Buf,
    V_Buf,
    Req_to_token,
    Req_pool_indices,
    Seq_lens,
    Mid_O,
    Mid_LSE,
    sm_scale,
    stride_qt,
    stride_qh,
    stride_buf_t,
    stride_buf_h,
    stride_r2t,
    stride_mid_b,
    stride_mid_h,
    stride_mid_s,
    head_dim,
    kv_group: tl.constexpr,
    num_splits: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """GQA: one program per (request, kv head, split) serves all kv_group query heads of that
    kv head with one [BLOCK_H, D] x [D, BLOCK_N] dot, so each K/V row is read once, not once
    per query head."""
    b = tl.program_id(0)
    kv_h = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    req = tl.load(Req_pool_indices + b).to(tl.int64)
    split_len = tl.cdiv(seq_len, num_splits)
    start = s * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    heads = kv_h * kv_group + offs_h
    mask_h = offs_h < kv_group
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    q_mask = mask_h[:, None] & mask_d[None, :]
    q = tl.load(Q + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)

    if end > start:
        m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            slots = tl.load(Req_to_token + req * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
            kv_off = slots[:, None] * stride_buf_t + kv_h * stride_buf_h + offs_d[None, :]
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(K_Buf + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
            qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * sm_scale
            qk = tl.where(mask_n[None, :], qk, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp(qk - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            v = tl.load(V_Buf + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        mid = b * stride_mid_b + heads[:, None] * stride_mid_h + s * stride_mid_s + offs_d[None, :]
        tl.store(Mid_O + mid, acc / l_i[:, None], mask=q_mask)
        lse_ptrs = Mid_LSE + (b * tl.num_programs(1) * kv_group + heads) * num_splits + s
        tl.store(lse_ptrs, m_i + tl.log(l_i), mask=mask_h)


@triton.jit
def _decode_stage2(
    Mid_O,
    Mid_LSE,
    O,
    Seq_lens,
    stride_mid_b,
    stride_mid_h,
    stride_mid_s,
    stride_ot,
    stride_oh,
    head_dim,
    num_splits: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    split_len = tl.cdiv(seq_len, num_splits)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    m = tl.full([], -float("inf"), tl.float32)
    l = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s in range(0, num_splits):
        if s * split_len < seq_len:
            lse = tl.load(Mid_LSE + (b * tl.num_programs(1) + h) * num_splits + s)
            o = tl.load(Mid_O + b * stride_mid_b + h * stride_mid_h + s * stride_mid_s + offs_d, mask=mask_d, other=0.0)
            m_new = tl.maximum(m, lse)
            alpha = tl.exp(m - m_new)
            w = tl.exp(lse - m_new)
            acc = acc * alpha + w * o
            l = l * alpha + w
            m = m_new
    tl.store(O + b * stride_ot + h * stride_oh + offs_d, (acc / l).to(O.dtype.element_ty), mask=mask_d)


def decode_attention_fwd(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    o: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    num_kv_splits: int = 8,
    mid_o: torch.Tensor = None,
    mid_lse: torch.Tensor = None,
    block_n: int = 32,
) -> None:
    """q, o: [bs, heads, D] (one query per request); k_buf/v_buf: [slots, kv_heads, D] contiguous;
    req_to_token: [R, max_ctx] int32; req_pool_indices, seq_lens: [bs]. Every seq_len must be >= 1.
    mid_o [bs, heads, splits, D] / mid_lse [bs, heads, splits] float32 may be passed preallocated
    (CUDA graphs)."""
    bs, H, D = q.shape
    if bs == 0:
        return
    kv_heads = k_buf.shape[1]
    assert H % kv_heads == 0 and q.stride(2) == 1 and o.stride(2) == 1 and k_buf.is_contiguous()
    if mid_o is None:
        mid_o = torch.empty((bs, H, num_kv_splits, D), dtype=torch.float32, device=q.device)
    if mid_lse is None:
        mid_lse = torch.empty((bs, H, num_kv_splits), dtype=torch.float32, device=q.device)
    assert mid_o.is_contiguous() and mid_lse.is_contiguous()
    BLOCK_D = triton.next_power_of_2(D)
    common = (
        q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse, sm_scale,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), D,
    )
    kv_group = H // kv_heads
    if kv_group == 1:
        _decode_stage1[(bs, H, num_kv_splits)](
            *common, kv_group=1, num_splits=num_kv_splits, BLOCK_N=block_n, BLOCK_D=BLOCK_D,
        )
    else:  # GQA: the query heads of one kv head together (tl.dot wants >= 16 rows: padded)
        _decode_stage1_grouped[(bs, kv_heads, num_kv_splits)](
            *common, kv_group=kv_group, num_splits=num_kv_splits,
            BLOCK_H=max(16, triton.next_power_of_2(kv_group)), BLOCK_N=block_n,
            BLOCK_D=max(16, BLOCK_D), INPUT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        )
    _decode_stage2[(bs, H)](
        mid_o, mid_lse, o, seq_lens,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), o.stride(0), o.stride(1), D,
        num_splits=num_kv_splits, BLOCK_D=BLOCK_D,
    )
