"""The GatedDeltaNet decode step as a Triton kernel (GPUs; the CPU's is csrc/gdn_kernels.cpp),
with the same contract: one token per request, each request's [dk, dv] float32 state updated in
place in the layer's state pool at its slot,

    S <- exp(g) S;   d = beta (v - S^T k);   S <- S + k d^T;   o = S^T q

One program per (request, value head, block of BLOCK_V state columns): the columns of S are
independent in every step above, so a program loads its [dk, BLOCK_V] tile once, keeps it in
registers through the update and stores it once. On the CPU it runs only under Triton's
interpreter (TRITON_INTERPRET=1), which is how tests/unit/test_gdn_triton.py checks it against
recurrent_gated_delta_step; serving on the CPU never imports this module.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gdn_decode_kernel(Q, K, V, G, Beta, Pool, Slots, Init, Out, H, DK, DV,
                       BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)  # request b, value head h: row bh of q, k, v, g, beta, out
    vb = tl.program_id(1)
    b = bh // H
    h = bh % H
    rk = tl.arange(0, BLOCK_K)
    rv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = rk < DK
    mv = rv < DV
    slot = tl.load(Slots + b).to(tl.int64)
    init = tl.load(Init + b)
    s_ptr = Pool + ((slot * H + h) * DK + rk[:, None]) * DV + rv[None, :]
    mask = mk[:, None] & mv[None, :]
    s = tl.load(s_ptr, mask=mask, other=0.0)
    s = tl.where(init != 0, s, 0.0)  # a request without a computed prefix starts from zeros
    q = tl.load(Q + bh * DK + rk, mask=mk, other=0.0)
    k = tl.load(K + bh * DK + rk, mask=mk, other=0.0)
    v = tl.load(V + bh * DV + rv, mask=mv, other=0.0)
    s = s * tl.exp(tl.load(G + bh))
    d = (v - tl.sum(s * k[:, None], axis=0)) * tl.load(Beta + bh)
    s = s + k[:, None] * d[None, :]
    tl.store(Out + bh * DV + rv, tl.sum(s * q[:, None], axis=0), mask=mv)
    tl.store(s_ptr, s, mask=mask)


def gated_delta_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state_pool: torch.Tensor, slots: torch.Tensor, has_initial: torch.Tensor) -> torch.Tensor:
    """q, k [B, H, dk], v [B, H, dv], g, beta [B, H] float32; state_pool [slots, H, dk, dv] float32,
    contiguous (rows slots[b] read and written); has_initial [B] bool. Returns o [B, H, dv]."""
    B, H, dk = q.shape
    dv = v.shape[2]
    assert state_pool.is_contiguous() and state_pool.dtype == torch.float32 and state_pool.shape[1:] == (H, dk, dv)
    out = torch.empty(B, H, dv, dtype=torch.float32, device=q.device)
    if B == 0:
        return out
    block_k = triton.next_power_of_2(dk)
    block_v = min(triton.next_power_of_2(dv), max(16, 8192 // block_k))  # a tile of <= 8k floats in registers
    grid = (B * H, triton.cdiv(dv, block_v))
    _gdn_decode_kernel[grid](q.float().contiguous(), k.float().contiguous(), v.float().contiguous(),
                             g.float().contiguous(), beta.float().contiguous(), state_pool, slots.to(torch.int64).contiguous(),
                             has_initial.to(torch.int32).contiguous(), out, H, dk, dv, BLOCK_K=block_k, BLOCK_V=block_v)
    return out
