"""Req and ScheduleBatch: the scheduler's view of requests and batches (seeds 001, 003, 004).

A Req's tokens and where their KV lives:

    origin_input_ids + output_ids                    all tokens of the request
    fill_ids          = the part to be in KV after this round (shorter for a prefill chunk)
    prefix_indices    = KV slots of fill_ids[:len(prefix_indices)], already in the pool
    extend_input_len  = len(fill_ids) - len(prefix_indices): tokens this round computes
    req_to_token[req_pool_idx, :seq_len] = the slot of every token that has KV
"""

from __future__ import annotations

import itertools
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Union

import regex
import torch

from radixserve.managers import spec_overlap
from radixserve.mem_cache.base_prefix_cache import BasePrefixCache
from radixserve.mem_cache.kv_ledger import KVLedger
from radixserve.model_executor.forward_batch import ForwardMode, ModelWorkerBatch
from radixserve.sampling.sampling_batch_info import SamplingBatchInfo
from radixserve.sampling_params import SamplingParams

# Cap of max_new_tokens when reserving decode space for a request (SGLang: CLIP_MAX_NEW_TOKENS).
CLIP_MAX_NEW_TOKENS = 4096
# Time a stop regex may take to search a request's output after one token (the scheduler waits).
STOP_REGEX_TIMEOUT_S = 0.05
# Decode steps reserved per running request when re-estimating new_token_ratio after a retraction.
RETRACT_DECODE_STEPS = 20


# ---- finish reasons ----------------------------------------------------------------------
class BaseFinishReason:
    def __init__(self, is_error: bool = False):
        self.is_error = is_error

    def to_json(self) -> Dict[str, Any]:
        raise NotImplementedError


class FINISH_MATCHED_TOKEN(BaseFinishReason):
    def __init__(self, matched: Union[int, List[int]]):
        super().__init__()
        self.matched = matched

    def to_json(self):
        return {"type": "stop", "matched": self.matched}


class FINISH_MATCHED_STR(BaseFinishReason):
    def __init__(self, matched: str):
        super().__init__()
        self.matched = matched

    def to_json(self):
        return {"type": "stop", "matched": self.matched}


class FINISHED_MATCHED_REGEX(BaseFinishReason):
    def __init__(self, matched: str):
        super().__init__()
        self.matched = matched

    def to_json(self):
        return {"type": "stop", "matched": self.matched}


class FINISH_LENGTH(BaseFinishReason):
    def __init__(self, length: int):
        super().__init__()
        self.length = length

    def to_json(self):
        return {"type": "length", "length": self.length}


class FINISH_ABORT(BaseFinishReason):
    def __init__(self, message: str = "Unknown error", status_code: Optional[int] = None, err_type: Optional[str] = None):
        super().__init__(is_error=True)
        self.message = message
        self.status_code = status_code
        self.err_type = err_type

    def to_json(self):
        return {"type": "abort", "message": self.message, "status_code": self.status_code, "err_type": self.err_type}


@dataclass
class FinishStatus:
    """A request's finish in one record (Req reads it under SGLang's three names, _record_field):
    running (nothing set) -> to finish (`pending`, an abort from outside) -> finished (`reason`)
    -> its final message sent (`sent`)."""

    reason: Optional[BaseFinishReason] = None  # Req.finished_reason: set, the request is finished
    # Req.to_finish: set from outside (abort); turned into the reason at the next check_finished,
    # so the result of the batch in flight is still processed normally.
    pending: Optional[BaseFinishReason] = None
    sent: bool = False  # Req.finished_sent: the final message went out (never send it twice)


@dataclass
class HiCacheState:
    """HiCache: the host-only continuation of the last match (loaded back at admission), and the
    tokens loaded back this round (of them, from the storage tier)."""

    last_host_node: Any = None
    host_hit_length: int = 0
    loaded_host_tokens: int = 0
    loaded_storage_tokens: int = 0


@dataclass
class DisaggState:
    """PD disaggregation (seed 001 §8): where the prefill server's handshake socket is and the
    request's room there; on the prefill server, the request's KVSender."""

    bootstrap_host: Optional[str] = None
    bootstrap_port: Optional[int] = None
    bootstrap_room: Optional[int] = None
    disagg_kv_sender: Any = None
    disagg_queued_at: float = 0.0


@dataclass
class SpecStats:
    """Speculative decoding (SGLang's meta_info names): verify steps, drafts proposed and accepted."""

    spec_verify_ct: int = 0
    spec_num_proposed_drafts: int = 0
    spec_num_correct_drafts: int = 0


def _record_field(record: str, name: str) -> property:
    """Req.<alias> reads and writes req.<record>.<name> (the state is grouped; the names are SGLang's).
    The getter is an attrgetter: read per request and step, it costs about a plain attribute."""
    record_of = operator.attrgetter(record)
    return property(operator.attrgetter(f"{record}.{name}"),
                    lambda req, value: setattr(record_of(req), name, value), doc=f"{record}.{name}")


# ---- Req -----------------------------------------------------------------------------------
class Req:
    """One request (one sample) as the scheduler sees it: its tokens, where their KV lives
    (see the diagram at the top), its finish state and what it has streamed out.

    Invariants, asserted where they change (check_invariants):
        0 <= len(prefix_indices) <= kv_committed_len <= seqlen() + 1
            (+1: in the overlap loop the token in flight has KV before it is appended)
        0 <= send_token_offset <= len(output_ids);  pending_chunks >= 0
        a finished request never gets a new token; finished_sent implies finished()"""

    finished_reason = _record_field("finish_status", "reason")
    to_finish = _record_field("finish_status", "pending")
    finished_sent = _record_field("finish_status", "sent")
    last_host_node = _record_field("hicache", "last_host_node")
    host_hit_length = _record_field("hicache", "host_hit_length")
    loaded_host_tokens = _record_field("hicache", "loaded_host_tokens")
    loaded_storage_tokens = _record_field("hicache", "loaded_storage_tokens")
    bootstrap_host = _record_field("disagg", "bootstrap_host")
    bootstrap_port = _record_field("disagg", "bootstrap_port")
    bootstrap_room = _record_field("disagg", "bootstrap_room")
    disagg_kv_sender = _record_field("disagg", "disagg_kv_sender")
    disagg_queued_at = _record_field("disagg", "disagg_queued_at")
    spec_verify_ct = _record_field("spec_stats", "spec_verify_ct")
    spec_num_proposed_drafts = _record_field("spec_stats", "spec_num_proposed_drafts")
    spec_num_correct_drafts = _record_field("spec_stats", "spec_num_correct_drafts")

    def __init__(
        self,
        rid: str,
        origin_input_text: Optional[str],
        origin_input_ids: List[int],
        sampling_params: SamplingParams,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        stream: bool = False,
        priority: Optional[int] = None,
        eos_token_ids: Optional[Set[int]] = None,
        vocab_size: Optional[int] = None,
        tokenizer: Any = None,
        arrival_time: Optional[float] = None,
        bootstrap_host: Optional[str] = None,
        bootstrap_port: Optional[int] = None,
        bootstrap_room: Optional[int] = None,
        lora_path: Optional[str] = None,
        multimodal_inputs: Any = None,
    ):
        self.rid = rid
        # images (multimodal.MultimodalInputs): origin_input_ids hold their pad values
        self.multimodal_inputs = multimodal_inputs
        self.lora_path = lora_path  # --enable-lora: the adapter's name; None = the base model
        self.custom_logit_processor: Optional[str] = None  # a registered processor's name (SamplingBatchInfo)
        self.origin_input_text = origin_input_text
        self.origin_input_ids = list(origin_input_ids)
        self.sampling_params = sampling_params
        # SGLang's prefill-only request: max_new_tokens 0 as asked (read before the scheduler clips
        # max_new_tokens to the context's room, where 0 still means the prefill's one token)
        self.is_prefill_only = sampling_params.max_new_tokens == 0
        self.return_logprob = return_logprob
        self.top_logprobs_num = top_logprobs_num
        # SGLang's default (-1) with return_logprob: the last prompt token's entry only, which is
        # None (input_token_logprobs == [[None, last_id, text]]); nothing more is computed for it.
        if return_logprob and logprob_start_len == -1:
            logprob_start_len = len(origin_input_ids) - 1
        self.logprob_start_len = logprob_start_len
        self.stream = stream
        self.priority = priority
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        # EOS of the model plus the request's stop_token_ids; ignore_eos drops the model's.
        model_eos = set() if sampling_params.ignore_eos else set(eos_token_ids or ())
        self.eos_token_ids: Set[int] = model_eos | set(sampling_params.stop_token_ids or ())

        self.output_ids: List[int] = []
        self.fill_ids: List[int] = []
        self.prefix_indices: torch.Tensor = torch.empty(0, dtype=torch.int64)
        self.last_node: Any = None
        self.extend_input_len = 0
        self.req_pool_idx: Optional[int] = None
        # Tokens whose KV is in the pool (or being written by the batch in flight).
        self.kv_committed_len = 0
        # Speculation in the overlap loop: row positions holding slots reserved ahead (0: none;
        # managers/spec_overlap.py). Everything a request holds is [0, max(this, kv_committed_len)).
        self.kv_allocated_len = 0
        # Chunks of this request's prefill whose results are still to process (SGLang's
        # `is_chunked`, a counter): the token sampled after a middle chunk means nothing.
        self.pending_chunks = 0

        self.finish_status = FinishStatus()  # finished_reason, to_finish, finished_sent
        self.retraction_count = 0
        # SGLang's TimeStats (perf_counter): entering the waiting queue, the first forward
        self.wait_queue_entry_time: Optional[float] = None
        self.forward_entry_time: Optional[float] = None
        self.cached_tokens = 0  # prompt tokens served from the prefix cache (first prefill)
        self.hicache = HiCacheState()  # last_host_node, host_hit_length, loaded_{host,storage}_tokens
        # cached_tokens by tier (device, HiCache's host and storage)
        self.cached_tokens_details: Dict[str, int] = {"device": 0, "host": 0, "storage": 0}
        self.already_computed = 0
        self.send_token_offset = 0  # output tokens already streamed out
        # Structured output: the grammar matcher (a Future while it compiles in the grammar
        # queue), its cache key, and when it entered the grammar queue (--grammar-timeout).
        self.grammar: Any = None
        self.grammar_key: Optional[tuple] = None
        self.grammar_queued_at = 0.0

        # Input logprobs, SGLang's convention: one entry per prompt token j >= logprob_start_len,
        # the first None (whatever the start), then the logprob of token j given the tokens < j.
        # Filled chunk by chunk (add_input_logprob_head puts the None first).
        self.input_token_logprobs_val: List[Optional[float]] = []
        self.input_token_logprobs_idx: List[int] = []
        self.input_logprob_send_offset = 0
        self.output_token_logprobs_val: List[float] = []
        self.output_token_logprobs_idx: List[int] = []
        self.output_top_logprobs_val: List[List[float]] = []
        self.output_top_logprobs_idx: List[List[int]] = []
        self.token_ids_logprob: Optional[List[int]] = None  # SGLang's: these ids' logprobs at each output position
        self.output_token_ids_logprobs_val: List[List[float]] = []
        self.output_token_ids_logprobs_idx: List[List[int]] = []
        # ... and at prompt positions (logprob_start_len), in step with input_token_logprobs_*
        self.input_token_ids_logprobs_val: List[Optional[List[float]]] = []
        self.input_token_ids_logprobs_idx: List[Optional[List[int]]] = []
        # ... and the top_logprobs_num best tokens there (SGLang's input_top_logprobs)
        self.input_top_logprobs_val: List[Optional[List[float]]] = []
        self.input_top_logprobs_idx: List[Optional[List[int]]] = []
        # return_hidden_states: row j is the final hidden state output token j was sampled from
        self.return_hidden_states = False
        self.hidden_states: List[List[float]] = []
        # input_embeds: the prompt's embeddings [len(origin_input_ids), hidden] (its ids are placeholders)
        self.input_embeds: Optional[torch.Tensor] = None

        self.disagg = DisaggState(bootstrap_host, bootstrap_port, bootstrap_room)  # PD: bootstrap_*, disagg_*
        self.spec_stats = SpecStats()  # speculative decoding: spec_verify_ct, spec_num_*_drafts

    @classmethod
    def from_tokenized(cls, recv: Any, eos_token_ids: Iterable[int], vocab_size: int, tokenizer: Any) -> "Req":
        """The scheduler's Req for a TokenizedGenerateReqInput."""
        req = cls(
            recv.rid, recv.input_text, recv.input_ids, recv.sampling_params,
            return_logprob=recv.return_logprob, top_logprobs_num=recv.top_logprobs_num,
            logprob_start_len=recv.logprob_start_len, stream=recv.stream, priority=recv.priority,
            eos_token_ids=set(eos_token_ids), vocab_size=vocab_size, tokenizer=tokenizer,
            bootstrap_host=recv.bootstrap_host, bootstrap_port=recv.bootstrap_port, bootstrap_room=recv.bootstrap_room,
            lora_path=getattr(recv, "lora_path", None),
            multimodal_inputs=getattr(recv, "mm_inputs", None),
        )
        req.custom_logit_processor = getattr(recv, "custom_logit_processor", None)
        req.token_ids_logprob = getattr(recv, "token_ids_logprob", None)
        req.return_hidden_states = bool(getattr(recv, "return_hidden_states", False))
        req.input_embeds = getattr(recv, "input_embeds", None)
        return req

    # ---- state ---------------------------------------------------------------------------
    def finished(self) -> bool:
        return self.finish_status.reason is not None

    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and 0 <= self.logprob_start_len < len(self.origin_input_ids)

    def next_input_logprob_token(self) -> int:
        """The next prompt token whose logprob is still to compute: the one at
        logprob_start_len gets None (SGLang's convention), so the first is the one after it."""
        return self.logprob_start_len + max(len(self.input_token_logprobs_idx), 1)

    def input_logprobs_pending(self) -> bool:
        """Input logprobs still to compute or to head with their None (a prefill to come)."""
        return self.wants_input_logprobs() and (
            not self.input_token_logprobs_idx or self.next_input_logprob_token() < len(self.origin_input_ids))

    def add_input_logprob_head(self) -> None:
        """The None entry of the token at logprob_start_len, first in every input list asked for
        (SGLang: `[None] + logprobs[:-1]`). An image's pad value is reported as 0, as SGLang does."""
        token = self.origin_input_ids[self.logprob_start_len]
        if self.vocab_size is not None and token >= self.vocab_size:
            token = 0
        self.input_token_logprobs_val.append(None)
        self.input_token_logprobs_idx.append(token)
        if self.top_logprobs_num > 0:
            self.input_top_logprobs_val.append(None)
            self.input_top_logprobs_idx.append(None)
        if self.token_ids_logprob is not None:
            self.input_token_ids_logprobs_val.append(None)
            self.input_token_ids_logprobs_idx.append(None)

    def input_logprob_positions(self, prefix_len: int, extend_len: int) -> range:
        """Positions of this round whose logits score prompt tokens still to compute (the
        logits at position q give token q+1's logprob)."""
        if not self.wants_input_logprobs():
            return range(0)
        start = self.next_input_logprob_token() - 1
        return range(max(start, prefix_len), min(prefix_len + extend_len, len(self.origin_input_ids) - 1))

    def check_invariants(self) -> None:
        assert 0 <= len(self.prefix_indices) <= self.kv_committed_len <= self.seqlen() + 1, (
            f"{self!r}: prefix {len(self.prefix_indices)}, kv_committed_len {self.kv_committed_len}")
        assert 0 <= self.send_token_offset <= len(self.output_ids) and self.pending_chunks >= 0, repr(self)
        assert not self.finished_sent or self.finished(), repr(self)

    def clipped_max_new_tokens(self) -> int:
        """max_new_tokens capped at CLIP_MAX_NEW_TOKENS: the decode room admission reserves.
        (0, a prompt that fills the context but one token, reserves nothing: it was reserved as
        the clip, which a small pool never held, so the request waited forever.)"""
        return min(self._max_new_or_clip(), CLIP_MAX_NEW_TOKENS)

    def clipped_remaining_new_tokens(self) -> int:
        """Output tokens still to come, capped the same way (a running request's reserve)."""
        return min(self._max_new_or_clip() - len(self.output_ids), CLIP_MAX_NEW_TOKENS)

    def _max_new_or_clip(self) -> int:
        max_new = self.sampling_params.max_new_tokens
        return CLIP_MAX_NEW_TOKENS if max_new is None else max_new

    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def init_next_round_input(self, tree_cache: Any = None) -> None:
        """fill_ids = everything so far; match the longest cached prefix (at least one token
        is always left to compute, since its logits give the next token). `tree_cache`: what
        answers match_prefix (the scheduler's KVLedger, or a prefix cache itself)."""
        self.fill_ids = self.origin_input_ids + self.output_ids
        self.last_host_node, self.host_hit_length = None, 0
        self.loaded_host_tokens = self.loaded_storage_tokens = 0
        if tree_cache is not None:
            max_prefix_len = len(self.fill_ids) - 1
            if self.input_logprobs_pending():
                # the logits at position j-1 give token j's logprob: compute from there
                max_prefix_len = min(max_prefix_len, self.next_input_logprob_token() - 1)
            # only prefixes computed under this request's adapter (lora_path; None = base)
            match = tree_cache.match_prefix(self.fill_ids[: max(max_prefix_len, 0)], self.lora_path)
            self.prefix_indices, self.last_node = match.device_indices, match.last_device_node
            self.last_host_node, self.host_hit_length = match.last_host_node, match.host_hit_length
        self.extend_input_len = len(self.fill_ids) - len(self.prefix_indices)

    def count_cached_tokens(self, num_tokens: int) -> None:
        """`num_tokens` more cached prompt tokens: those loaded back this round are the tail of
        the prefix (tier host, or storage where the storage tier supplied them), the rest was
        on the device."""
        host = min(num_tokens, self.loaded_host_tokens)
        storage = min(host, self.loaded_storage_tokens)
        self.cached_tokens += num_tokens
        details = self.cached_tokens_details
        details["device"] += num_tokens - host
        details["host"] += host - storage
        details["storage"] += storage
        self.loaded_host_tokens = self.loaded_storage_tokens = 0

    def reset_for_retract(self) -> None:
        """Back to the waiting queue: its KV is gone, the outputs so far are kept."""
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None
        self.extend_input_len = 0
        self.req_pool_idx = None  # (the ledger's release gave its row and lengths back)
        self.pending_chunks = 0
        self.retraction_count += 1

    # ---- finish conditions (seed 001 §22, in this order) ---------------------------------
    def check_finished(self) -> None:
        if self.finished():
            return
        if self.to_finish is not None:
            self.finished_reason, self.to_finish = self.to_finish, None
            return
        max_new = self.sampling_params.max_new_tokens
        if max_new is not None and len(self.output_ids) >= max_new:
            self.finished_reason = FINISH_LENGTH(length=max_new)
            return
        if self.grammar is not None and self.grammar.is_terminated():
            self.finished_reason = FINISH_MATCHED_TOKEN(matched=self.output_ids[-1])
            return
        if not self.output_ids:
            return
        last = self.output_ids[-1]
        if last in self.eos_token_ids and len(self.output_ids) > self.sampling_params.min_new_tokens - 1:
            self.finished_reason = FINISH_MATCHED_TOKEN(matched=last)
            return
        if self.vocab_size is not None and not 0 <= last < self.vocab_size:
            # A NaN in the logits makes an impossible token: stop instead of emitting it.
            if self.eos_token_ids:
                self.output_ids[-1] = min(self.eos_token_ids)
            self.finished_reason = FINISH_MATCHED_STR(matched="NaN happened")
            return
        self._check_str_based_finish()

    def _check_str_based_finish(self) -> None:
        sp = self.sampling_params
        if not (sp.stop_strs or sp.stop_regex_strs) or self.tokenizer is None:
            return
        if sp.stop_strs:
            tail = self.tokenizer.decode(self.output_ids[-(sp.stop_str_max_len + 1) :])
            for stop in sp.stop_strs:
                if stop in tail:
                    self.finished_reason = FINISH_MATCHED_STR(matched=stop)
                    return
        if sp.stop_regex_strs:
            text = self.tokenizer.decode(self.output_ids)
            for pattern in sp.stop_regex_strs:
                try:  # a pathological pattern ((a+)+b) must not stall the scheduler: a time limit
                    matched = regex.search(pattern, text, timeout=STOP_REGEX_TIMEOUT_S)
                except TimeoutError:
                    self.finished_reason = FINISH_ABORT(
                        f"stop_regex {pattern!r} took over {STOP_REGEX_TIMEOUT_S * 1000:g} ms to match the output "
                        f"(catastrophic backtracking?); the request is ended.", status_code=400, err_type="BadRequestError")
                    return
                if matched:
                    self.finished_reason = FINISHED_MATCHED_REGEX(matched=pattern)
                    return

    @property
    def queue_time(self) -> Optional[float]:
        """Seconds from the waiting queue to the first forward (None until both happened)."""
        if self.wait_queue_entry_time is None or self.forward_entry_time is None:
            return None
        return max(self.forward_entry_time - self.wait_queue_entry_time, 0.0)

    def __repr__(self) -> str:
        return f"Req(rid={self.rid}, input_len={len(self.origin_input_ids)}, output_len={len(self.output_ids)})"


# ---- ScheduleBatch ---------------------------------------------------------------------------
@dataclass
class ScheduleBatch:
    """A batch of Reqs on the scheduler's side (CPU lists + the tensors of the next forward).
    prepare_for_extend / prepare_for_decode allocate KV slots and build the inputs;
    filter_batch / merge_batch / retract_decode change who is in it; get_model_worker_batch
    hands the worker what it needs.

    Invariant after each prepare (check_invariants): one row per request, and the batch's
    seq_lens_cpu[i] is reqs[i]'s kv_committed_len (the tokens with KV in the pool)."""

    reqs: List[Req]
    ledger: Optional[KVLedger] = None  # rows, slots and tree locks: all KV goes through it
    tree_cache: Optional[BasePrefixCache] = None  # (read: prefix matching)
    vocab_size: int = 0
    device: str = "cpu"
    forward_mode: Optional[ForwardMode] = None
    batch_is_full: bool = False

    input_ids: Optional[torch.Tensor] = None
    req_pool_indices: Optional[torch.Tensor] = None
    seq_lens: Optional[torch.Tensor] = None
    seq_lens_cpu: List[int] = field(default_factory=list)
    out_cache_loc: Optional[torch.Tensor] = None
    # The last sampled token of each request (decode input); filled by the scheduler.
    output_ids: Optional[torch.Tensor] = None
    prefix_lens: List[int] = field(default_factory=list)
    extend_lens: List[int] = field(default_factory=list)
    extend_num_tokens: int = 0
    sampling_info: Optional[SamplingBatchInfo] = None
    return_logprob: bool = False
    top_logprobs_nums: List[int] = field(default_factory=list)
    # Input logprobs: flat token positions to score, the prompt tokens they score, per-req counts.
    input_logprob_positions: Optional[torch.Tensor] = None
    input_logprob_token_ids: Optional[torch.Tensor] = None
    input_logprob_counts: List[int] = field(default_factory=list)
    # ... token_ids_logprob there: [positions, k] the ids each position scores (see ModelWorkerBatch)
    input_token_ids_logprob_ids: Optional[torch.Tensor] = None
    input_top_logprobs_k: int = 0  # ... top_logprobs_num there (the batch's largest)
    # input_embeds: the flat rows of input_ids whose embeddings are given, and those embeddings
    input_embeds_rows: Optional[torch.Tensor] = None
    input_embeds: Optional[torch.Tensor] = None
    # Mixed chunk: the running requests that decode inside this extend batch.
    decoding_reqs: Optional[List[Req]] = None
    chunked_req: Optional[Req] = None
    # Overlap mode: the ForwardThread that samples with sampling_info. Changes to
    # sampling_info (filter / merge) are queued there, after the forwards already in flight.
    forward_thread: Any = None
    # Speculative decoding: drafts a decode step may add per request (the memory check counts their slots).
    spec_max_drafts: int = 0
    # ... in the overlap loop: slots reserved ahead, the step's input for the forward thread (spec_overlap.py)
    spec_overlap: bool = False
    spec_overlap_input: Any = None

    @classmethod
    def init_new(cls, reqs: List[Req], ledger: KVLedger, vocab_size: int, device: str = "cpu", chunked_req: Optional[Req] = None,
                 forward_thread: Any = None, spec_max_drafts: int = 0, spec_overlap: bool = False) -> "ScheduleBatch":
        return cls(
            reqs=reqs,
            ledger=ledger,
            tree_cache=ledger.tree_cache,
            vocab_size=vocab_size,
            device=device,
            return_logprob=any(r.return_logprob for r in reqs),
            chunked_req=chunked_req,
            forward_thread=forward_thread,
            spec_max_drafts=spec_max_drafts,
            spec_overlap=spec_overlap,
        )

    def copy(self) -> "ScheduleBatch":
        """What processing this batch's result needs, detached from later filter/merge."""
        return ScheduleBatch(
            reqs=list(self.reqs), forward_mode=self.forward_mode, decoding_reqs=self.decoding_reqs,
            return_logprob=self.return_logprob, ledger=self.ledger, tree_cache=self.tree_cache, device=self.device,
            input_logprob_counts=self.input_logprob_counts,
        )

    def _sampling_op(self, fn, *args) -> None:
        if self.forward_thread is None:
            fn(*args)
        else:
            self.forward_thread.submit(fn, *args)

    def batch_size(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return len(self.reqs) == 0

    # ---- memory (all through the ledger) -------------------------------------------------------
    def alloc_token_slots(self, num_tokens: int) -> torch.Tensor:
        return self.ledger.alloc_slots(num_tokens)

    def alloc_slots_after(self, prefix_lens: List[int], seq_lens: List[int]) -> torch.Tensor:
        """Slots for tokens prefix_len..seq_len-1 of each request, whose row already holds the
        slots before them (speculative drafts after the decode token): concatenated."""
        return self.ledger.reserve(prefix_lens, seq_lens, self._last_locs(prefix_lens))

    def _last_locs(self, prefix_lens: List[int]) -> List[int]:
        """Slot of each request's token prefix_len-1 (-1 if none): paged alloc continues its page."""
        return self.ledger.last_locs(self.reqs, prefix_lens)

    # ---- extend ------------------------------------------------------------------------------
    def prepare_for_extend(self) -> None:
        """Rows for new requests, slots for the tokens to compute, and req_to_token filled in."""
        self.forward_mode = ForwardMode.EXTEND
        reqs = self.reqs
        now = time.perf_counter()
        for r in reqs:
            if r.forward_entry_time is None:  # the first chunk ends its queue time (not a retraction's rerun)
                r.forward_entry_time = now
        new_rows = [r for r in reqs if r.req_pool_idx is None]
        if new_rows:
            rows = self.ledger.alloc_rows(len(new_rows))
            if rows is None:
                raise RuntimeError("req_to_token_pool is full; max_running_requests is too large")
            for r, row in zip(new_rows, rows):
                r.req_pool_idx = row
            self.ledger.restore_prefix_states(new_rows)  # a hybrid model's cached prefix: its state too
        self.prefix_lens = [len(r.prefix_indices) for r in reqs]
        self.extend_lens = [r.extend_input_len for r in reqs]
        self.seq_lens_cpu = [len(r.fill_ids) for r in reqs]
        self.extend_num_tokens = sum(self.extend_lens)
        # The cached prefix goes into the row first (a paged alloc reads the last prefix slot).
        cached = [(r, p) for r, p in zip(reqs, self.prefix_lens) if p > 0]
        if cached:
            self.ledger.write_spans([r.req_pool_idx for r, _ in cached], [0] * len(cached),
                                    [p for _, p in cached], torch.cat([r.prefix_indices for r, _ in cached]))
        out_cache_loc = self.ledger.reserve(self.prefix_lens, self.seq_lens_cpu, self._last_locs(self.prefix_lens))
        self.ledger.write_spans([r.req_pool_idx for r in reqs], self.prefix_lens, self.extend_lens, out_cache_loc)
        for r in reqs:
            # Only prefix hits beyond what this request computed itself count as cached.
            r.count_cached_tokens(max(len(r.prefix_indices) - r.already_computed, 0))
            r.already_computed = len(r.fill_ids)
            self.ledger.advance(r, len(r.fill_ids))
            r.check_invariants()
        new_tokens = itertools.chain.from_iterable(r.fill_ids[p:] for r, p in zip(reqs, self.prefix_lens))
        self.input_ids = torch.tensor(list(new_tokens), dtype=torch.int64)
        self.req_pool_indices = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        self.seq_lens = torch.tensor(self.seq_lens_cpu, dtype=torch.int64)
        self.out_cache_loc = out_cache_loc
        self.top_logprobs_nums = [r.top_logprobs_num for r in reqs]
        self.sampling_info = SamplingBatchInfo.from_reqs(reqs, self.vocab_size, self.device)
        self._prepare_input_logprobs()
        self._prepare_input_embeds()

    def _prepare_input_logprobs(self) -> None:
        if not any(r.input_logprobs_pending() for r in self.reqs):
            return
        positions, token_ids, counts, offset = [], [], [], 0
        for r, p, n in zip(self.reqs, self.prefix_lens, self.extend_lens):
            pos = r.input_logprob_positions(p, n)
            positions += [offset + q - p for q in pos]
            token_ids += [r.origin_input_ids[q + 1] for q in pos]
            counts.append(len(pos))
            offset += n
        self.input_logprob_positions = torch.tensor(positions, dtype=torch.int64)
        self.input_logprob_token_ids = torch.tensor(token_ids, dtype=torch.int64)
        self.input_logprob_counts = counts
        asked = [(r.token_ids_logprob or []) if r.wants_input_logprobs() else [] for r in self.reqs]
        width = max(len(a) for a in asked)
        if width:  # token_ids_logprob at prompt positions: each position's row of ids, padded with 0
            rows = [a + [0] * (width - len(a)) for a, c in zip(asked, counts) for _ in range(c)]
            self.input_token_ids_logprob_ids = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), width)
        # top_logprobs_num at prompt positions: the widest asked; each request keeps its own k
        self.input_top_logprobs_k = max((r.top_logprobs_num for r, c in zip(self.reqs, counts) if c), default=0)

    def _prepare_input_embeds(self) -> None:
        """input_embeds: this round's prompt positions [prefix_len, min(seq_len, prompt_len)) of
        each such request take its embeddings (a retraction's re-prefill of its output tokens
        embeds their ids as usual)."""
        rows, embeds, offset = [], [], 0
        for r, p, n in zip(self.reqs, self.prefix_lens, self.extend_lens):
            end = min(p + n, len(r.origin_input_ids))
            if r.input_embeds is not None and end > p:
                rows.append(torch.arange(offset, offset + end - p, dtype=torch.int64))
                embeds.append(r.input_embeds[p:end])
            offset += n
        self.input_embeds_rows = torch.cat(rows) if rows else None
        self.input_embeds = torch.cat(embeds) if embeds else None

    def mix_with_running(self, running_batch: "ScheduleBatch") -> None:
        """--enable-mixed-chunk: append the decode requests (already prepared for decode)
        to this extend batch as extend requests of length 1."""
        self.forward_mode = ForwardMode.MIXED
        running_bs = running_batch.batch_size()
        for r in running_batch.reqs:
            r.fill_ids = r.origin_input_ids + r.output_ids
            r.extend_input_len = 1
        self.input_ids = torch.cat([self.input_ids, running_batch.input_ids])
        self.out_cache_loc = torch.cat([self.out_cache_loc, running_batch.out_cache_loc])
        self.req_pool_indices = torch.cat([self.req_pool_indices, running_batch.req_pool_indices])
        self.seq_lens = torch.cat([self.seq_lens, running_batch.seq_lens])
        self.seq_lens_cpu = self.seq_lens_cpu + running_batch.seq_lens_cpu
        self.prefix_lens = self.prefix_lens + [s - 1 for s in running_batch.seq_lens_cpu]
        self.extend_lens = self.extend_lens + [1] * running_bs
        self.extend_num_tokens += running_bs
        self.reqs = self.reqs + running_batch.reqs
        self.top_logprobs_nums = self.top_logprobs_nums + running_batch.top_logprobs_nums
        self._sampling_op(self.sampling_info.merge_batch, running_batch.sampling_info)
        self.return_logprob = self.return_logprob or running_batch.return_logprob

    # ---- decode ------------------------------------------------------------------------------
    def new_tokens_next_decode(self, indices: Optional[List[int]] = None) -> int:
        """Slots the next decode step needs (whole new pages when page_size > 1; with
        speculative decoding, room for each request's drafts too)."""
        ps = self.ledger.page_size
        if self.spec_overlap:
            reqs = self.reqs if indices is None else [self.reqs[i] for i in indices]
            return spec_overlap.new_slots_needed(reqs, self.spec_max_drafts, self.ledger.row_width, ps)
        lens = self.seq_lens_cpu if indices is None else [self.seq_lens_cpu[i] for i in indices]
        if ps == 1:
            return len(lens) * (1 + self.spec_max_drafts)
        if self.spec_max_drafts:  # tokens seq_len .. seq_len + drafts: the new pages they reach
            return sum(ps * (-(-(n + 1 + self.spec_max_drafts) // ps) - -(-n // ps)) for n in lens)
        # The next token goes at position seq_len; it starts a new page when that is aligned.
        return sum(ps for n in lens if n % ps == 0)

    def check_decode_mem(self, indices: Optional[List[int]] = None) -> bool:
        return self.ledger.make_room(self.new_tokens_next_decode(indices))

    def prepare_for_decode(self) -> None:
        """One new slot per request, written at req_to_token[row, seq_len]; seq_lens += 1."""
        if self.spec_overlap:
            return spec_overlap.prepare_decode(self)
        self.forward_mode = ForwardMode.DECODE
        self.input_ids = self.output_ids
        self.output_ids = None
        locs_before = self.seq_lens_cpu  # the new token's position in the row
        self.out_cache_loc = self.ledger.reserve(locs_before, [s + 1 for s in locs_before], self._last_locs(locs_before))
        self.ledger.write_at(self.req_pool_indices, self.seq_lens, self.out_cache_loc)
        self.seq_lens = self.seq_lens + 1
        self.seq_lens_cpu = [s + 1 for s in self.seq_lens_cpu]
        for r in self.reqs:
            self.ledger.advance(r, r.kv_committed_len + 1)
        self.check_invariants()

    def check_invariants(self) -> None:
        assert len(self.seq_lens_cpu) == len(self.reqs), (len(self.seq_lens_cpu), len(self.reqs))
        for r, n in zip(self.reqs, self.seq_lens_cpu):
            assert r.req_pool_idx is not None and r.kv_committed_len == n, (r, n)

    def release_req(self, req: Req) -> None:
        """Free everything a running request holds that the tree does not (retract / preempt).
        Its prefix stays in the tree, unlocked (evictable)."""
        self.ledger.release(req)
        req.reset_for_retract()

    def retract_decode(self, priority_key: Optional[Callable[["Req"], int]] = None) -> tuple:
        """Seed 001 §9: retract requests until the rest can decode; least progress first
        (fewest output tokens, then longest prompt), and with priority scheduling (§9.2,
        priority_key: larger is worse) the worst priority before that. Returns (retracted,
        new_token_ratio, reqs_to_abort): the last request left, when it alone still has no room
        for its next token (it outgrew the whole pool), is finished with an abort, its KV given
        to the tree, instead of being retracted (and readmitted, and retracted) forever."""
        def worth_keeping(i: int) -> tuple:
            r = self.reqs[i]
            return (-priority_key(r) if priority_key else 0, len(r.output_ids), -len(r.origin_input_ids))

        order = sorted(range(len(self.reqs)), key=worth_keeping, reverse=True)
        retracted: List[Req] = []
        first = True
        while first or not self.check_decode_mem(order):
            if len(order) == 1:
                break  # the last request stays: the check above evicted all it could
            first = False
            req = self.reqs[order.pop()]
            self.release_req(req)
            retracted.append(req)
            # The tree part just unlocked is evictable now; use it for the remaining requests.
            self.ledger.make_room(len(order) * RETRACT_DECODE_STEPS)
        reqs_to_abort: List[Req] = []
        if len(order) == 1 and not self.check_decode_mem(order):
            need = self.new_tokens_next_decode(order)
            req = self.reqs[order.pop()]
            if req.seqlen() + need <= self.ledger.total_size():
                # It fits the pool alone: other batches (PP's micro-batches, a chunked prefill)
                # hold the rest now, so it waits in the queue like any retracted request.
                self.release_req(req)
                retracted.append(req)
            else:
                req.finished_reason = FINISH_ABORT(
                    f"The request needs more KV cache than the whole pool holds ({req.seqlen()} tokens so far, "
                    f"pool {self.ledger.total_size()}): lower max_new_tokens or raise --max-total-tokens.",
                    status_code=500, err_type="InternalServerError")
                req.grammar = None
                if req.kv_allocated_len:  # slots reserved ahead (speculation in the overlap loop) go back first
                    self.ledger.commit(req, req.kv_committed_len)
                self.ledger.cache_finished_req(req)
                reqs_to_abort.append(req)
        self.filter_batch(keep_indices=sorted(order))
        decoded = sum(len(r.output_ids) for r in self.reqs)
        max_new = sum(r.clipped_max_new_tokens() for r in self.reqs)
        new_ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(self.reqs)) / (max_new + 1))
        return retracted, new_ratio, reqs_to_abort

    # ---- filter / merge ----------------------------------------------------------------------
    def filter_batch(self, keep_indices: Optional[List[int]] = None, chunked_req_to_exclude: Optional[List[Req]] = None) -> None:
        if keep_indices is None:
            exclude = set(id(r) for r in (chunked_req_to_exclude or []))
            keep_indices = [i for i, r in enumerate(self.reqs) if not r.finished() and id(r) not in exclude]
        if len(keep_indices) == len(self.reqs):
            return
        self.reqs = [self.reqs[i] for i in keep_indices]
        if not keep_indices:
            self.reqs = []
            self.seq_lens_cpu = []
            self.sampling_info = None
            self.output_ids = None
            return
        idx = torch.tensor(keep_indices, dtype=torch.int64)
        self.req_pool_indices = self.req_pool_indices[idx]
        self.seq_lens = self.seq_lens[idx]
        self.seq_lens_cpu = [self.seq_lens_cpu[i] for i in keep_indices]
        if self.output_ids is not None:
            self.output_ids = self.output_ids[idx]
        self.top_logprobs_nums = [self.top_logprobs_nums[i] for i in keep_indices]
        self.return_logprob = any(r.return_logprob for r in self.reqs)
        if self.sampling_info is not None:
            self._sampling_op(self.sampling_info.filter_batch, keep_indices)

    def merge_batch(self, other: "ScheduleBatch") -> None:
        if other.is_empty():
            return
        if self.is_empty():
            self.reqs = list(other.reqs)
            self.req_pool_indices, self.seq_lens = other.req_pool_indices, other.seq_lens
            self.seq_lens_cpu = list(other.seq_lens_cpu)
            self.output_ids = other.output_ids
            self.top_logprobs_nums = list(other.top_logprobs_nums)
            self.sampling_info = other.sampling_info
            self.return_logprob = other.return_logprob
            return
        self._sampling_op(self.sampling_info.merge_batch, other.sampling_info)
        self.req_pool_indices = torch.cat([self.req_pool_indices, other.req_pool_indices])
        self.seq_lens = torch.cat([self.seq_lens, other.seq_lens])
        self.seq_lens_cpu = self.seq_lens_cpu + other.seq_lens_cpu
        self.output_ids = torch.cat([self.output_ids, other.output_ids])
        self.top_logprobs_nums = self.top_logprobs_nums + other.top_logprobs_nums
        self.reqs = self.reqs + other.reqs
        self.return_logprob = self.return_logprob or other.return_logprob

    def get_model_worker_batch(self) -> ModelWorkerBatch:
        extend = self.forward_mode.is_extend()
        return ModelWorkerBatch(
            forward_mode=self.forward_mode,
            input_ids=self.input_ids,
            req_pool_indices=self.req_pool_indices,
            seq_lens=self.seq_lens,
            out_cache_loc=self.out_cache_loc,
            seq_lens_cpu=list(self.seq_lens_cpu),
            extend_seq_lens=list(self.extend_lens) if extend else None,
            extend_prefix_lens=list(self.prefix_lens) if extend else None,
            sampling_info=self.sampling_info,
            return_logprob=self.return_logprob,
            top_logprobs_nums=list(self.top_logprobs_nums) if self.return_logprob else None,
            token_ids_logprobs=[r.token_ids_logprob for r in self.reqs] if self.return_logprob and any(
                r.token_ids_logprob is not None for r in self.reqs) else None,
            input_logprob_positions=self.input_logprob_positions if extend else None,
            input_logprob_token_ids=self.input_logprob_token_ids if extend else None,
            lora_paths=[r.lora_path for r in self.reqs],
            multimodal_inputs=self.multimodal_inputs(),
            mamba_state_slots=self.ledger.state_slots(self.req_pool_indices),
            swa_locs=self.ledger.swa_forward_locs(self.req_pool_indices, self.prefix_lens if extend else
                                                  [s - 1 for s in self.seq_lens_cpu], self.seq_lens_cpu,
                                                  self.out_cache_loc),
            return_hidden_states=any(r.return_hidden_states for r in self.reqs),
            input_token_ids_logprob_ids=self.input_token_ids_logprob_ids if extend else None,
            input_top_logprobs_k=self.input_top_logprobs_k if extend else 0,
            input_embeds_rows=self.input_embeds_rows if extend else None,
            input_embeds=self.input_embeds if extend else None,
        )

    def multimodal_inputs(self) -> Optional[List[Any]]:
        """Each request's images for the model (their M-RoPE positions in decode too); None
        when no request has any, which keeps text batches as they were."""
        mm = [r.multimodal_inputs for r in self.reqs]
        return mm if any(m is not None for m in mm) else None
