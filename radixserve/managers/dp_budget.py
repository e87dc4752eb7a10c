"""DPBudget: which data-parallel replica takes the next request (--load-balance-method, seed 001
§25.5). Plain state, no sockets: the DataParallelController feeds it each replica's reported
load and asks it for a replica per request.

    round_robin         the next replica in turn
    decode_round_robin  a request with a PD bootstrap_room follows it (room % dp_size, so the
                        prefill and the decode side of one request agree); others in turn
    shortest_queue      fewest requests (waiting + running)
    minimum_tokens      fewest tokens (KV held by running requests + prompts waiting)

A replica's load is what it last reported plus what was sent to it since, so a burst of requests
arriving between two reports spreads out instead of all going to the replica that looked idle.
A request's own `data_parallel_rank` overrides the method.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from radixserve.server_args import LOAD_BALANCE_METHODS


@dataclass
class DPBudget:
    dp_size: int
    method: str = "round_robin"
    round_robin_counter: int = 0
    reported_reqs: List[int] = field(default_factory=list)
    reported_tokens: List[int] = field(default_factory=list)
    sent_reqs: List[int] = field(default_factory=list)  # since the replica's last report
    sent_tokens: List[int] = field(default_factory=list)
    num_dispatched: List[int] = field(default_factory=list)  # ever, for /get_server_info

    def __post_init__(self) -> None:
        assert self.method in LOAD_BALANCE_METHODS, self.method
        assert self.dp_size >= 1
        for name in ("reported_reqs", "reported_tokens", "sent_reqs", "sent_tokens", "num_dispatched"):
            setattr(self, name, [0] * self.dp_size)

    def choose(self, num_tokens: int, bootstrap_room: Optional[int] = None,
               data_parallel_rank: Optional[int] = None) -> int:
        """The replica for a request of `num_tokens` prompt tokens; counts it as sent there."""
        if data_parallel_rank is not None:  # checked in [0, dp_size) by the front end
            i = data_parallel_rank
        elif self.method == "shortest_queue":
            i = _argmin([r + s for r, s in zip(self.reported_reqs, self.sent_reqs)])
        elif self.method == "minimum_tokens":
            i = _argmin([r + s for r, s in zip(self.reported_tokens, self.sent_tokens)])
        elif self.method == "decode_round_robin" and bootstrap_room is not None:
            i = bootstrap_room % self.dp_size
        else:
            i = self.round_robin_counter
            self.round_robin_counter = (i + 1) % self.dp_size
        self.sent_reqs[i] += 1
        self.sent_tokens[i] += num_tokens
        self.num_dispatched[i] += 1
        return i

    def on_load(self, dp_rank: int, num_reqs: int, num_tokens: int) -> None:
        """A replica's report replaces what was counted as sent to it (a request still in its
        socket is missed until the next report: a small undercount, for one turn of its loop)."""
        self.reported_reqs[dp_rank] = num_reqs
        self.reported_tokens[dp_rank] = num_tokens
        self.sent_reqs[dp_rank] = 0
        self.sent_tokens[dp_rank] = 0


def _argmin(values: List[int]) -> int:
    return values.index(min(values))
