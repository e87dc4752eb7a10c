"""ServerArgs: every flag of radixserve, its default, its validation, and its argparse form.

Names follow SGLang's `server_args.py` so that a reader of the seeds (and a user of SGLang)
finds the same knobs: `--chunked-prefill-size`, `--schedule-policy`, `--max-running-requests`...
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "dummy")


@dataclass
class ServerArgs:
    # Model. None means the embedded tiny model (radixserve/assets/tiny_qwen3).
    model_path: Optional[str] = None
    tokenizer_path: Optional[str] = None
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "auto"  # "cpu", "cuda" or "auto" (cuda when available)
    seed: int = 0
    context_length: Optional[int] = None

    # Memory
    max_total_tokens: Optional[int] = None  # KV pool size in tokens; derived from memory when None
    mem_fraction_static: float = 0.85  # GPU: fraction of free memory for weights + KV
    cpu_kv_cache_bytes: int = 2 * 1024**3  # CPU: byte budget for the KV pool
    max_running_requests: Optional[int] = None
    page_size: int = 1

    # Scheduling
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0
    chunked_prefill_size: Optional[int] = 2048  # None or <= 0 disables chunking
    max_prefill_tokens: int = 16384
    enable_mixed_chunk: bool = False
    disable_radix_cache: bool = False
    radix_eviction_policy: str = "lru"  # "lru" or "lfu"
    max_queued_requests: Optional[int] = None
    prefill_max_requests: Optional[int] = None
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    stream_interval: int = 1
    disable_overlap_schedule: bool = False
    # Test knob (SGLang's SGLANG_TEST_RETRACT): force a retraction every N decode steps.
    test_retract_interval: Optional[int] = None

    # Serving
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: Optional[str] = None
    log_level: str = "info"
    skip_tokenizer_init: bool = False

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Reject inconsistent settings with a message that names the flag."""
        _choice("--load-format", self.load_format, LOAD_FORMATS)
        _choice("--dtype", self.dtype, DTYPES)
        _choice("--schedule-policy", self.schedule_policy, SCHEDULE_POLICIES)
        _choice("--radix-eviction-policy", self.radix_eviction_policy, ("lru", "lfu"))
        _choice("--device", self.device, ("auto", "cpu", "cuda"))
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError("--max-total-tokens must hold at least one page")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError("--max-running-requests must be >= 1")
        if not 0 < self.mem_fraction_static <= 1:
            raise ValueError("--mem-fraction-static must be in (0, 1]")
        if self.stream_interval < 1:
            raise ValueError("--stream-interval must be >= 1")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size <= 0:
            self.chunked_prefill_size = None
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < self.page_size:
            raise ValueError("--chunked-prefill-size must be >= --page-size")

    # ---- argparse -------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            default = f.default
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", default=default)
                continue
            parser.add_argument(flag, type=_arg_type(f), default=default)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def replace(self, **changes: Any) -> "ServerArgs":
        return dataclasses.replace(self, **changes)


def _arg_type(f: dataclasses.Field) -> Any:
    t = str(f.type)
    if "int" in t:
        return int
    if "float" in t:
        return float
    return str


def _choice(flag: str, value: str, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{flag} must be one of {', '.join(choices)}; got {value!r}")
