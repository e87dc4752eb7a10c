"""Triton kernels for GGUF blocks on a GPU (issue 38, item 5): x @ W^T with W still in its ggml
blocks, and the dequantization of a tile of rows.

The design follows how vLLM / SGLang serve GGUF on CUDA (ggml's CUDA kernels there): few rows of
x (decode, up to 8) take a fused kernel that streams each weight block once, dequantizes it in
registers and multiplies in float32 (vLLM's MMVQ); up to 64 rows of fp16/bf16 x, a kernel that
dequantizes a tile of blocks into registers and multiplies on the tensor cores (vLLM's MMQ range);
more rows (prefill) dequantize a tile of output rows to x's dtype and let the vendor GEMM
multiply (the weight is then read once per tile, the GEMM runs at its full speed).
All share one unpacking (_dequant_tile), written from the layouts of the gguf package's
`gguf/quants.py` (the same ones the C++ kernels unpack, csrc/quant_kernels.cpp):

  type  values/block  bytes  layout (offsets in the block)
  Q4_0   32   18   d f16 @0, 16 bytes of nibbles @2: value j < 16 low nibble of byte j, else high of j-16; (q - 8) d
  Q4_1   32   20   d @0, m @2, nibbles @4; q d + m
  Q5_0   32   22   d @0, qh u32 @2 (bit j: the 5th bit of value j), nibbles @6; (q - 16) d
  Q5_1   32   24   d @0, m @2, qh @4, nibbles @8; q d + m
  Q8_0   32   34   d @0, int8 @2; q d
  Q4_K  256  144   d @0, dmin @2, 12 bytes of 6-bit scales/mins @4, nibbles @16: sub-block s = j / 32
                   (its scale and min), byte 32 (s / 2) + j % 32, high nibble for odd s; d sc q - dmin m
  Q5_K  256  176   as Q4_K, qh @16 (bit s of byte j % 32), nibbles @48
  Q6_K  256  210   low nibbles @0, 2-bit highs @128, int8 scales @192 (one per 16 values), d @208; d sc (q - 32)
  Q2_K  256   84   scales @0 (per 16 values: 4-bit scale, 4-bit min), 2-bit q @16, d @80, dmin @82; d sc q - dmin m
  Q3_K  256  110   hmask @0, 2-bit q @32, 6-bit scales @96 (16 of them, packed), d @108; d (sc - 32) (q - 4 (1 - hbit))
  (the 2-bit q of value j = 128 h + 32 s + l: bits 2s..2s+1 of byte 32 h + l; Q3_K's high bit: bit j / 32 of hmask[l])

w8a8_int8 stores ggml Q8_0 rows (w8a8_int8.py), so it runs on the Q8_0 kernel.
On the CPU these run only under Triton's interpreter (TRITON_INTERPRET=1, the unit tests); serving
on the CPU never imports this module (gguf.py imports it on the first CUDA tensor).
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# ggml type id -> (values per block, bytes per block)
TRITON_TYPES: Dict[int, Tuple[int, int]] = {
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    6: (32, 22),  # Q5_0
    7: (32, 24),  # Q5_1
    8: (32, 34),  # Q8_0
    10: (256, 84),  # Q2_K
    11: (256, 110),  # Q3_K
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
}
# Rows of x up to which the fused kernel runs (weight-bandwidth bound: blocks read once); above,
# a dequantized tile and the vendor GEMM (compute bound: tensor cores), as vLLM's GGUF path does
# (its mat-vec kernel up to a batch of 8, MMVQ_MAX_BATCH_SIZE).
FUSED_MAX_ROWS = 8
# Up to here (above FUSED_MAX_ROWS) half-precision x takes the tensor-core kernel: each program
# dequantizes its tile of blocks into registers and multiplies with tl.dot (a decode batch of
# 9-64 requests would otherwise dequantize the whole weight every step; vLLM's MMQ range).
MMA_MAX_ROWS = 64
DEQUANT_TILE_BYTES = 64 << 20  # bytes of a dequantized tile of weight rows on the prefill path


@triton.jit
def _u8(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(ptr, mask):
    # a little-endian float16 at two byte addresses
    bits = (_u8(ptr, mask) | (_u8(ptr + 1, mask) << 8)).to(tl.uint16)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibble32(qs_ptr, j, mask):
    # a 32-value block's 16 bytes: value j < 16 is the low nibble of byte j, else the high of j - 16
    return (_u8(qs_ptr + (j % 16), mask) >> ((j // 16) * 4)) & 0xF


@triton.jit
def _nibble_k(qs_ptr, j, mask):
    # a K-quant's 128 bytes: sub-block s = j / 32 in byte 32 (s / 2) + j % 32, high nibble for odd s
    s = j // 32
    return (_u8(qs_ptr + (s // 2) * 32 + j % 32, mask) >> ((s % 2) * 4)) & 0xF


@triton.jit
def _crumb(qs_ptr, j, mask):
    # Q2_K/Q3_K's 64 bytes of 2-bit values: j = 128 h + 32 s + l is bits 2s..2s+1 of byte 32 h + l
    return (_u8(qs_ptr + 32 * (j // 128) + j % 32, mask) >> (2 * ((j // 32) % 4))) & 3


@triton.jit
def _bit(ptr, i, mask):
    return (_u8(ptr, mask) >> i) & 1


@triton.jit
def _scale_min_k4(sc_ptr, s, mask):
    """Q4_K/Q5_K: the 6-bit scale and min of sub-block s (0..7) from the 12 scale bytes."""
    lo = s < 4
    s4 = tl.where(lo, s, s - 4)
    b_s = _u8(sc_ptr + s4, mask)  # bytes 0..3
    b_m = _u8(sc_ptr + s4 + 4, mask)  # bytes 4..7
    b_md = _u8(sc_ptr + s4 + 8, mask)  # bytes 8..11
    sc = tl.where(lo, b_s & 63, (b_md & 0xF) | ((b_s >> 6) << 4))
    mn = tl.where(lo, b_m & 63, (b_md >> 4) | ((b_m >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _dequant_tile(W, rn, rk, stride_wn, N, K, QTYPE: tl.constexpr, QK: tl.constexpr, TYPE_SIZE: tl.constexpr):
    """float32 [len(rn), len(rk)]: the weight's rows rn, columns rk, unpacked from the blocks
    (zeros outside [N, K])."""
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    j = (rk % QK)[None, :]
    blk = W + rn[:, None].to(tl.int64) * stride_wn + ((rk // QK) * TYPE_SIZE)[None, :]
    if QTYPE == 8:  # Q8_0
        q = _u8(blk + 2 + j, mask)
        w = _f16(blk, mask) * tl.where(q > 127, q - 256, q).to(tl.float32)
    elif QTYPE == 2:  # Q4_0
        w = _f16(blk, mask) * (_nibble32(blk + 2, j, mask) - 8).to(tl.float32)
    elif QTYPE == 3:  # Q4_1
        w = _f16(blk, mask) * _nibble32(blk + 4, j, mask).to(tl.float32) + _f16(blk + 2, mask)
    elif QTYPE == 6:  # Q5_0
        q = _nibble32(blk + 6, j, mask) | (_bit(blk + 2 + j // 8, j % 8, mask) << 4)
        w = _f16(blk, mask) * (q - 16).to(tl.float32)
    elif QTYPE == 7:  # Q5_1
        q = _nibble32(blk + 8, j, mask) | (_bit(blk + 4 + j // 8, j % 8, mask) << 4)
        w = _f16(blk, mask) * q.to(tl.float32) + _f16(blk + 2, mask)
    elif QTYPE == 12:  # Q4_K
        s = j // 32
        q = _nibble_k(blk + 16, j, mask)
        sc, mn = _scale_min_k4(blk + 4, s, mask)
        w = (_f16(blk, mask) * sc) * q.to(tl.float32) - _f16(blk + 2, mask) * mn
    elif QTYPE == 13:  # Q5_K
        s = j // 32
        q = _nibble_k(blk + 48, j, mask) | (_bit(blk + 16 + j % 32, s, mask) << 4)
        sc, mn = _scale_min_k4(blk + 4, s, mask)
        w = (_f16(blk, mask) * sc) * q.to(tl.float32) - _f16(blk + 2, mask) * mn
    elif QTYPE == 10:  # Q2_K
        sc = _u8(blk + j // 16, mask)
        q = _crumb(blk + 16, j, mask)
        w = (_f16(blk + 80, mask) * (sc & 0xF).to(tl.float32)) * q.to(tl.float32) \
            - _f16(blk + 82, mask) * (sc >> 4).to(tl.float32)
    elif QTYPE == 11:  # Q3_K
        i = j // 16  # its scale: a low nibble of bytes 0..7 and two high bits of bytes 8..11
        lo = (_u8(blk + 96 + i % 8, mask) >> (4 * (i // 8))) & 0xF
        hi = (_u8(blk + 104 + i % 4, mask) >> (2 * (i // 4))) & 3
        q = _crumb(blk + 32, j, mask) - 4 * (1 - _bit(blk + j % 32, j // 32, mask))
        w = (_f16(blk + 108, mask) * ((lo | (hi << 4)) - 32).to(tl.float32)) * q.to(tl.float32)
    else:  # Q6_K
        h = j // 128
        t = (j // 32) % 4
        l = j % 32
        lo4 = (_u8(blk + 64 * h + 32 * (t % 2) + l, mask) >> (4 * (t // 2))) & 0xF
        hi2 = (_u8(blk + 128 + 32 * h + l, mask) >> (2 * t)) & 3
        sc = _u8(blk + 192 + j // 16, mask)
        sc = tl.where(sc > 127, sc - 256, sc).to(tl.float32)
        w = (_f16(blk + 208, mask) * sc) * ((lo4 | (hi2 << 4)) - 32).to(tl.float32)
    return w


@triton.jit
def _gguf_matmul_kernel(X, W, Out, M, N, K, stride_xm, stride_xk, stride_wn, stride_om,
                        QTYPE: tl.constexpr, QK: tl.constexpr, TYPE_SIZE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # One program: all M (<= BLOCK_M <= FUSED_MAX_ROWS) rows of x by BLOCK_N weight rows, so every
    # block of the weight is read once. Products and sums in float32 on the CUDA cores (few rows
    # of x: the weight's bandwidth bounds it, not the FMAs; no tensor-core padding to 16 rows).
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + rm[:, None].to(tl.int64) * stride_xm + rk[None, :] * stride_xk,
                    mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0).to(tl.float32)
        w = _dequant_tile(W, rn, rk, stride_wn, N, K, QTYPE, QK, TYPE_SIZE)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    tl.store(Out + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(Out.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _gguf_mma_kernel(X, W, Out, M, N, K, stride_xm, stride_xk, stride_wn, stride_om,
                     QTYPE: tl.constexpr, QK: tl.constexpr, TYPE_SIZE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # BLOCK_M (16-64) rows of x by BLOCK_N weight rows; the tile of weight rounded to x's dtype
    # (as a dequantized model's would be), products on the tensor cores, sums in float32.
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + rm[:, None].to(tl.int64) * stride_xm + rk[None, :] * stride_xk,
                    mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w = _dequant_tile(W, rn, rk, stride_wn, N, K, QTYPE, QK, TYPE_SIZE).to(x.dtype)
        acc += tl.dot(x, tl.trans(w))
    tl.store(Out + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(Out.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _gguf_dequant_kernel(W, Out, N, K, stride_wn, QTYPE: tl.constexpr, QK: tl.constexpr,
                         TYPE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    w = _dequant_tile(W, rn, rk, stride_wn, N, K, QTYPE, QK, TYPE_SIZE)
    tl.store(Out + rn[:, None].to(tl.int64) * K + rk[None, :], w.to(Out.dtype.element_ty),
             mask=(rn[:, None] < N) & (rk[None, :] < K))


def _geometry(data: torch.Tensor, qtype: int, cols: int) -> Tuple[int, int]:
    if qtype not in TRITON_TYPES:
        raise ValueError(f"no Triton kernel for ggml type {qtype} (have {sorted(TRITON_TYPES)})")
    qk, size = TRITON_TYPES[qtype]
    assert data.dtype == torch.uint8 and data.dim() == 2 and data.stride(1) == 1, (data.dtype, data.shape, data.stride())
    assert cols % qk == 0 and data.shape[1] == cols // qk * size, (cols, data.shape)
    return qk, size


def gguf_dequantize(data: torch.Tensor, qtype: int, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The rows of `data` (uint8 [N, row bytes], rows may be strided) as dtype [N, cols]."""
    qk, size = _geometry(data, qtype, cols)
    n = data.shape[0]
    out = torch.empty(n, cols, dtype=dtype, device=data.device)
    if n == 0:
        return out
    block_n, block_k = 32, 256
    grid = (triton.cdiv(n, block_n), triton.cdiv(cols, block_k))
    _gguf_dequant_kernel[grid](data, out, n, cols, data.stride(0), QTYPE=qtype, QK=qk, TYPE_SIZE=size,
                               BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def gguf_matmul(x: torch.Tensor, data: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    """x [M, cols] (float32, bf16 or fp16; any strides) @ dequantize(data)^T -> [M, N] in x's dtype.
    Few rows: the fused kernel, float32 products and sums; up to MMA_MAX_ROWS of half-precision x:
    the tensor-core kernel; more: _dequantized_matmul."""
    qk, size = _geometry(data, qtype, cols)
    assert x.dim() == 2 and x.shape[1] == cols, (x.shape, cols)
    m, n = x.shape[0], data.shape[0]
    if m > FUSED_MAX_ROWS:
        if m <= MMA_MAX_ROWS and takes_mma(x):
            return _mma_matmul(x, data, qtype, cols, qk, size)
        return _dequantized_matmul(x, data, qtype, cols)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_m = max(2, triton.next_power_of_2(m))  # 2: no 1-wide arange on the compiler side
    block_n, block_k = 32, 64 if block_m <= 4 else 32
    _gguf_matmul_kernel[(triton.cdiv(n, block_n),)](
        x, data, out, m, n, cols, x.stride(0), x.stride(1), data.stride(0), out.stride(0),
        QTYPE=qtype, QK=qk, TYPE_SIZE=size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def takes_mma(x: torch.Tensor) -> bool:
    """fp16 x anywhere; bf16 only on a GPU: Triton's CPU interpreter multiplies bf16 tl.dot operands
    as their raw 16-bit patterns (wrong answers), so an interpreted bf16 run takes the dequantized path."""
    return x.dtype == torch.float16 or (x.dtype == torch.bfloat16 and x.is_cuda)


def _mma_matmul(x: torch.Tensor, data: torch.Tensor, qtype: int, cols: int, qk: int, size: int) -> torch.Tensor:
    m, n = x.shape[0], data.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    block_m, block_n, block_k = max(16, triton.next_power_of_2(m)), 64, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _gguf_mma_kernel[grid](x, data, out, m, n, cols, x.stride(0), x.stride(1), data.stride(0), out.stride(0),
                           QTYPE=qtype, QK=qk, TYPE_SIZE=size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def _dequantized_matmul(x: torch.Tensor, data: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    """The prefill path: a tile of weight rows dequantized to x's dtype at a time (never the whole
    matrix), multiplied by the vendor GEMM."""
    n = data.shape[0]
    tile = max(16, DEQUANT_TILE_BYTES // (x.element_size() * cols) // 16 * 16)
    if tile >= n:
        return F.linear(x, gguf_dequantize(data, qtype, cols, x.dtype))
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    for r in range(0, n, tile):
        rows = min(tile, n - r)
        out[:, r : r + rows] = F.linear(x, gguf_dequantize(data[r : r + rows], qtype, cols, x.dtype))
    return out
