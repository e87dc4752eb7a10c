"""What the Scheduler, its helpers, the speculative workers, LoRA and PP may ask of a TP worker
(issue 40): `TpModelWorker` (tp_worker.py) serves it, and so does the simulator's
`SimModelWorker` (sim/worker.py). No caller reaches into the worker's `model_runner`: what it
needs of the model is a method here.

    forward           forward_batch_generation, forward_batch_embedding, to_host
    KV geometry       get_memory_pool (the rows and the allocator: the KV ledger is built on
                      them), get_kv_pool (the K/V buffers; None: nothing is computed)
    features          lora_manager (None: --enable-lora off), pooling_config (--is-embedding),
                      embed_and_head (EAGLE's head shares them), memory_saver (release/resume),
                      expert_recorder (MoE models: EPLB's expert distribution record),
                      image_embedder (a model that takes images: the EncodeQueue encodes ahead),
                      eplb_rebalance (EPLB: re-place the experts now)
    weight updates    SchedulerUpdateWeights calls the update_weights_* family (TpModelWorker's)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional, Protocol, Tuple

import torch

if TYPE_CHECKING:
    from radixserve.layers.expert_distribution import ExpertDistributionRecorder
    from radixserve.layers.pooler import PoolingConfig
    from radixserve.lora.lora_manager import LoRAManager
    from radixserve.model_executor.forward_batch import ModelWorkerBatch
    from radixserve.model_executor.memory_saver import MemorySaverAdapter
    from radixserve.model_executor.tp_worker import GenerationBatchResult
    from radixserve.models.model_config import ModelConfig
    from radixserve.multimodal.embedder import ImageEmbedder


class ModelWorker(Protocol):
    """A TP rank's model as the scheduler's side sees it."""

    model_config: "ModelConfig"
    device: str
    max_total_num_tokens: int
    max_running_requests: int
    context_len: int
    pp_transport: Any  # --pp-size: the stages' messages (None: torch.distributed's, GlooTransport)
    expert_recorder: Optional["ExpertDistributionRecorder"]  # None: a model without experts

    def get_memory_pool(self) -> Tuple[Any, Any]:
        """(ReqToTokenPool, TokenToKVPoolAllocator): the scheduler builds its KV ledger on them."""

    def get_kv_pool(self) -> Optional[Any]:
        """The K/V buffers (a tree verify's KV moves, HiCache, PD); None: a simulated worker."""

    def forward_batch_generation(self, batch: "ModelWorkerBatch", skip_sample: bool = False) -> "GenerationBatchResult":
        """Run one batch (and sample, unless a PP stage's first part)."""

    def to_host(self, t: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        """Start the copy of sampled tokens to the host; (host tensor, event or None)."""

    @property
    def lora_manager(self) -> Optional["LoRAManager"]:
        """The adapters' manager (None: --enable-lora is off, or a simulated worker)."""

    def memory_saver(self) -> Optional["MemorySaverAdapter"]:
        """Release/resume of the KV pool, the weights and the CUDA graphs (None: nothing to release)."""

    def image_embedder(self) -> Optional["ImageEmbedder"]:
        """The vision encoder and its embedding cache (None: a model without images)."""

    def eplb_rebalance(self) -> Dict[str, float]:
        """EPLB: re-place the experts now from the recorded load (ValueError: EPLB is off)."""


class EmbeddingWorker(ModelWorker, Protocol):
    """--is-embedding: a prefill's pooled hidden states."""

    def pooling_config(self) -> "PoolingConfig": ...

    def forward_batch_embedding(self, batch: "ModelWorkerBatch") -> torch.Tensor: ...


class TargetWorker(ModelWorker, Protocol):
    """What a speculative worker may ask of its target model."""

    dtype: torch.dtype

    def embed_and_head(self) -> Tuple[torch.nn.Module, torch.nn.Module]:
        """The target's token embedding and LM head (an EAGLE head shares both)."""
