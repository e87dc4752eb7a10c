"""Messages between the TokenizerManager, the Scheduler and the Detokenizer (SGLang's io_struct).
Plain dataclasses: pickled over ZeroMQ in the served runtime, passed as objects in-process."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from radixserve.sampling_params import SamplingParams

# The per-request logprob lists a BatchTokenIDOutput / BatchStrOutput carries, in this order.
LOGPROB_KEYS = (
    "input_token_logprobs_val", "input_token_logprobs_idx", "output_token_logprobs_val",
    "output_token_logprobs_idx", "output_top_logprobs_val", "output_top_logprobs_idx",
    "output_token_ids_logprobs_val", "output_token_ids_logprobs_idx",
    "input_token_ids_logprobs_val", "input_token_ids_logprobs_idx",
    "input_top_logprobs_val", "input_top_logprobs_idx",
)
# Speculative decoding's per-request counters (SGLang's names), in BatchTokenIDOutput and BatchStrOutput.
SPEC_KEYS = ("spec_verify_ct", "spec_num_correct_drafts", "spec_num_proposed_drafts")


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
    lora_path: Optional[str] = None  # --enable-lora: the adapter's name; None = the base model
    # /health_generate's probe (SGLang marks it by its rid; a field no HTTP body can set cannot
    # be faked by a client's rid)
    is_health_check: bool = False
    # images (multimodal.MultimodalInputs): input_ids hold each image's pad values (pad_input_ids)
    mm_inputs: Any = None
    data_parallel_rank: Optional[int] = None  # --dp-size: the replica that must serve it
    custom_logit_processor: Optional[str] = None  # a registered processor's name (custom_params: its args)
    token_ids_logprob: Optional[List[int]] = None  # with return_logprob: these ids' logprobs at each output position
    return_hidden_states: bool = False  # meta_info.hidden_states (SGLang's)
    # SGLang's input_embeds: [len(input_ids), hidden] float32 (a CPU tensor) the prefill uses instead
    # of embed_tokens(input_ids); input_ids then only hold placeholders (0) of the prompt's length
    input_embeds: Any = None


def is_health_check_generate_req(obj: Any) -> bool:
    return isinstance(obj, TokenizedGenerateReqInput) and obj.is_health_check


@dataclass
class BatchTokenizedGenerateReqInput:
    batch: List[TokenizedGenerateReqInput]


# ---- embeddings (--is-embedding: prefill only, SGLang's io_struct names) -------------------
@dataclass
class EmbeddingReqInput:
    """The body of POST /encode and what /v1/embeddings and Engine.encode make: one prompt or a
    batch, `text` (str or list of str) or `input_ids` (list of int, or list of lists)."""

    text: Optional[Any] = None
    input_ids: Optional[Any] = None
    rid: Optional[Any] = None  # str, or one per prompt of a batch
    dimensions: Optional[int] = None  # Matryoshka truncation: only the hidden size itself here
    priority: Optional[int] = None


@dataclass
class TokenizedEmbeddingReqInput:
    rid: str
    input_text: Optional[str]
    input_ids: List[int]
    priority: Optional[int] = None


@dataclass
class BatchTokenizedEmbeddingReqInput:
    batch: List[TokenizedEmbeddingReqInput]


@dataclass
class BatchEmbeddingOutput:
    """Scheduler -> TokenizerManager (no detokenizing): the embedding of each finished request
    (None when it was aborted: its finished_reason says why)."""

    rids: List[str]
    finished_reasons: List[Dict[str, Any]]
    embeddings: List[Optional[List[float]]]
    prompt_tokens: List[int]
    cached_tokens: List[int]


@dataclass
class AbortReq:
    rid: str = ""
    abort_all: bool = False
    abort_message: Optional[str] = None  # the finish reason's message; None: "Aborted by AbortReq."


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


# SGLang's POST /clear_hicache_storage_backend: remove every page of this server's storage tier
@dataclass
class ClearHiCacheReqInput:
    query_id: str = ""


@dataclass
class ClearHiCacheReqOutput:
    success: bool
    message: str = ""
    query_id: str = ""


@dataclass
class GetInternalStateReq:
    query_id: str = ""
    with_dashboard: bool = False  # /dashboard/state: add the scheduler's snapshot (managers/scheduler_dashboard.py)


@dataclass
class GetInternalStateReqOutput:
    internal_state: Dict[str, Any]
    query_id: str = ""
    with_dashboard: bool = False


# SGLang's POST /set_internal_state: scheduler settings changed at run time
@dataclass
class SetInternalStateReq:
    server_args: Dict[str, Any]
    query_id: str = ""


@dataclass
class SetInternalStateReqOutput:
    success: bool  # SGLang's `updated` (the DP controller merges `success`)
    message: str = ""
    server_args: Dict[str, Any] = field(default_factory=dict)  # the settable values now
    query_id: str = ""


@dataclass
class SchedulerHeartbeat:
    """Rank 0 of a scheduler sends one about every second while its loop turns (/health)."""

    dp_rank: int = 0


# ---- between pipeline stages (--pp-size; managers/scheduler_pp.py) ---------------------------
@dataclass
class PPBatchMessage:
    """A micro-batch going down the pipeline: what the next stage runs, and the hidden states
    (models.llama.PPProxyTensors) of the stage before. req_to_token_rows: for an EXTEND or MIXED
    batch, each request's KV slots [0, seq_len) back to back (the first stage's radix cache
    filled them; a decode step's one new slot is out_cache_loc)."""

    worker_batch: Any  # model_executor.forward_batch.ModelWorkerBatch
    proxy: Any
    req_to_token_rows: Any = None  # int32 tensor, or None for DECODE


@dataclass
class PPBatchResult:
    """The last stage's sampled tokens (tp_worker.GenerationBatchResult, logits dropped), sent
    back to the first stage, which owns the requests."""

    result: Any


@dataclass
class PPKeepAlive:
    """The first stage, idle: the other stages' receives would otherwise time out."""


@dataclass
class PPStop:
    """The first stage shuts down: each stage passes it on, then leaves the process group."""


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
    output_token_ids_logprobs_val: List[List[List[float]]] = field(default_factory=list)  # token_ids_logprob
    output_token_ids_logprobs_idx: List[List[List[int]]] = field(default_factory=list)
    # token_ids_logprob at prompt positions (logprob_start_len): None for the prompt's first token
    input_token_ids_logprobs_val: List[List[Optional[List[float]]]] = field(default_factory=list)
    input_token_ids_logprobs_idx: List[List[Optional[List[int]]]] = field(default_factory=list)
    # top_logprobs_num at prompt positions (logprob_start_len): None for the first token from there
    input_top_logprobs_val: List[List[Optional[List[float]]]] = field(default_factory=list)
    input_top_logprobs_idx: List[List[Optional[List[int]]]] = field(default_factory=list)
    # return_hidden_states: the final hidden state each new output token was sampled from
    output_hidden_states: List[List[List[float]]] = field(default_factory=list)
    retraction_counts: List[int] = field(default_factory=list)
    # seconds from the waiting queue to the first forward (SGLang's meta_info queue_time); None: not yet
    queue_times: List[Optional[float]] = field(default_factory=list)
    spec_verify_ct: List[int] = field(default_factory=list)  # SPEC_KEYS
    spec_num_correct_drafts: List[int] = field(default_factory=list)
    spec_num_proposed_drafts: List[int] = field(default_factory=list)
    # HiCache: cached_tokens by tier ({"device", "host", "storage"}), None without HiCache
    cached_tokens_details: List[Optional[Dict[str, int]]] = field(default_factory=list)


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
    lora_path: Optional[Any] = None  # an adapter name (str), or one per prompt of a batch; None = base
    is_health_check: bool = False  # set by /health_generate only (not a field of the HTTP body)
    # Images, one per image placeholder of the prompt, in order: a data URL, a file path or URL,
    # (offline) bytes or a PIL image; a list of such lists for a batch. SGLang's field.
    image_data: Optional[Any] = None
    # Where each image came from, for error messages (the chat route names the message part)
    image_labels: Optional[List[str]] = None
    data_parallel_rank: Optional[int] = None  # --dp-size: route to this replica (0-based)
    # --enable-custom-logit-processor: a registered processor's name (sampling/custom_logit_processor.py;
    # never a pickled class, as SGLang sends); its arguments are sampling_params.custom_params
    custom_logit_processor: Optional[Any] = None
    # with return_logprob: the logprobs of these token ids at each output position (a list, or
    # one list per prompt of a batch)
    token_ids_logprob: Optional[Any] = None
    # meta_info.hidden_states: the final hidden states (after the final norm) of the prompt's last
    # position and of each generated token but the last (true/false, or one per prompt of a batch)
    return_hidden_states: Any = False
    # instead of text / input_ids: the prompt's embeddings, [seq, hidden] floats (a list of such
    # for a batch); needs --disable-radix-cache, as in SGLang (the prefix cache keys on token ids)
    input_embeds: Optional[Any] = None


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
    output_token_ids_logprobs_val: List[List[List[float]]] = field(default_factory=list)  # token_ids_logprob
    output_token_ids_logprobs_idx: List[List[List[int]]] = field(default_factory=list)
    # token_ids_logprob at prompt positions (logprob_start_len): None for the prompt's first token
    input_token_ids_logprobs_val: List[List[Optional[List[float]]]] = field(default_factory=list)
    input_token_ids_logprobs_idx: List[List[Optional[List[int]]]] = field(default_factory=list)
    # top_logprobs_num at prompt positions (logprob_start_len): None for the first token from there
    input_top_logprobs_val: List[List[Optional[List[float]]]] = field(default_factory=list)
    input_top_logprobs_idx: List[List[Optional[List[int]]]] = field(default_factory=list)
    # return_hidden_states: the final hidden state each new output token was sampled from
    output_hidden_states: List[List[List[float]]] = field(default_factory=list)
    retraction_counts: List[int] = field(default_factory=list)
    # seconds from the waiting queue to the first forward (SGLang's meta_info queue_time); None: not yet
    queue_times: List[Optional[float]] = field(default_factory=list)
    spec_verify_ct: List[int] = field(default_factory=list)  # SPEC_KEYS
    spec_num_correct_drafts: List[int] = field(default_factory=list)
    spec_num_proposed_drafts: List[int] = field(default_factory=list)
    # HiCache: cached_tokens by tier ({"device", "host", "storage"}), None without HiCache
    cached_tokens_details: List[Optional[Dict[str, int]]] = field(default_factory=list)


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
class HealthCheckOutput:
    """A busy scheduler's answer to a /health_generate probe it did not queue behind its work:
    sent after the next batch's results were processed, so it proves the loop and the forward
    pass both move (seed 000's return_health_check_ct)."""

    rid: str


@dataclass
class SchedulerLoad:
    """A data-parallel replica's load, reported to the DataParallelController when it changes."""

    dp_rank: int
    num_reqs: int  # waiting + running
    num_tokens: int = 0  # KV held by running requests + waiting prompts (minimum_tokens only)


# ---- weight updates without a restart (SGLang's io_struct names and fields) --------------------
# Each reply echoes its query's query_id (see FlushCacheReqInput). A TP group answers from rank 0
# after every rank agreed; with --dp-size every replica answers and the controller merges.
@dataclass
class UpdateWeightFromDiskReqInput:
    model_path: str = ""  # a checkpoint of the same architecture and shapes
    load_format: Optional[str] = None  # None: auto (safetensors, or a .gguf file)
    abort_all_requests: bool = False  # False: in-flight requests finish first, new ones wait
    weight_version: Optional[str] = None  # set as the new weight_version on success
    query_id: str = ""


@dataclass
class UpdateWeightFromDiskReqOutput:
    success: bool
    message: str
    num_paused_requests: int = 0
    query_id: str = ""


@dataclass
class UpdateWeightsFromTensorReqInput:
    """SGLang's field carries tensors pickled per TP rank; here the (name, tensor) pairs travel
    in the message itself (pickled between our own processes only), full checkpoint tensors
    that every rank shards as its loader does."""

    named_tensors: List[Any] = field(default_factory=list)  # [(checkpoint name, torch.Tensor)]
    load_format: Optional[str] = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    query_id: str = ""


@dataclass
class UpdateWeightsFromTensorReqOutput:
    success: bool
    message: str
    query_id: str = ""


@dataclass
class InitWeightsUpdateGroupReqInput:
    """A trainer (rank 0) and every scheduler rank (rank_offset + tp_rank) form a process group."""

    master_address: str = ""
    master_port: int = 0
    rank_offset: int = 1
    world_size: int = 2
    group_name: str = "weight_update_group"
    backend: str = "nccl"
    timeout: float = 15.0  # seconds to wait for every member to join (on a thread: the loop serves meanwhile)
    query_id: str = ""


@dataclass
class InitWeightsUpdateGroupReqOutput:
    success: bool
    message: str
    query_id: str = ""


@dataclass
class UpdateWeightsFromDistributedReqInput:
    """The trainer broadcasts these tensors (from its rank 0), in this order."""

    names: List[str] = field(default_factory=list)
    dtypes: List[str] = field(default_factory=list)
    shapes: List[List[int]] = field(default_factory=list)
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    load_format: Optional[str] = None
    query_id: str = ""


@dataclass
class UpdateWeightsFromDistributedReqOutput:
    success: bool
    message: str
    query_id: str = ""


@dataclass
class DestroyWeightsUpdateGroupReqInput:
    group_name: str = "weight_update_group"
    query_id: str = ""


@dataclass
class DestroyWeightsUpdateGroupReqOutput:
    success: bool
    message: str
    query_id: str = ""


@dataclass
class GetWeightsByNameReqInput:
    name: str = ""  # a checkpoint tensor name (q_proj, not the fused qkv_proj)
    truncate_size: int = 100  # the first rows (elements of a vector)
    query_id: str = ""


@dataclass
class GetWeightsByNameReqOutput:
    parameter: Optional[List[Any]]  # None: no such tensor; a list per replica with --dp-size
    query_id: str = ""


# ---- LoRA adapters at run time (--enable-lora; SGLang's io_struct names) ----------------------
@dataclass
class LoadLoRAAdapterReqInput:
    lora_name: str = ""
    lora_path: str = ""  # a PEFT directory: adapter_config.json + adapter_model.safetensors
    query_id: str = ""


@dataclass
class UnloadLoRAAdapterReqInput:
    lora_name: str = ""
    query_id: str = ""


@dataclass
class LoRAUpdateOutput:
    success: bool
    error_message: Optional[str] = None
    loaded_adapters: Dict[str, str] = field(default_factory=dict)  # name -> path, after the change
    query_id: str = ""
    in_use_by: int = 0  # unload refused: requests of the scheduler's that still use the adapter


@dataclass
class UpdateWeightVersionReqInput:
    new_version: str = ""
    abort_all_requests: bool = True


# ---- memory release, pause, profiling (SGLang's io_struct names and fields) --------------------
# Replies echo their query's query_id (see FlushCacheReqInput); success False carries the reason.
@dataclass
class ReleaseMemoryOccupationReqInput:
    tags: Optional[List[str]] = None  # "kv_cache", "weights", "cuda_graph"; None: all of them
    query_id: str = ""


@dataclass
class ReleaseMemoryOccupationReqOutput:
    success: bool = True
    message: str = ""
    query_id: str = ""


@dataclass
class ResumeMemoryOccupationReqInput:
    tags: Optional[List[str]] = None  # None: every tag released
    query_id: str = ""


@dataclass
class ResumeMemoryOccupationReqOutput:
    success: bool = True
    message: str = ""
    query_id: str = ""


class BlockReqType(Enum):
    BLOCK = 1
    UNBLOCK = 2


@dataclass
class BlockReqInput:
    """SchedulerInputBlocker (seed 000): from BLOCK to UNBLOCK new work requests are held."""

    type: BlockReqType = BlockReqType.BLOCK


@dataclass
class PauseGenerationReqInput:
    """abort: every request in flight or waiting ends (finish_reason abort); retract: running
    requests go back to the waiting queue, their KV freed; in_place: everything stays, nothing
    is scheduled. In every mode new requests are held until ContinueGenerationReqInput."""

    mode: str = "abort"
    query_id: str = ""


@dataclass
class PauseGenerationReqOutput:
    success: bool = True
    message: str = ""
    query_id: str = ""


@dataclass
class ContinueGenerationReqInput:
    query_id: str = ""


@dataclass
class ContinueGenerationReqOutput:
    success: bool = True
    message: str = ""
    query_id: str = ""


class ExpertDistributionReqType(Enum):
    START_RECORD = 1
    STOP_RECORD = 2
    DUMP_RECORD = 3


@dataclass
class ExpertDistributionReq:
    """SGLang's /start_expert_distribution_record, /stop_... and /dump_... (layers/expert_distribution.py)."""

    action: ExpertDistributionReqType = ExpertDistributionReqType.START_RECORD
    query_id: str = ""


@dataclass
class ExpertDistributionReqOutput:
    success: bool = True
    message: str = ""
    record: Optional[Dict[str, Any]] = None  # the dump: path, logical_count [layers][experts], num_forward_passes
    query_id: str = ""


@dataclass
class EplbRebalanceReqInput:
    """SGLang's EPLB rebalance (/eplb_rebalance): re-place the experts now from the recorded load."""

    query_id: str = ""


@dataclass
class EplbRebalanceReqOutput:
    success: bool = True
    message: str = ""
    stats: Optional[Dict[str, float]] = None  # per-rank load max / mean, before and after
    query_id: str = ""


class ProfileReqType(Enum):
    START_PROFILE = 1
    STOP_PROFILE = 2


@dataclass
class ProfileReq:
    """torch.profiler traces of every scheduler rank, written as Chrome-trace JSON (gzipped) to
    output_dir/{profile_id}-TP-{rank}.trace.json.gz; with num_steps it stops by itself."""

    type: ProfileReqType = ProfileReqType.START_PROFILE
    output_dir: Optional[str] = None
    start_step: Optional[int] = None
    num_steps: Optional[int] = None
    activities: Optional[List[str]] = None  # "CPU", "GPU" (also "CUDA")
    with_stack: Optional[bool] = None
    record_shapes: Optional[bool] = None
    profile_by_stage: bool = False
    profile_id: Optional[str] = None
    query_id: str = ""


@dataclass
class ProfileReqOutput:
    success: bool = True
    message: str = ""
    query_id: str = ""
