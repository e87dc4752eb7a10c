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

ViT DP (seed 001's "ViT DP + multimodal cache", issue 46): every replica has its own vision
encoder, and each encodes the images of the requests routed to it. Under round_robin, requests with
images are routed apart from text ones so that the encoder work spreads: one about an image seen
recently goes to the replica that encoded it (its embedding cache and its radix prefix are there),
any other to the replica that was sent the fewest image patches so far. (Text and image requests
interleaved would otherwise put every image on the same replica: text, image, text, image ...)
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from radixserve.server_args import LOAD_BALANCE_METHODS

MAX_IMAGE_AFFINITY = 4096  # image hashes remembered (a replica's embedding cache holds fewer)


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
    image_patches_sent: List[int] = field(default_factory=list)  # ever: each replica's encoder work
    # image hash -> the replica that was sent it last (bounded, least recently used out first)
    image_replica: "OrderedDict[int, int]" = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        assert self.method in LOAD_BALANCE_METHODS, self.method
        assert self.dp_size >= 1
        for name in ("reported_reqs", "reported_tokens", "sent_reqs", "sent_tokens", "num_dispatched", "image_patches_sent"):
            setattr(self, name, [0] * self.dp_size)

    def choose(self, num_tokens: int, bootstrap_room: Optional[int] = None,
               data_parallel_rank: Optional[int] = None, image_hashes: Sequence[int] = (),
               image_patches: int = 0) -> int:
        """The replica for a request of `num_tokens` prompt tokens (with images: their hashes and
        their patches, the encoder's work); counts it as sent there."""
        if data_parallel_rank is not None:  # checked in [0, dp_size) by the front end
            i = data_parallel_rank
        elif image_hashes and self.method == "round_robin":
            i = self._image_replica(image_hashes)
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
        self.image_patches_sent[i] += image_patches
        for h in image_hashes:
            self.image_replica[h] = i
            self.image_replica.move_to_end(h)
        while len(self.image_replica) > MAX_IMAGE_AFFINITY:
            self.image_replica.popitem(last=False)
        return i

    def _image_replica(self, image_hashes: Sequence[int]) -> int:
        """ViT DP: where one of the images was sent before (its embedding is cached there), else the
        replica with the least encoder work sent so far."""
        for h in image_hashes:
            if h in self.image_replica:
                return self.image_replica[h]
        return _argmin(self.image_patches_sent)

    def on_load(self, dp_rank: int, num_reqs: int, num_tokens: int) -> None:
        """A replica's report replaces what was counted as sent to it (a request still in its
        socket is missed until the next report: a small undercount, for one turn of its loop)."""
        self.reported_reqs[dp_rank] = num_reqs
        self.reported_tokens[dp_rank] = num_tokens
        self.sent_reqs[dp_rank] = 0
        self.sent_tokens[dp_rank] = 0


def _argmin(values: List[int]) -> int:
    return values.index(min(values))
