"""Triton kernels: RMSNorm with an optional fused residual add, and neox-style rotary embedding.

Both are out of place (fresh, contiguous outputs; the inputs are never written), which keeps
the exact interface of the torch path in layernorm.py / rotary_embedding.py: callers may hold
on to their inputs (the first decoder layer's residual *is* the embedding output).

On the CPU they run only under Triton's interpreter (TRITON_INTERPRET=1), which is how the
unit tests check them; serving on the CPU never imports this module.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------- RMSNorm


@triton.jit
def _rmsnorm_kernel(
    X,
    Res,
    Out,
    ResOut,
    W,
    stride_xt,
    stride_xh,
    stride_rt,
    stride_rh,
    n_heads,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One program per row (token t, head h); a 2-D input is the n_heads == 1 case.
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < n_cols
    x = tl.load(X + t * stride_xt + h * stride_xh + offs, mask=mask, other=0.0)
    out_row = (t * n_heads + h) * n_cols  # outputs are contiguous
    if HAS_RESIDUAL:
        r = tl.load(Res + t * stride_rt + h * stride_rh + offs, mask=mask, other=0.0)
        # The sum is rounded to the input dtype before normalizing, as the torch path does.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(ResOut.dtype.element_ty)
        tl.store(ResOut + out_row + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + out_row + offs, (xf * rstd * w).to(Out.dtype.element_ty), mask=mask)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """A [T, H, N] view (copy only if it must) with a unit stride on N."""
    if x.dim() == 3:
        rows = x
    elif x.dim() == 2:
        rows = x.unsqueeze(1)
    else:
        rows = x.reshape(-1, 1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _rmsnorm_warps(block_n: int) -> int:
    # Roughly 8-16 elements per thread; a 128-wide q/k-norm row needs a single warp.
    return max(1, min(8, block_n // 512))


def can_fuse_rmsnorm(x: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor]) -> bool:
    """Inputs the kernel reproduces exactly; anything else (dtype promotion) takes torch."""
    if x.dtype not in _FUSED_DTYPES or x.numel() == 0 or weight.shape != (x.shape[-1],) or not weight.is_contiguous():
        return False
    return residual is None or (residual.dtype == x.dtype and residual.shape == x.shape)


def fused_add_rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """RMSNorm over the last dim of `x` ([..., N]; [T, heads, head_dim] for the Qwen3 q/k norm).

    With `residual`: s = x + residual (in x's dtype), returns (rmsnorm(s), s).
    Without: returns (rmsnorm(x), None). Normalization is in float32, output in x's dtype.
    """
    n_cols = x.shape[-1]
    rows = _as_rows(x)
    res_rows = _as_rows(residual) if residual is not None else rows  # dummy when absent
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out  # dummy when absent
    n_tokens, n_heads = rows.shape[0], rows.shape[1]
    block_n = triton.next_power_of_2(n_cols)
    _rmsnorm_kernel[(n_tokens, n_heads)](
        rows, res_rows, out, res_out, weight,
        rows.stride(0), rows.stride(1), res_rows.stride(0), res_rows.stride(1),
        n_heads, n_cols, eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK_N=block_n,
        num_warps=_rmsnorm_warps(block_n),
    )
    return out, (res_out if residual is not None else None)


# ----------------------------------------------------------------------------- rotary


@triton.jit
def _rotate_heads(
    X,
    Out,
    t,
    stride_xt,
    stride_xh,
    n_heads,
    cos,
    sin,
    HEAD_DIM: tl.constexpr,
    ROT_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
):
    """All heads of token t: out[:half] = x1*cos - x2*sin, out[half:rot] = x2*cos + x1*sin."""
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_HALF)[None, :]
    head_ok = offs_h < n_heads
    mask = head_ok & (offs_d < ROT_HALF)
    src = X + t * stride_xt + offs_h * stride_xh  # [BLOCK_H, 1] head starts
    dst = Out + (t * n_heads + offs_h) * HEAD_DIM  # the output is contiguous
    x1 = tl.load(src + offs_d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + ROT_HALF + offs_d, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + offs_d, (x1 * cos - x2 * sin).to(Out.dtype.element_ty), mask=mask)
    tl.store(dst + ROT_HALF + offs_d, (x2 * cos + x1 * sin).to(Out.dtype.element_ty), mask=mask)
    if BLOCK_TAIL > 0:
        # Partial rotary: the dims past rotary_dim pass through unchanged.
        offs_tail = 2 * ROT_HALF + tl.arange(0, BLOCK_TAIL)[None, :]
        tail_mask = head_ok & (offs_tail < HEAD_DIM)
        tl.store(dst + offs_tail, tl.load(src + offs_tail, mask=tail_mask), mask=tail_mask)


@triton.jit
def _rotary_kernel(
    Pos,
    Cos,
    Sin,
    Q,
    K,
    QOut,
    KOut,
    stride_cos,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    n_q_heads,
    n_k_heads,
    HEAD_DIM: tl.constexpr,
    ROT_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
):
    # One program per token: its cos/sin row is loaded once and shared by every q and k head.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)[None, :]
    cs_mask = offs_d < ROT_HALF
    # The caches repeat each half; the first half is the compact [rotary_dim / 2] row.
    cos = tl.load(Cos + pos * stride_cos + offs_d, mask=cs_mask, other=0.0).to(tl.float32)
    sin = tl.load(Sin + pos * stride_cos + offs_d, mask=cs_mask, other=0.0).to(tl.float32)
    _rotate_heads(Q, QOut, t, stride_qt, stride_qh, n_q_heads, cos, sin,
                  HEAD_DIM, ROT_HALF, BLOCK_HQ, BLOCK_HALF, BLOCK_TAIL)
    _rotate_heads(K, KOut, t, stride_kt, stride_kh, n_k_heads, cos, sin,
                  HEAD_DIM, ROT_HALF, BLOCK_HK, BLOCK_HALF, BLOCK_TAIL)


def can_fuse_rotary(q: torch.Tensor, k: torch.Tensor, cos_cached: torch.Tensor, sin_cached: torch.Tensor) -> bool:
    """Shapes/dtypes the kernel handles; the two caches share one row stride."""
    return (
        q.dim() == 3 and k.dim() == 3 and q.shape[-1] == k.shape[-1] and q.shape[0] > 0
        and q.dtype in _FUSED_DTYPES and k.dtype == q.dtype
        and cos_cached.stride(-1) == 1 and sin_cached.stride() == cos_cached.stride()
    )


def apply_rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cached: torch.Tensor,
    sin_cached: torch.Tensor,
    rotary_dim: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary, out of place: returns new contiguous (q, k), inputs untouched.

    positions: [T]; q: [T, Hq, D]; k: [T, Hk, D] (any strides but a unit last one);
    cos_cached / sin_cached: [max_pos, rotary_dim], each half repeated (RotaryEmbedding's).
    Math in float32, stored in q's dtype; dims rotary_dim..D are copied unchanged.
    """
    n_tokens, n_q_heads, head_dim = q.shape
    n_k_heads = k.shape[1]
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    half = rotary_dim // 2
    tail = head_dim - 2 * half
    _rotary_kernel[(n_tokens,)](
        positions, cos_cached, sin_cached, q, k, q_out, k_out,
        cos_cached.stride(0), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        n_q_heads, n_k_heads,
        HEAD_DIM=head_dim,
        ROT_HALF=half,
        BLOCK_HQ=triton.next_power_of_2(n_q_heads),
        BLOCK_HK=triton.next_power_of_2(n_k_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_TAIL=triton.next_power_of_2(tail) if tail > 0 else 0,
        num_warps=4,
    )
    return q_out, k_out
