"""EncodeQueue: requests with images wait here while the encoder thread encodes them (issue 46
item 2: the vision encoder off the decode path).

Before, a new request's ViT ran inside its prefill step, and every running request's next decode
step waited for it. Now, when a request is queued, the images its embedding cache lacks are
handed to the model's encoder thread (multimodal/embedder.py: ImageEmbedder.encode_ahead); the
request waits here, out of the waiting queue, while the scheduler keeps running decode steps;
once encoded it joins the waiting queue and its prefill finds the embeddings in the cache. A
request whose images are cached (a second turn) goes straight to the waiting queue.

    tokenized ──> admit ──(images cached / no images / off)──────────────> waiting_queue
                    └──(encode_ahead started)──> EncodeQueue ──pop_ready──> waiting_queue

If an embedding is evicted before the prefill (a small --mm-embedding-cache-mb), the prefill
encodes it again itself: slower, never wrong. An exception on the encoder thread is raised here, on
the scheduler's thread, so it takes the scheduler down loudly instead of leaving a request stuck."""

from __future__ import annotations

from concurrent import futures
from typing import Callable, Iterator, List, Optional, Protocol, Sequence, Tuple

from radixserve.managers.schedule_batch import Req

IDLE_ENCODE_WAIT_S = 0.005  # an idle scheduler waits this long for an encode instead of spinning


class EncodesAhead(Protocol):
    """What the queue needs of the model's encoder (ImageEmbedder)."""

    def encode_ahead(self, items: Sequence) -> Optional[futures.Future]: ...

    def shutdown(self) -> None: ...


class EncodeQueue:
    def __init__(self, embedder: Optional[EncodesAhead]):
        self.embedder = embedder  # None: a text model, or --disable-mm-encode-ahead
        self.queue: List[Tuple[Req, futures.Future]] = []
        self.running: List[futures.Future] = []  # every encode not known done, a removed request's too
        self.num_encoded_ahead = 0  # requests that waited here

    def __len__(self) -> int:
        return len(self.queue)

    def __iter__(self) -> Iterator[Req]:
        return (req for req, _ in self.queue)

    def admit(self, req: Req) -> bool:
        """True: the request can join the waiting queue now. False: it waits here for its images."""
        mm = req.multimodal_inputs
        if self.embedder is None or mm is None:
            return True
        future = self.embedder.encode_ahead(mm.items)
        if future is None:  # all cached
            return True
        self.queue.append((req, future))
        self.running = [f for f in self.running if not f.done()] + [future]
        return False

    def wait_idle(self) -> None:
        """Until no encode runs (before the weights are released: the encoder thread reads them)."""
        futures.wait(self.running)
        self.running = []

    def pop_ready(self, scheduler_idle: bool) -> List[Req]:
        """The requests whose images are encoded, in arrival order."""
        if not self.queue:
            return []
        if scheduler_idle:
            futures.wait([f for _, f in self.queue], timeout=IDLE_ENCODE_WAIT_S, return_when=futures.FIRST_COMPLETED)
        done = [f.done() for _, f in self.queue]  # once: a future may finish while we look
        ready = [entry for entry, d in zip(self.queue, done) if d]
        self.queue = [entry for entry, d in zip(self.queue, done) if not d]
        for _, f in ready:
            f.result()  # the encoder's exception, if any, here: the scheduler goes down with it
        self.num_encoded_ahead += len(ready)
        return [req for req, _ in ready]

    def remove(self, match: Callable[[Req], bool]) -> List[Req]:
        """Take out the matching requests (aborted); their encode finishes unused (its result cached)."""
        out = [req for req, _ in self.queue if match(req)]
        self.queue = [(req, f) for req, f in self.queue if not match(req)]
        return out

    def shutdown(self) -> None:
        if self.embedder is not None:
            self.embedder.shutdown()
