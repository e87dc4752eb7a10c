"""SGLang's routes for memory release, pause, profiling and clearing HiCache's storage tier, with
its request fields and replies (the work: managers/admin_requests.py, and the scheduler's
scheduler_memory_saver.py, scheduler_pause.py, scheduler_profiler.py and scheduler_hicache.py).

    GET|POST /release_memory_occupation  {"tags": [...]}     -> 200 null
    GET|POST /resume_memory_occupation   {"tags": [...]}     -> 200 null
    POST     /pause_generation           {"mode": "abort"}   -> {"message": "Generation paused successfully.", "status": "ok"}
    POST     /continue_generation                            -> {"message": "Generation continued successfully.", "status": "ok"}
    GET|POST /start_profile              {"num_steps": 5, "activities": ["CPU"], "output_dir": ...} -> "Start profiling.\\n"
    GET|POST /stop_profile                                   -> "Stop profiling. This will take some time.\\n"
    GET|POST /clear_hicache_storage_backend                  -> "Hierarchical cache storage backend cleared.\\n"
    GET|POST /start_expert_distribution_record               -> "Start recording the expert distribution.\\n"
    GET|POST /stop_expert_distribution_record                -> "Stop recording the expert distribution.\\n"
    GET|POST /dump_expert_distribution_record                -> {"path": ..., "logical_count": [[...]], "num_forward_passes": N}
    GET|POST /eplb_rebalance                                 -> {"max_over_mean_before": ..., "max_over_mean_after": ..., ...}
    POST|PUT /set_internal_state  {"server_args": {"max_running_requests": 8}}
                                  -> {"updated": true, "server_args": {"max_running_requests": 8, "chunked_prefill_size": 2048}}

Every body but /set_internal_state's is optional (its fields have defaults). A refusal is a 400 whose message says why:
an unknown tag or mode or activity, a release while requests run, a resume of what was not
released, a stop without a start, a clear on a server without --hicache-storage-backend, a setting that
cannot change at run time or a value out of its range (the message names the field).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from radixserve.managers.scheduler_profiler import default_profile_dir
from radixserve.managers.tokenizer_manager import RequestError, TokenizerManager
from radixserve.protocol import ExpertDistributionReqType
from radixserve.sampling_params import MAX_INT_PARAM


class MemoryOccupationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    tags: Optional[List[str]] = Field(
        None, description='What to release / resume: "kv_cache", "weights" (and "cuda_graph"); absent: all.')


class PauseGenerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    mode: str = Field("abort", description="abort: end every request; retract: running requests give back their "
                                           "KV and wait; in_place: everything stays. New requests wait until continue.")


class ProfileRequest(BaseModel):
    """SGLang's ProfileReqInput."""

    model_config = ConfigDict(extra="ignore")

    output_dir: Optional[str] = Field(None, description="Where the traces go: under the profile directory "
                                                        "($SGLANG_TORCH_PROFILER_DIR, else the temp dir; a relative path "
                                                        "is taken from there), which is also the default.")
    start_step: Optional[StrictInt] = Field(None, le=MAX_INT_PARAM, description="Start at this forward count (default: now).")
    num_steps: Optional[StrictInt] = Field(None, le=MAX_INT_PARAM, description="Stop by itself after this many batches.")
    activities: Optional[List[str]] = Field(None, description='"CPU", and "GPU" (or "CUDA") on a GPU.')
    with_stack: Optional[StrictBool] = None
    record_shapes: Optional[StrictBool] = None
    profile_by_stage: StrictBool = False
    merge_profiles: StrictBool = False  # SGLang's; one trace per rank here


class SetInternalStateRequest(BaseModel):
    """SGLang's SetInternalStateReq (values are checked by name, so their errors name the field)."""

    model_config = ConfigDict(extra="ignore")

    server_args: Dict[str, Any] = Field(
        ..., description="Settings to change now: max_running_requests, chunked_prefill_size.")


def profile_output_dir(requested: Optional[str]) -> Optional[str]:
    """A request's output_dir, kept under the profile directory: an HTTP caller chooses where in
    it the traces go, never a path elsewhere on the server's disk (400)."""
    if requested is None:
        return None
    base = os.path.realpath(default_profile_dir())
    path = os.path.realpath(os.path.join(base, requested))
    if os.path.commonpath([base, path]) != base:
        raise RequestError(f"output_dir must be under the profile directory {base} ($SGLANG_TORCH_PROFILER_DIR, "
                           f"else the temp dir); got {requested!r}")
    return path


def add_admin_routes(app: FastAPI, tm: TokenizerManager) -> None:
    admin = tm.admin

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(body: Optional[MemoryOccupationRequest] = None) -> None:
        """Free the KV pool and / or the weights (requests get 503 until the resume)."""
        await admin.release_memory_occupation(body.tags if body else None)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(body: Optional[MemoryOccupationRequest] = None) -> None:
        """Restore what was released (the weights exactly as they were)."""
        await admin.resume_memory_occupation(body.tags if body else None)

    @app.post("/pause_generation")
    async def pause_generation(body: Optional[PauseGenerationRequest] = None) -> JSONResponse:
        await admin.pause_generation(body.mode if body else "abort")
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation() -> JSONResponse:
        await admin.continue_generation()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.api_route("/start_profile", methods=["GET", "POST"])
    async def start_profile(body: Optional[ProfileRequest] = None) -> PlainTextResponse:
        """A torch.profiler trace of the scheduler (a gzipped Chrome trace per rank, for Perfetto)."""
        b = body or ProfileRequest()
        await admin.start_profile(output_dir=profile_output_dir(b.output_dir), start_step=b.start_step, num_steps=b.num_steps,
                                  activities=b.activities, with_stack=b.with_stack, record_shapes=b.record_shapes,
                                  profile_by_stage=b.profile_by_stage)
        return PlainTextResponse("Start profiling.\n")

    @app.api_route("/stop_profile", methods=["GET", "POST"])
    async def stop_profile() -> PlainTextResponse:
        await admin.stop_profile()
        return PlainTextResponse("Stop profiling. This will take some time.\n")

    @app.api_route("/start_expert_distribution_record", methods=["GET", "POST"])
    async def start_expert_distribution_record() -> PlainTextResponse:
        """Count the tokens each MoE layer routes to each expert (EPLB's input); 400 without experts."""
        await admin.expert_distribution(ExpertDistributionReqType.START_RECORD)
        return PlainTextResponse("Start recording the expert distribution.\n")

    @app.api_route("/stop_expert_distribution_record", methods=["GET", "POST"])
    async def stop_expert_distribution_record() -> PlainTextResponse:
        await admin.expert_distribution(ExpertDistributionReqType.STOP_RECORD)
        return PlainTextResponse("Stop recording the expert distribution.\n")

    @app.api_route("/dump_expert_distribution_record", methods=["GET", "POST"])
    async def dump_expert_distribution_record() -> JSONResponse:
        """The counts so far, also saved (SGLang's file: a torch.save'd {"logical_count": [layers, experts]})."""
        return JSONResponse(await admin.expert_distribution(ExpertDistributionReqType.DUMP_RECORD))

    @app.api_route("/eplb_rebalance", methods=["GET", "POST"])
    async def eplb_rebalance() -> JSONResponse:
        """EPLB: re-place the experts now from the recorded load; 400 when EPLB is off."""
        return JSONResponse(await admin.eplb_rebalance())

    @app.api_route("/clear_hicache_storage_backend", methods=["GET", "POST"])
    async def clear_hicache_storage_backend() -> PlainTextResponse:
        """Remove every page of HiCache's storage tier (--hicache-storage-backend); 400 without one."""
        await admin.clear_hicache_storage()
        return PlainTextResponse("Hierarchical cache storage backend cleared.\n")

    @app.api_route("/set_internal_state", methods=["POST", "PUT"])
    async def set_internal_state(body: SetInternalStateRequest) -> JSONResponse:
        """Change scheduler settings while serving; 400 naming the field for a bad one."""
        values = await admin.set_internal_state(body.server_args)
        return JSONResponse({"updated": True, "server_args": values})
