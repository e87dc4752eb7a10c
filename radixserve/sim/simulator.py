"""The scheduler simulator: a workload replayed through the production Scheduler (its
PrefillAdder, RadixCache, pools, retraction, chunking, mixed chunk) on a virtual clock.

    client (arrival times, --max-concurrency)       virtual clock `now`
        │ TokenizedGenerateReqInput at the first step boundary after its send time
        ▼
    Scheduler.run_step()  ── run_batch ──> SimModelWorker: cost_model.step(batch) seconds
        │ BatchTokenIDOutput                        now += those seconds
        ▼
    per-request token times -> TTFT / ITL / TPOT / E2E (the metrics of bench serving)

The scheduler runs its normal loop (no overlap thread): the part of scheduling that overlap
would hide is not charged at all, and the exposed part is the cost model's per-step overhead.
When nothing is running the clock jumps to the next arrival, so a long trace runs in the time
the scheduler's own Python takes, not in its duration.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional

from radixserve.bench.datasets import DatasetRow, arrival_times
from radixserve.bench.metrics import RequestOutput, calculate_metrics
from radixserve.models.model_config import ModelConfig
from radixserve.protocol import BatchTokenIDOutput, TokenizedGenerateReqInput
from radixserve.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs
from radixserve.sim.cost_model import DeviceSpec
from radixserve.sim.worker import make_sim_scheduler

# Steps in a row without a forward while requests wait: the scheduler can never admit them.
MAX_IDLE_STEPS = 3


@dataclass
class StepRecord:
    time: float  # virtual time at the end of the step
    mode: str  # extend / decode / mixed
    batch_size: int
    num_tokens: int  # tokens computed in this forward
    seconds: float
    num_waiting: int
    num_running: int
    token_usage: float


@dataclass
class SimResult:
    outputs: List[RequestOutput]
    metrics: Dict[str, Any]
    steps: List[StepRecord]
    scheduler_stats: Dict[str, Any]
    pool: Dict[str, int]
    wall_seconds: float
    errors: List[str] = field(default_factory=list)


class Simulator:
    def __init__(self, server_args: ServerArgs, model_config: ModelConfig, device: DeviceSpec,
                 rows: List[DatasetRow], request_rate: float = float("inf"), burstiness: float = 1.0,
                 max_concurrency: Optional[int] = None, seed: int = 1, record_steps: bool = True,
                 progress: bool = False):
        self.rows = rows
        self._inbox: List[Any] = []
        self._outbox: List[Any] = []
        self.scheduler, self.worker = make_sim_scheduler(
            server_args, model_config, device, recv_fn=self._drain, send_fn=self._outbox.append
        )
        if all(r.arrival_time is not None for r in rows):
            self.times = [float(r.arrival_time) for r in rows]
        else:
            self.times = arrival_times(len(rows), request_rate, burstiness, seed)
        self.max_concurrency = max_concurrency
        self.record_steps = record_steps
        self.progress = progress
        # --pp-size: a slot without a micro-batch is a step without a forward, not a stuck scheduler
        self.pp_loop_size = server_args.pp_size + server_args.pp_async_batch_depth if server_args.pp_size > 1 else 0

    def _drain(self) -> List[Any]:
        items, self._inbox = self._inbox, []
        return items

    def run(self) -> SimResult:
        t_wall = time.perf_counter()
        sched, rows, n = self.scheduler, self.rows, len(self.rows)
        order = sorted(range(n), key=lambda i: self.times[i])
        outputs = [RequestOutput(prompt_len=r.prompt_len) for r in rows]
        send_time = [0.0] * n
        tokens = [0] * n
        last = [0.0] * n
        maxc = self.max_concurrency
        free_slots: Deque[float] = deque([0.0] * maxc) if maxc else deque()
        steps: List[StepRecord] = []
        errors: List[str] = []
        now, next_i, done, idle_steps = 0.0, 0, 0, 0
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=n, desc="simulate", leave=False)

        while done < n:
            # The client: every request whose time has come and that has a concurrency slot.
            while next_i < n and self.times[order[next_i]] <= now and (not maxc or free_slots):
                i = order[next_i]
                next_i += 1
                send_time[i] = max(self.times[i], free_slots.popleft()) if maxc else self.times[i]
                outputs[i].start_time = send_time[i]
                self._inbox.append(self._make_request(i, rows[i]))
            if not self._inbox and not sched.has_work():
                if next_i >= n:
                    break
                # Idle: jump to the next arrival (a slot is free, or something would be running).
                now = max(now, self.times[order[next_i]])
                continue

            sched.process_input_requests(self._drain())
            if self.worker.pp_transport is not None:  # --pp-size: the stages' clock starts from here
                self.worker.pp_transport.now = now
            batch = sched.run_step()
            dt = self.worker.take_elapsed()
            now += dt
            if batch is None:
                idle_steps += 1
                if idle_steps > MAX_IDLE_STEPS + self.pp_loop_size and not self._outbox:
                    if next_i < n and not sched.has_work():
                        continue
                    raise RuntimeError(
                        f"the scheduler cannot admit the waiting requests ({len(sched.waiting_queue)} waiting, "
                        f"pool {sched.max_total_num_tokens} tokens): raise the pool size or shorten the requests"
                    )
            else:
                idle_steps = 0
                if self.record_steps:
                    mode = batch.forward_mode.name.lower()
                    steps.append(StepRecord(
                        now, mode, batch.batch_size(), int(batch.extend_num_tokens) if mode != "decode" else batch.batch_size(),
                        dt, len(sched.waiting_queue), sched.running_batch.batch_size(), self._token_usage(),
                    ))

            outs, self._outbox[:] = list(self._outbox), []
            for out in outs:
                if not isinstance(out, BatchTokenIDOutput):
                    continue
                for k, rid in enumerate(out.rids):
                    i = int(rid)
                    o = outputs[i]
                    total = out.output_ids_len[k]
                    new = total - tokens[i]
                    if new > 0:
                        if tokens[i] == 0:
                            o.ttft = now - send_time[i]
                        else:
                            o.itl.append(now - last[i])
                        o.chunks.append((now, new))
                        tokens[i], last[i] = total, now
                    reason = out.finished_reasons[k]
                    if reason is not None:
                        o.latency = now - send_time[i]
                        o.output_len = tokens[i]
                        o.cached_tokens = out.cached_tokens[k]
                        o.success = reason.get("type") != "abort"
                        if not o.success:
                            errors.append(str(reason.get("message")))
                        done += 1
                        if maxc:
                            free_slots.append(now)
                        if bar is not None:
                            bar.update(1)
        if bar is not None:
            bar.close()

        t_first = min((self.times[i] for i in range(n)), default=0.0)
        metrics = calculate_metrics(outputs, now - t_first)
        prompt = sum(o.prompt_len for o in outputs if o.success)
        metrics["cache_hit_rate"] = metrics["cached_tokens"] / prompt if prompt else 0.0
        stats = sched.get_stats()
        metrics["num_retracted_reqs"] = stats.num_retracted_reqs
        metrics["num_forwards"] = self.worker.num_forwards
        if self.worker.pp_transport is not None:  # each stage's busy share and bubble over the run
            metrics["pp_stages"] = self.worker.pp_transport.stage_report(now - t_first)
        sched.check_memory()  # everything finished: every slot is free or in the tree
        pool = dict(max_total_num_tokens=sched.max_total_num_tokens, max_running_requests=sched.max_running_requests,
                    context_len=sched.context_len)
        return SimResult(outputs, metrics, steps, stats.to_dict(), pool, time.perf_counter() - t_wall, errors)

    def _make_request(self, i: int, row: DatasetRow) -> TokenizedGenerateReqInput:
        sp = SamplingParams(max_new_tokens=row.output_len, temperature=0.0, ignore_eos=True)
        sp.normalize(None)
        ids = row.input_ids
        if ids is None:
            raise ValueError("the simulator needs token ids (text rows need a tokenizer: use an ids dataset)")
        return TokenizedGenerateReqInput(str(i), None, list(ids), sp, stream=True)

    def _token_usage(self) -> float:
        s = self.scheduler
        total = s.max_total_num_tokens
        used = total - s.ledger.available_size() - s.tree_cache.evictable_size()
        return used / total if total else 0.0


def simulate(server_args: ServerArgs, model_config: ModelConfig, device: DeviceSpec, rows: List[DatasetRow],
             **kwargs: Any) -> SimResult:
    return Simulator(server_args, model_config, device, rows, **kwargs).run()
