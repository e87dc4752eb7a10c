"""Store the new K/V rows of a forward into the paged pool: k_buf[out_cache_loc[t]] = k[t]."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    K,
    V,
    K_Buf,
    V_Buf,
    Loc,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_buf_t,
    stride_buf_h,
    num_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(Loc + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < head_dim)
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    dst = slot * stride_buf_t + offs_h[:, None] * stride_buf_h + offs_d[None, :]
    tl.store(K_Buf + dst, k.to(K_Buf.dtype.element_ty), mask=mask)
    tl.store(V_Buf + dst, v.to(V_Buf.dtype.element_ty), mask=mask)


def store_kv_cache(k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor) -> None:
    """k, v: [T, kv_heads, head_dim] (last dim contiguous); k_buf, v_buf: [slots, kv_heads, head_dim]
    contiguous; loc: [T] slot indices."""
    T, H, D = k.shape
    if T == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_buf.is_contiguous() and v_buf.is_contiguous()
    _store_kv_kernel[(T,)](
        k, v, k_buf, v_buf, loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buf.stride(0), k_buf.stride(1),
        H, D,
        BLOCK_H=triton.next_power_of_2(H),
        BLOCK_D=triton.next_power_of_2(D),
    )
