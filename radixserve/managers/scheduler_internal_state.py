"""SGLang's /set_internal_state on the scheduler's side: settings an operator may change while the
server runs (SetInternalStateReq.server_args), checked against what the server was built with.

    max_running_requests   1 .. the request pool's rows (the pool, the CUDA graphs and the overlap
                           loop's FutureMap are sized at start; lowering it is the useful move:
                           requests running beyond it finish, new ones wait)
    chunked_prefill_size   page_size .. (no upper bound); in the overlap loop, no smaller than
                           the FutureMap's chunk count allows (ceil(context_len / size) chunks)

A bad value changes nothing and the reply says which field and why (the HTTP route's 400). The
front end checks names and types first (make_set_internal_state_req); this checks ranges, since
only the scheduler knows its pool (it is also driven directly).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Type

from radixserve.protocol import SetInternalStateReq, SetInternalStateReqOutput

SETTABLE_AT_RUN_TIME: Tuple[str, ...] = ("max_running_requests", "chunked_prefill_size")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class RunTimeLimits:
    """What the scheduler was built with: the bounds of the values it can take now."""

    pool_rows: int  # the most requests the request pool (and the FutureMap) holds
    page_size: int
    context_len: int
    overlap_max_chunks: Optional[int]  # the overlap loop's FutureMap: chunks per prompt; None: no overlap
    pipeline_parallel: bool

    def min_chunk(self) -> int:
        if self.overlap_max_chunks is None:
            return self.page_size
        return max(self.page_size, _ceil_div(self.context_len, self.overlap_max_chunks))


def settable_type_problem(updates: Any) -> Optional[str]:
    """Names and types (the front end's check): a non-empty object of settable integers."""
    if not isinstance(updates, dict) or not updates:
        return f"server_args must be a non-empty object; settable at run time: {', '.join(SETTABLE_AT_RUN_TIME)}."
    for name, value in updates.items():
        if name not in SETTABLE_AT_RUN_TIME:
            return (f"server_args.{name} cannot be set at run time; settable: "
                    f"{', '.join(SETTABLE_AT_RUN_TIME)}.")
        if isinstance(value, bool) or not isinstance(value, int):
            return f"server_args.{name} must be an integer, got {value!r}."
    return None


def internal_state_problem(updates: Dict[str, Any], limits: RunTimeLimits) -> Optional[str]:
    """Why these updates cannot be applied (naming the field), or None."""
    problem = settable_type_problem(updates)
    if problem is not None:
        return problem
    if "max_running_requests" in updates:
        value = updates["max_running_requests"]
        if limits.pipeline_parallel:
            return "server_args.max_running_requests cannot be changed at run time with --pp-size > 1."
        if not 1 <= value <= limits.pool_rows:
            return (f"server_args.max_running_requests must be in [1, {limits.pool_rows}] (the request pool's rows, "
                    f"sized at start), got {value}.")
    if "chunked_prefill_size" in updates:
        value, low = updates["chunked_prefill_size"], limits.min_chunk()
        if value < low:
            why = "the page size" if low == limits.page_size else "the overlap loop's FutureMap, sized at start"
            return f"server_args.chunked_prefill_size must be at least {low} ({why}), got {value}."
    return None


class SchedulerInternalState:
    """The scheduler's handler of SetInternalStateReq (every TP rank applies the same update):
    `current` reads the settable values, `apply` sets them (Scheduler.apply_internal_state)."""

    def __init__(self, limits: RunTimeLimits, current: Callable[[], Dict[str, Any]],
                 apply: Callable[[Dict[str, Any]], None]):
        self.limits = limits
        self.current = current
        self.apply = apply

    @classmethod
    def limits_of(cls, max_running_requests: int, page_size: int, context_len: int, chunked_prefill_size: Optional[int],
                  enable_overlap: bool, pipeline_parallel: bool) -> RunTimeLimits:
        start_chunk = chunked_prefill_size or context_len
        return RunTimeLimits(
            pool_rows=max_running_requests, page_size=page_size, context_len=context_len,
            overlap_max_chunks=_ceil_div(context_len, start_chunk) if enable_overlap else None,
            pipeline_parallel=pipeline_parallel,
        )

    def dispatch_entries(self) -> List[Tuple[Type, Callable[[Any], Any]]]:
        return [(SetInternalStateReq, self.set_internal_state)]

    def set_internal_state(self, recv: SetInternalStateReq) -> SetInternalStateReqOutput:
        problem = internal_state_problem(recv.server_args, self.limits)
        if problem is not None:
            return SetInternalStateReqOutput(False, problem, self.current(), recv.query_id)
        self.apply(recv.server_args)
        return SetInternalStateReqOutput(True, "", self.current(), recv.query_id)
