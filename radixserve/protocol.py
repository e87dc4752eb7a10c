"""Messages between the TokenizerManager, the Scheduler and the Detokenizer (SGLang's io_struct).
Plain dataclasses: pickled over ZeroMQ in the served runtime, passed as objects in-process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from radixserve.sampling_params import SamplingParams

# The per-request logprob lists a BatchTokenIDOutput / BatchStrOutput carries, in this order.
LOGPROB_KEYS = (
    "input_token_logprobs_val", "input_token_logprobs_idx", "output_token_logprobs_val",
    "output_token_logprobs_idx", "output_top_logprobs_val", "output_top_logprobs_idx",
)


@dataclass
class TokenizedGenerateReqInput:
    rid: str
    input_text: Optional[str]
    input_ids: List[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    priority: Optional[int] = None
    # PD disaggregation: the prefill server's bootstrap address and this request's room there
    # (sglang-router fills them in and sends the request to both servers).
    bootstrap_host: Optional[str] = None
    bootstrap_port: Optional[int] = None
    bootstrap_room: Optional[int] = None


@dataclass
class BatchTokenizedGenerateReqInput:
    batch: List[TokenizedGenerateReqInput]


@dataclass
class AbortReq:
    rid: str = ""
    abort_all: bool = False


# Control queries carry an id their reply echoes, so a reply is matched to its query even when
# an earlier query timed out and its reply arrives late.
@dataclass
class FlushCacheReqInput:
    query_id: str = ""


@dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""
    query_id: str = ""


@dataclass
class GetInternalStateReq:
    query_id: str = ""


@dataclass
class GetInternalStateReqOutput:
    internal_state: Dict[str, Any]
    query_id: str = ""


@dataclass
class SchedulerHeartbeat:
    """Rank 0 of a scheduler sends one about every second while its loop turns (/health)."""

    dp_rank: int = 0


@dataclass
class BatchTokenIDOutput:
    """Per step, for every request with something to report: its new output tokens since the
    last message (decode_ids), and when finished, why."""

    rids: List[str]
    finished_reasons: List[Optional[Dict[str, Any]]]
    decode_ids: List[List[int]]  # new output token ids of each request
    output_ids_len: List[int]  # total output tokens so far
    prompt_tokens: List[int]
    completion_tokens: List[int]
    cached_tokens: List[int]
    skip_special_tokens: List[bool]
    spaces_between_special_tokens: List[bool]
    no_stop_trim: List[bool]
    output_token_logprobs_val: List[List[float]] = field(default_factory=list)
    output_token_logprobs_idx: List[List[int]] = field(default_factory=list)
    input_token_logprobs_val: List[List[Optional[float]]] = field(default_factory=list)
    input_token_logprobs_idx: List[List[int]] = field(default_factory=list)
    output_top_logprobs_val: List[List[List[float]]] = field(default_factory=list)
    output_top_logprobs_idx: List[List[List[int]]] = field(default_factory=list)
    retraction_counts: List[int] = field(default_factory=list)


# ---- served runtime ---------------------------------------------------------------
@dataclass
class GenerateReqInput:
    """The body of POST /generate (SGLang's field names). One prompt or a batch: `text` (str or
    list of str) or `input_ids` (list of int, or list of lists); per-prompt lists are allowed
    for `sampling_params`, `rid` and `return_logprob`."""

    text: Optional[Any] = None
    input_ids: Optional[Any] = None
    sampling_params: Optional[Any] = None
    rid: Optional[Any] = None
    return_logprob: Optional[Any] = None
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    priority: Optional[int] = None
    session_params: Optional[Dict[str, Any]] = None
    bootstrap_host: Optional[Any] = None  # str, or one per prompt of a batch
    bootstrap_port: Optional[Any] = None
    bootstrap_room: Optional[Any] = None


@dataclass
class BatchStrOutput:
    """Detokenizer -> TokenizerManager: per request, the text that became final since the last
    message. The request's text is `text[:text_offsets[i]] + output_strs[i]`; the offset is the
    text length sent so far, except when a finished request's stop string is trimmed off text
    that was already sent (then it is shorter)."""

    rids: List[str]
    finished_reasons: List[Optional[Dict[str, Any]]]
    output_strs: List[str]
    text_offsets: List[int]
    output_ids: List[List[int]]  # new output token ids of each request
    prompt_tokens: List[int]
    completion_tokens: List[int]
    cached_tokens: List[int]
    input_token_logprobs_val: List[List[Optional[float]]] = field(default_factory=list)
    input_token_logprobs_idx: List[List[int]] = field(default_factory=list)
    output_token_logprobs_val: List[List[float]] = field(default_factory=list)
    output_token_logprobs_idx: List[List[int]] = field(default_factory=list)
    output_top_logprobs_val: List[List[List[float]]] = field(default_factory=list)
    output_top_logprobs_idx: List[List[List[int]]] = field(default_factory=list)
    retraction_counts: List[int] = field(default_factory=list)


@dataclass
class OpenSessionReqInput:
    # SGLang clients send it; a session here is bounded by the model's context length instead.
    capacity_of_str_len: int = 8192
    session_id: Optional[str] = None


@dataclass
class CloseSessionReqInput:
    session_id: str = ""


@dataclass
class SessionParams:
    """`session_params` of a generate request: continue request `rid` of session `id` (default:
    its last request), keeping its first `offset` tokens (default: all of them)."""

    id: str = ""
    rid: Optional[str] = None
    offset: Optional[int] = None


@dataclass
class SchedulerLoad:
    """A data-parallel replica's load, reported to the DataParallelController when it changes."""

    dp_rank: int
    num_reqs: int  # waiting + running
