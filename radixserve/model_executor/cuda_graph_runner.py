"""CudaGraphRunner: decode forwards captured once per batch size as CUDA graphs, then replayed.

A decode step launches hundreds of small kernels; replaying a captured graph launches them all
at once, with no Python in between. A graph replays exactly the kernels it recorded, on the
same memory, so everything a step changes must live in static device tensors:

    static buffers (max_bs rows, allocated once)       a replay of raw batch size 3, graph bs 4
    input_ids, positions, req_pool_indices,       ->   | r0 | r1 | r2 | pad |  unused ... |
    seq_lens, out_cache_loc                             0              3     4          max_bs

Padding requests read req_to_token row 0 with seq_len `seq_len_fill_value` and write their
KV to slot 0, the padding slot the allocator never hands out. The attention backend refills
its own static metadata before each replay (init_forward_metadata_replay_cuda_graph).
Sampling stays outside the graph. Batches the graphs cannot run (extend/mixed, too large,
all-position logits, input logprobs) take the eager path.

The graph mechanism is injectable (GraphBackend) so the CPU tests can stand in an eager
replay with the same semantics: capture-time Python objects stay frozen, only tensor
contents change between replays.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol

import torch

from radixserve.distributed.parallel_state import get_tp_group
from radixserve.layers.logits_processor import LogitsProcessorOutput
from radixserve.model_executor.forward_batch import ForwardBatch, ForwardMode
from radixserve.utils import progress

logger = logging.getLogger(__name__)


def get_batch_sizes_to_capture(max_bs: int, max_running_requests: int) -> List[int]:
    """[1, 2, 4, 8, 16, 24, ...] up to max_bs; no batch exceeds max_running_requests."""
    limit = min(max_bs, max_running_requests)
    return [bs for bs in [1, 2, 4, 8] + list(range(16, max_bs + 1, 8)) if bs <= limit]


class CapturedGraph(Protocol):
    output: torch.Tensor  # written by every replay, in place

    def replay(self) -> None: ...


class GraphBackend(Protocol):
    def new_pool(self) -> Any: ...

    def capture(self, fn: Callable[[], torch.Tensor], pool: Any) -> CapturedGraph: ...


class GraphRunnerHost(Protocol):
    """What CudaGraphRunner reads of the ModelRunner that owns it (not imported: model_runner.py
    imports this module)."""

    model: torch.nn.Module
    attn_backend: Any
    server_args: Any
    model_config: Any
    max_running_requests: int
    tp_size: int
    device: Any
    req_to_token_pool: Any
    token_to_kv_pool: Any


@dataclass
class _CudaGraph:
    graph: "torch.cuda.CUDAGraph"
    output: torch.Tensor

    def replay(self) -> None:
        self.graph.replay()


class CudaGraphBackend:
    """The real mechanism: torch.cuda.CUDAGraph, all graphs in one shared memory pool."""

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream()  # capture (and warm up) off the default stream

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor], pool: Any) -> _CudaGraph:
        # Warm-up runs compile the Triton kernels and settle the allocator before recording.
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(self.stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=self.stream):
            output = fn()
        torch.cuda.synchronize()
        return _CudaGraph(graph, output)


@dataclass
class _EagerGraph:
    fn: Callable[[], torch.Tensor]
    output: torch.Tensor

    def replay(self) -> None:
        # The same callable on the same captured objects; results land in the same output
        # tensor, as a real graph's would.
        self.output.copy_(self.fn())


class EagerGraphBackend:
    """A stand-in for CPU tests: 'capture' keeps the callable, 'replay' calls it again."""

    def new_pool(self) -> Any:
        return None

    def capture(self, fn: Callable[[], torch.Tensor], pool: Any) -> _EagerGraph:
        return _EagerGraph(fn, fn())


class CudaGraphRunner:
    def __init__(self, model_runner: GraphRunnerHost, graph_backend: Optional[GraphBackend] = None):
        self.model_runner = model_runner
        self.attn_backend = model_runner.attn_backend
        self.graph_backend = graph_backend or CudaGraphBackend()
        self.capture_bs = get_batch_sizes_to_capture(
            model_runner.server_args.cuda_graph_max_bs, model_runner.max_running_requests
        )
        self.max_bs = self.capture_bs[-1]
        self.seq_len_fill_value = self.attn_backend.get_cuda_graph_seq_len_fill_value()
        cfg = model_runner.model_config
        # Raises NotImplementedError (with the reason) for a backend that cannot be captured.
        self.attn_backend.init_cuda_graph_state(
            self.max_bs, max(1, cfg.num_attention_heads // model_runner.tp_size), cfg.head_dim
        )

        def buf(fill: int) -> torch.Tensor:
            return torch.full((self.max_bs,), fill, dtype=torch.int64, device=model_runner.device)

        self.input_ids = buf(0)
        self.positions = buf(self.seq_len_fill_value - 1)
        self.req_pool_indices = buf(0)
        self.seq_lens = buf(self.seq_len_fill_value)
        self.out_cache_loc = buf(0)  # the padding slot
        self.graphs: Dict[int, CapturedGraph] = {}
        self.capture()

    # ---- capture ----------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        pool = self.graph_backend.new_pool()
        # Largest first: it sizes the shared pool, and the smaller graphs reuse its memory.
        for bs in progress(list(reversed(self.capture_bs)), desc="Capturing decode graphs", unit="graph",
                           enabled=get_tp_group().rank == 0):
            self.graphs[bs] = self.graph_backend.capture(self._capture_forward(bs), pool)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.capture_bs)

    def _capture_forward(self, bs: int) -> Callable[[], torch.Tensor]:
        """The forward a graph of bs records, on views of the static buffers. Its Python-side
        fields (seq_lens_cpu, ...) are frozen here: nothing in the graph may depend on them."""
        fill = self.seq_len_fill_value
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=[fill] * bs,
            out_cache_loc=self.out_cache_loc[:bs],
            extend_seq_lens_cpu=[1] * bs,
            extend_prefix_lens_cpu=[fill - 1] * bs,
            req_to_token_pool=self.model_runner.req_to_token_pool,
            token_to_kv_pool=self.model_runner.token_to_kv_pool,
            attn_backend=self.attn_backend,
        )
        fb.attn_metadata = self.attn_backend.init_forward_metadata_capture_cuda_graph(bs, fb.req_pool_indices, fb.seq_lens)
        model = self.model_runner.model

        def forward() -> torch.Tensor:
            return model(fb.input_ids, fb.positions, fb).next_token_logits

        return forward

    # ---- replay -----------------------------------------------------------------------------
    def can_run(self, batch: Any) -> bool:
        """batch: a ForwardBatch or ModelWorkerBatch. Only plain decode batches that fit."""
        positions = batch.input_logprob_positions
        return (
            batch.forward_mode.is_decode()
            and 0 < batch.batch_size <= self.max_bs
            and not batch.capture_all_logits
            and (positions is None or positions.numel() == 0)
            and getattr(batch, "multimodal_inputs", None) is None  # M-RoPE deltas: eager
            and not getattr(batch, "return_hidden_states", False)  # the graph returns logits only
        )

    @torch.inference_mode()
    def replay(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        raw_bs = forward_batch.batch_size
        bs = self.capture_bs[bisect.bisect_left(self.capture_bs, raw_bs)]
        if bs != raw_bs:
            self._fill_padding(raw_bs, bs)
        self.input_ids[:raw_bs].copy_(forward_batch.input_ids)
        self.positions[:raw_bs].copy_(forward_batch.positions)
        self.req_pool_indices[:raw_bs].copy_(forward_batch.req_pool_indices)
        self.seq_lens[:raw_bs].copy_(forward_batch.seq_lens)
        self.out_cache_loc[:raw_bs].copy_(forward_batch.out_cache_loc)
        self.attn_backend.init_forward_metadata_replay_cuda_graph(bs, self.req_pool_indices[:bs], self.seq_lens[:bs])
        graph = self.graphs[bs]
        graph.replay()
        # A view of the graph's output: valid until the next replay (sampling reads it first).
        return LogitsProcessorOutput(next_token_logits=graph.output[:raw_bs])

    def _fill_padding(self, raw_bs: int, bs: int) -> None:
        """Padding requests: row 0, seq_len_fill_value tokens, KV written to padding slot 0."""
        self.input_ids[raw_bs:bs].zero_()
        self.positions[raw_bs:bs].fill_(self.seq_len_fill_value - 1)
        self.req_pool_indices[raw_bs:bs].zero_()
        self.seq_lens[raw_bs:bs].fill_(self.seq_len_fill_value)
        self.out_cache_loc[raw_bs:bs].zero_()
