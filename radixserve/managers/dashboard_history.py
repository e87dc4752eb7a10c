"""The /dashboard page's plots over the last minutes (issue 59): per-second buckets of what the
main process sees of each request, kept whether or not a page is open.

    TokenizerManager._handle_batch_output --on_update(state, num_new, now)--> RequestTimeline
        one bucket per wall-clock second: tokens generated, prefills (prompt and cached tokens:
        the prefix-cache hit rate), time to first token, inter-token latency, finished requests

Fed before TokenizerMetrics.on_update, which records the same request's first-token and last-token
times (this reads them as they were before this output: None = this output brings the first token).
TTFT and ITL come from streamed requests only: the scheduler sends a request that does not stream
its output once, when it finishes, so its "first token" would be its end-to-end latency.
A bucket is a few integers; HISTORY_SECONDS of them are kept (a deque), so memory is bounded.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Deque, Dict, List

HISTORY_SECONDS = 600


@dataclass
class SecondBucket:
    t: int  # the wall-clock second (time.time())
    gen_tokens: int = 0
    first_tokens: int = 0  # requests whose first token came in this second (prefills done)
    prompt_tokens: int = 0  # ... their prompts
    cached_tokens: int = 0  # ... and the part of them served from the prefix cache
    ttft_n: int = 0  # streamed requests among first_tokens (TTFT is theirs)
    ttft_sum: float = 0.0
    ttft_max: float = 0.0
    itl_sum: float = 0.0  # one inter-token interval per token after the first
    itl_n: int = 0
    finished: int = 0


class RequestTimeline:
    def __init__(self, seconds: int = HISTORY_SECONDS):
        self.buckets: Deque[SecondBucket] = deque(maxlen=seconds)

    def _bucket(self, wall: float) -> SecondBucket:
        second = int(wall)
        if not self.buckets or self.buckets[-1].t != second:
            self.buckets.append(SecondBucket(second))
        return self.buckets[-1]

    def on_update(self, state: Any, num_new_tokens: int, now: float) -> None:
        """One request's news (a ReqState), read before TokenizerMetrics.on_update changes it."""
        if not num_new_tokens and not state.finished:
            return
        b = self._bucket(time.time())
        if num_new_tokens:
            b.gen_tokens += num_new_tokens
            if state.first_token_time is None:  # this output brings the first token
                b.first_tokens += 1
                b.prompt_tokens += len(state.input_ids or ())
                b.cached_tokens += state.cached_tokens
                num_new_tokens -= 1
                if state.stream:
                    ttft = now - state.created
                    b.ttft_n += 1
                    b.ttft_sum += ttft
                    b.ttft_max = max(b.ttft_max, ttft)
            if num_new_tokens and state.stream and state.last_time is not None:
                b.itl_sum += now - state.last_time  # spread over the tokens of this interval
                b.itl_n += num_new_tokens
        if state.finished:
            b.finished += 1

    def since(self, seconds: float) -> List[Dict[str, Any]]:
        start = time.time() - seconds
        return [asdict(b) for b in self.buckets if b.t >= start]
