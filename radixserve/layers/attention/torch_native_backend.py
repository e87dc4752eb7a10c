"""Attention in plain PyTorch over the paged KV pool (CPU and any device).

The KV of request i is scattered over the pool: its slots are req_to_token[req_pool_idx, :seq_len].

- Decode-like requests (one new token: every request of a DECODE batch, and extend requests
  whose extend length is 1) are done together: gather their KV into a padded
  [B, max_len, kv_heads, head_dim] block with one index op per layer, mask the padding, and
  run one SDPA call (GQA without repeating K/V).
- Longer extend requests run one SDPA call each: with no cached prefix the fresh k/v are used
  directly (causal); with a prefix the prefix KV is gathered and the mask is causal with an offset.
The index tables are built once per forward in init_forward_metadata, not once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.nn.functional as F

from radixserve.layers.attention.base_attn_backend import AttentionBackend


@dataclass
class ExtendSeq:
    start: int  # first token of this request in the batch's token array
    extend_len: int
    prefix_len: int
    kv_slots: Optional[torch.Tensor]  # [seq_len] slots of prefix + extend; None when no prefix
    mask: Optional[torch.Tensor]  # [extend_len, seq_len] bool; None = plain causal


@dataclass
class TorchNativeMetadata:
    decode_token_idx: Optional[torch.Tensor] = None  # rows of q that are decode-like
    decode_kv_slots: Optional[torch.Tensor] = None  # [Bd * max_len], row-major
    decode_shape: tuple = (0, 0)  # (Bd, max_len)
    decode_mask: Optional[torch.Tensor] = None  # [Bd, 1, 1, max_len] bool, True = attend
    all_decode: bool = False
    extend_seqs: List[ExtendSeq] = field(default_factory=list)


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self, device: str = "cpu"):
        self.device = device

    def init_forward_metadata(self, fb) -> None:
        md = TorchNativeMetadata()
        ext_lens, prefix_lens = fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu
        req_to_token = fb.req_to_token_pool.req_to_token
        if fb.forward_mode.is_decode():
            dec_rows = list(range(fb.batch_size))
            md.all_decode = True
        else:
            dec_rows = [i for i, n in enumerate(ext_lens) if n == 1]
        if dec_rows:
            rows = torch.tensor(dec_rows, dtype=torch.int64)
            seq_lens = fb.seq_lens[rows.to(fb.seq_lens.device)]
            max_len = max(fb.seq_lens_cpu[i] for i in dec_rows)
            pool_idx = fb.req_pool_indices[rows.to(fb.req_pool_indices.device)]
            # flattened: index_select on a 1-D index is several times faster than 2-D indexing
            md.decode_kv_slots = req_to_token[pool_idx, :max_len].reshape(-1).long()
            md.decode_shape = (len(dec_rows), max_len)
            ar = torch.arange(max_len, device=seq_lens.device)
            md.decode_mask = (ar[None, :] < seq_lens[:, None])[:, None, None, :]
            if not md.all_decode:
                starts = _starts(ext_lens)
                md.decode_token_idx = torch.tensor([starts[i] for i in dec_rows], device=self.device)
        if not md.all_decode:
            starts = _starts(ext_lens)
            for i, n in enumerate(ext_lens):
                if n == 1:
                    continue
                p = prefix_lens[i]
                slots = mask = None
                if p > 0:
                    slots = req_to_token[fb.req_pool_indices[i], : p + n].long()
                    q_pos = torch.arange(n, device=self.device)[:, None] + p
                    mask = torch.arange(p + n, device=self.device)[None, :] <= q_pos
                md.extend_seqs.append(ExtendSeq(starts[i], n, p, slots, mask))
        fb.attn_metadata = md

    def forward_decode(self, q, k, v, layer, fb) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        return self._decode(q, layer, fb.attn_metadata, pool)

    def forward_extend(self, q, k, v, layer, fb) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        md: TorchNativeMetadata = fb.attn_metadata
        out = torch.empty_like(q)
        if md.decode_token_idx is not None:
            out[md.decode_token_idx] = self._decode(q[md.decode_token_idx], layer, md, pool)
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        for s in md.extend_seqs:
            sl = slice(s.start, s.start + s.extend_len)
            if s.kv_slots is None:
                ks, vs = k[sl], v[sl]
            else:
                ks, vs = k_buf[s.kv_slots], v_buf[s.kv_slots]
            o = F.scaled_dot_product_attention(
                q[sl].transpose(0, 1).unsqueeze(0),
                ks.transpose(0, 1).unsqueeze(0).to(q.dtype),
                vs.transpose(0, 1).unsqueeze(0).to(q.dtype),
                attn_mask=s.mask,
                is_causal=s.mask is None,
                scale=layer.scaling,
                enable_gqa=True,
            )
            out[sl] = o.squeeze(0).transpose(0, 1)
        return out

    @staticmethod
    def _decode(q, layer, md: TorchNativeMetadata, pool) -> torch.Tensor:
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        shape = (*md.decode_shape, k_buf.shape[1], k_buf.shape[2])
        keys = k_buf.index_select(0, md.decode_kv_slots).view(shape).transpose(1, 2)  # [B, kv_heads, L, D]
        values = v_buf.index_select(0, md.decode_kv_slots).view(shape).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [B, heads, 1, D]
            keys.to(q.dtype),
            values.to(q.dtype),
            attn_mask=md.decode_mask,
            scale=layer.scaling,
            enable_gqa=True,
        )
        return o.squeeze(2)


def _starts(lens: List[int]) -> List[int]:
    out, acc = [], 0
    for n in lens:
        out.append(acc)
        acc += n
    return out
