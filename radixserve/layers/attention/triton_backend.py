"""Attention with Triton kernels over the paged KV pool (`--attention-backend triton`).

Same contract as TorchNativeAttnBackend (the reference it is tested against):
- store_kv_cache writes the new K/V rows at out_cache_loc (one kernel for K and V);
- extend: extend_attention_fwd (cached prefix through req_to_token + the new k/v, causal, GQA);
  MIXED batches' decode rows are extend rows of length 1 there;
- verify over token trees (speculative decoding): every token a decode row whose KV slots are
  its prefix and its root-to-token path (layers/attention/spec_tree.py), decode_attention_fwd;
- decode: decode_attention_fwd, split-KV (stage 1 per (request, head, split), stage 2 merges
  the splits by log-sum-exp). The splits are num_kv_splits shares of each request's own keys,
  whatever the batch: batch-invariant as they are (--enable-deterministic-inference); its extend
  then reads every key from the pool in blocks on absolute positions (batch_invariant=True).
The per-forward index tensors are built once in init_forward_metadata, not once per layer.
CUDA graphs (decode): the decode kernels read req_pool_indices and seq_lens from device tensors
only, so a captured forward reads static copies of them (refilled in place before each replay)
and preallocated split buffers; nothing depends on CPU-side lengths.
Made for the GPU; on the CPU the kernels run only under Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from radixserve.layers import batch_invariant
from radixserve.layers.attention.base_attn_backend import AttentionBackend, window_table


@dataclass
class TritonMetadata:
    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int64
    prefix_lens: Optional[torch.Tensor] = None  # [bs] int64 (extend only)
    extend_lens: Optional[torch.Tensor] = None
    extend_start: Optional[torch.Tensor] = None
    max_extend_len: int = 0
    # TARGET_VERIFY over token trees: every token a decode row of (table, row, length) (spec_tree.py)
    tree_rows: Optional[tuple] = None
    # Sliding-window layers' decode (when some request is longer than the window): a table of each
    # request's last W slots, read in place of req_to_token (rows 0..n-1), and their lengths.
    window_table: Optional[torch.Tensor] = None
    window_rows: Optional[torch.Tensor] = None
    window_lens: Optional[torch.Tensor] = None
    # Decode split-KV scratch: preallocated under CUDA graphs, else allocated per layer call.
    mid_o: Optional[torch.Tensor] = None  # [bs, heads, splits, head_dim] float32
    mid_lse: Optional[torch.Tensor] = None  # [bs, heads, splits] float32


@dataclass
class TritonGraphState:
    """Static buffers of max_bs rows shared by every captured batch size (one replays at a time)."""

    req_pool_indices: torch.Tensor  # [max_bs] int64
    seq_lens: torch.Tensor  # [max_bs] int64
    mid_o: torch.Tensor
    mid_lse: torch.Tensor


class TritonAttnBackend(AttentionBackend):
    cuda_graph_unsupported_reason = None

    def __init__(self, device: str = "cuda", num_kv_splits: int = 8, sliding_window: Optional[int] = None):
        from radixserve.layers.attention import triton_ops  # imports triton: only when chosen

        self.ops = triton_ops
        self.device = device
        self.num_kv_splits = num_kv_splits
        self.sliding_window = sliding_window  # the model's windowed layers' W (None: none is)
        if sliding_window is not None:
            self.cuda_graph_unsupported_reason = ("sliding-window layers decode through a per-batch table of the "
                                                  "window's slots, which a captured graph would freeze")
        self.graph_state: Optional[TritonGraphState] = None

    def init_forward_metadata(self, fb) -> None:
        dev = self.device
        md = TritonMetadata(
            req_pool_indices=fb.req_pool_indices.to(dev, torch.int64),
            seq_lens=fb.seq_lens.to(dev, torch.int64),
        )
        if not fb.forward_mode.is_decode():
            ext, pre = fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu
            starts, acc = [], 0
            for n in ext:
                starts.append(acc)
                acc += n
            md.prefix_lens = torch.tensor(pre, dtype=torch.int64).to(dev)
            md.extend_lens = torch.tensor(ext, dtype=torch.int64).to(dev)
            md.extend_start = torch.tensor(starts, dtype=torch.int64).to(dev)
            md.max_extend_len = max(ext) if ext else 0
        if fb.forward_mode.is_target_verify() and fb.spec_tree is not None:
            rows = fb.spec_tree.kv_rows(fb.req_to_token_pool.req_to_token, fb.req_pool_indices.tolist(),
                                        fb.extend_prefix_lens_cpu, fb.out_cache_loc)
            md.tree_rows = tuple(t.to(dev) for t in rows)
        if fb.forward_mode.is_decode() and self.sliding_window is not None and max(fb.seq_lens_cpu) > self.sliding_window:
            self._window_rows(fb, md, self.sliding_window)
        fb.attn_metadata = md

    @staticmethod
    def _window_rows(fb, md: TritonMetadata, window: int) -> None:
        """Each request's last `window` slots as a table the decode kernel reads as req_to_token."""
        md.window_table, seen = window_table(fb.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens_cpu, window)
        md.window_rows = torch.arange(len(seen), dtype=torch.int64, device=md.seq_lens.device)
        md.window_lens = seen.to(md.seq_lens.device)

    def _store(self, k, v, layer, fb):
        pool = fb.token_to_kv_pool
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        self.ops.store_kv_cache(k, v, k_buf, v_buf, fb.out_cache_loc)
        return k_buf, v_buf

    def forward_extend(self, q, k, v, layer, fb) -> torch.Tensor:
        k_buf, v_buf = self._store(k, v, layer, fb)
        md: TritonMetadata = fb.attn_metadata
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if md.tree_rows is not None:  # the tree mask as each token's own KV row
            table, rows, lens = md.tree_rows
            self.ops.decode_attention_fwd(q, k_buf, v_buf, out, table, rows, lens, layer.scaling,
                                          num_kv_splits=self.num_kv_splits)
            return out
        self.ops.extend_attention_fwd(
            q, k, v, out, k_buf, v_buf,
            fb.req_to_token_pool.req_to_token, md.req_pool_indices,
            md.prefix_lens, md.extend_lens, md.extend_start, md.max_extend_len, layer.scaling,
            sliding_window=layer.sliding_window_size or 0,
            batch_invariant=batch_invariant.is_enabled(),  # --enable-deterministic-inference: keys on absolute blocks
        )
        return out

    def forward_decode(self, q, k, v, layer, fb) -> torch.Tensor:
        k_buf, v_buf = self._store(k, v, layer, fb)
        md: TritonMetadata = fb.attn_metadata
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        table, rows, lens = fb.req_to_token_pool.req_to_token, md.req_pool_indices, md.seq_lens
        if md.window_table is not None and layer.sliding_window_size is not None:
            table, rows, lens = md.window_table, md.window_rows, md.window_lens
        self.ops.decode_attention_fwd(
            q, k_buf, v_buf, out, table, rows, lens,
            layer.scaling, num_kv_splits=self.num_kv_splits, mid_o=md.mid_o, mid_lse=md.mid_lse,
        )
        return out

    # ---- CUDA graphs ----------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, num_heads: int, head_dim: int) -> None:
        dev, splits = self.device, self.num_kv_splits
        self.graph_state = TritonGraphState(
            req_pool_indices=torch.zeros(max_bs, dtype=torch.int64, device=dev),
            seq_lens=torch.full((max_bs,), self.get_cuda_graph_seq_len_fill_value(), dtype=torch.int64, device=dev),
            mid_o=torch.empty((max_bs, num_heads, splits, head_dim), dtype=torch.float32, device=dev),
            mid_lse=torch.empty((max_bs, num_heads, splits), dtype=torch.float32, device=dev),
        )

    def init_forward_metadata_capture_cuda_graph(self, bs, req_pool_indices, seq_lens) -> TritonMetadata:
        st = self.graph_state
        assert st is not None and bs <= st.seq_lens.numel(), "init_cuda_graph_state(max_bs) first"
        # Leading-dim slices of contiguous buffers stay contiguous (the kernels assume it).
        md = TritonMetadata(
            req_pool_indices=st.req_pool_indices[:bs], seq_lens=st.seq_lens[:bs],
            mid_o=st.mid_o[:bs], mid_lse=st.mid_lse[:bs],
        )
        self.init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens)  # warm-up runs read them
        return md

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens) -> None:
        st = self.graph_state
        st.req_pool_indices[:bs].copy_(req_pool_indices)
        st.seq_lens[:bs].copy_(seq_lens)
