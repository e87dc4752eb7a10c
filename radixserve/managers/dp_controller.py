"""DataParallelController (seed 001 §25.5): with --dp-size M, one process between the
TokenizerManager and M scheduler groups (each of --tp-size ranks, its own model copy).

    TokenizerManager --PUSH--> [scheduler_input] PULL  controller  PUSH --> [scheduler_input-dp{i}]
    scheduler dp{i} rank 0 --PUSH--> [controller_reply] PULL  controller  PUSH --> [tokenizer]
    scheduler dp{i} rank 0 --PUSH--> [detokenizer]   (token outputs go straight on)

Generate requests go to one replica, the one DPBudget picks (managers/dp_budget.py: round_robin,
decode_round_robin, shortest_queue or minimum_tokens from the load each replica reports, or the
request's own data_parallel_rank); aborts and control queries (flush, state, pause, memory release, profiling,
...) go to all, and the controller merges their replies into one, so the TokenizerManager never
knows there are several.
"""

from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass, replace
from typing import Any, Dict, List

from radixserve.managers.dp_budget import DPBudget
from radixserve.managers.process_utils import (become_server_child, configure_process_logging,
                                               leave_stop_signals_to_launcher)
from radixserve.layers.expert_distribution import merge_expert_records
from radixserve.protocol import (
    BatchTokenizedEmbeddingReqInput,
    BatchTokenizedGenerateReqInput,
    ExpertDistributionReqOutput,
    GetInternalStateReqOutput,
    GetWeightsByNameReqOutput,
    SchedulerLoad,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from radixserve.server_args import PortArgs, ServerArgs

logger = logging.getLogger("radixserve.dp_controller")

# Internal-state keys that add up over replicas; the others are averaged.
_SUMMED = {
    "num_retractions", "num_retracted_reqs", "num_preempted_reqs", "num_prefill_batches", "num_decode_batches",
    "num_mixed_batches", "num_chunked_prefills", "prompt_tokens", "cached_tokens", "max_total_num_tokens",
    "max_running_requests", "num_waiting_reqs", "num_running_reqs", "available_tokens", "evictable_tokens",
    "protected_tokens", "forward_ct", "gen_throughput", "num_held_reqs",
    "spec_verify_ct", "spec_num_accept_tokens", "spec_num_correct_drafts", "spec_num_proposed_drafts",
    "num_grammar_queue_reqs", "num_grammar_total", "num_grammar_cache_hit", "num_grammar_aborted", "num_grammar_timeout",
    "grammar_compilation_time_sum", "num_encode_queue_reqs",
}


def dp_port_args(port_args: PortArgs, dp_rank: int) -> PortArgs:
    """The endpoints a replica's rank 0 uses: its own input socket, replies to the controller."""
    return replace(
        port_args,
        scheduler_input_ipc_name=f"{port_args.scheduler_input_ipc_name}-dp{dp_rank}",
        tokenizer_ipc_name=controller_reply_ipc_name(port_args),
    )


def controller_reply_ipc_name(port_args: PortArgs) -> str:
    return f"ipc://{port_args.ipc_dir}/controller_reply"


@dataclass
class _Gather:
    """Replies gathered so far from the replicas for one fanned-out query."""

    replies: List[Any]


class DataParallelController:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs, context: Any = None):
        import zmq

        self.dp_size = server_args.dp_size
        self.budget = DPBudget(self.dp_size, server_args.load_balance_method)
        self.ctx = context or zmq.Context(2)
        self.recv_from_tokenizer = self.ctx.socket(zmq.PULL)
        self.recv_from_tokenizer.bind(port_args.scheduler_input_ipc_name)
        self.recv_from_schedulers = self.ctx.socket(zmq.PULL)
        self.recv_from_schedulers.bind(controller_reply_ipc_name(port_args))
        self.send_to_tokenizer = self.ctx.socket(zmq.PUSH)
        self.send_to_tokenizer.connect(port_args.tokenizer_ipc_name)
        self.workers = []
        for i in range(self.dp_size):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(dp_port_args(port_args, i).scheduler_input_ipc_name)
            self.workers.append(sock)
        self.pending: Dict[str, _Gather] = {}  # by query_id

    # ---- routing --------------------------------------------------------------------------
    def dispatch(self, req: Any) -> None:
        items = getattr(getattr(req, "mm_inputs", None), "items", None) or ()  # images: ViT DP (dp_budget.py)
        i = self.budget.choose(len(req.input_ids), getattr(req, "bootstrap_room", None),
                               getattr(req, "data_parallel_rank", None), [it.hash for it in items],
                               sum(it.pixel_values.shape[0] for it in items))
        self.workers[i].send_pyobj(req)

    def handle_tokenizer_message(self, obj: Any) -> None:
        if isinstance(obj, (TokenizedGenerateReqInput, TokenizedEmbeddingReqInput)):
            self.dispatch(obj)
        elif isinstance(obj, (BatchTokenizedGenerateReqInput, BatchTokenizedEmbeddingReqInput)):
            for r in obj.batch:
                self.dispatch(r)
        else:
            if getattr(obj, "query_id", ""):  # a control query: one merged reply
                self.pending[obj.query_id] = _Gather([])
            for w in self.workers:  # aborts and queries: every replica
                w.send_pyobj(obj)

    def handle_scheduler_message(self, obj: Any) -> None:
        if isinstance(obj, SchedulerLoad):
            self.budget.on_load(obj.dp_rank, obj.num_reqs, obj.num_tokens)
            return
        query_id = getattr(obj, "query_id", None)
        gather = self.pending.get(query_id) if query_id else None
        if gather is None:  # token-free messages (heartbeats) pass through
            self.send_to_tokenizer.send_pyobj(obj)
            return
        gather.replies.append(obj)
        if len(gather.replies) == self.dp_size:
            del self.pending[query_id]
            self.send_to_tokenizer.send_pyobj(self.merge(gather.replies))

    def merge(self, replies: List[Any]) -> Any:
        first = replies[0]
        if isinstance(first, GetWeightsByNameReqOutput):  # SGLang's shape: one list per replica
            params = [r.parameter for r in replies]
            return replace(first, parameter=None if None in params else params)
        if isinstance(first, ExpertDistributionReqOutput) and all(r.success and r.record for r in replies):
            return replace(first, record=merge_expert_records([r.record for r in replies]))
        if not isinstance(first, GetInternalStateReqOutput):
            if not hasattr(first, "success"):
                return first
            # flush, pause, memory release, profiling, ...: it succeeded where every replica's did
            messages = "; ".join(dict.fromkeys(r.message for r in replies if getattr(r, "message", "")))
            return replace(first, success=all(r.success for r in replies),
                           **({"message": messages} if hasattr(first, "message") else {}))
        # in replica order (they answer in any order): /get_server_info's internal_states[i] is replica i
        states = sorted((r.internal_state for r in replies), key=lambda s: s.get("dp_rank", 0))
        merged: Dict[str, Any] = {}
        for key in states[0]:
            values = [s.get(key) for s in states]
            if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                merged[key] = sum(values) if key in _SUMMED else sum(values) / len(values)
            elif key.endswith("_counts") and all(isinstance(v, list) and len(v) == len(values[0]) for v in values):
                merged[key] = [sum(c) for c in zip(*values)]  # a histogram's buckets: every replica's
            else:
                merged[key] = values[0]
        merged.pop("dp_rank", None)  # each replica's, in dp_states
        merged["dp_size"] = self.dp_size
        merged["dp_states"] = states
        merged["dp_num_dispatched"] = list(self.budget.num_dispatched)
        return GetInternalStateReqOutput(merged, replies[0].query_id)

    # ---- loop -----------------------------------------------------------------------------
    def event_loop(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self.recv_from_tokenizer, zmq.POLLIN)
        poller.register(self.recv_from_schedulers, zmq.POLLIN)
        while True:
            for sock, _ in poller.poll(1000):
                while True:
                    try:
                        obj = sock.recv_pyobj(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if sock is self.recv_from_tokenizer:
                        self.handle_tokenizer_message(obj)
                    else:
                        self.handle_scheduler_message(obj)


def run_data_parallel_controller_process(server_args: ServerArgs, port_args: PortArgs, pipe: Any) -> None:
    become_server_child(port_args.ipc_dir)  # never outlive the launcher
    configure_process_logging(server_args, "dp controller")
    try:
        controller = DataParallelController(server_args, port_args)
    except Exception:
        pipe.send({"status": "error", "error": traceback.format_exc()})
        raise SystemExit(1)
    leave_stop_signals_to_launcher()  # from now on SIGTERM / SIGINT are the launcher's
    pipe.send({"status": "ready", "pid": os.getpid()})
    try:
        controller.event_loop()
    except Exception:
        logger.error("DataParallelController hit an exception:\n%s", traceback.format_exc())
        os._exit(1)
