"""TpModelWorker: the scheduler's handle on the model (one per TP rank)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from radixserve.layers.logits_processor import LogitsProcessorOutput
from radixserve.layers.pooler import PoolingConfig
from radixserve.lora.lora_manager import LoRAManager
from radixserve.model_executor.forward_batch import ForwardBatch, ModelWorkerBatch
from radixserve.model_executor.memory_saver import MemorySaverAdapter
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.models.model_config import ModelConfig
from radixserve.multimodal.embedder import ImageEmbedder
from radixserve.protocol import (
    DestroyWeightsUpdateGroupReqInput, GetWeightsByNameReqInput, InitWeightsUpdateGroupReqInput,
    UpdateWeightFromDiskReqInput, UpdateWeightsFromDistributedReqInput, UpdateWeightsFromTensorReqInput,
)
from radixserve.server_args import ServerArgs


@dataclass
class GenerationBatchResult:
    logits_output: Optional[LogitsProcessorOutput]
    next_token_ids: torch.Tensor  # [bs] int64
    next_token_logprobs: Optional[torch.Tensor] = None
    top_logprobs_val: Optional[List[List[float]]] = None
    top_logprobs_idx: Optional[List[List[int]]] = None
    token_ids_logprobs_val: Optional[List[Optional[List[float]]]] = None  # per request (token_ids_logprob)
    copy_done: Any = None  # CUDA event: next_token_ids (pinned host memory) is filled (overlap)
    # Speculative decoding (SGLang's name): drafts accepted per request; next_token_ids then holds
    # accept_lens[i] + 1 tokens of each request back to back (logprobs likewise).
    accept_lens: Optional[List[int]] = None
    num_drafts: Optional[List[int]] = None  # drafts each request verified (set on every speculative decode step)


class TpModelWorker:
    pp_transport = None  # --pp-size: the stages talk over torch.distributed (the simulator's worker brings its own)

    def __init__(self, server_args: ServerArgs, model_config: ModelConfig, tp_rank: int = 0, tp_size: int = 1,
                 pp_rank: int = 0):
        self.server_args = server_args
        self.model_config = model_config
        self.model_runner = ModelRunner(model_config, server_args, tp_rank, tp_size, pp_rank=pp_rank)
        self.device = self.model_runner.device
        self.dtype = self.model_runner.dtype
        self.max_total_num_tokens = self.model_runner.max_total_num_tokens
        self.max_running_requests = self.model_runner.max_running_requests
        self.context_len = self.model_runner.context_len
        # SGLang's expert distribution recorder (EPLB's input); None for a model without experts
        self.expert_recorder = self.model_runner.expert_recorder

    def get_memory_pool(self):
        r = self.model_runner
        return r.req_to_token_pool, r.token_to_kv_pool_allocator

    def get_kv_pool(self):
        """The K/V buffers (the ledger moves a tree verify's KV; HiCache copies to the host)."""
        return self.model_runner.token_to_kv_pool

    # ---- what features ask of the model (worker_protocol.py: nobody reaches into model_runner) ----
    @property
    def lora_manager(self) -> Optional[LoRAManager]:
        return self.model_runner.lora_manager

    def pooling_config(self) -> PoolingConfig:
        """--is-embedding: how the model's pooler pools (CLS, mean, last token)."""
        return self.model_runner.pooler.config

    def embed_and_head(self) -> Tuple[torch.nn.Module, torch.nn.Module]:
        """The token embedding and the LM head (EAGLE's head shares both)."""
        model = self.model_runner.model
        return model.model.embed_tokens, model.lm_head

    def image_embedder(self) -> Optional[ImageEmbedder]:
        """A model that takes images: its encoder and embedding cache (the EncodeQueue encodes ahead)."""
        return getattr(self.model_runner.model, "embedder", None)

    def memory_saver(self) -> MemorySaverAdapter:
        return MemorySaverAdapter(self.model_runner)

    def eplb_rebalance(self) -> Dict[str, float]:
        return self.model_runner.eplb_rebalance()

    # ---- weight updates (SGLang's TpModelWorker: a request in, (success, message) out) ----------
    def update_weights_from_disk(self, recv_req: UpdateWeightFromDiskReqInput) -> Tuple[bool, str]:
        return self.model_runner.update_weights_from_disk(recv_req.model_path, recv_req.load_format)

    def update_weights_from_tensor(self, recv_req: UpdateWeightsFromTensorReqInput) -> Tuple[bool, str]:
        return self.model_runner.update_weights_from_tensor(recv_req.named_tensors, recv_req.load_format)

    def init_weights_update_group(self, recv_req: InitWeightsUpdateGroupReqInput) -> Tuple[bool, str]:
        r = recv_req
        return self.model_runner.init_weights_update_group(r.master_address, r.master_port, r.rank_offset,
                                                           r.world_size, r.group_name, r.backend, r.timeout)

    def join_weights_update_group(self, recv_req: InitWeightsUpdateGroupReqInput) -> Optional[str]:
        """The join alone, for a thread of its own (finish_weights_update_group_join agrees after)."""
        r = recv_req
        return self.model_runner.join_weights_update_group(r.master_address, r.master_port, r.rank_offset,
                                                           r.world_size, r.group_name, r.backend, r.timeout)

    def finish_weights_update_group_join(self, recv_req: InitWeightsUpdateGroupReqInput,
                                         error: Optional[str]) -> Tuple[bool, str]:
        return self.model_runner.finish_weights_update_group_join(recv_req.group_name, error)

    def update_weights_from_distributed(self, recv_req: UpdateWeightsFromDistributedReqInput) -> Tuple[bool, str]:
        r = recv_req
        return self.model_runner.update_weights_from_distributed(r.names, r.dtypes, r.shapes, r.group_name)

    def destroy_weights_update_group(self, recv_req: DestroyWeightsUpdateGroupReqInput) -> Tuple[bool, str]:
        return self.model_runner.destroy_weights_update_group(recv_req.group_name)

    def get_weights_by_name(self, recv_req: GetWeightsByNameReqInput) -> Optional[List[Any]]:
        return self.model_runner.get_weights_by_name(recv_req.name, recv_req.truncate_size)

    @staticmethod
    def to_host(t: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        """Start the device -> host copy of sampled tokens; returns (host tensor, event).

        On CUDA the copy goes into pinned memory without blocking, and the event marks when it
        is done: the forward thread goes straight on to launch the next batch, and only the
        scheduler thread waits (PendingResult.wait), right before it reads the tokens.
        """
        if t.device.type == "cpu":
            return t, None
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        copy_done = torch.cuda.Event()
        copy_done.record()
        return host, copy_done

    def forward_batch_embedding(self, batch: ModelWorkerBatch) -> torch.Tensor:
        """--is-embedding: a prefill's pooled hidden states, [bs, hidden] float32 on the CPU
        (each request's part of its embedding; see layers/pooler.py)."""
        forward_batch = ForwardBatch.init_new(batch, self.model_runner)
        return self.model_runner.forward_embedding(forward_batch).embeddings.cpu()

    def forward_batch_generation(self, batch: ModelWorkerBatch, skip_sample: bool = False) -> GenerationBatchResult:
        forward_batch = ForwardBatch.init_new(batch, self.model_runner)
        logits_output = self.model_runner.forward(forward_batch)
        if skip_sample:
            return GenerationBatchResult(logits_output, torch.empty(0, dtype=torch.int64))
        out = self.model_runner.sample(logits_output, batch)
        self.model_runner.on_forward_pass_end()  # a step boundary (EPLB)
        return GenerationBatchResult(
            logits_output,
            out.next_token_ids,
            out.next_token_logprobs,
            out.top_logprobs_val,
            out.top_logprobs_idx,
            token_ids_logprobs_val=out.token_ids_logprobs_val,
        )
