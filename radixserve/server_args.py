"""ServerArgs: every flag of radixserve, its default, its validation, and its argparse form.

Names follow SGLang's `server_args.py` so that a reader of the seeds (and a user of SGLang)
finds the same knobs: `--chunked-prefill-size`, `--schedule-policy`, `--max-running-requests`...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

logger = logging.getLogger(__name__)

HICACHE_STORAGE_BACKENDS = ("file", "mooncake")
HICACHE_PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "float32", "fp32")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
QUANTIZATION_METHODS = ("auto", "none", "gguf", "w8a8_int8")  # layers/quantization/
CPU_GEMM_PATHS = ("auto", "int8", "int8_fused", "int8_i16", "onednn_bf16", "f32")  # layers/gemm_select.py
CPU_CHUNKED_PREFILL_SIZE, GPU_CHUNKED_PREFILL_SIZE = 512, 2048  # --chunked-prefill-size unset (chunked_prefill_size_on)
GRAMMAR_BACKENDS = ("xgrammar", "none")
SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE", "NEXTN")  # SGLang's names
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
HICACHE_IO_BACKENDS = ("direct", "kernel", "kernel_ascend")  # SGLang's; all one torch copy here
HICACHE_MEM_LAYOUTS = ("layer_first", "page_first", "page_first_direct")  # SGLang's; layer_first here
# The names of entrypoints/parsers/ (kept here so the flags need no import from entrypoints)
TOOL_CALL_PARSERS = ("hermes", "qwen25", "llama3", "mistral")
REASONING_PARSERS = ("deepseek-r1", "qwen3")


# NGRAM's verify forward: the last token and up to 3 drafts (a 4-token EXTEND costs about one
# decode step on the CPU; benchmarks/cpu/spec_ngram.py).
NGRAM_DEFAULT_NUM_DRAFT_TOKENS = 4
# STANDALONE: draft model forwards per step (a chain: num_draft_tokens = num_steps + 1). SGLang's
# default (5 steps, topk 4) builds a token tree; a chain of 3 drafts verifies in a 4-token EXTEND.
STANDALONE_DEFAULT_NUM_STEPS = 3
# EAGLE: SGLang's defaults when none of (num_steps, eagle_topk, num_draft_tokens) is given.
EAGLE_DEFAULTS = (5, 4, 8)


# --load-balance-method (managers/dp_budget.py implements them)
LOAD_BALANCE_METHODS = ("round_robin", "decode_round_robin", "shortest_queue", "minimum_tokens")


@dataclass
class ServerArgs:
    # Model. None means the embedded tiny model (radixserve/assets/tiny_qwen3).
    model_path: Optional[str] = None
    tokenizer_path: Optional[str] = None
    chat_template: Optional[str] = None  # a Jinja file, or the template itself; None: the model's
    sampling_defaults: str = "openai"  # "model": unset sampling fields come from generation_config.json
    load_format: str = "auto"
    quantization: str = "auto"
    cpu_gemm_path: str = "auto"  # auto: measured at start per matrix shape and row count (gemm_select.py)
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # auto: the activations' dtype (fp16 in the CPU's bf16 mode)
    device: str = "auto"  # "cpu", "cuda" or "auto" (cuda when available)
    seed: int = 0
    context_length: Optional[int] = None
    # Serve the model as an embedding model (prefill only; /encode, /v1/embeddings): the pooling
    # of its sentence-transformers config (modules.json), else the last token, normalized.
    is_embedding: bool = False
    # Issue 57: no model forward at all (sim/null_worker.py): the pools sized from the model's
    # config, a forward that returns at once; `bench serving` then measures the host path alone.
    null_worker: bool = False
    null_worker_token_ids: Optional[str] = None  # "5,6,7": the token after p tokens is ids[p % 3]

    # Memory
    max_total_tokens: Optional[int] = None  # KV pool size in tokens; derived from memory when None
    mem_fraction_static: float = 0.85  # GPU: fraction of free memory for weights + KV
    cpu_kv_cache_bytes: int = 2 * 1024**3  # CPU: byte budget for the KV pool
    max_running_requests: Optional[int] = None
    page_size: int = 1
    attention_backend: str = "torch_native"  # "triton": the Triton kernels (GPU)
    # CUDA graphs for decode (cuda_graph_runner.py): on CUDA with a backend that supports them.
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 256

    # Scheduling
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0
    chunked_prefill_size: Optional[int] = None  # None: by device (chunked_prefill_size_on); <= 0 disables chunking
    max_prefill_tokens: int = 16384
    enable_mixed_chunk: bool = False
    # SGLang's: batch-invariant kernels, so a request's tokens and logprobs do not depend on its
    # batch, chunking or prefix-cache hits (layers/batch_invariant.py)
    enable_deterministic_inference: bool = False
    disable_radix_cache: bool = False
    radix_eviction_policy: str = "lru"  # "lru" or "lfu"
    max_queued_requests: Optional[int] = None
    prefill_max_requests: Optional[int] = None
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    stream_interval: int = 1
    allow_auto_truncate: bool = False  # SGLang's: a too long input is cut to fit, not refused
    # SGLang's: requests may name a custom_logit_processor (from sampling/custom_logit_processor.py)
    enable_custom_logit_processor: bool = False
    # None: the overlap loop on CUDA, the normal loop on the CPU (overlap_schedule_enabled).
    disable_overlap_schedule: Optional[bool] = None
    disable_consecutive_prefill_overlap: bool = False
    # Test knob (SGLang's SGLANG_TEST_RETRACT): force a retraction every N decode steps.
    test_retract_interval: Optional[int] = None
    # Test knob: after every step, check that each KV page is free, cached or held (conservation).
    test_check_memory: bool = False

    # The SWA pool (issue 42; mem_cache/swa_memory_pool.py): a model with sliding-window layers
    # keeps their KV only for the tokens inside some window, in a pool of its own (SGLang's hybrid
    # SWA memory). None (the default): on for such a model where it runs, else one KV pool with a
    # log line (model_runner.use_swa_pool); True (--enable-hybrid-swa-memory): asked for, refused
    # at start where it cannot run; False (--disable-hybrid-swa-memory): one KV pool.
    enable_hybrid_swa_memory: Optional[bool] = None
    swa_full_tokens_ratio: float = 0.8  # SWA pool slots / full pool slots

    # HiCache (issue 29, SGLang's flags; mem_cache/hiradix_cache.py): radix nodes evicted from the
    # device KV pool keep their KV in a host pool, and a later hit loads it back.
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0  # host pool size / device pool size
    hicache_size: int = 0  # host pool in GB; 0: use --hicache-ratio
    hicache_write_policy: str = "write_through"
    hicache_io_backend: str = "kernel"
    hicache_mem_layout: str = "layer_first"
    # HiCache's storage tier (mem_cache/storage/): pages backed up below the host pool, shared
    # across restarts (file) or servers (mooncake); prefetched beside the scheduler.
    hicache_storage_backend: Optional[str] = None  # "file" or "mooncake"; None: no storage tier
    hicache_storage_backend_extra_config: Optional[Any] = None  # a JSON object (string); parsed to a dict by check()
    hicache_storage_prefetch_policy: str = "best_effort"  # or "wait_complete", "timeout"

    # Speculative decoding (issue 27, SGLang's flags; radixserve/speculative/). NGRAM: drafts from
    # an n-gram cache of every request's prompt and output, a chain verified in one forward.
    speculative_algorithm: Optional[str] = None
    # Tokens per request in a verify forward, the verified (last sampled) one included, as SGLang.
    speculative_num_draft_tokens: Optional[int] = None  # None: NGRAM_DEFAULT_NUM_DRAFT_TOKENS
    # STANDALONE: a smaller model with the target's tokenizer drafts num_steps tokens (a chain:
    # topk 1), its KV in buffers of its own indexed by the target's slots.
    speculative_draft_model_path: Optional[str] = None
    speculative_num_steps: Optional[int] = None  # None: STANDALONE_DEFAULT_NUM_STEPS
    speculative_eagle_topk: Optional[int] = None  # branches per draft step (EAGLE's token tree; STANDALONE: 1)
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    speculative_ngram_max_bfs_breadth: int = 1  # 1: a chain (SGLang's default 10 builds a token tree; the draft budget's cost model is a chain's)
    speculative_ngram_capacity: int = 200_000  # n-grams kept (SGLang counts 10M trie nodes)

    # Multi-LoRA serving (issue 28, SGLang's flags; radixserve/lora/): PEFT adapters, many per batch
    enable_lora: bool = False
    lora_paths: Optional[Any] = None  # ["name=path", ...] (or a dict name -> path); parsed by check()
    max_loras_per_batch: int = 8
    max_lora_rank: Optional[int] = None  # None: the largest rank of --lora-paths
    lora_target_modules: Optional[List[str]] = None  # None: every module --lora-paths target; "all"
    max_loaded_loras: Optional[int] = None

    # Images in (issue 46, radixserve/multimodal/): where an image may come from, its limits,
    # and the encoder outputs kept by image hash
    allowed_local_media_path: Optional[str] = None
    enable_media_url_fetch: bool = False
    max_image_pixels: int = 4096 * 4096
    max_image_bytes: int = 20 * 1024 * 1024
    mm_embedding_cache_mb: int = 512
    disable_mm_encode_ahead: bool = False  # encode a queued request's images in the prefill instead

    # PD disaggregation (seed 001 §8): this server prefills or decodes; sglang-router in front
    disaggregation_mode: str = "null"  # "null" (unified), "prefill" or "decode"
    disaggregation_bootstrap_port: int = 8998  # prefill: the handshake socket decode servers connect to
    disaggregation_transfer_backend: str = "mooncake"  # or "fake" (KV copied through ZeroMQ)
    disaggregation_timeout: float = 300.0  # seconds a request may wait for the other server

    # Parallelism (torch.distributed: gloo on CPU, NCCL on GPU)
    tp_size: int = 1
    ep_size: int = 1  # expert parallelism: groups of the TP ranks that each hold whole experts (MoE models)
    # EPLB (radixserve/eplb/): redundant copies of the hot experts, re-placed from the recorded load
    ep_num_redundant_experts: int = 0  # physical expert slots beyond the model's experts (copies)
    enable_eplb: bool = False  # record the expert load and re-place the experts every N forward passes
    eplb_rebalance_num_iterations: int = 1000  # N: forward passes between two rebalances
    init_expert_location: Optional[str] = None  # a /dump_expert_distribution_record file: place by it at start
    dp_size: int = 1
    nnodes: int = 1  # machines the TP ranks span (rank r runs on node r // (tp_size // nnodes))
    node_rank: int = 0  # this machine; only node 0 serves HTTP
    load_balance_method: str = "round_robin"  # one of LOAD_BALANCE_METHODS (--dp-size > 1)
    dist_init_addr: Optional[str] = None  # host:port of rank 0's rendezvous; a free local port when None
    # Pipeline parallelism (issue 30, seed 001 §27; managers/scheduler_pp.py): the layers split
    # over pp_size stages, pp_size + pp_async_batch_depth micro-batches in flight.
    pp_size: int = 1
    pp_partition: Optional[str] = None  # decoder layers per stage, "3,1"; None: an even split
    pp_max_micro_batch_size: Optional[int] = None  # requests per micro-batch; None: --max-running-requests // pp_size
    pp_async_batch_depth: int = 0

    # Serving
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: Optional[str] = None
    weight_version: str = "default"  # the weights' version in every meta_info (RL: set by weight updates)
    log_level: str = "info"
    skip_tokenizer_init: bool = False
    skip_server_warmup: bool = False  # no warm-up /generate before /health turns 200 (entrypoints/warmup.py)
    api_key: Optional[str] = None  # every route but /health needs "Authorization: Bearer KEY"
    admin_api_key: Optional[str] = None  # the operations routes need it (entrypoints/admin_auth.py)
    max_request_body_bytes: int = 32 * 1024 * 1024  # larger request bodies get 413
    watchdog_timeout: float = 300.0  # seconds without forward progress before the server exits
    decode_log_interval: int = 40  # log one line every this many decode batches

    # Limits and liveness: every one finite by default (README: "Limits and failure behaviour")
    max_concurrent_requests: int = 1024  # requests (samples of n) in flight over HTTP; more get 503
    zmq_hwm: int = 1024  # messages queued towards the scheduler before new requests get 503
    max_sessions: int = 1024  # open sessions; opening another gets 503
    session_timeout: float = 3600.0  # seconds an idle session lives
    grammar_cache_size: int = 1024  # compiled grammars kept (least recently used go first)
    request_timeout: Optional[float] = None  # seconds a request may run before it is aborted (504)
    health_check_timeout: float = 20.0  # /health is 503 when the scheduler's heartbeat is older
    graceful_shutdown_timeout: float = 15.0  # SIGTERM: seconds in-flight requests get to finish

    # Structured output (json_schema / regex / ebnf requests)
    grammar_backend: str = "xgrammar"  # or "none"
    grammar_timeout: float = 60.0  # seconds a grammar may compile; below --watchdog-timeout
    # None: compact JSON (no whitespace), so a weak model cannot pad JSON until max_new_tokens.
    constrained_json_whitespace_pattern: Optional[str] = None

    # Chat output parsers (entrypoints/parsers/): tool calls and reasoning, SGLang's names
    tool_call_parser: Optional[str] = None
    reasoning_parser: Optional[str] = None

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Reject inconsistent settings with a message that names the flag."""
        for name in ("max_image_pixels", "max_image_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.mm_embedding_cache_mb < 0:
            raise ValueError("--mm-embedding-cache-mb must be >= 0")
        if self.allowed_local_media_path is not None and not os.path.isdir(self.allowed_local_media_path):
            raise ValueError(f"--allowed-local-media-path {self.allowed_local_media_path!r} is not a directory")
        _choice("--load-format", self.load_format, LOAD_FORMATS)
        if self.null_worker_token_ids is not None and not self.null_worker:
            raise ValueError("--null-worker-token-ids needs --null-worker")
        if self.null_worker and (self.pp_size > 1 or self.is_embedding or self.speculative_algorithm is not None):
            raise ValueError("--null-worker serves plain generation only (no --pp-size, --is-embedding or "
                             "--speculative-algorithm)")
        _choice("--quantization", self.quantization, QUANTIZATION_METHODS)
        _choice("--cpu-gemm-path", self.cpu_gemm_path, CPU_GEMM_PATHS)
        _choice("--dtype", self.dtype, DTYPES)
        _choice("--kv-cache-dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _choice("--schedule-policy", self.schedule_policy, SCHEDULE_POLICIES)
        _choice("--radix-eviction-policy", self.radix_eviction_policy, ("lru", "lfu"))
        _choice("--device", self.device, ("auto", "cpu", "cuda"))
        _choice("--attention-backend", self.attention_backend, ("torch_native", "triton"))
        if self.enable_hybrid_swa_memory not in (None, True, False):
            raise ValueError(f"--enable-hybrid-swa-memory must be a bool (or None: where it runs), got {self.enable_hybrid_swa_memory!r}")
        if self.disable_overlap_schedule not in (None, True, False):
            raise ValueError(f"--disable-overlap-schedule must be a bool (or None: by device), got {self.disable_overlap_schedule!r}")
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError("--max-total-tokens must hold at least one page")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError("--max-running-requests must be >= 1")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"--cuda-graph-max-bs must be >= 1, got {self.cuda_graph_max_bs}")
        if not 0 < self.mem_fraction_static <= 1:
            raise ValueError("--mem-fraction-static must be in (0, 1]")
        _choice("--load-balance-method", self.load_balance_method, LOAD_BALANCE_METHODS)
        if self.dp_size < 1:
            raise ValueError(f"--dp-size must be >= 1, got {self.dp_size}")
        if self.nnodes > 1:
            if (self.tp_size * self.pp_size) % self.nnodes or self.dp_size > 1:
                raise ValueError("--nnodes must divide --tp-size x --pp-size (and --dp-size must be 1 across nodes)")
            if not self.dist_init_addr:
                raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT of node 0, the same on every node")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, --nnodes), got {self.node_rank}")
        if self.tp_size < 1:
            raise ValueError(f"--tp-size must be >= 1, got {self.tp_size}")
        if self.ep_size < 1 or self.tp_size % self.ep_size:
            raise ValueError(f"--ep-size must divide --tp-size (experts are placed on the TP ranks), got {self.ep_size}")
        self.check_eplb_args()
        if self.stream_interval < 1:
            raise ValueError("--stream-interval must be >= 1")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size <= 0:
            self.chunked_prefill_size = -1  # SGLang's "off"
        if self.chunked_prefill_size is not None and 0 < self.chunked_prefill_size < self.page_size:
            raise ValueError("--chunked-prefill-size must be >= --page-size")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"--port must be in [1, 65535], got {self.port}")
        if self.watchdog_timeout <= 0:
            raise ValueError("--watchdog-timeout must be > 0")
        _choice("--grammar-backend", self.grammar_backend, GRAMMAR_BACKENDS)
        _choice("--sampling-defaults", self.sampling_defaults, ("openai", "model"))
        if self.tool_call_parser is not None:
            _choice("--tool-call-parser", self.tool_call_parser, TOOL_CALL_PARSERS)
        if self.reasoning_parser is not None:
            _choice("--reasoning-parser", self.reasoning_parser, REASONING_PARSERS)
        if not 0 < self.grammar_timeout < self.watchdog_timeout:
            # A compile still running at the watchdog's limit would take the server down.
            raise ValueError("--grammar-timeout must be > 0 and below --watchdog-timeout")
        if self.decode_log_interval < 1:
            raise ValueError("--decode-log-interval must be >= 1")
        if self.max_request_body_bytes < 1024:
            raise ValueError("--max-request-body-bytes must be >= 1024")
        for flag in ("max_concurrent_requests", "zmq_hwm", "max_sessions", "grammar_cache_size"):
            if getattr(self, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
        for flag in ("session_timeout", "health_check_timeout", "graceful_shutdown_timeout"):
            if not getattr(self, flag) > 0:
                raise ValueError(f"--{flag.replace('_', '-')} must be > 0")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError("--request-timeout must be > 0")
        _choice("--disaggregation-mode", self.disaggregation_mode, ("null", "prefill", "decode"))
        _choice("--disaggregation-transfer-backend", self.disaggregation_transfer_backend, ("mooncake", "fake"))
        if not 1 <= self.disaggregation_bootstrap_port <= 65535:
            raise ValueError("--disaggregation-bootstrap-port must be in [1, 65535]")
        if not self.disaggregation_timeout > 0:
            raise ValueError("--disaggregation-timeout must be > 0")
        if self.is_embedding and self.disable_overlap_schedule is False:
            raise ValueError("--is-embedding runs the normal loop (prefill only: nothing to overlap); drop --enable-overlap-schedule")
        if self.is_embedding and self.disaggregation_mode != "null":
            raise ValueError("--is-embedding does not run with --disaggregation-mode (an embedding has no decode)")
        if self.disaggregation_mode != "null" and (self.tp_size > 1 or self.dp_size > 1):
            raise ValueError("--disaggregation-mode runs with --tp-size 1 and --dp-size 1 in radixserve; "
                             "scale out with several prefill and decode servers behind sglang-router")
        if self.enable_hybrid_swa_memory is not False:
            self._check_hybrid_swa_memory()
        if self.enable_hierarchical_cache:
            self._check_hicache()
        if self.hicache_storage_backend is not None:
            self._check_hicache_storage()
        if self.pp_size != 1 or self.pp_partition is not None:
            self._check_pp()
        if self.speculative_algorithm is not None:
            self._check_speculative()
        if self.enable_lora or self.lora_paths:
            self._check_lora()
        if self.enable_deterministic_inference:
            what = self.deterministic_inference_unsupported()
            if what is not None:
                raise ValueError(f"--enable-deterministic-inference does not run with {what}")

    def deterministic_inference_unsupported(self) -> Optional[str]:
        """The first flag whose kernels or scheduling are not batch-invariant here (None: none);
        what depends on the model (windowed or linear attention, GGUF paths) is checked at load."""
        unsupported = [
            (self.device == "cuda", "--device cuda (the GPU GEMMs are cuBLAS's, whose reduction order depends on the "
                                    "row count; the batch-invariant kernels are the CPU's)"),
            (self.speculative_algorithm is not None, "--speculative-algorithm (a verify forward computes a token "
                                                     "with other kernels than a decode step)"),
            (self.enable_mixed_chunk, "--enable-mixed-chunk (a decode token inside an extend forward takes the "
                                      "extend kernel, alone the decode kernel)"),
            (self.enable_lora or bool(self.lora_paths), "--enable-lora (the segmented LoRA matmul is not batch-invariant)"),
        ]
        return next((what for bad, what in unsupported if bad), None)

    def _check_hybrid_swa_memory(self) -> None:
        """What the SWA pool does not run with is refused here, each with one line, where it was
        asked for (--enable-hybrid-swa-memory); by default the model runner falls back to one pool."""
        if not (math.isfinite(self.swa_full_tokens_ratio) and self.swa_full_tokens_ratio > 0):
            raise ValueError(f"--swa-full-tokens-ratio must be a finite number > 0, got {self.swa_full_tokens_ratio}")
        what = self.hybrid_swa_memory_unsupported()
        if self.enable_hybrid_swa_memory and what is not None:
            raise ValueError(f"--enable-hybrid-swa-memory does not run with {what}")

    def hybrid_swa_memory_unsupported(self) -> Optional[str]:
        """The first flag the SWA pool does not run with (None: none)."""
        unsupported = [
            (self.page_size > 1, "--page-size > 1 (the SWA pool hands out single slots)"),
            (self.enable_hierarchical_cache, "--enable-hierarchical-cache (the host tier keeps no windowed layers' KV)"),
            (self.speculative_algorithm is not None, "--speculative-algorithm (a verify forward's drafts are not windowed)"),
            (self.attention_backend == "triton", "--attention-backend triton (its extend kernel reads req_to_token's full slots)"),
            (self.chunked_prefill_size == -1, "chunked prefill off (a prompt's window slots must fit the SWA pool chunk by chunk)"),
            (self.pp_size > 1, "--pp-size > 1"),
            (self.disaggregation_mode != "null", "--disaggregation-mode (the transfer moves full-pool KV only)"),
        ]
        return next((what for bad, what in unsupported if bad), None)

    def _check_hicache(self) -> None:
        if self.disable_radix_cache:
            raise ValueError("--enable-hierarchical-cache needs the radix cache; drop --disable-radix-cache")
        _choice("--hicache-write-policy", self.hicache_write_policy, HICACHE_WRITE_POLICIES)
        _choice("--hicache-io-backend", self.hicache_io_backend, HICACHE_IO_BACKENDS)
        _choice("--hicache-mem-layout", self.hicache_mem_layout, HICACHE_MEM_LAYOUTS)
        if not math.isfinite(self.hicache_size) or self.hicache_size < 0:
            raise ValueError(f"--hicache-size must be a finite number of GB >= 0 (0: use --hicache-ratio), got {self.hicache_size}")
        if self.hicache_size == 0 and not (math.isfinite(self.hicache_ratio) and self.hicache_ratio > 0):
            raise ValueError(f"--hicache-ratio must be a finite number > 0, got {self.hicache_ratio}")

    def _check_hicache_storage(self) -> None:
        if not self.enable_hierarchical_cache:
            raise ValueError("--hicache-storage-backend needs --enable-hierarchical-cache (the storage tier sits below the host pool)")
        _choice("--hicache-storage-backend", self.hicache_storage_backend, HICACHE_STORAGE_BACKENDS)
        _choice("--hicache-storage-prefetch-policy", self.hicache_storage_prefetch_policy, HICACHE_PREFETCH_POLICIES)
        extra = self.hicache_storage_backend_extra_config
        if isinstance(extra, str):
            try:
                extra = json.loads(extra) if extra.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(f"--hicache-storage-backend-extra-config is not JSON: {e}") from None
        if not isinstance(extra, (dict, type(None))):
            raise ValueError("--hicache-storage-backend-extra-config must be a JSON object")
        self.hicache_storage_backend_extra_config = extra or {}
        if self.tp_size > 1 or self.pp_size > 1:  # the ranks would have to agree on every prefetch
            raise ValueError("--hicache-storage-backend runs with --tp-size 1 and --pp-size 1 in radixserve")

    def _check_pp(self) -> None:
        """--pp-size: its numbers, and one line for each feature it does not run with yet."""
        if self.pp_size < 1:
            raise ValueError(f"--pp-size must be >= 1, got {self.pp_size}")
        parts = self.pp_partition_list()
        if parts is not None and (len(parts) != self.pp_size or min(parts) < 1):
            raise ValueError(f"--pp-partition {self.pp_partition} must give each of the {self.pp_size} stages >= 1 layer")
        if self.pp_async_batch_depth < 0:
            raise ValueError("--pp-async-batch-depth must be >= 0")
        if self.pp_max_micro_batch_size is not None and self.pp_max_micro_batch_size < 1:
            raise ValueError("--pp-max-micro-batch-size must be >= 1")
        if self.pp_size == 1:
            return
        refused = [
            (self.disable_overlap_schedule is False, "--enable-overlap-schedule", "the PP loop overlaps the stages itself"),
            (self.speculative_algorithm is not None, "--speculative-algorithm", "a verify step's drafts would cross the stages"),
            (self.enable_lora or bool(self.lora_paths), "--enable-lora", "the adapters' layers are not split by stage"),
            (self.disaggregation_mode != "null", "--disaggregation-mode", "the KV transfer is not split by stage"),
            (self.is_embedding, "--is-embedding", "the pooler runs on one stage only"),
            (self.dp_size > 1, "--dp-size > 1", "one pipeline per server"),
            (self.enable_hierarchical_cache, "--enable-hierarchical-cache",
             "the host tier would back up the first stage's layers only"),
            (self.test_check_memory, "--test-check-memory", "it checks one micro-batch slot's requests"),
        ]
        for on, what, why in refused:
            if on:
                raise ValueError(f"--pp-size > 1 does not run with {what} ({why})")

    def pp_partition_list(self) -> Optional[List[int]]:
        """--pp-partition "3,1" as [3, 1] (None: an even split)."""
        if self.pp_partition is None or isinstance(self.pp_partition, (list, tuple)):
            return None if self.pp_partition is None else [int(x) for x in self.pp_partition]
        try:
            return [int(x) for x in str(self.pp_partition).split(",")]
        except ValueError:
            raise ValueError(f"--pp-partition must be comma-separated layer counts like 3,1; got {self.pp_partition!r}") from None

    def _check_lora(self) -> None:
        """What multi-LoRA serving runs with so far (one line each for what it does not)."""
        self.enable_lora = True  # --lora-paths implies it, as in SGLang
        self.lora_paths = parse_lora_paths(self.lora_paths)
        if self.max_loras_per_batch < 1:
            raise ValueError("--max-loras-per-batch must be >= 1")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError("--max-lora-rank must be >= 1")
        if self.max_loaded_loras is not None and self.max_loaded_loras < len(self.lora_paths):
            raise ValueError(f"--max-loaded-loras {self.max_loaded_loras} is below the {len(self.lora_paths)} adapters of --lora-paths")
        if isinstance(self.lora_target_modules, str):
            self.lora_target_modules = [self.lora_target_modules]
        refused = [  # (on, what, how to run instead)
            (self.device == "cuda" and not self.disable_cuda_graph, "CUDA graphs", "add --disable-cuda-graph"),
            (self.disaggregation_mode != "null", "--disaggregation-mode", "drop it"),
            (self.speculative_algorithm is not None, "--speculative-algorithm", "drop it"),
            (self.is_embedding, "--is-embedding", "drop it"),
        ]
        for bad, what, instead in refused:
            if bad:
                raise ValueError(f"--enable-lora with {what} is not built yet: {instead}")

    def _check_speculative(self) -> None:
        """What speculative decoding runs with so far (one line each for what it does not)."""
        self.speculative_algorithm = str(self.speculative_algorithm).upper()
        _choice("--speculative-algorithm", self.speculative_algorithm, SPECULATIVE_ALGORITHMS)
        if self.speculative_algorithm == "NEXTN":
            # As SGLang: EAGLE's worker with the target checkpoint's own MTP layers as the draft
            # (models/qwen3_next_mtp.py); the draft path is the model's unless given.
            self.speculative_algorithm = "EAGLE"
            self.speculative_draft_model_path = self.speculative_draft_model_path or self.model_path
        if self.speculative_algorithm == "EAGLE":
            self._check_eagle()
        elif self.speculative_algorithm == "STANDALONE":
            self._check_standalone()
        else:
            self._check_ngram()
        refused = [
            (self.disable_overlap_schedule is False and self.enable_mixed_chunk,
             "--enable-mixed-chunk in the overlap loop (--enable-overlap-schedule): a mixed batch's decode part "
             "needs the lengths the step in flight commits"),
            (self.disaggregation_mode != "null", "--disaggregation-mode"),
            (self.is_embedding, "--is-embedding (nothing to decode)"),
            (self.tp_size > 1 and self.speculative_algorithm != "NGRAM",
             "--tp-size > 1 (the draft model runs on one rank; NGRAM needs no draft model)"),
        ]
        for bad, what in refused:
            if bad:
                raise ValueError(f"--speculative-algorithm with {what} is not built yet")

    def _check_draft_path(self, what: str) -> None:
        path = self.speculative_draft_model_path
        if not path:
            raise ValueError(f"--speculative-algorithm {self.speculative_algorithm} needs --speculative-draft-model-path ({what})")
        if not os.path.exists(path):
            raise ValueError(f"--speculative-draft-model-path {path}: no such file or directory")

    def _check_eagle(self) -> None:
        """An EAGLE head (its config names LlamaForCausalLMEagle; the worker checks it) drafting a
        tree: SGLang's defaults (5 steps, topk 4, 8 tokens) when none is given; topk 1 is a chain."""
        self._check_draft_path("an EAGLE head: a directory with config.json and its weights")
        given = (self.speculative_num_steps, self.speculative_eagle_topk, self.speculative_num_draft_tokens)
        if given == (None, None, None):
            given = EAGLE_DEFAULTS
        steps, topk, tokens = given
        self.speculative_num_steps = EAGLE_DEFAULTS[0] if steps is None else steps
        self.speculative_eagle_topk = 1 if topk is None else topk
        if self.speculative_num_steps < 1:
            raise ValueError("--speculative-num-steps must be >= 1 (draft head forwards per step)")
        if self.speculative_eagle_topk < 1:
            raise ValueError("--speculative-eagle-topk must be >= 1 (branches per draft step)")
        tree_nodes = self.speculative_eagle_topk * (1 + (self.speculative_num_steps - 1) * self.speculative_eagle_topk)
        if self.speculative_eagle_topk == 1:
            if tokens not in (None, self.speculative_num_steps + 1):
                logger.warning("--speculative-num-draft-tokens is adjusted to --speculative-num-steps + 1 = %d (a chain)",
                               self.speculative_num_steps + 1)
            tokens = self.speculative_num_steps + 1
        elif tokens is None:
            tokens = EAGLE_DEFAULTS[2]
        if not 2 <= tokens <= tree_nodes + 1:
            raise ValueError(f"--speculative-num-draft-tokens must be in [2, {tree_nodes + 1}]: the drafts verified "
                             f"(plus the last token) come from a tree of {tree_nodes} nodes")
        self.speculative_num_draft_tokens = tokens

    def _check_standalone(self) -> None:
        """A draft model of the target's vocabulary (the factory compares the two configs when it
        loads them) drafting a chain: SGLang's flags with topk 1, num_draft_tokens = num_steps + 1."""
        self._check_draft_path("a smaller model with the target's tokenizer: a Hugging Face directory or a .gguf")
        if self.speculative_eagle_topk is None:
            self.speculative_eagle_topk = 1
        if self.speculative_eagle_topk != 1:
            raise ValueError("--speculative-eagle-topk > 1 (a token tree) is not built yet for STANDALONE: it drafts a chain (1)")
        if self.speculative_num_steps is None:
            given = self.speculative_num_draft_tokens
            self.speculative_num_steps = given - 1 if given is not None else STANDALONE_DEFAULT_NUM_STEPS
        if self.speculative_num_steps < 1:
            raise ValueError("--speculative-num-steps must be >= 1 (draft model forwards per step)")
        if self.speculative_num_draft_tokens not in (None, self.speculative_num_steps + 1):
            # SGLang adjusts it the same way for topk 1: a chain verifies its steps and the last token.
            logger.warning("--speculative-num-draft-tokens is adjusted to --speculative-num-steps + 1 = %d (a chain)",
                           self.speculative_num_steps + 1)
        self.speculative_num_draft_tokens = self.speculative_num_steps + 1

    def _check_ngram(self) -> None:
        if self.speculative_num_draft_tokens is None:
            self.speculative_num_draft_tokens = NGRAM_DEFAULT_NUM_DRAFT_TOKENS
        if self.speculative_num_draft_tokens < 2:
            raise ValueError("--speculative-num-draft-tokens counts the verified token too: it must be >= 2")
        if not 1 <= self.speculative_ngram_min_match_window_size <= self.speculative_ngram_max_match_window_size:
            raise ValueError("the n-gram match window sizes must be 1 <= --speculative-ngram-min-match-window-size "
                             "<= --speculative-ngram-max-match-window-size")
        if self.speculative_ngram_max_bfs_breadth < 1:
            raise ValueError("--speculative-ngram-max-bfs-breadth must be >= 1 (1: a chain; more: a token tree)")
        if self.speculative_ngram_capacity < 1:
            raise ValueError("--speculative-ngram-capacity must be >= 1")

    # ---- argparse -------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            default = f.default
            text = FLAG_HELP.get(f.name, "")
            if f.name == "enable_hybrid_swa_memory":  # tri-state: asked for, off, or where it runs
                parser.add_argument(flag, action="store_const", const=True, default=None,
                                    help=f"{text} (default: on for a model with windowed layers where it runs)")
                parser.add_argument("--disable-hybrid-swa-memory", dest=f.name, action="store_const", const=False,
                                    help="keep every layer's KV in one pool, windowed layers too")
                continue
            if f.name == "disable_overlap_schedule":  # tri-state: on, off, or by device
                parser.add_argument(flag, action="store_const", const=True, default=None, help=text)
                parser.add_argument("--enable-overlap-schedule", dest=f.name, action="store_const", const=False,
                                    help="run the overlap loop on the CPU too (where it is off by default)")
                continue
            if f.name in ("lora_paths", "lora_target_modules"):  # lists: --lora-paths a=/x b=/y
                parser.add_argument(flag, nargs="*", default=default, help=text)
                continue
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", default=default, help=f"{text} (default: off)".strip())
                continue
            shown = "%(default)s" if f.name not in ("api_key", "admin_api_key") else "none"
            parser.add_argument(flag, type=_arg_type(f), default=default, help=f"{text} (default: {shown})".strip())

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def overlap_schedule_enabled(self, device: str) -> bool:
        """The overlap loop by default on CUDA only: on a CPU the forward needs every core, and
        a scheduler thread beside it slowed decode steps (benchmarks/NOTES.md)."""
        if self.disaggregation_mode != "null":
            return False  # the PD queues run between steps of the normal loop
        if self.speculative_algorithm is not None and self.enable_mixed_chunk:
            return False  # a mixed batch's decode part is laid out with the committed lengths
        if self.is_embedding:
            return False  # prefill only: a result must be processed before the next schedule
        if self.pp_size > 1:
            return False  # the PP loop (scheduler_pp.py) keeps micro-batches in flight instead
        if self.disable_overlap_schedule is None:
            return device != "cpu"
        return not self.disable_overlap_schedule

    def chunked_prefill_size_on(self, device: str) -> Optional[int]:
        """The prefill chunk in tokens on `device`, None when chunking is off. Unset, it is picked
        by device, as SGLang picks it by GPU memory: 2048 on a GPU; 512 on a CPU, where 512
        tokens already take seconds and its GEMMs run as fast as at 2048, while a batch of 2048
        holds back the first token of every request in it (a quarter of the mean TTFT at 16
        concurrent on Qwen2.5-Coder-1.5B, benchmarks/NOTES.md)."""
        if self.chunked_prefill_size is None:
            return max(self.page_size, CPU_CHUNKED_PREFILL_SIZE if device == "cpu" else GPU_CHUNKED_PREFILL_SIZE)
        return self.chunked_prefill_size if self.chunked_prefill_size > 0 else None

    def replace(self, **changes: Any) -> "ServerArgs":
        return dataclasses.replace(self, **changes)


    def check_eplb_args(self) -> None:
        """EPLB's flags: copies and re-placement only mean something across expert-parallel ranks."""
        if self.ep_num_redundant_experts < 0:
            raise ValueError(f"--ep-num-redundant-experts must be >= 0, got {self.ep_num_redundant_experts}")
        if self.eplb_rebalance_num_iterations < 1:
            raise ValueError(f"--eplb-rebalance-num-iterations must be >= 1, got {self.eplb_rebalance_num_iterations}")
        wants = [flag for flag, on in (("--ep-num-redundant-experts", self.ep_num_redundant_experts > 0),
                                       ("--enable-eplb", self.enable_eplb),
                                       ("--init-expert-location", self.init_expert_location is not None)) if on]
        if wants and self.ep_size == 1:
            raise ValueError(f"{wants[0]} needs --ep-size > 1: placing experts balances load between expert-parallel ranks")
        if wants and self.pp_size > 1:
            raise ValueError(f"{wants[0]} with --pp-size > 1 is not supported yet (each stage would balance its own layers)")


# Help text of every flag (`radixserve serve --help` adds each one's default).
FLAG_HELP = {
    "nnodes": "number of machines the tensor-parallel ranks span",
    "node_rank": "this machine's index among --nnodes (node 0 serves HTTP)",
    "dp_size": "data parallelism: number of model replicas (each with --tp-size ranks) behind one server",
    "load_balance_method": "how --dp-size routes requests: round_robin, decode_round_robin, shortest_queue or minimum_tokens",
    "tp_size": "tensor parallelism: number of ranks (processes) that split every layer",
    "ep_size": "expert parallelism (MoE models): split the TP ranks into this many groups, each holding whole experts (must divide --tp-size)",
    "ep_num_redundant_experts": "EPLB: physical expert slots beyond the model's experts, holding copies of the most loaded ones (needs --ep-size > 1)",
    "enable_eplb": "EPLB: record the experts' load and re-place them (with their copies) every --eplb-rebalance-num-iterations forward passes",
    "eplb_rebalance_num_iterations": "EPLB: forward passes between two automatic rebalances (--enable-eplb)",
    "init_expert_location": "EPLB: place the experts at start from a /dump_expert_distribution_record file (.pt)",
    "pp_size": "pipeline parallelism: number of stages (each with --tp-size ranks) the layers are split over",
    "pp_partition": "decoder layers per pipeline stage, comma-separated (e.g. 3,1); default: an even split",
    "pp_max_micro_batch_size": "requests per pipeline micro-batch (default: --max-running-requests // --pp-size)",
    "pp_async_batch_depth": "extra micro-batches in flight beyond --pp-size (pp_size + depth in all)",
    "dist_init_addr": "host:port for torch.distributed rendezvous of the ranks (a free local port when unset)",
    "model_path": "Hugging Face model directory, or a .gguf file; none serves the embedded tiny model",
    "tokenizer_path": "tokenizer directory, when it differs from --model-path",
    "chat_template": "chat template: a Jinja file, or the template text itself; none = the model's own",
    "sampling_defaults": "defaults of unset sampling fields: openai (temperature 1, top_p 1, ...) or model (its generation_config.json)",
    "null_worker": "no model forward: fixed tokens at once, to measure the host path (HTTP, scheduler, "
                   "detokenizer, streaming) alone",
    "null_worker_token_ids": "--null-worker: comma-separated ids; the token after a sequence of p tokens is "
                             "ids[p % len(ids)] (default: one id that is not EOS)",
    "load_format": f"weights: {', '.join(LOAD_FORMATS)} (dummy = random weights)",
    "quantization": "a GGUF file's quantized weights: gguf keeps the linear layers in the file's blocks (the C++ "
                    "integer kernel: activations quantized to 8 bits per block, as llama.cpp); none dequantizes "
                    "them at load to --dtype; auto: gguf in the CPU's bf16 mode where the kernel is built, else none "
                    "(--dtype float32 is the exact reference; on a GPU auto is none and gguf keeps Q4_0/Q4_1/Q5_0/"
                    "Q5_1/Q8_0 and Q2_K..Q6_K in blocks for the Triton kernels); w8a8_int8 quantizes a safetensors "
                    "checkpoint's linear layers to 8 bits at load (Q8_0 blocks on the same integer kernel, or "
                    "Triton's Q8_0 kernel on a GPU)",
    "cpu_gemm_path": "how a CPU multiplies the matrices kept in GGUF blocks: auto times every path at start on "
                     "the model's own shapes, at decode and prefill row counts, and takes the fastest (cached per "
                     "machine); int8 (the integer kernel), int8_fused (the same kernel and bits, its fused decode "
                     "for up to 16 rows on AVX2), int8_i16 (the same kernel with int16 sums per Q4_K super-block for 13+ "
                     "rows on AVX2), onednn_bf16 (dequantized to bf16, oneDNN) or f32 (dequantized "
                     "to float32, torch's GEMM) force one wherever a matrix can take it",
    "dtype": f"model dtype: {', '.join(DTYPES)}; auto: bf16 where the device has native bf16 (a CPU with AVX512_BF16 / AMX, or the engine's bf16 GEMM on AVX2 + FMA; a GPU with bf16 tensor cores), float32 checkpoints included (logged; float32 keeps them exact; the embedded tiny model stays float32); else float32 (a GPU keeps a float16 checkpoint's dtype). bf16 on a CPU with the C++ GEMM keeps the weights in bf16 and the activations in float32",
    "kv_cache_dtype": f"KV cache dtype: {', '.join(KV_CACHE_DTYPES)}; auto: the activations' dtype, except fp16 in the CPU's bf16 mode (bf16 weights, float32 activations; as llama.cpp's default)",
    "device": "cpu, cuda, or auto (cuda when available)",
    "seed": "random seed for weights of dummy models and for sampling",
    "context_length": "override the model's context length",
    "is_embedding": "serve the model as an embedding model (/encode, /v1/embeddings): pooling from its sentence-transformers modules.json, else last token, normalized",
    "max_total_tokens": "KV cache pool size in tokens; derived from memory when not given",
    "mem_fraction_static": "GPU: fraction of free memory for weights and the KV cache",
    "cpu_kv_cache_bytes": "CPU: byte budget for the KV cache pool",
    "max_running_requests": "most requests decoding at once; derived from the pool when not given",
    "page_size": "tokens per KV cache page",
    "attention_backend": "attention kernels: torch_native (any device) or triton (GPU; CPU only under TRITON_INTERPRET=1)",
    "disable_cuda_graph": "run decode eagerly instead of replaying captured CUDA graphs",
    "cuda_graph_max_bs": "largest decode batch captured as a CUDA graph; larger batches run eagerly",
    "schedule_policy": f"order of the waiting queue: {', '.join(SCHEDULE_POLICIES)}",
    "schedule_conservativeness": "higher reserves more KV for running requests (fewer retractions)",
    "chunked_prefill_size": "the most prompt tokens one prefill forward takes (longer prompts are split into chunks); by device when unset: 512 on a CPU, 2048 on a GPU; -1 disables chunking",
    "max_prefill_tokens": "most new prompt tokens in one prefill batch",
    "enable_mixed_chunk": "run the decode batch inside chunked prefill forwards",
    "enable_deterministic_inference": "batch-invariant kernels: a request's tokens and logprobs do not depend on what it "
                                      "is batched with, on chunked prefill or on prefix-cache hits (with sampling_seed, "
                                      "at temperature > 0 too)",
    "disable_radix_cache": "no prefix sharing between requests",
    "radix_eviction_policy": "radix cache eviction: lru or lfu",
    "max_queued_requests": "refuse new requests with 503 while this many wait; none = unbounded",
    "prefill_max_requests": "most new requests in one prefill batch",
    "enable_priority_scheduling": "order by the request's priority and preempt lower ones",
    "schedule_low_priority_values_first": "with priority scheduling: smaller values first",
    "priority_scheduling_preemption_threshold": "priority difference that allows preemption",
    "stream_interval": "stream every this many tokens",
    "allow_auto_truncate": "cut an input longer than the context to its first context_len - 1 tokens instead of refusing it (400)",
    "enable_custom_logit_processor": "let requests name a registered custom_logit_processor with JSON arguments",
    "disable_overlap_schedule": "run the scheduler's normal loop instead of the overlap loop (default: the overlap loop on GPU, the normal loop on CPU)",
    "disable_consecutive_prefill_overlap": "overlap loop: process a prefill's result before launching the next prefill (lower TTFT)",
    "test_retract_interval": "testing: force a retraction every this many decode steps",
    "enable_hybrid_swa_memory": "models with sliding-window layers: keep those layers' KV only for the tokens inside a window, in a pool of its own (the SWA pool); asked for, what it cannot run with is refused at start",
    "swa_full_tokens_ratio": "with the SWA pool: its slots per full pool slot",
    "enable_hierarchical_cache": "HiCache: keep KV evicted from the device pool in a host memory pool and load it back on a prefix hit",
    "hicache_ratio": "HiCache: host pool size as a multiple of the device KV pool",
    "hicache_size": "HiCache: host pool size in GB; 0 = use --hicache-ratio",
    "hicache_write_policy": "HiCache: when device KV is copied to the host: write_through (on insert), write_through_selective (on the second hit), write_back (on eviction)",
    "hicache_storage_backend": "HiCache storage tier below the host pool: file (a directory; extra config {\"path\": ...}) or mooncake (Mooncake Store; extra config {\"master_server_address\": \"host:port\"}); none = no storage tier",
    "hicache_storage_backend_extra_config": "HiCache storage tier: a JSON object of backend settings (path; master_server_address, global_segment_size, ...; prefetch_threshold, prefetch_timeout_base, prefetch_timeout_per_ki_token)",
    "hicache_storage_prefetch_policy": "HiCache storage tier: best_effort (a request takes the pages prefetched by the time it is scheduled), wait_complete (it waits for the prefetch), timeout (it waits up to a bound)",
    "hicache_mem_layout": "HiCache: host pool layout, SGLang's values (layer_first, page_first, page_first_direct); accepted for SGLang's command lines, the host pool here is always layer_first ([2, layers, tokens, heads, dim])",
    "hicache_io_backend": "HiCache: host<->device copy backend, SGLang's values (direct, kernel, kernel_ascend); radixserve does every copy as a torch index copy, on the CPU a memory copy",
    "test_check_memory": "testing: after every scheduler step, check that every KV page is free, cached, or held by a live request",
    "speculative_algorithm": f"speculative decoding: {', '.join(SPECULATIVE_ALGORITHMS)} (NGRAM: drafts from an n-gram cache of prompts and outputs, no extra weights; STANDALONE: a smaller draft model; EAGLE: a draft head on the target's hidden states, a token tree; NEXTN: EAGLE with the model's own multi-token-prediction layers, Qwen3-Next / Qwen3.5)",
    "speculative_num_draft_tokens": "tokens per request in one verify forward, the last sampled token included (drafts + 1); default: 4 for NGRAM, 8 for EAGLE; a chain (STANDALONE, topk 1): --speculative-num-steps + 1",
    "speculative_draft_model_path": "STANDALONE: the draft model (a Hugging Face directory or a .gguf) with the target's tokenizer and vocabulary; EAGLE: the head's directory (or a Qwen3-Next / Qwen3.5 checkpoint: its MTP layers); NEXTN: the model's own unless given",
    "speculative_num_steps": f"draft forwards (the tree's depth) per step; default: {STANDALONE_DEFAULT_NUM_STEPS} for STANDALONE, {EAGLE_DEFAULTS[0]} for EAGLE",
    "speculative_eagle_topk": f"EAGLE: branches per node of the draft tree (1: a chain); default: {EAGLE_DEFAULTS[1]}; STANDALONE: 1",
    "speculative_ngram_min_match_window_size": "NGRAM: shortest suffix of a request's tokens looked up in the n-gram cache",
    "speculative_ngram_max_match_window_size": "NGRAM: longest suffix looked up (the longest that matches drafts)",
    "speculative_ngram_max_bfs_breadth": "NGRAM: continuations per node of the draft tree, breadth first (1: a chain)",
    "speculative_ngram_capacity": "NGRAM: most n-grams the cache keeps (the least recently seen go first)",
    "enable_lora": "serve LoRA adapters (PEFT directories) of the base model, many in one batch",
    "lora_paths": "LoRA adapters to load at start: name=path ... (a PEFT directory: adapter_config.json + adapter_model.safetensors)",
    "max_loras_per_batch": "most distinct LoRA adapters in one batch (slots of the LoRA memory pool)",
    "max_lora_rank": "largest LoRA rank served; default: the largest of --lora-paths",
    "lora_target_modules": "modules LoRA may target (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or all); default: those of --lora-paths",
    "max_loaded_loras": "most LoRA adapters kept in host memory; none = no limit",
    "allowed_local_media_path": "images: a directory whose files a request may name (a path or file:// URL); none = no local files",
    "enable_media_url_fetch": "images: let requests name http(s) URLs, which the server fetches (off: data URLs and allowed files only)",
    "max_image_pixels": "images: largest width x height taken (checked before decoding); larger is a 400",
    "max_image_bytes": "images: largest encoded image taken; larger is a 400",
    "mm_embedding_cache_mb": "images: MB of vision-encoder outputs kept by image hash (least recently used out first)",
    "disable_mm_encode_ahead": "images: run the vision encoder inside the prefill step (default: on an encoder thread as the request is queued, beside the decode of others)",
    "disaggregation_mode": "PD disaggregation: null (prefill and decode here), prefill, or decode; put sglang-router --pd-disaggregation in front",
    "disaggregation_bootstrap_port": "prefill server: port of the handshake socket decode servers connect to (give it to the router after the prefill URL)",
    "disaggregation_transfer_backend": "how KV moves from prefill to decode: mooncake (Mooncake transfer engine, TCP or RDMA) or fake (through ZeroMQ)",
    "disaggregation_timeout": "seconds a PD request may wait for the other server (handshake, KV transfer) before it fails",
    "host": "address to bind; 0.0.0.0 exposes the server to the network",
    "port": "HTTP port",
    "served_model_name": "model name in the OpenAI API; the model path when not given",
    "weight_version": "version of the served weights, reported in every response's meta_info; weight updates and /update_weight_version set it",
    "log_level": "debug, info, warning or error",
    "skip_tokenizer_init": "no tokenizer: input_ids in, output_ids out",
    "skip_server_warmup": "do not send the warm-up request (a short /generate, or /encode) that the server runs once "
                          "it listens and before /health turns 200",
    "api_key": "require 'Authorization: Bearer KEY' on every route but /health",
    "admin_api_key": "the operations routes (weights, LoRA load/unload, release/resume, pause, profile, flush) take "
                     "only 'Authorization: Bearer KEY'; without it they answer only on a loopback --host",
    "max_request_body_bytes": "refuse larger request bodies with 413",
    "watchdog_timeout": "seconds the scheduler may have work without progress before the server exits",
    "decode_log_interval": "log one decode line every this many decode batches",
    "max_concurrent_requests": "most requests (each sample of n counts) in flight over HTTP; more get 503",
    "zmq_hwm": "most messages queued towards the scheduler; new requests beyond get 503",
    "max_sessions": "most open sessions; /open_session beyond gets 503",
    "session_timeout": "seconds an unused session stays open",
    "grammar_cache_size": "compiled grammars kept in the cache (least recently used are dropped)",
    "request_timeout": "abort a request that runs longer than this many seconds (504); none = no limit",
    "health_check_timeout": "/health answers 503 when the scheduler has not reported for this many seconds; "
                            "/health_generate when its probe gets no answer in this time",
    "graceful_shutdown_timeout": "on SIGTERM, seconds in-flight requests get to finish (new ones get 503)",
    "grammar_backend": f"structured output backend: {', '.join(GRAMMAR_BACKENDS)}",
    "grammar_timeout": "abort a request whose grammar has not compiled after this many seconds",
    "tool_call_parser": f"parse tool calls out of chat output: {', '.join(TOOL_CALL_PARSERS)}; none = no parsing",
    "reasoning_parser": f"split chat output into reasoning_content and content: {', '.join(REASONING_PARSERS)}",
    "constrained_json_whitespace_pattern": "regex of the whitespace allowed in JSON-schema output; none = compact JSON",
}


@dataclass
class PortArgs:
    """The ZeroMQ endpoints of one server: ipc sockets in a private temporary directory, so two
    servers on one machine never collide and shutdown removes every socket file."""

    ipc_dir: str
    tokenizer_ipc_name: str  # detokenizer (and scheduler replies) -> tokenizer manager
    scheduler_input_ipc_name: str  # tokenizer manager -> scheduler
    detokenizer_ipc_name: str  # scheduler -> detokenizer

    @classmethod
    def init_new(cls, ipc_dir: Optional[str] = None) -> "PortArgs":
        import tempfile

        ipc_dir = ipc_dir or tempfile.mkdtemp(prefix="radixserve-ipc-")  # mode 0700
        return cls(
            ipc_dir,
            f"ipc://{ipc_dir}/tokenizer",
            f"ipc://{ipc_dir}/scheduler_input",
            f"ipc://{ipc_dir}/detokenizer",
        )


def parse_lora_paths(lora_paths: Any) -> Dict[str, str]:
    """--lora-paths: "name=path" or "path" (named by its path) entries, or a dict name -> path."""
    if not lora_paths:
        return {}
    if isinstance(lora_paths, dict):
        return {str(k): str(v) for k, v in lora_paths.items()}
    if isinstance(lora_paths, str):
        lora_paths = [lora_paths]
    out: Dict[str, str] = {}
    for item in lora_paths:
        name, sep, path = str(item).partition("=")
        out[name if sep else item] = path if sep else item
    return out


def _arg_type(f: dataclasses.Field) -> Any:
    t = str(f.type)
    if "int" in t:
        return int
    if "float" in t:
        return float
    return str


def _choice(flag: str, value: str, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{flag} must be one of {', '.join(choices)}; got {value!r}")
