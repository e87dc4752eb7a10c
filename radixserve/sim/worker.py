"""SimModelWorker: stands in for TpModelWorker under the real Scheduler. No model, no KV tensors:
the real ReqToTokenPool and TokenToKVPoolAllocator (sized as ModelRunner would size them, from
the model config and the device description), and a forward that only asks the cost model how
long it would take and returns a fixed token.

The token is never an EOS id, so a request runs exactly max_new_tokens (with or without
ignore_eos): output lengths come from the workload, as in a benchmark with ignore_eos.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Tuple

import torch

from radixserve.distributed.parallel_state import get_pp_indices
from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixserve.model_executor.forward_batch import ModelWorkerBatch
from radixserve.model_executor.tp_worker import GenerationBatchResult
from radixserve.models.model_config import ModelConfig
from radixserve.server_args import ServerArgs
from radixserve.sim.cost_model import CostModel, DeviceSpec
from radixserve.sim.pipeline import SimPipeline

logger = logging.getLogger(__name__)


def pick_sim_token(model_config: ModelConfig) -> int:
    """The largest id that is not an EOS id (nor a low special id)."""
    eos = set(model_config.eos_token_ids)
    for t in range(model_config.vocab_size - 1, -1, -1):
        if t not in eos:
            return t
    raise ValueError("every token id is an EOS id")


class SimModelWorker:
    def __init__(self, server_args: ServerArgs, model_config: ModelConfig, device: DeviceSpec):
        self.server_args = server_args
        self.model_config = model_config
        self.device = "cpu"  # where the scheduler's tensors live; the simulated device is `device`
        dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(server_args.dtype, device.dtype_bytes)
        self.cost_model = CostModel(model_config, device, server_args.tp_size, dtype_bytes)
        self.context_len = model_config.serving_context_len(server_args.context_length)
        self.page_size = server_args.page_size
        self.expert_recorder = None  # no experts are routed in a simulation
        if server_args.max_total_tokens:
            max_tokens = server_args.max_total_tokens
        elif device.name == "cpu":  # ModelRunner on CPU: a byte budget, not a memory fraction
            max_tokens = server_args.cpu_kv_cache_bytes // self.cost_model.shape.kv_bytes_per_token
        else:
            max_tokens = self.cost_model.kv_pool_tokens(server_args.mem_fraction_static)
        pp_share = max(b - a for a, b in (get_pp_indices(model_config.num_hidden_layers, r, server_args.pp_size,
                                                         server_args.pp_partition_list()) for r in range(server_args.pp_size)))
        pp_share /= model_config.num_hidden_layers
        if server_args.pp_size > 1 and not server_args.max_total_tokens and device.name != "cpu":
            # --pp-size: the largest stage's weights and KV decide (the stages share the slots)
            shape = self.cost_model.shape
            budget = device.memory_bytes * server_args.mem_fraction_static - shape.weight_bytes * pp_share
            max_tokens = max(int(budget // (shape.kv_bytes_per_token * pp_share)), 0)
        max_tokens = max_tokens // self.page_size * self.page_size
        if max_tokens < self.page_size:
            raise ValueError(
                f"the model's weights ({self.cost_model.shape.weight_bytes / 1e9:.1f} GB) leave no room for a KV "
                f"cache on {device.name}: raise --tp-size or --mem-fraction-static, or give --max-total-tokens"
            )
        self.max_total_num_tokens = max_tokens
        # The same rule as ModelRunner.init_memory_pool.
        self.max_running_requests = server_args.max_running_requests or min(
            max(max_tokens // self.context_len * 512, 2048), 4096
        )
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests + 1, self.context_len + 4, self.device)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(max_tokens, self.page_size, self.device)
        self.token_id = pick_sim_token(model_config)
        # --pp-size: SchedulerPP sends its micro-batches here (the stages on the virtual clock)
        self.pp_transport = SimPipeline(self.cost_model, server_args.pp_size, server_args.pp_partition_list(),
                                        model_config.num_hidden_layers, self.token_id) if server_args.pp_size > 1 else None
        # The simulator reads and resets this after every scheduler step.
        self.elapsed = 0.0
        self.num_forwards = 0

    def get_memory_pool(self):
        return self.req_to_token_pool, self.token_to_kv_pool_allocator

    def get_kv_pool(self):
        return None  # no K/V buffers: nothing is computed

    lora_manager = None  # no adapters: nothing is computed

    def image_embedder(self) -> None:
        return None

    def memory_saver(self) -> None:
        return None  # nothing to release

    @staticmethod
    def eplb_rebalance() -> Dict[str, float]:
        raise ValueError("A simulated model has no experts to re-place.")

    @staticmethod
    def to_host(t: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return t, None  # already on the host: nothing to wait for

    def forward_batch_generation(self, batch: ModelWorkerBatch, skip_sample: bool = False) -> GenerationBatchResult:
        if batch.forward_mode.is_decode():
            ext: List[int] = [1] * batch.batch_size
            pre: List[int] = [s - 1 for s in batch.seq_lens_cpu]
        else:
            ext, pre = list(batch.extend_seq_lens), list(batch.extend_prefix_lens)
        self.num_forwards += 1
        if self.pp_transport is not None:  # the first stage's part: SimPipeline times every stage
            return GenerationBatchResult(None, torch.empty(0, dtype=torch.int64))
        self.elapsed += self.cost_model.step(ext, pre).seconds
        n = 0 if skip_sample else batch.batch_size
        return GenerationBatchResult(None, torch.full((n,), self.token_id, dtype=torch.int64))

    def take_elapsed(self) -> float:
        t, self.elapsed = self.elapsed, 0.0
        return t + (self.pp_transport.take_elapsed() if self.pp_transport is not None else 0.0)


def make_sim_scheduler(server_args: ServerArgs, model_config: ModelConfig, device: DeviceSpec,
                       recv_fn=lambda: [], send_fn=lambda obj: None):
    """The production Scheduler over a SimModelWorker (normal loop, no tokenizer)."""
    from radixserve.managers.scheduler import Scheduler
    from radixserve.managers.scheduler_builder import build_scheduler_parts

    args = server_args.replace(disable_overlap_schedule=True, skip_tokenizer_init=True)
    worker = SimModelWorker(args, model_config, device)
    return Scheduler(args, recv_fn=recv_fn, send_fn=send_fn, parts=build_scheduler_parts(args, tp_worker=worker)), worker
