"""ModelRunner: owns the model, the KV pools and the sampler of one (TP rank of a) model."""

from __future__ import annotations

import gc
import logging
import os
from typing import Any, Dict, List, Optional, Tuple

import torch

from radixserve.distributed.parallel_state import (
    all_reduce_min,
    broadcast_from_first_rank,
    init_distributed_environment,
    set_moe_ep_size,
    stage_layers,
)
from radixserve.eplb.eplb_manager import EPLBManager, load_logical_count
from radixserve.layers.attention.base_attn_backend import AttentionBackend
from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend
from radixserve.layers import batch_invariant
from radixserve.layers.cpu_weight_only import convert_to_weight_only, resolve_kv_cache_dtype, weight_only_available
from radixserve.layers.logits_processor import LogitsProcessorOutput
from radixserve.layers.expert_distribution import ExpertDistributionRecorder
from radixserve.layers.moe import FusedMoE
from radixserve.layers.pooler import EmbeddingPoolerOutput, Pooler, PoolingConfig
from radixserve.layers.sampler import Sampler, SamplerOutput
from radixserve.layers.quantization.gguf import select_cpu_gemm_paths
from radixserve.lora.lora_manager import LoRAManager
from radixserve.mem_cache.mamba_pool import HybridReqToTokenPool, MambaPool
from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from radixserve.mem_cache.swa_memory_pool import SWAKVPool, SWATokenToKVPoolAllocator
from radixserve.model_executor.cuda_graph_runner import CudaGraphRunner
from radixserve.model_executor.forward_batch import ForwardBatch, ModelWorkerBatch
from radixserve.model_executor.model_loader import check_w8a8, get_model, gguf_block_types
from radixserve.model_executor.weight_updater import ModelWeightUpdater
from radixserve.models.model_config import LoadError, ModelConfig
from radixserve.models.qwen2_5_vl import check_vision_server_args
from radixserve.models.qwen3_next import check_hybrid_server_args
from radixserve.models.qwen3_next_mtp import MTP_ARCHITECTURES, mtp_config
from radixserve.models.registry import MODEL_REGISTRY
from radixserve.server_args import ServerArgs
from radixserve.utils import trim_heap

logger = logging.getLogger(__name__)

# GPU memory left outside the KV pool for the decode graphs' shared pool (one forward's
# activations at the largest captured batch): a fixed part plus, per row, the float32 logits
# and their low-precision original with slack. Loosely SGLang's reserve that grows with
# --cuda-graph-max-bs; without it the graphs' pool would eat into what the KV pool counted on.
CUDA_GRAPH_FIXED_RESERVE_BYTES = 256 * 1024**2
CUDA_GRAPH_BYTES_PER_VOCAB_ENTRY = 8
# Hybrid (linear-attention) models without --max-running-requests: state slots for at most this
# many requests, and at most this share of the memory budget (the rest is the KV pool's).
HYBRID_DEFAULT_MAX_RUNNING_REQUESTS = 256
HYBRID_STATE_BUDGET_SHARE = 0.25


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def share_cpu_cores(ranks_on_this_machine: int) -> None:
    """Each of the ranks that run forwards on this machine's CPU gets its share of the cores:
    OpenMP threads of several ranks on the same cores would wait on each other at every op."""
    if ranks_on_this_machine > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_on_this_machine))


class ModelRunner:
    def __init__(self, model_config: ModelConfig, server_args: ServerArgs, tp_rank: int = 0, tp_size: int = 1,
                 shared_slots: Optional[Tuple[ReqToTokenPool, TokenToKVPoolAllocator]] = None, pp_rank: int = 0):
        # shared_slots: another runner's req_to_token_pool and allocator (a STANDALONE draft model):
        # this runner's KV buffers are indexed by the same slots (init_memory_pool).
        self.shared_slots = shared_slots
        self.model_config = model_config
        self.server_args = server_args
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.device = resolve_device(server_args.device)
        self.dtype = model_config.resolve_dtype(server_args.dtype, self.device)  # the weights'
        self.page_size = server_args.page_size
        # A hybrid model (linear-attention layers, their states in a MambaPool): refuse what it does
        # not run with, before loading anything.
        self.is_hybrid = hasattr(MODEL_REGISTRY.get(model_config.architecture), "mamba_state_shape")
        if self.is_hybrid:
            check_hybrid_server_args(server_args, model_config.model_path or model_config.architecture)
        if getattr(MODEL_REGISTRY.get(model_config.architecture), "takes_images", False):
            check_vision_server_args(server_args, model_config.model_path or model_config.architecture)
        if server_args.enable_deterministic_inference:  # before loading: GGUF's paths are chosen at load
            why = batch_invariant.unsupported_for_model(self.device, self.is_hybrid, model_config.sliding_window,
                                                        model_config.head_dim)
            if why is not None:
                raise LoadError(f"--enable-deterministic-inference does not run with {why}")
        # set either way: an in-process Engine without the flag may follow one with it
        batch_invariant.enable_batch_invariant_mode(server_args.enable_deterministic_inference)
        if self.device == "cpu":
            share_cpu_cores(server_args.dp_size * tp_size * server_args.pp_size // server_args.nnodes)
        if tp_size > 1 or server_args.pp_size > 1:  # --pp-size: this stage's TP group and the stages' group
            init_distributed_environment(tp_rank, tp_size, server_args.dist_init_addr, self.device, pp_rank,
                                         server_args.pp_size, server_args.pp_partition_list(), server_args.watchdog_timeout)
        set_moe_ep_size(server_args.ep_size, server_args.ep_num_redundant_experts)  # which expert slots this rank's MoE layers hold
        torch.manual_seed(server_args.seed)
        # --quantization: the GGUF types the linear layers keep in their blocks (layers/quantization/)
        self.gguf_block_types = gguf_block_types(server_args.quantization, model_config, self.dtype, self.device)
        self.model = get_model(model_config, server_args.load_format, self.dtype, self.device, server_args.seed,
                               self.gguf_block_types, check_w8a8(server_args.quantization, model_config, self.device))
        if getattr(self.model, "mm_cache", None) is not None:  # a model that takes images: its encoder outputs
            self.model.mm_cache.max_bytes = server_args.mm_embedding_cache_mb * 1024 * 1024
        # bf16 on a CPU with the C++ GEMM: bf16 weights, float32 activations (cpu_weight_only.py)
        self.weight_only = weight_only_available(self.dtype, self.device)
        if self.weight_only:
            convert_to_weight_only(self.model)
        self.activation_dtype = torch.float32 if self.weight_only else self.dtype
        if self.device == "cpu":  # which GEMM multiplies each GGUF-block matrix: measured (gemm_select.py)
            select_cpu_gemm_paths(self.model, server_args.cpu_gemm_path)
            trim_heap()  # the load's freed temporaries back to the OS (resident memory, issue 54)
        self.lora_manager = self.init_lora_manager()
        self.expert_recorder = ExpertDistributionRecorder.for_model(self.model, FusedMoE)
        self.eplb_manager = self.init_eplb_manager()  # EPLB: re-placing the experts (radixserve/eplb/)
        self.weight_updater = ModelWeightUpdater(self)  # weight updates without a restart
        self.kv_cache_dtype = resolve_kv_cache_dtype(server_args.kv_cache_dtype, self.activation_dtype, self.weight_only)
        # Both attention backends apply a sliding window (serving_context_len keeps the cap for one that would not).
        self.context_len = model_config.serving_context_len(server_args.context_length, windowed_attention=True)
        if model_config.sliding_window is not None and server_args.speculative_algorithm is not None:
            raise LoadError(f"{model_config.model_path}: speculative decoding with sliding-window attention is not "
                            f"implemented yet (the verify forward attends to every key)")
        self.attn_backend = self.init_attention_backend()
        # --is-embedding: the pooling of the model directory's sentence-transformers config
        self.pooler = Pooler(PoolingConfig.from_model_path(model_config.model_path)) if server_args.is_embedding else None
        self.init_memory_pool()
        self.sampler = Sampler()
        self.cuda_graph_runner = self.init_cuda_graphs()

    def init_lora_manager(self) -> Optional[LoRAManager]:
        if not self.server_args.enable_lora:
            return None
        # Adapters in the weights' dtype, like the base weights (bf16 in the CPU's bf16 mode, where
        # activations are float32): half the bytes the kernel reads per step (benchmarks/NOTES.md).
        return LoRAManager.from_server_args(self.model, self.server_args, self.dtype, self.device)

    def init_eplb_manager(self) -> Optional[EPLBManager]:
        """--enable-eplb / --init-expert-location / --ep-num-redundant-experts: the experts'
        placement manager; a model it cannot serve is refused with one line."""
        a = self.server_args
        if not (a.enable_eplb or a.init_expert_location or a.ep_num_redundant_experts):
            return None
        path = self.model_config.model_path or self.model_config.architecture
        rec = self.expert_recorder
        if rec is None:
            raise LoadError(f"{path}: EPLB flags (--enable-eplb, --ep-num-redundant-experts, --init-expert-location) "
                            f"need a model with experts")
        if any(layer.expert_blocks is not None for layer in rec.layers):
            raise LoadError(f"{path}: EPLB with the experts kept in GGUF blocks is not supported yet (load them as floats: --quantization none)")
        manager = EPLBManager(rec.layers, a.ep_size, lambda: rec.counts, broadcast_from_first_rank,
                              a.eplb_rebalance_num_iterations if a.enable_eplb else None)
        if a.init_expert_location:
            try:
                stats = manager.rebalance(load_logical_count(a.init_expert_location))
            except (OSError, ValueError, RuntimeError) as e:
                raise LoadError(f"--init-expert-location {a.init_expert_location}: {e}") from None
            logger.info("Experts placed from %s: %s", a.init_expert_location, stats)
        if a.enable_eplb:
            rec.start()  # the load the periodic rebalances read
        return manager

    def eplb_rebalance(self) -> Dict[str, float]:
        """Re-place the experts now from the recorded load (every TP rank, at a step boundary)."""
        if self.eplb_manager is None:
            raise ValueError("EPLB is off: start the server with --enable-eplb or --ep-num-redundant-experts (and --ep-size > 1).")
        return self.eplb_manager.rebalance()

    def on_forward_pass_end(self) -> None:
        """A step boundary: EPLB's periodic rebalance may run here."""
        if self.eplb_manager is not None:
            self.eplb_manager.on_forward_pass_end()

    def init_attention_backend(self) -> AttentionBackend:
        if self.server_args.attention_backend == "triton":
            from radixserve.layers.attention.triton_backend import TritonAttnBackend  # imports triton

            return TritonAttnBackend(self.device, sliding_window=self.model_config.sliding_window)
        return TorchNativeAttnBackend(self.device, sliding_window=self.model_config.sliding_window)

    def use_cuda_graph(self) -> bool:
        return (
            self.device == "cuda"
            and self.lora_manager is None  # the LoRA delta runs eagerly (server_args refuses the pair)
            and not self.server_args.disable_cuda_graph
            and not self.server_args.is_embedding  # the graphs are of decode steps
            and self.attn_backend.cuda_graph_unsupported_reason is None
            and self.server_args.pp_size == 1  # a stage's graphs would need its proxy tensors as inputs
            and not self.is_hybrid  # the linear layers' extend metadata is built on the host
            # the experts' loop reads on the host which experts a batch hits (layers/moe.py)
            and not any(isinstance(m, FusedMoE) for m in self.model.modules())
        )

    def init_cuda_graphs(self) -> Optional[CudaGraphRunner]:
        if not self.use_cuda_graph():
            reason = self.attn_backend.cuda_graph_unsupported_reason
            if self.device == "cuda" and not self.server_args.disable_cuda_graph:
                logger.info("CUDA graphs off: %s: %s", type(self.attn_backend).__name__, reason)
            return None
        try:
            return CudaGraphRunner(self)
        except Exception as e:
            raise RuntimeError(f"capturing the decode CUDA graphs failed ({e}); retry with --disable-cuda-graph") from e

    # ---- memory -------------------------------------------------------------------------
    def num_stage_layers(self) -> int:
        """Decoder layers this process holds: its pipeline stage's (all without --pp-size)."""
        start, end = stage_layers(self.model_config.num_hidden_layers)
        return end - start

    def kv_heads_per_rank(self) -> int:
        return max(1, self.model_config.num_key_value_heads // self.tp_size)

    def num_kv_layers(self) -> int:
        """Layers whose KV the pool holds: this stage's, or a hybrid model's full-attention ones."""
        return self.model.num_kv_layers() if self.is_hybrid else self.num_stage_layers()

    def profile_max_num_token(self, reserved_bytes: int = 0) -> int:
        """KV pool size in tokens from the memory budget (seed 004), less reserved_bytes (a
        hybrid model's state pool)."""
        cfg = self.model_config
        per_token = MHATokenToKVPool.bytes_per_token(
            self.kv_heads_per_rank(), cfg.head_dim, self.num_kv_layers(), self.kv_cache_dtype
        ) + self.draft_kv_bytes_per_token()
        return max(int((self.memory_budget_bytes() - reserved_bytes) // per_token), 0)

    def memory_budget_bytes(self) -> float:
        """Bytes for the KV pool (and a hybrid model's state pool): on a GPU what is left of
        --mem-fraction-static after the weights (and the decode graphs), on a CPU --cpu-kv-cache-bytes."""
        cfg = self.model_config
        if self.device == "cuda":
            # Memory of objects already dropped (an engine made and failed before this one, in
            # the same process) would count as used by others: collect and release it first.
            gc.collect()
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info()
            total = torch.cuda.get_device_properties(0).total_memory
            used_by_others = total - free
            budget = total * self.server_args.mem_fraction_static - used_by_others
            if self.use_cuda_graph():
                budget -= CUDA_GRAPH_FIXED_RESERVE_BYTES + (
                    self.server_args.cuda_graph_max_bs * cfg.vocab_size * CUDA_GRAPH_BYTES_PER_VOCAB_ENTRY
                )
        else:
            budget = self.server_args.cpu_kv_cache_bytes
        return budget

    def draft_kv_bytes_per_token(self) -> int:
        """--speculative-algorithm STANDALONE / EAGLE / NEXTN: the draft's KV bytes per slot, counted
        in the budget of the pool it shares (every slot holds the target's KV and the draft's). A
        NEXTN draft is the checkpoint's MTP layers (mtp_config), not the whole model."""
        args = self.server_args
        if args.speculative_algorithm not in ("STANDALONE", "EAGLE") or not args.speculative_draft_model_path:
            return 0
        cfg = ModelConfig.from_pretrained(args.speculative_draft_model_path)
        if args.speculative_algorithm == "EAGLE" and cfg.architecture in MTP_ARCHITECTURES:
            cfg = mtp_config(cfg)
        heads = max(1, cfg.num_key_value_heads // self.tp_size)
        return MHATokenToKVPool.bytes_per_token(heads, cfg.head_dim, cfg.num_hidden_layers, self.kv_cache_dtype)

    def init_shared_memory_pool(self) -> None:
        """KV buffers of this model for every slot of another runner's pool (shared_slots)."""
        self.req_to_token_pool, self.token_to_kv_pool_allocator = self.shared_slots
        self.max_total_num_tokens = self.token_to_kv_pool_allocator.size
        self.max_running_requests = self.req_to_token_pool.size - 1
        self.token_to_kv_pool = MHATokenToKVPool(
            self.max_total_num_tokens, self.page_size, self.kv_cache_dtype, self.kv_heads_per_rank(),
            self.model_config.head_dim, self.model_config.num_hidden_layers, self.device,
        )

    def init_memory_pool(self) -> None:
        if self.shared_slots is not None:
            return self.init_shared_memory_pool()
        args = self.server_args
        max_reqs, state_pool_bytes = args.max_running_requests, 0
        # The hybrid radix cache keeps its prefix snapshots in the state pool: as many slots again as
        # rows, so that a new row always finds one (at most one locked snapshot per row).
        slots_per_row = 1 if args.disable_radix_cache else 2
        if self.is_hybrid:  # the state pool's slots cap the running requests; its bytes come off the KV budget
            shape = self.model.mamba_state_shape()
            max_reqs = max_reqs or max(1, min(HYBRID_DEFAULT_MAX_RUNNING_REQUESTS, int(
                self.memory_budget_bytes() * HYBRID_STATE_BUDGET_SHARE
                // (shape.bytes_per_slot(self.activation_dtype) * slots_per_row))))
            state_pool_bytes = MambaPool.bytes_for((max_reqs + 1) * slots_per_row, shape, self.activation_dtype)
        if self.use_swa_pool():
            return self.init_swa_memory_pool()
        max_tokens = args.max_total_tokens or self.profile_max_num_token(state_pool_bytes)
        # Ranks must agree on the pool (they run the same schedule): take the smallest.
        max_tokens = all_reduce_min(max_tokens) // self.page_size * self.page_size
        if max_tokens < self.page_size:
            states = f" after the state pool's {state_pool_bytes / 2**20:.0f} MB (lower --max-running-requests)" \
                if state_pool_bytes else ""
            raise RuntimeError(f"not enough memory for the KV cache{states}; lower the model size or raise the budget")
        self.max_total_num_tokens = max_tokens
        max_reqs = max_reqs or min(max(max_tokens // self.context_len * 512, 2048), 4096)
        self.max_running_requests = max_reqs
        if self.is_hybrid:  # each request row holds a state slot: allocated and freed with it
            self.mamba_pool = MambaPool((max_reqs + 1) * slots_per_row, self.model.mamba_state_shape(),
                                        self.activation_dtype, self.device)
            self.req_to_token_pool = HybridReqToTokenPool(max_reqs + 1, self.context_len + 4, self.mamba_pool,
                                                          self.device)
            logger.info("State pool: %d slots, %.1f MB", self.mamba_pool.size, self.mamba_pool.mem_bytes() / 2**20)
        else:
            self.req_to_token_pool = ReqToTokenPool(max_reqs + 1, self.context_len + 4, self.device)
        self.token_to_kv_pool = MHATokenToKVPool(
            max_tokens, self.page_size, self.kv_cache_dtype, self.kv_heads_per_rank(), self.model_config.head_dim,
            self.num_kv_layers(), self.device,
        )
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(max_tokens, self.page_size, self.device)
        logger.info("KV pool: %d tokens of %s, max running requests: %d, context: %d", max_tokens,
                    str(self.kv_cache_dtype).removeprefix("torch."), max_reqs, self.context_len)

    def use_swa_pool(self) -> bool:
        """The SWA pool for a model with sliding-window layers: where it was asked for
        (--enable-hybrid-swa-memory; what it cannot run with was refused at start, or is here),
        and by default where it runs; elsewhere one KV pool, with a log line saying why."""
        asked = self.server_args.enable_hybrid_swa_memory
        name = self.model_config.model_path or self.model_config.architecture
        if asked is False:
            return False
        if self.model_config.sliding_window is None:
            if asked:
                logger.info("--enable-hybrid-swa-memory: %s has no sliding-window layers; one KV pool", name)
            return False
        why = "a linear-attention (state pool) model" if self.is_hybrid else self.server_args.hybrid_swa_memory_unsupported()
        if why is None:
            size, size_swa = self.swa_pool_sizes()
            need = self.swa_pool_min_size()
            if size_swa < need:
                why = (f"a SWA pool of {size_swa} slots: it needs {need} (3 x sliding window {self.model_config.sliding_window} "
                       f"+ --chunked-prefill-size {self.server_args.chunked_prefill_size_on(self.device)} + 8); raise --swa-full-tokens-ratio "
                       f"or the KV budget")
        if why is None:
            return True
        if asked:
            raise LoadError(f"--enable-hybrid-swa-memory does not run with {why}")
        logger.info("one KV pool for %s's windowed layers too: the SWA pool does not run with %s "
                    "(--disable-hybrid-swa-memory: this without the line)", name, why)
        return False

    def swa_pool_min_size(self) -> int:
        """A prefill chunk beside a decoding request must fit: the windows their prefixes lock, the
        decoding one's own window (kept a forward late) and the chunk."""
        return 3 * self.model_config.sliding_window + (self.server_args.chunked_prefill_size_on(self.device) or 0) + 8

    def swa_pool_sizes(self) -> Tuple[int, int]:
        """(full slots, swa slots) of the SWA pool layout, the same on every rank."""
        args, cfg = self.server_args, self.model_config
        window_layers = cfg.window_layers
        n_swa = sum(window_layers)
        if args.max_total_tokens:
            size = args.max_total_tokens
            size_swa = int(size * args.swa_full_tokens_ratio)
        else:
            per_layer_token = MHATokenToKVPool.bytes_per_token(self.kv_heads_per_rank(), cfg.head_dim, 1, self.kv_cache_dtype)
            size, size_swa = SWAKVPool.sizes_for_budget(self.memory_budget_bytes(), per_layer_token,
                                                        len(window_layers) - n_swa, n_swa, args.swa_full_tokens_ratio)
        return all_reduce_min(size), all_reduce_min(size_swa)

    def init_swa_memory_pool(self) -> None:
        """The SWA pool (mem_cache/swa_memory_pool.py): full layers' KV for every slot, windowed
        layers' KV in swa_full_tokens_ratio as many slots, handed out and dropped by the ledger."""
        args, cfg = self.server_args, self.model_config
        window_layers = cfg.window_layers
        n_swa = sum(window_layers)
        size, size_swa = self.swa_pool_sizes()
        self.max_total_num_tokens = size
        max_reqs = args.max_running_requests or min(max(size // self.context_len * 512, 2048), 4096)
        self.max_running_requests = max_reqs
        self.req_to_token_pool = ReqToTokenPool(max_reqs + 1, self.context_len + 4, self.device)
        self.token_to_kv_pool_allocator = SWATokenToKVPoolAllocator(size, size_swa, self.device)
        self.token_to_kv_pool = SWAKVPool(size, size_swa, self.kv_cache_dtype, self.kv_heads_per_rank(), cfg.head_dim,
                                          window_layers, self.token_to_kv_pool_allocator, self.device)
        logger.info("KV pools: full %d tokens x %d layers, SWA %d tokens x %d layers (window %d), %.1f MB of %s; "
                    "max running requests: %d, context: %d", size, len(window_layers) - n_swa, size_swa, n_swa,
                    cfg.sliding_window, self.token_to_kv_pool.mem_bytes() / 2**20,
                    str(self.kv_cache_dtype).removeprefix("torch."), max_reqs, self.context_len)

    # ---- weight updates (weight_updater.py): each returns (success, message) ----------------
    def update_weights_from_disk(self, model_path: str, load_format: Optional[str] = None) -> Tuple[bool, str]:
        return self.weight_updater.update_weights_from_disk(model_path, load_format)

    def update_weights_from_tensor(self, named_tensors: List[Any], load_format: Optional[str] = None) -> Tuple[bool, str]:
        return self.weight_updater.update_weights_from_tensor(named_tensors, load_format)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str = "gloo", timeout: float = 15.0) -> Tuple[bool, str]:
        return self.weight_updater.init_weights_update_group(master_address, master_port, rank_offset, world_size,
                                                             group_name, backend, timeout)

    def join_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str = "gloo", timeout: float = 15.0) -> Optional[str]:
        return self.weight_updater.join_update_group(master_address, master_port, rank_offset, world_size,
                                                     group_name, backend, timeout)

    def finish_weights_update_group_join(self, group_name: str, error: Optional[str]) -> Tuple[bool, str]:
        return self.weight_updater.finish_update_group_join(group_name, error)

    def update_weights_from_distributed(self, names: List[str], dtypes: List[str], shapes: List[List[int]],
                                        group_name: str) -> Tuple[bool, str]:
        return self.weight_updater.update_weights_from_distributed(names, dtypes, shapes, group_name)

    def destroy_weights_update_group(self, group_name: str) -> Tuple[bool, str]:
        return self.weight_updater.destroy_weights_update_group(group_name)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Optional[List[Any]]:
        return self.weight_updater.get_weights_by_name(name, truncate_size)

    # ---- forward ------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        if self.cuda_graph_runner is not None and self.cuda_graph_runner.can_run(forward_batch):
            return self.cuda_graph_runner.replay(forward_batch)
        if forward_batch.attn_metadata is None:  # ForwardBatch.init_new left it for a replay
            self.attn_backend.init_forward_metadata(forward_batch)
        if self.lora_manager is not None:
            self.lora_manager.prepare_lora_batch(forward_batch)
        return self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)

    @torch.inference_mode()
    def forward_embedding(self, forward_batch: ForwardBatch) -> EmbeddingPoolerOutput:
        """--is-embedding: an EXTEND forward's final hidden states, pooled per request."""
        if forward_batch.attn_metadata is None:
            self.attn_backend.init_forward_metadata(forward_batch)
        hidden_states = self.model(forward_batch.input_ids, forward_batch.positions, forward_batch, get_embedding=True)
        return self.pooler(hidden_states, forward_batch)

    @torch.inference_mode()
    def sample(self, logits_output: LogitsProcessorOutput, batch: ModelWorkerBatch) -> SamplerOutput:
        out = self.sampler(
            logits_output.next_token_logits,
            batch.sampling_info,
            batch.return_logprob,
            batch.top_logprobs_nums,
            token_bitmask=batch.token_bitmask,
            token_ids_logprobs=batch.token_ids_logprobs,
        )
        broadcast_from_first_rank(out.next_token_ids)
        return out
