"""The segmented LoRA matmul for the GPU in Triton (issue 28): for each part of a (fused) linear
layer, two launches that cover every segment of the batch (SGLang's sgemm_lora_a / _b split):

  shrink  h[t, :R]           = x[t] @ A[slot]^T                   grid (segment, token block)
  expand  y[t, off:off + n] += scaling * h[t] @ B[slot]^T          grid (segment, token block, out block)

A and B are one layer's slot buffers from the pool ([slot, R, K] and [slot, n, R]); R is the
pool's --max-lora-rank, every adapter zero-padded to it (radixserve/lora/mem_pool.py), so mixed
ranks share one launch. Tokens outside every segment (base-model requests) are never read or
written. Accumulation in float32. Tested on the CPU under TRITON_INTERPRET=1
(tests/unit/test_lora_kernels.py) against the torch loop of lora/layers.py."""

from __future__ import annotations

from typing import List

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # tokens per program (a decode segment is often a single token)
BLOCK_N = 64  # outputs per expand program
BLOCK_K = 64  # input columns per shrink step


@triton.jit
def _shrink_kernel(X, A, H, Seg, stride_xt, stride_as, stride_ar, stride_ht, K, R,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
    s = tl.program_id(0)
    start = tl.load(Seg + s * 3)
    end = tl.load(Seg + s * 3 + 1)
    slot = tl.load(Seg + s * 3 + 2)
    offs_m = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(X + offs_m[:, None] * stride_xt + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        a = tl.load(A + slot * stride_as + offs_r[None, :] * stride_ar + offs_k[:, None],
                    mask=mask_r[None, :] & mask_k[:, None], other=0.0)  # [BLOCK_K, BLOCK_R] = A^T
        acc += tl.dot(x, a.to(x.dtype), input_precision=PRECISION)
    tl.store(H + offs_m[:, None] * stride_ht + offs_r[None, :], acc, mask=mask_m[:, None] & mask_r[None, :])


@triton.jit
def _expand_kernel(H, B, Y, Seg, Scaling, stride_ht, stride_bs, stride_bn, stride_yt, offset, N, R,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
    s = tl.program_id(0)
    start = tl.load(Seg + s * 3)
    end = tl.load(Seg + s * 3 + 1)
    slot = tl.load(Seg + s * 3 + 2)
    scaling = tl.load(Scaling + s)
    offs_m = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    h = tl.load(H + offs_m[:, None] * stride_ht + offs_r[None, :], mask=mask_m[:, None] & mask_r[None, :], other=0.0)
    b = tl.load(B + slot * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None],
                mask=mask_n[None, :] & mask_r[:, None], other=0.0)  # [BLOCK_R, BLOCK_N] = B^T
    delta = tl.dot(h.to(b.dtype), b, input_precision=PRECISION) * scaling
    y_ptrs = Y + offs_m[:, None] * stride_yt + offset + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


def lora_delta(y: torch.Tensor, x: torch.Tensor, a_bufs: List[torch.Tensor], b_bufs: List[torch.Tensor],
               offsets: List[int], segments: torch.Tensor, scalings: torch.Tensor, max_len: int) -> None:
    """y [T, N] += the LoRA delta of x [T, K], in place, for every part p: A a_bufs[p] [slot, R, K],
    B b_bufs[p] [slot, n_p, R] into y's columns [offsets[p], offsets[p] + n_p). segments [S, 3]
    int64 (start, end, slot); scalings [S] float32; max_len: the longest segment."""
    assert x.stride(-1) == 1 and y.stride(-1) == 1, "x and y must be contiguous in their last dimension"
    num_segs, K = segments.shape[0], x.shape[1]
    if num_segs == 0:
        return
    R = a_bufs[0].shape[1]
    block_r = max(16, triton.next_power_of_2(R))  # tl.dot takes dimensions of 16 and up
    # bf16 / fp16 multiply in their own dtype (float32 sums); float32 stays exact (no tf32)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    h = torch.empty(x.shape[0], R, dtype=torch.float32, device=x.device)
    m_blocks = triton.cdiv(max_len, BLOCK_M)
    for a, b, offset in zip(a_bufs, b_bufs, offsets):
        assert a.stride(-1) == 1 and b.stride(-1) == 1 and a.shape[2] == K and b.shape[2] == R
        n = b.shape[1]
        _shrink_kernel[(num_segs, m_blocks)](x, a, h, segments, x.stride(0), a.stride(0), a.stride(1), h.stride(0), K, R,
                                             BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, BLOCK_R=block_r, PRECISION=precision)
        _expand_kernel[(num_segs, m_blocks, triton.cdiv(n, BLOCK_N))](
            h, b, y, segments, scalings, h.stride(0), b.stride(0), b.stride(1), y.stride(0), offset, n, R,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=block_r, PRECISION=precision)
