"""The experts as one fused op on a GPU (issue 41, item 1): SGLang's fused_moe design, written here.

The (token, k) pairs of a step are sorted by expert and each expert's run padded to a multiple of
BLOCK_M (`moe_align`, a few vectorized torch calls, no host sync), so every block of BLOCK_M sorted
pairs belongs to one expert. One grouped-GEMM kernel then runs twice:

  gate|up:  h[pair]  = x[pair // top_k] @ w13[e]^T      ([P, 2I], rows gathered from x)
  down:     y[pair]  = act(h)[pair] @ w2[e]^T * weight   ([P, H], the routing weight folded in)

and the k rows of each token are summed. Each program loads its expert's weight tile once for
BLOCK_M pairs (the point of fusing: a decode step reads each used expert's weights once, as the
C++ kernel does on the CPU), accumulates in float32 and casts x to the weights' dtype for tl.dot.
Pairs whose expert id is -1 (another --ep-size rank's) are never sorted in: their rows stay zero.

On the CPU this runs only under Triton's interpreter (TRITON_INTERPRET=1, tests/unit/test_moe_triton.py);
FusedMoE imports it on the first CUDA tensor (moe.py), so serving on the CPU never imports triton.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, w_ptr, sorted_ptr, block_expert_ptr,
                         N, K, num_pairs, top_k,
                         stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                         A_PER_TOKEN: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[pair, n-tile] = A[row(pair)] @ B[expert]^T for BLOCK_M sorted pairs of one expert."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # a block past the padded runs (the grid is sized without a host sync)
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)
    valid = pair < num_pairs  # padding rows hold num_pairs
    if A_PER_TOKEN:
        a_row = pair // top_k
    else:
        a_row = pair
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=valid[:, None] & (offs_k[None, :] < K), other=0.0)
        b = tl.load(b_ptr + expert.to(tl.int64) * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk,
                    mask=(offs_n[None, :] < N) & (offs_k[:, None] < K), other=0.0)
        acc += tl.dot(a.to(b.dtype), b)
    if MUL_WEIGHT:
        w = tl.load(w_ptr + pair, mask=valid, other=0.0)
        acc = acc * w[:, None].to(tl.float32)
    tl.store(c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & (offs_n[None, :] < N))


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sorted pair ids [S], block's expert [S / block_m]): the flat (token, k) pairs grouped by
    expert, each expert's run padded to a multiple of block_m with the id P (= no pair), and -1
    for the blocks past the last run. S is the worst case (P + E (block_m - 1), rounded up), so
    nothing here waits for the device."""
    flat = topk_ids.flatten().long()
    P = flat.numel()
    valid = flat >= 0
    keyed = torch.where(valid, flat, num_experts)  # -1 (another rank's) sorts after every expert
    order = torch.argsort(keyed, stable=True)
    counts = torch.bincount(keyed, minlength=num_experts + 1)[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    run_start = torch.cumsum(padded, 0) - padded  # where each expert's padded run begins
    first = torch.cumsum(counts, 0) - counts  # where its pairs begin in `order`
    experts_sorted = keyed[order]
    n_valid = valid.sum()
    rank = torch.arange(P, device=flat.device) - first[experts_sorted.clamp(max=num_experts - 1)]
    dest = run_start[experts_sorted.clamp(max=num_experts - 1)] + rank
    size = triton.cdiv(P + num_experts * (block_m - 1), block_m) * block_m
    sorted_ids = torch.full((size + 1,), P, dtype=torch.int32, device=flat.device)  # +1: a sink for -1 pairs
    keep = torch.arange(P, device=flat.device) < n_valid
    sorted_ids[torch.where(keep, dest, size)] = order.to(torch.int32)
    sorted_ids = sorted_ids[:size]
    blocks = torch.arange(size // block_m, device=flat.device) * block_m
    block_expert = torch.searchsorted(torch.cumsum(padded, 0), blocks, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, sorted_ids: torch.Tensor,
                  block_expert: torch.Tensor, top_k: int, a_per_token: bool, block_m: int) -> None:
    N, K = b.shape[1], b.shape[2]
    block_n, block_k = 64, 32
    grid = (block_expert.numel(), triton.cdiv(N, block_n))
    _grouped_gemm_kernel[grid](a, b, out, weights, sorted_ids, block_expert, N, K, out.shape[0], top_k,
                               a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2),
                               out.stride(0), out.stride(1),
                               A_PER_TOKEN=a_per_token, MUL_WEIGHT=not a_per_token,
                               BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_k weight[t, k] * (silu(gate) * up)(x[t] @ w13[e]^T) @ w2[e]^T for e = topk_ids[t, k]
    (-1: skipped): x [T, H], w13 [E, 2I, H], w2 [E, H, I]; out [T, H] in x's dtype."""
    T, top_k = topk_ids.shape
    P = T * top_k
    block_m = 16 if P <= 64 * w13.shape[0] else 64  # a decode step's runs are short: less padding
    sorted_ids, block_expert = moe_align(topk_ids, w13.shape[0], block_m)
    h = torch.zeros(P, w13.shape[1], dtype=x.dtype, device=x.device)  # -1 pairs stay 0
    _grouped_gemm(x, w13, h, topk_weights, sorted_ids, block_expert, top_k, True, block_m)
    gate, up = h.chunk(2, dim=-1)
    act = (F.silu(gate.float()) * up.float()).to(x.dtype).contiguous()
    y = torch.zeros(P, w2.shape[1], dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _grouped_gemm(act, w2, y, weights, sorted_ids, block_expert, top_k, False, block_m)
    return y.view(T, top_k, -1).sum(dim=1).to(x.dtype)
