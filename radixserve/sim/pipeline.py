"""`radixserve simulate --pp-size N`: the PP loop's schedule (managers/scheduler_pp.py) on the
virtual clock. The real SchedulerPP runs on the first stage; its messages go to this
SimPipeline instead of to processes (SimModelWorker.pp_transport):

    send(PPBatchMessage) at `now`:  stage s starts the micro-batch when it arrives from stage
        s-1 and stage s is free; it takes the step's cost x the stage's share of the layers
        (the cost model's whole-model step, split by --pp-partition)
    recv(): the oldest micro-batch's tokens; the first stage's loop waits (the clock moves)
        until the last stage has finished it

Each stage's busy time is summed, so the bubble (1 - busy / duration) can be read per stage.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Deque, List, Tuple

import torch

from radixserve.distributed.parallel_state import get_pp_indices
from radixserve.model_executor.tp_worker import GenerationBatchResult
from radixserve.protocol import PPBatchMessage, PPBatchResult
from radixserve.sim.cost_model import CostModel


class SimPipeline:
    def __init__(self, cost_model: CostModel, pp_size: int, partition: Any, num_layers: int, token_id: int):
        self.cost_model = cost_model
        self.token_id = token_id
        spans = [get_pp_indices(num_layers, s, pp_size, partition) for s in range(pp_size)]
        self.shares = [(end - start) / num_layers for start, end in spans]
        self.free = [0.0] * pp_size  # when each stage finishes what it has queued
        self.busy = [0.0] * pp_size
        self.pending: Deque[Tuple[float, int]] = deque()  # (ready time, batch size), in launch order
        self.now = 0.0  # the simulator's clock at the start of this scheduler step
        self.elapsed = 0.0  # how far this step moved the first stage's clock

    def send(self, obj: Any, dst_stage: int) -> None:
        if not isinstance(obj, PPBatchMessage):
            return  # PPKeepAlive / PPStop: nothing to simulate
        wb = obj.worker_batch
        if wb.forward_mode.is_decode():
            ext, pre = [1] * wb.batch_size, [n - 1 for n in wb.seq_lens_cpu]
        else:
            ext, pre = list(wb.extend_seq_lens), list(wb.extend_prefix_lens)
        step = self.cost_model.step(ext, pre).seconds
        t = self.now + self.elapsed
        for s, share in enumerate(self.shares):
            start = max(t, self.free[s])
            t = self.free[s] = start + step * share
            self.busy[s] += step * share
        self.pending.append((t, wb.batch_size))

    def recv(self, src_stage: int) -> PPBatchResult:
        ready, bs = self.pending.popleft()
        self.elapsed = max(self.elapsed, ready - self.now)
        return PPBatchResult(GenerationBatchResult(None, torch.full((bs,), self.token_id, dtype=torch.int64)))

    def close(self) -> None:
        pass

    def take_elapsed(self) -> float:
        t, self.elapsed = self.elapsed, 0.0
        return t

    def stage_report(self, duration: float) -> List[dict]:
        return [{"stage": s, "layers_share": share, "busy_s": busy, "busy_share": busy / duration if duration else 0.0,
                 "bubble": 1 - busy / duration if duration else 0.0}
                for s, (share, busy) in enumerate(zip(self.shares, self.busy))]
