"""Attention in plain PyTorch over the paged KV pool (CPU and any device).

The KV of request i is scattered over the pool: its slots are req_to_token[req_pool_idx, :seq_len].

- Decode-like requests (one new token: every request of a DECODE batch, and extend requests
  whose extend length is 1) are done in a few groups of similar length: each group's KV is
  gathered into a padded [B, max_len, kv_heads, head_dim] block with one index_select per
  layer, the padding is masked, and one SDPA call runs (GQA without repeating K/V).
- Longer extend requests run one SDPA call each: with no cached prefix the fresh k/v are used
  directly (causal); with a prefix the prefix KV is gathered and the mask is causal with an offset.
The index tables are built once per forward in init_forward_metadata, not once per layer.

On the CPU, decode-like requests instead go to one C++ kernel (radixserve.layers.cpu_kernels)
that reads K/V through req_to_token in place: no gather copy, no padding, an online softmax,
GQA-aware, a prefix every request of a DECODE batch shares read once for all of them; and the
longer extend requests to another (one call per layer for all of them, their prefix read in
place, no mask built). `use_cpu_kernels=False` keeps the torch path, the reference
the kernels are tested on.

Sliding-window layers (RadixAttention.sliding_window_size = W: a query attends to the W keys up
to itself, transformers' rule) take a second metadata, made only when some request is longer
than W: decode rows read a table of each request's last W slots (the C++ kernel or the padded
block take it as they take req_to_token), and extend requests run one SDPA call each over their
slots from the first key any of their queries sees, with the window in the mask. With the SWA
pool (mem_cache/swa_memory_pool.py: windowed layers' K/V in buffers of their own) every forward
takes that metadata, its slots the SWA pool's: translated when the batch was scheduled
(`fb.swa_locs`; the overlap loop changes the map while a forward runs), else here (`translate_loc`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.nn.functional as F

from radixserve.layers import batch_invariant, cpu_kernels
from radixserve.layers.attention.base_attn_backend import AttentionBackend, window_table


@dataclass
class ExtendSeq:
    start: int  # first token of this request in the batch's token array
    extend_len: int
    prefix_len: int
    kv_slots: Optional[torch.Tensor]  # [seq_len] slots of prefix + extend; None when no prefix
    mask: Optional[torch.Tensor]  # [extend_len, seq_len] bool; None = plain causal


@dataclass
class DecodeGroup:
    """Decode-like requests of similar length, gathered into one padded block."""

    token_idx: torch.Tensor  # their rows in q
    kv_slots: torch.Tensor  # [B * max_len] slots, row-major (index_select wants 1-D)
    shape: tuple  # (B, max_len)
    mask: torch.Tensor  # [B, 1, 1, max_len] bool, True = attend


@dataclass
class DecodeRows:
    """Decode-like requests for the C++ paged decode kernel (no gather, no padding)."""

    token_idx: Optional[torch.Tensor]  # their rows in q; None: every row, in order (DECODE)
    req_pool_indices: torch.Tensor  # [n] int64
    seq_lens: torch.Tensor  # [n] int64
    req_to_token: torch.Tensor
    shared_prefix_len: int = 0  # the first slots every request has in common (shared_prefix_len)


@dataclass
class ExtendRows:
    """Extend requests (more than one new token) for the C++ extend kernel."""

    req_pool_indices: torch.Tensor  # [R] int64
    prefix_lens: torch.Tensor  # [R] int64
    extend_lens: torch.Tensor  # [R] int64
    q_starts: torch.Tensor  # [R] int64: each request's first row in q
    req_to_token: torch.Tensor


@dataclass
class TorchNativeMetadata:
    decode_groups: List[DecodeGroup] = field(default_factory=list)
    decode_rows: Optional[DecodeRows] = None  # instead of decode_groups, with the C++ kernel
    all_decode: bool = False
    extend_seqs: List[ExtendSeq] = field(default_factory=list)
    extend_rows: Optional[ExtendRows] = None  # instead of extend_seqs, with the C++ kernel
    windowed: Optional["TorchNativeMetadata"] = None  # for sliding-window layers, when it differs


# A decode group's shortest request is at least this share of its longest, so at most ~30%
# of the gathered KV is padding (one padded block over ragged lengths read 1.6x the KV).
DECODE_GROUP_MIN_FILL = 0.7

# A DECODE batch whose requests all begin with the same slots (a system prompt every request
# shares: one radix-tree node) has the kernel attend to that prefix once for all of them, as
# tiles, from this many shared keys on.
SHARED_PREFIX_MIN = 64


def shared_prefix_len(req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: List[int]) -> int:
    """How many leading slots the requests in `rows` all share (0 below SHARED_PREFIX_MIN); each
    keeps at least its last key to itself. Same slots = same K/V: the radix cache hands a prefix
    it holds to every request that matches it."""
    if len(rows) < 2 or min(seq_lens) - 1 < SHARED_PREFIX_MIN:
        return 0
    first = req_to_token[rows, 0]
    if not bool((first == first[0]).all()):  # the usual answer, for 2 x B bytes
        return 0
    table = req_to_token[rows, : min(seq_lens) - 1]
    same = (table == table[:1]).all(dim=0)
    n = int(same.numel()) if bool(same.all()) else int(torch.argmin(same.to(torch.int8)))
    return n if n >= SHARED_PREFIX_MIN else 0


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self, device: str = "cpu", use_cpu_kernels: bool = True, sliding_window: Optional[int] = None):
        self.device = device
        self.sliding_window = sliding_window  # the model's windowed layers' W (None: it has none)
        self.cpu_ops = cpu_kernels.get() if use_cpu_kernels and device == "cpu" else None
        # the tile kernels (AVX-512 or AVX2 builds): extend attention, decode over a shared prefix
        self._tiles = self.cpu_ops is not None and bool(self.cpu_ops.has_extend_attention())

    def init_forward_metadata(self, fb) -> None:
        md = TorchNativeMetadata()
        if fb.forward_mode.is_target_verify() and (fb.spec_tree is not None or self.cpu_ops is not None):
            if fb.spec_tree is not None:
                self._tree_metadata(fb, md)
            else:
                md.decode_rows = self._verify_rows(fb)
            fb.attn_metadata = md
            return
        ext_lens, prefix_lens = fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu
        if fb.forward_mode.is_decode():
            dec_rows = list(range(fb.batch_size))
            md.all_decode = True
            token_of_row = dec_rows
        else:
            # Batch-invariant mode: a one-token extend (the last token of a chunked prompt or of a
            # prefix hit) takes the extend kernel, as the same token does in a longer extend.
            one_token_extends = not (batch_invariant.is_enabled() and self._tiles_fit(fb.token_to_kv_pool))
            dec_rows = [i for i, n in enumerate(ext_lens) if n == 1 and one_token_extends]
            starts = _starts(ext_lens)
            token_of_row = {i: starts[i] for i in dec_rows}
        if dec_rows and self.cpu_ops is not None:
            md.decode_rows = self._decode_rows(fb, dec_rows, token_of_row, md.all_decode)
        elif dec_rows:
            md.decode_groups = self._decode_groups(fb, dec_rows, token_of_row)
        if not md.all_decode and self._tiles_fit(fb.token_to_kv_pool):
            md.extend_rows = self._extend_rows(fb, starts)
        elif not md.all_decode:
            req_to_token = fb.req_to_token_pool.req_to_token
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
        # With the SWA pool (its own slots for windowed layers) every forward needs the windowed
        # layers' tables, translated; without it only one that reaches past the window.
        swa_pool = hasattr(fb.token_to_kv_pool, "translate_loc")
        if self.sliding_window is not None and (swa_pool or max(fb.seq_lens_cpu) > self.sliding_window):
            md.windowed = self._window_metadata(fb, self.sliding_window)
        fb.attn_metadata = md

    def _window_metadata(self, fb, window: int) -> TorchNativeMetadata:
        """The metadata of a sliding-window layer: query at position p sees keys p - W + 1 .. p."""
        md = TorchNativeMetadata()
        req_to_token = fb.req_to_token_pool.req_to_token
        rows = fb.req_pool_indices.to(req_to_token.device).long()
        # The SWA pool (mem_cache/swa_memory_pool.py): full slots -> the windowed layers' own slots,
        # translated when the batch was scheduled (fb.swa_locs), or here where no scheduler did.
        translate = getattr(fb.token_to_kv_pool, "translate_loc", lambda slots: slots)
        locs = getattr(fb, "swa_locs", None)
        if fb.forward_mode.is_decode():
            if locs is not None:
                table, seen = locs.table, locs.lens
            else:
                table, seen = window_table(req_to_token, rows, fb.seq_lens_cpu, window)
                table = translate(table)
            n, width = table.shape
            md.all_decode = True
            if self.cpu_ops is not None:
                md.decode_rows = DecodeRows(None, torch.arange(n), seen, table)
            else:
                mask = (torch.arange(width)[None, :] < seen[:, None])[:, None, None, :].to(self.device)
                md.decode_groups = [DecodeGroup(torch.arange(n, device=self.device), table.reshape(-1).long(),
                                                (n, width), mask)]
            return md
        for i, (start, n, p) in enumerate(zip(_starts(fb.extend_seq_lens_cpu), fb.extend_seq_lens_cpu,
                                              fb.extend_prefix_lens_cpu)):
            first = max(0, p - window + 1)
            if locs is not None:
                slots = locs.table[i, : p + n - first].long()
            else:
                slots = translate(req_to_token[rows[i], first : p + n].long())
            q_pos = torch.arange(p, p + n, device=self.device)[:, None]
            k_pos = torch.arange(first, p + n, device=self.device)[None, :]
            md.extend_seqs.append(ExtendSeq(start, n, p, slots, (k_pos <= q_pos) & (k_pos > q_pos - window)))
        return md

    @staticmethod
    def _metadata(layer, fb) -> TorchNativeMetadata:
        md: TorchNativeMetadata = fb.attn_metadata
        return md.windowed if md.windowed is not None and layer.sliding_window_size is not None else md

    def _tiles_fit(self, pool) -> bool:
        """The C++ tile kernels (extend; decode's shared prefix; AVX-512 or AVX2 builds) take
        head_dim a multiple of 16."""
        return self._tiles and getattr(pool, "head_dim", 1) % 16 == 0

    @staticmethod
    def _extend_rows(fb, starts: List[int]) -> Optional[ExtendRows]:
        shortest = 1 if batch_invariant.is_enabled() else 2  # see init_forward_metadata
        ext = [i for i, n in enumerate(fb.extend_seq_lens_cpu) if n >= shortest]
        if not ext:
            return None
        pick = lambda xs: torch.tensor([xs[i] for i in ext], dtype=torch.int64)  # noqa: E731
        rows = fb.req_pool_indices.cpu()[torch.tensor(ext, dtype=torch.int64)].long().contiguous()
        return ExtendRows(rows, pick(fb.extend_prefix_lens_cpu), pick(fb.extend_seq_lens_cpu), pick(starts),
                          fb.req_to_token_pool.req_to_token)

    @staticmethod
    def _set_kv(pool, layer, fb, k, v) -> None:
        if getattr(fb, "swa_locs", None) is None:
            pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        else:  # the SWA pool: a windowed layer writes at the swa slots translated at schedule time
            pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v, loc_swa=fb.swa_locs.out_cache_loc)

    def forward_decode(self, q, k, v, layer, fb) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        self._set_kv(pool, layer, fb, k, v)
        out = torch.empty_like(q)
        self._decode_into(out, q, layer, self._metadata(layer, fb), pool)
        return out

    def _decode_rows(self, fb, dec_rows: List[int], token_of_row, all_decode: bool) -> DecodeRows:
        req_to_token = fb.req_to_token_pool.req_to_token
        if all_decode:
            rows = fb.req_pool_indices.long().contiguous()
            # batch-invariant mode: no shared-prefix pass (it depends on who shares the batch)
            fits = self._tiles_fit(fb.token_to_kv_pool) and not batch_invariant.is_enabled()
            shared = shared_prefix_len(req_to_token, rows, fb.seq_lens_cpu) if fits else 0
            return DecodeRows(None, rows, fb.seq_lens.long().contiguous(), req_to_token, shared)
        idx = torch.tensor(dec_rows, dtype=torch.int64)
        token_idx = torch.tensor([token_of_row[i] for i in dec_rows], dtype=torch.int64)
        seq_lens = torch.tensor([fb.seq_lens_cpu[i] for i in dec_rows], dtype=torch.int64)
        return DecodeRows(token_idx, fb.req_pool_indices[idx].long().contiguous(), seq_lens, req_to_token)

    @staticmethod
    def _verify_rows(fb) -> DecodeRows:
        """A speculative verify forward: token j of a request attends to its first prefix_len + j + 1
        positions (a chain's causal mask), so each token is a decode-like row of the C++ kernel,
        and all of them go in one call per layer."""
        lens = torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int64)
        req_pool_indices = torch.repeat_interleave(fb.req_pool_indices.long().cpu(), lens).contiguous()
        seq_lens = [p + j + 1 for p, n in zip(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu) for j in range(n)]
        return DecodeRows(None, req_pool_indices, torch.tensor(seq_lens, dtype=torch.int64), fb.req_to_token_pool.req_to_token)

    def _tree_metadata(self, fb, md: TorchNativeMetadata) -> None:
        """A verify forward over token trees (spec_tree.py): every token a decode row over its
        prefix + path slots; the C++ kernel reads them in place, the torch path gathers them
        into one padded block."""
        table, rows, lens = fb.spec_tree.kv_rows(fb.req_to_token_pool.req_to_token, fb.req_pool_indices.tolist(),
                                                 fb.extend_prefix_lens_cpu, fb.out_cache_loc)
        if self.cpu_ops is not None:
            md.decode_rows = DecodeRows(None, rows, lens, table)
            return
        max_len = int(lens.max())
        slots = table.to(self.device)[rows.to(self.device), :max_len]
        mask = (torch.arange(max_len, device=self.device)[None, :] < lens.to(self.device)[:, None])[:, None, None, :]
        token_idx = torch.arange(len(rows), device=self.device)
        md.decode_groups = [DecodeGroup(token_idx, slots.reshape(-1).long(), (len(rows), max_len), mask)]

    def _decode_groups(self, fb, dec_rows: List[int], token_of_row) -> List[DecodeGroup]:
        req_to_token = fb.req_to_token_pool.req_to_token
        lens = fb.seq_lens_cpu
        order = sorted(dec_rows, key=lambda i: -lens[i])
        groups, cur = [], [order[0]]
        for i in order[1:]:
            if lens[i] >= DECODE_GROUP_MIN_FILL * lens[cur[0]]:
                cur.append(i)
            else:
                groups.append(cur)
                cur = [i]
        groups.append(cur)
        out = []
        for rows in groups:
            max_len = lens[rows[0]]
            idx = torch.tensor(rows, dtype=torch.int64)
            seq_lens = torch.tensor([lens[i] for i in rows], dtype=torch.int64, device=self.device)
            slots = req_to_token[fb.req_pool_indices[idx.to(fb.req_pool_indices.device)], :max_len]
            ar = torch.arange(max_len, device=self.device)
            mask = (ar[None, :] < seq_lens[:, None])[:, None, None, :]
            token_idx = torch.tensor([token_of_row[i] for i in rows], dtype=torch.int64, device=self.device)
            out.append(DecodeGroup(token_idx, slots.reshape(-1).long(), (len(rows), max_len), mask))
        return out

    def forward_extend(self, q, k, v, layer, fb) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        self._set_kv(pool, layer, fb, k, v)
        md = self._metadata(layer, fb)
        out = torch.empty_like(q)
        if md.decode_groups or md.decode_rows is not None:
            self._decode_into(out, q, layer, md, pool)
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        rows = md.extend_rows
        if rows is not None:
            self.cpu_ops.extend_attention(out, q, k_buf, v_buf, rows.req_to_token, rows.req_pool_indices,
                                          rows.prefix_lens, rows.extend_lens, rows.q_starts, layer.scaling)
        if k_buf.dtype != k.dtype:  # attend to the new tokens as the cache holds them, as decode will
            k, v = k.to(k_buf.dtype), v.to(v_buf.dtype)
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

    def _decode_into(self, out: torch.Tensor, q: torch.Tensor, layer, md: TorchNativeMetadata, pool) -> None:
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        rows = md.decode_rows
        if rows is not None:
            args = (k_buf, v_buf, rows.req_to_token, rows.req_pool_indices, rows.seq_lens, layer.scaling)
            split = batch_invariant.decode_split_tokens()  # fixed under the flag, else 0: by the batch
            if rows.token_idx is None:
                self.cpu_ops.decode_attention(out, q, *args, rows.shared_prefix_len, split)
            else:
                o = torch.empty((len(rows.token_idx), *q.shape[1:]), dtype=q.dtype)
                self.cpu_ops.decode_attention(o, q[rows.token_idx], *args, 0, split)
                out[rows.token_idx] = o
        for g in md.decode_groups:
            shape = (*g.shape, k_buf.shape[1], k_buf.shape[2])
            keys = k_buf.index_select(0, g.kv_slots).view(shape).transpose(1, 2)  # [B, kv_heads, L, D]
            values = v_buf.index_select(0, g.kv_slots).view(shape).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q[g.token_idx].unsqueeze(2),  # [B, heads, 1, D]
                keys.to(q.dtype),
                values.to(q.dtype),
                attn_mask=g.mask,
                scale=layer.scaling,
                enable_gqa=True,
            )
            out[g.token_idx] = o.squeeze(2)


def _starts(lens: List[int]) -> List[int]:
    out, acc = [], 0
    for n in lens:
        out.append(acc)
        acc += n
    return out
