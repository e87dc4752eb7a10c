"""The control requests of memory release, pause and profiling, built and checked in one place
for the TokenizerManager's routes and the Engine's methods (their side of the request front end),
and the TokenizerManager's end of them (TokenizerAdmin).

    /release_memory_occupation  {"tags": ["kv_cache", "weights"]}   (absent: all)
    /resume_memory_occupation   {"tags": [...]}                      (absent: all released)
    /pause_generation           {"mode": "abort" | "retract" | "in_place"}   (default abort)
    /continue_generation
    /start_profile              {"output_dir", "num_steps", "activities", ...}
    /stop_profile

Bad input (an unknown tag or mode, a resume without a release, a stop without a start) is a
RequestError 400 with the reason; the scheduler checks again (it is also driven directly) and
refuses with success False, which becomes the same 400.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

from radixserve.managers.request_frontend import RequestError
from radixserve.managers.scheduler_input_blocker import PAUSE_MODES
from radixserve.managers.scheduler_internal_state import settable_type_problem
from radixserve.managers.scheduler_memory_saver import parse_memory_tags
from radixserve.managers.scheduler_profiler import activities_problem
from radixserve.model_executor.memory_saver import GPU_MEMORY_ALL_TYPES
from radixserve.protocol import (
    ClearHiCacheReqInput, ContinueGenerationReqInput, EplbRebalanceReqInput, ExpertDistributionReq, ExpertDistributionReqType, PauseGenerationReqInput, ProfileReq, ProfileReqType, ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput, SetInternalStateReq,
)


def make_release_req(tags: Optional[List[str]] = None) -> ReleaseMemoryOccupationReqInput:
    _, error = parse_memory_tags(tags, GPU_MEMORY_ALL_TYPES)
    if error is not None:
        raise RequestError(error)
    return ReleaseMemoryOccupationReqInput(tags)


def make_resume_req(tags: Optional[List[str]] = None) -> ResumeMemoryOccupationReqInput:
    _, error = parse_memory_tags(tags, GPU_MEMORY_ALL_TYPES)
    if error is not None:
        raise RequestError(error)
    return ResumeMemoryOccupationReqInput(tags)


def make_pause_req(mode: str = "abort") -> PauseGenerationReqInput:
    if mode not in PAUSE_MODES:
        raise RequestError(f"Unknown pause mode {mode!r}: use one of {', '.join(PAUSE_MODES)}.")
    return PauseGenerationReqInput(mode)


def make_profile_req(
    output_dir: Optional[str] = None, start_step: Optional[int] = None, num_steps: Optional[int] = None,
    activities: Optional[List[str]] = None, with_stack: Optional[bool] = None, record_shapes: Optional[bool] = None,
    profile_by_stage: bool = False,
) -> ProfileReq:
    error = activities_problem(activities)
    if error is not None:
        raise RequestError(error)
    if profile_by_stage:
        raise RequestError("profile_by_stage is not supported: profile a number of steps (num_steps) instead.")
    for name, value in (("num_steps", num_steps), ("start_step", start_step)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise RequestError(f"{name} must be a positive integer.")
    # One id for every rank and replica: their traces sit side by side (SGLang's too: the time).
    return ProfileReq(ProfileReqType.START_PROFILE, output_dir, start_step, num_steps, activities, with_stack,
                      record_shapes, profile_by_stage, profile_id=str(time.time()))


def make_set_internal_state_req(server_args: Any) -> SetInternalStateReq:
    problem = settable_type_problem(server_args)
    if problem is not None:
        raise RequestError(problem)
    return SetInternalStateReq(dict(server_args))


def check_reply(out: Any) -> Any:
    """The scheduler's reply, or its refusal as a 400."""
    if not out.success:
        raise RequestError(out.message or "The scheduler refused the request.")
    return out


class TokenizerAdmin:
    """The TokenizerManager's end: sends each request and waits for the scheduler's reply (with
    --dp-size, the controller's merge of every replica's). The state they leave (paused, memory
    released) is the scheduler's to know: /server_info reads it from there, and a generate request
    that comes while the memory is released is answered 503 by the scheduler."""

    def __init__(self, tokenizer_manager: Any):
        self.tm = tokenizer_manager

    async def _call(self, obj: Any) -> str:
        if self.tm.dead_reason is not None:
            raise RequestError(self.tm.dead_reason, 503, "ServiceUnavailable")
        return check_reply(await self.tm.communicator(obj)).message

    async def release_memory_occupation(self, tags: Optional[List[str]] = None) -> str:
        return await self._call(make_release_req(tags))

    async def resume_memory_occupation(self, tags: Optional[List[str]] = None) -> str:
        return await self._call(make_resume_req(tags))

    async def pause_generation(self, mode: str = "abort") -> str:
        return await self._call(make_pause_req(mode))

    async def continue_generation(self) -> str:
        return await self._call(ContinueGenerationReqInput())

    async def start_profile(self, **fields: Any) -> str:
        return await self._call(make_profile_req(**fields))

    async def stop_profile(self) -> str:
        return await self._call(ProfileReq(ProfileReqType.STOP_PROFILE))

    async def expert_distribution(self, action: ExpertDistributionReqType) -> Dict[str, Any]:
        """Start / stop / dump the expert distribution record; the dump's record (else {})."""
        if self.tm.dead_reason is not None:
            raise RequestError(self.tm.dead_reason, 503, "ServiceUnavailable")
        return check_reply(await self.tm.communicator(ExpertDistributionReq(action))).record or {}

    async def eplb_rebalance(self) -> Dict[str, Any]:
        """Re-place the experts now (EPLB); the balance before and after."""
        if self.tm.dead_reason is not None:
            raise RequestError(self.tm.dead_reason, 503, "ServiceUnavailable")
        return check_reply(await self.tm.communicator(EplbRebalanceReqInput())).stats or {}

    async def clear_hicache_storage(self) -> str:
        return await self._call(ClearHiCacheReqInput())

    async def set_internal_state(self, server_args: Any) -> Dict[str, Any]:
        """The settable values after the update (with --dp-size, replica 0's; all got it)."""
        req = make_set_internal_state_req(server_args)
        if self.tm.dead_reason is not None:
            raise RequestError(self.tm.dead_reason, 503, "ServiceUnavailable")
        return check_reply(await self.tm.communicator(req)).server_args
