"""/start_profile and /stop_profile on the scheduler side (SGLang's scheduler_profiler_mixin.py):
a torch.profiler trace of this scheduler process (every thread: the overlap loop's forwards run
on the ForwardThread), written at the stop as a gzipped Chrome trace that Perfetto and
chrome://tracing open:

    {output_dir}/{profile_id}-TP-{tp_rank}.trace.json.gz     (-DP-{dp_rank} added with --dp-size)

output_dir defaults to $SGLANG_TORCH_PROFILER_DIR, else the system's temp dir (tempfile's, /tmp
on Linux; SGLang's default is /tmp). activities: "CPU", and "GPU" (or "CUDA") where CUDA is at
hand; by default both where there is a GPU, else CPU. With num_steps the profile stops by
itself after that many batches (forwards); with start_step it starts at that forward count.
with_stack is off unless asked (SGLang turns it on): Python stacks make a CPU trace many times
larger and its writing slow enough to outlast the scheduler's 60 s reply timeout on a busy host.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from typing import Any, Callable, List, Optional, Tuple, Type

import torch

from radixserve.protocol import ProfileReq, ProfileReqOutput, ProfileReqType

logger = logging.getLogger(__name__)

PROFILE_ACTIVITIES = ("CPU", "GPU", "CUDA")


def default_profile_dir() -> str:
    return os.environ.get("SGLANG_TORCH_PROFILER_DIR") or tempfile.gettempdir()


def default_activities() -> List[str]:
    return ["CPU", "GPU"] if torch.cuda.is_available() else ["CPU"]


def activities_problem(activities: Optional[List[str]]) -> Optional[str]:
    """Why these activities cannot be profiled here, or None."""
    if activities is None:
        return None
    if not isinstance(activities, list) or not activities or not all(isinstance(a, str) for a in activities):
        return "activities must be a non-empty list of strings."
    unknown = [a for a in activities if a not in PROFILE_ACTIVITIES]
    if unknown:
        return f"Unknown profiler activities {unknown}: use CPU, and GPU (or CUDA) on a GPU."
    if any(a in ("GPU", "CUDA") for a in activities) and not torch.cuda.is_available():
        return "GPU (CUDA) activity needs a GPU: this server has none; use [\"CPU\"]."
    return None


def _all_threads_config() -> Any:
    """torch.profiler records the threads that started it only, unless asked for all of them."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):  # an older torch: the scheduler thread only
        return None


class SchedulerProfiler:
    def __init__(self, tp_rank: int, forward_ct: Callable[[], int]):
        self.tp_rank = tp_rank  # (the trace's file name)
        self.forward_ct = forward_ct  # the Scheduler's forward count: start_step / num_steps count it
        self.torch_profiler: Optional[torch.profiler.profile] = None
        self.output_dir = ""
        self.profile_id = ""
        self.activities: List[str] = []
        self.with_stack = False
        self.record_shapes = False
        self.start_forward_ct: Optional[int] = None  # start_step: begin when forward_ct gets there
        self.target_forward_ct: Optional[int] = None  # num_steps: stop when forward_ct passes it
        self.num_steps: Optional[int] = None
        self.last_trace_path: Optional[str] = None
        self.dp_rank: Optional[int] = None  # set by the scheduler process of a --dp-size replica

    def dispatch_entries(self) -> List[Tuple[Type, Callable[[Any], Any]]]:
        return [(ProfileReq, self.profile)]

    @property
    def profile_in_progress(self) -> bool:
        return self.torch_profiler is not None or self.start_forward_ct is not None

    def profile(self, recv: ProfileReq) -> ProfileReqOutput:
        if recv.type == ProfileReqType.STOP_PROFILE:
            out = self.stop_profile()
        else:
            out = self.init_profile(recv)
        out.query_id = recv.query_id
        return out

    def init_profile(self, recv: ProfileReq) -> ProfileReqOutput:
        if self.profile_in_progress:
            return ProfileReqOutput(False, "Profiling is already in progress. Call /stop_profile first.")
        error = activities_problem(recv.activities)
        if error is None and recv.profile_by_stage:
            error = "profile_by_stage is not supported: profile a number of steps (num_steps) instead."
        for name in ("num_steps", "start_step"):
            value = getattr(recv, name)
            if error is None and value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                error = f"{name} must be a positive integer."
        if error is not None:
            return ProfileReqOutput(False, error)
        self.output_dir = recv.output_dir or default_profile_dir()
        try:
            os.makedirs(self.output_dir, exist_ok=True)
        except OSError as e:
            return ProfileReqOutput(False, f"output_dir {self.output_dir!r} cannot be made: {e}")
        self.profile_id = recv.profile_id or str(time.time())
        self.activities = recv.activities or default_activities()
        self.with_stack = bool(recv.with_stack)
        self.record_shapes = bool(recv.record_shapes)
        self.num_steps = recv.num_steps
        if recv.start_step:
            self.start_forward_ct = max(recv.start_step, self.forward_ct() + 1)
            return ProfileReqOutput(True, f"Profiling will start at step {self.start_forward_ct}; traces go to {self.output_dir}.")
        try:
            self.start_profile()
        except Exception as e:  # the profiler would not start: the server goes on without it
            logger.exception("The profiler did not start")
            self.torch_profiler = None
            return ProfileReqOutput(False, f"The profiler did not start: {type(e).__name__}: {e}")
        return ProfileReqOutput(True, f"Profiling started; traces go to {self.output_dir}.")

    def start_profile(self) -> None:
        self.start_forward_ct = None
        kinds = {"CPU": torch.profiler.ProfilerActivity.CPU, "GPU": torch.profiler.ProfilerActivity.CUDA,
                 "CUDA": torch.profiler.ProfilerActivity.CUDA}
        activities = list(dict.fromkeys(kinds[a] for a in self.activities))
        self.torch_profiler = torch.profiler.profile(
            activities=activities, with_stack=self.with_stack, record_shapes=self.record_shapes,
            experimental_config=_all_threads_config(),
        )
        self.torch_profiler.start()
        ct = self.forward_ct()
        self.target_forward_ct = ct + self.num_steps if self.num_steps else None
        logger.info("Profiling starts (%s, %s). Traces will be saved to: %s (with profile id: %s)",
                    ", ".join(self.activities), f"{self.num_steps} steps" if self.num_steps else "until /stop_profile",
                    self.output_dir, self.profile_id)

    def stop_profile(self) -> ProfileReqOutput:
        if not self.profile_in_progress:
            return ProfileReqOutput(False, "Profiling is not in progress. Call /start_profile first.")
        if self.torch_profiler is None:  # start_step not reached yet: nothing recorded
            self.start_forward_ct = None
            return ProfileReqOutput(True, "Profiling stopped before it started: no trace.")
        prof, self.torch_profiler, self.target_forward_ct = self.torch_profiler, None, None
        dp = f"-DP-{self.dp_rank}" if self.dp_rank is not None else ""
        path = os.path.join(self.output_dir, f"{self.profile_id}-TP-{self.tp_rank}{dp}.trace.json.gz")
        try:
            prof.stop()
            prof.export_chrome_trace(path)
        except Exception as e:  # e.g. the disk is full: no trace, the server goes on
            logger.exception("Writing the trace failed")
            return ProfileReqOutput(False, f"Profiling stopped, but writing {path} failed: {type(e).__name__}: {e}")
        self.last_trace_path = path
        logger.info("Profiling done. Traces are saved to: %s", path)
        return ProfileReqOutput(True, f"Profiling stopped; trace saved to {path}.")

    def on_forward(self) -> None:
        """Each batch, before its forward (forward_ct counted): start at start_step, stop after num_steps."""
        ct = self.forward_ct()
        if self.target_forward_ct is not None and ct > self.target_forward_ct:
            self.stop_profile()
        if self.start_forward_ct is not None and ct >= self.start_forward_ct:
            self.start_profile()
            self.target_forward_ct = ct - 1 + self.num_steps if self.num_steps else None
