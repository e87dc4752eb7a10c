"""GatedDeltaNet linear attention (Qwen3-Next, Qwen3.5), in torch (the decode step in C++ on the CPU).

Per request and value head h the layer keeps a matrix state S [head_k_dim, head_v_dim]; each
token t (q, k l2-normalized, q scaled by head_k_dim^-0.5) does

    S <- exp(g_t) * S                           decay,  g_t = -exp(A_log) * softplus(a_t + dt_bias)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T     delta-rule write, beta_t = sigmoid(b_t)
    o_t = S^T q_t

after a depthwise causal conv1d (kernel K, silu) over the concatenated q, k, v channels. Both
states live in the MambaPool (mem_cache/mamba_pool.py), one slot per request: the conv state
is the last K - 1 conv inputs, the temporal state is S.

  decode   one recurrent step for the whole batch: on the CPU the C++ kernel
           (csrc/gdn_kernels.cpp: two passes over each state, updated in place in the pool), on
           CUDA the Triton one (gdn_triton.py), else tensor ops (recurrent_gated_delta_step, the
           kernels' reference).
  extend   the chunked form of the same recurrence (chunks of CHUNK_SIZE tokens, the UT
           transform inside a chunk, a loop over chunks carrying S). The batch's requests are
           padded to one length and run together: a padded position has k = v = 0, beta = 0 and
           g = 0, which leaves S unchanged, so padding never alters a request's final state.
           Each request starts from its saved state when it has a computed prefix (a chunk after
           the first one of a chunked prefill), from zeros otherwise.

The output is RMS-normalized per head, gated by silu(z) (RMSNormGated), and projected back.
Tensor parallelism splits the heads: a rank keeps num_k_heads / tp key heads with their value
heads, their projections' rows, their conv channels (of each of q, k and v), their decays, and
their states in its own MambaPool; out_proj is row-parallel (its all-reduce joins the heads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed.parallel_state import get_tp_group
from radixserve.layers import cpu_kernels
from radixserve.layers.linear import ColumnParallelLinear, RowParallelLinear, StackedColumnParallelLinear, rank_parts

CHUNK_SIZE = 64
CONV_INPUTS = -1  # verify_traces' key of the conv inputs of the layer being run (its trace takes them)


@dataclass
class LinearAttnMetadata:
    """What every linear layer of one forward needs, built once per forward (build())."""

    state_slots: torch.Tensor  # [bs] int64: each request's MambaPool slot
    is_decode: bool
    extend_lens: List[int]  # new tokens per request
    has_initial_state: torch.Tensor  # [bs] bool: start from the saved state (a prefix is computed)
    # Extend: token j of the batch sits at (pad_rows[j], pad_cols[j]) of a [bs, padded_len] layout.
    pad_rows: torch.Tensor
    pad_cols: torch.Tensor
    padded_len: int
    # A speculative verify (its drafts may be rejected): the states are read, not written, and each
    # layer records its VerifyTrace here (by layer_id) for advance_states once the drafts are judged
    verify_traces: Optional[Dict[int, "VerifyTrace"]] = None

    @property
    def write_states(self) -> bool:
        return self.verify_traces is None

    @classmethod
    def build(cls, state_slots: torch.Tensor, is_decode: bool, extend_lens: List[int],
              prefix_lens: List[int], verify_traces: Optional[Dict[int, "VerifyTrace"]] = None) -> "LinearAttnMetadata":
        device = state_slots.device
        bs = len(extend_lens)
        has_initial = torch.tensor([p > 0 for p in prefix_lens], dtype=torch.bool, device=device)
        if is_decode:
            empty = torch.empty(0, dtype=torch.int64, device=device)
            return cls(state_slots, True, extend_lens, has_initial, empty, empty, 1, verify_traces)
        lens = torch.tensor(extend_lens, dtype=torch.int64)
        rows = torch.repeat_interleave(torch.arange(bs), lens)
        cols = torch.arange(int(lens.sum())) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
        return cls(state_slots, False, extend_lens, has_initial, rows.to(device), cols.to(device), max(extend_lens),
                   verify_traces)


@dataclass
class VerifyTrace:
    """What one linear layer's verify forward leaves to advance its states by any prefix of each
    request's verify tokens, without a forward (advance_states). Per request b, verify token j:

        S_j = exp(G_j) S_0 + sum_{i <= j} exp(G_j - G_i) k_i u_i^T

    (the chunked rule's state after token j: S_0 the state before the verify, G the cumulative
    log decay, u the delta-rule writes, which depend only on the tokens up to theirs), and the
    conv state after token j is the K - 1 conv inputs ending at it. O(tokens) numbers per layer,
    where keeping every token's state (SGLang's intermediate states) takes dk x dv per head."""

    slots: torch.Tensor  # [bs] the requests' state slots
    conv_inputs: torch.Tensor  # [bs, K - 1 + L, C]: the K - 1 inputs before the verify, then its tokens'
    k: torch.Tensor  # [bs, H, L, dk] float32
    u: torch.Tensor  # [bs, H, L, dv] float32
    log_decay: torch.Tensor  # [bs, H, L] float32, G


def advance_states(trace: VerifyTrace, conv_state: torch.Tensor, temporal_state: torch.Tensor,
                   keep_lens: torch.Tensor) -> None:
    """Move each request's states (this layer's pool tensors, untouched by the verify) on by its
    first keep_lens[b] >= 1 verify tokens (its last token and the accepted drafts)."""
    bs, heads, width = trace.log_decay.shape
    last = (keep_lens.to(trace.k.device) - 1).clamp(0, width - 1)  # [bs] the last kept token
    g_last = trace.log_decay.gather(2, last[:, None, None].expand(bs, heads, 1))  # [bs, H, 1]
    kept = torch.arange(width, device=last.device)[None, :] <= last[:, None]  # [bs, L]
    weight = (g_last - trace.log_decay).masked_fill(~kept[:, None, :], float("-inf")).exp()  # [bs, H, L]
    s0 = temporal_state[trace.slots]
    temporal_state[trace.slots] = g_last.exp()[..., None] * s0 + torch.einsum(
        "bhl,bhlk,bhlv->bhkv", weight, trace.k, trace.u)
    keep = conv_state.shape[1]
    cols = (last + 1)[:, None] + torch.arange(keep, device=last.device)[None, :]
    conv_state[trace.slots] = trace.conv_inputs[torch.arange(bs, device=last.device)[:, None], cols].to(conv_state.dtype)


class RMSNormGated(nn.Module):
    """RMSNorm over each head's values, then times silu(gate) (the weight is plain, not 1 + w)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        x = self.weight * x.to(dtype)
        return (x * F.silu(gate.float())).to(dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv1d(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, meta: LinearAttnMetadata,
                  ) -> torch.Tensor:
    """Depthwise causal conv + silu over x [T, C] (the batch's tokens, request after request),
    each request continuing from its conv state (zeros without a computed prefix); writes the
    requests' new conv states. conv_state: [slots, K - 1, C] of this layer; weight [C, K]."""
    keep = weight.shape[1] - 1
    slots = meta.state_slots
    prev = conv_state[slots].to(x.dtype) * meta.has_initial_state[:, None, None].to(x.dtype)  # [bs, K-1, C]
    if meta.is_decode:
        window = torch.cat([prev, x[:, None, :]], dim=1)  # [bs, K, C]
        conv_state[slots] = window[:, 1:].to(conv_state.dtype)
        out = (window * weight.t()[None].to(x.dtype)).sum(1)
        return F.silu(out)
    # Each request's inputs with its K - 1 previous ones in front, padded: [bs, K - 1 + L, C].
    bs, width = len(meta.extend_lens), keep + meta.padded_len
    seqs = x.new_zeros(bs, width, x.shape[1])
    seqs[:, :keep] = prev
    seqs[meta.pad_rows, meta.pad_cols + keep] = x
    # Token j's window: positions col .. col + K - 1 of its request's row.
    offs = torch.arange(keep + 1, device=x.device)
    windows = seqs[meta.pad_rows[:, None], meta.pad_cols[:, None] + offs[None, :]]  # [T, K, C]
    out = (windows * weight.t()[None].to(x.dtype)).sum(1)
    # The new state: each request's last K - 1 inputs (its prev ones where it has fewer tokens).
    lens = torch.tensor(meta.extend_lens, dtype=torch.int64, device=x.device)
    tail = seqs[torch.arange(bs, device=x.device)[:, None], lens[:, None] + torch.arange(keep, device=x.device)[None, :]]
    if meta.write_states:
        conv_state[slots] = tail.to(conv_state.dtype)
    else:  # a verify: its layer's trace keeps the inputs (advance_states takes the accepted ones)
        meta.verify_traces[CONV_INPUTS] = seqs
    return F.silu(out)


def recurrent_gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """One token per request. q, k [bs, H, dk] (normalized, q scaled), v [bs, H, dv], g and beta
    [bs, H], state [bs, H, dk, dv] float32 -> (o [bs, H, dv], new state)."""
    state = state * g.exp()[..., None, None]
    kv_mem = (state * k[..., None]).sum(-2)  # S^T k: [bs, H, dv]
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2), state


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, chunk_size: int = CHUNK_SIZE) -> Tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over whole sequences, a chunk at a time. q, k [B, H, L, dk] (normalized, q
    scaled), v [B, H, L, dv], g and beta [B, H, L], state [B, H, dk, dv] float32; padded
    positions must have k = v = beta = g = 0. Returns (o [B, H, L, dv], final state).

    Inside a chunk, with G_i the cumulative log decay up to i and A[i, j] = beta_i k_i.k_j
    exp(G_i - G_j) for j < i, the writes U solve (I + A) U = beta V - beta exp(G) K S0 (S0 the
    state entering the chunk); then o_i = exp(G_i) S0^T q_i + sum_{j<=i} exp(G_i - G_j) q_i.k_j u_j
    and the chunk leaves exp(G_C) S0 + sum_j exp(G_C - G_j) k_j u_j^T."""
    B, H, L, dk = k.shape
    pad = (-L) % chunk_size
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (L + pad) // chunk_size
    q, k, v = (t.reshape(B, H, n, chunk_size, -1) for t in (q, k, v))
    g, beta = (t.reshape(B, H, n, chunk_size) for t in (g, beta))
    cum = g.cumsum(-1)  # G
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # exp(G_i - G_j) for j <= i, 0 above the diagonal (masked before exp: no overflow)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    a = (k_beta @ k.transpose(-1, -2)) * decay  # the diagonal is ignored by the unitriangular solve
    solve = lambda rhs: torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)  # noqa: E731
    u_v = solve(v * beta[..., None])  # (I + A)^-1 beta V
    u_k = solve(k_beta * cum.exp()[..., None])  # (I + A)^-1 beta exp(G) K: U = u_v - u_k S0
    qk = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(v)
    for c in range(n):
        u = u_v[:, :, c] - u_k[:, :, c] @ state
        out[:, :, c] = q_decayed[:, :, c] @ state + qk[:, :, c] @ u
        state = state * chunk_decay[:, :, c] + k_to_end[:, :, c].transpose(-1, -2) @ u
    return out.reshape(B, H, n * chunk_size, -1)[:, :, :L], state


def chunk_with_writes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """chunk_gated_delta_rule's one-chunk case (L <= CHUNK_SIZE, same shapes), returning instead of
    the final state what gives the state after any token (VerifyTrace): (o, the writes U, G)."""
    L = k.shape[2]
    cum = g.cumsum(-1)  # G
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    a = (k_beta @ k.transpose(-1, -2)) * decay
    solve = lambda rhs: torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)  # noqa: E731
    u = solve(v * beta[..., None]) - solve(k_beta * cum.exp()[..., None]) @ state
    out = (q * cum.exp()[..., None]) @ state + ((q @ k.transpose(-1, -2)) * decay) @ u
    return out, u, cum


def _padded(x: torch.Tensor, meta: LinearAttnMetadata) -> torch.Tensor:
    """The batch's tokens [T, ...] as [bs, ..., padded_len, ...]: heads before positions."""
    out = x.new_zeros(len(meta.extend_lens), meta.padded_len, *x.shape[1:])
    out[meta.pad_rows, meta.pad_cols] = x
    return out.transpose(1, 2)


def decode_kernel(q: torch.Tensor) -> Optional[Callable[..., torch.Tensor]]:
    """The fused decode step for q's device: the C++ kernel on the CPU, Triton's on CUDA (unless
    RADIXSERVE_DISABLE_FUSED_KERNELS is set), else None (recurrent_gated_delta_step)."""
    if q.is_cuda:
        from radixserve.layers import fused

        if not fused.ENABLED:
            return None
        try:
            from radixserve.layers.gdn_triton import gated_delta_decode  # imports triton: GPUs only
        except ImportError:  # no triton: the torch step serves
            return None
        return gated_delta_decode
    ops = cpu_kernels.kernels_for(q)
    return None if ops is None else ops.gated_delta_decode


class ShardedConvWeight(nn.Module):
    """The depthwise conv's weight [C, 1, K] (checkpoint name conv1d.weight, channels q | k | v):
    a tensor-parallel rank keeps its heads' channels of each part."""

    def __init__(self, part_sizes: List[int], kernel: int, tp_rank: int, tp_size: int):
        super().__init__()
        self.part_sizes, self.tp_rank, self.tp_size = part_sizes, tp_rank, tp_size
        self.weight = nn.Parameter(torch.empty(sum(part_sizes) // tp_size, 1, kernel), requires_grad=False)
        self.kernel_size = (kernel,)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        part = torch.cat(rank_parts(loaded, self.part_sizes, self.tp_rank, self.tp_size))
        if part.shape != param.shape:
            raise ValueError(f"conv1d.weight: expected {sum(self.part_sizes)} channels of kernel {param.shape[-1]}, "
                             f"got {tuple(loaded.shape)}")
        param.data.copy_(part)


class GatedDeltaNet(nn.Module):
    """A linear-attention token mixer; `layer_id` is its index among the model's linear layers
    (its MambaPool layer). Head counts and dims are this tensor-parallel rank's."""

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, layer_id: int, eps: float = 1e-6, hidden_act: str = "silu"):
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"unsupported linear-attention activation {hidden_act!r} (only silu)")
        assert num_v_heads % num_k_heads == 0, (num_v_heads, num_k_heads)
        tp = get_tp_group()
        if num_k_heads % tp.size:
            raise ValueError(f"{num_k_heads} linear-attention key heads are not divisible by --tp-size {tp.size}")
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.num_k_heads, self.num_v_heads = num_k_heads // tp.size, num_v_heads // tp.size
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = self.num_k_heads * head_k_dim, self.num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.layer_id = layer_id
        full_key, full_value = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        # Checkpoint layout: per key head [q | k | v of its value heads | z of its value heads]:
        # a rank's rows are its key heads', contiguous.
        self.in_proj_qkvz = ColumnParallelLinear(hidden_size, 2 * full_key + 2 * full_value)
        self.in_proj_ba = ColumnParallelLinear(hidden_size, 2 * num_v_heads)  # per key head [b... | a...]
        self.conv1d = ShardedConvWeight([full_key, full_key, full_value], conv_kernel, tp.rank, tp.size)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads), requires_grad=False)
        self.norm = RMSNormGated(head_v_dim, eps)
        self.out_proj = RowParallelLinear(full_value, hidden_size)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        """dt_bias and A_log (one value per value head): this rank's heads."""
        n = param.shape[0]
        part = loaded.narrow(0, self.tp_rank * n, n) if loaded.shape[0] == n * self.tp_size else loaded
        if part.shape != param.shape:
            raise ValueError(f"expected {n * self.tp_size} values (one per value head), got {tuple(loaded.shape)}")
        param.data.copy_(part)

    def project(self, hidden_states: torch.Tensor):
        """-> the conv's input [T, q | k | v channels], z [T, Hv, dv], b and a [T, Hv]. Qwen3-Next's
        checkpoint interleaves the projections per key head: undo it."""
        T, r = hidden_states.shape[0], self.num_v_heads // self.num_k_heads
        dk, dv = self.head_k_dim, self.head_v_dim
        qkvz, ba = self.in_proj_qkvz.forward(hidden_states), self.in_proj_ba.forward(hidden_states)
        q, k, v, z = qkvz.view(T, self.num_k_heads, -1).split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = ba.view(T, self.num_k_heads, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return mixed, z.reshape(T, -1, dv), b.reshape(T, self.num_v_heads), a.reshape(T, self.num_v_heads)

    def forward(self, hidden_states: torch.Tensor, meta: LinearAttnMetadata, conv_state: torch.Tensor,
                temporal_state: torch.Tensor) -> torch.Tensor:
        """hidden_states [T, hidden]; conv_state / temporal_state: this layer's MambaPool tensors."""
        T = hidden_states.shape[0]
        mixed, z, b, a = self.project(hidden_states)
        mixed = causal_conv1d(mixed, conv_state, self.conv1d.weight.squeeze(1), meta)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        r = self.num_v_heads // self.num_k_heads
        # float32 from here on, as the recurrence is; each key head serves r value heads
        q = l2norm(q.float().view(T, self.num_k_heads, -1)).repeat_interleave(r, dim=1) * self.head_k_dim ** -0.5
        k = l2norm(k.float().view(T, self.num_k_heads, -1)).repeat_interleave(r, dim=1)
        v = v.float().view(T, self.num_v_heads, -1)
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        slots = meta.state_slots
        step = decode_kernel(q) if meta.is_decode and temporal_state.is_contiguous() else None
        if step is not None:  # the C++ / Triton step, the states updated in place in the pool
            out = step(q, k, v, g, beta, temporal_state, slots, meta.has_initial_state)
        else:
            state = temporal_state[slots] * meta.has_initial_state[:, None, None, None]
            if meta.is_decode:
                out, state = recurrent_gated_delta_step(q, k, v, g, beta, state)
            elif meta.write_states:
                out, state = self._extend(q, k, v, g, beta, state, meta)
            else:
                out = self._verify(q, k, v, g, beta, state, meta)
            if meta.write_states:
                temporal_state[slots] = state
        out = self.norm.forward(out.to(hidden_states.dtype), z)
        return self.out_proj.forward(out.reshape(T, self.value_dim))

    @staticmethod
    def _extend(q, k, v, g, beta, state, meta: LinearAttnMetadata):
        """Pad the batch's requests to one length [bs, H, L, ...], run the chunked rule, unpad."""
        rows, cols = meta.pad_rows, meta.pad_cols
        out, state = chunk_gated_delta_rule(*(_padded(x, meta) for x in (q, k, v, g, beta)), state)
        return out.transpose(1, 2)[rows, cols], state

    def _verify(self, q, k, v, g, beta, state, meta: LinearAttnMetadata) -> torch.Tensor:
        """A verify's outputs from the states, which stay as they are; its VerifyTrace recorded.
        The verify's tokens (a chain: the last token and the drafts) fit in one chunk."""
        assert meta.padded_len <= CHUNK_SIZE, meta.padded_len
        q, k, v, g, beta = (_padded(x, meta) for x in (q, k, v, g, beta))
        out, u, log_decay = chunk_with_writes(q, k, v, g, beta, state)
        conv_inputs = meta.verify_traces.pop(CONV_INPUTS)
        meta.verify_traces[self.layer_id] = VerifyTrace(meta.state_slots, conv_inputs, k, u, log_decay)
        return out.transpose(1, 2)[meta.pad_rows, meta.pad_cols]


class Qwen3_5GatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's layer: the same recurrence, its projections apart and not interleaved
    (in_proj_qkv gives the conv's channels in order, in_proj_z / in_proj_b / in_proj_a the rest)."""

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, layer_id: int, eps: float = 1e-6, hidden_act: str = "silu"):
        super().__init__(hidden_size, num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel, layer_id, eps,
                         hidden_act)
        del self.in_proj_qkvz, self.in_proj_ba
        full_key, full_value = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.in_proj_qkv = StackedColumnParallelLinear(hidden_size, [full_key, full_key, full_value])  # q | k | v
        self.in_proj_z = ColumnParallelLinear(hidden_size, full_value)
        self.in_proj_b = ColumnParallelLinear(hidden_size, num_v_heads)
        self.in_proj_a = ColumnParallelLinear(hidden_size, num_v_heads)

    def project(self, hidden_states: torch.Tensor):
        T = hidden_states.shape[0]
        return (self.in_proj_qkv.forward(hidden_states), self.in_proj_z.forward(hidden_states).view(T, -1, self.head_v_dim),
                self.in_proj_b.forward(hidden_states), self.in_proj_a.forward(hidden_states))
