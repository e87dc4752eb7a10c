"""ImageEmbedder: a model's vision encoder runs and the MultimodalEmbeddingCache in front of them,
shared by two callers:

  - the forward (a prefill's image rows: the images its chunk holds, cached or encoded there), and
  - the scheduler's encoder thread (encode_ahead): a newly queued request's images are encoded
    beside the decode steps of the running requests, so its prefill finds them in the cache and
    the decode of others is not held up by the ViT (issue 46 item 2; managers/encode_queue.py).

Two locks: the cache's (held for a lookup or an insert only) and the encoder's (one encoder run at
a time). A forward whose images are cached never waits for the encoder thread; one whose images the
thread is encoding right now waits for that run and then finds them cached (never encodes twice)."""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from radixserve.multimodal.mm_cache import MultimodalEmbeddingCache
from radixserve.multimodal.mm_inputs import MultimodalDataItem


class ImageEmbedder:
    def __init__(self, visual: nn.Module, cache: MultimodalEmbeddingCache, device: Callable[[], torch.device]):
        self.visual = visual
        self.cache = cache
        self.device = device  # where the encoder's weights are (they may move after construction)
        self.images_encoded = 0  # images the vision encoder has run on (cache misses that ran)
        self.images_encoded_ahead = 0  # of those, encoded on the encoder thread
        self._cache_lock = threading.Lock()
        self._encode_lock = threading.Lock()
        self._executor: Optional[ThreadPoolExecutor] = None

    # ---- the forward's side -------------------------------------------------------------------
    def embeddings(self, items: Sequence[MultimodalDataItem]) -> Dict[int, torch.Tensor]:
        """Each item's encoder output by hash: from the cache, else one encoder run over all the
        missing images together (then cached)."""
        found, missing = self._lookup(items)
        if missing:
            with self._encode_lock:
                more, missing = self._lookup(missing)  # the encoder thread may have just done them
                found.update(more)
                if missing:
                    found.update(self._encode(missing))
        for emb in found.values():
            if emb.is_cuda:  # made on the encoder thread's stream: not reused while this stream reads it
                emb.record_stream(torch.cuda.current_stream(emb.device))
        return found

    # ---- the encoder thread's side ------------------------------------------------------------
    def encode_ahead(self, items: Sequence[MultimodalDataItem]) -> Optional[Future]:
        """Start encoding the items not cached on the encoder thread; None when all are cached. The
        future's result is None; an exception in the encoder is raised by future.result()."""
        with self._cache_lock:
            todo = _unique(i for i in items if i.hash not in self.cache)
        if not todo:
            return None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="vit-encoder")
        return self._executor.submit(self._encode_ahead, todo)

    def clear(self) -> None:
        """Forget every embedding (new weights), after the encode in flight, whose output is the old
        weights' too."""
        with self._encode_lock, self._cache_lock:
            self.cache.clear()

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def _encode_ahead(self, items: List[MultimodalDataItem]) -> None:
        # grad mode and the current CUDA stream are per thread: set both here
        device = self.device()
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        with torch.no_grad(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            with self._encode_lock:
                _, missing = self._lookup(items, count=False)
                if missing:
                    self._encode(missing, stream)
                    self.images_encoded_ahead += len(missing)

    # ---- both -------------------------------------------------------------------------------
    def _lookup(self, items: Sequence[MultimodalDataItem], count: bool = True
                ) -> Tuple[Dict[int, torch.Tensor], List[MultimodalDataItem]]:
        found: Dict[int, torch.Tensor] = {}
        missing: List[MultimodalDataItem] = []
        with self._cache_lock:
            for item in _unique(items):
                emb = self.cache.get(item.hash) if count else self.cache.peek(item.hash)
                if emb is not None:
                    found[item.hash] = emb
                else:
                    missing.append(item)
        return found, missing

    def _encode(self, items: List[MultimodalDataItem], stream=None) -> Dict[int, torch.Tensor]:
        pixels = torch.cat([i.pixel_values for i in items]).to(self.device())
        out = self.visual(pixels, [i.image_grid_thw for i in items])
        if stream is not None:  # the forward stream reads these: done before anyone sees them
            stream.synchronize()
        self.images_encoded += len(items)
        found = dict(zip((i.hash for i in items), out.split([i.num_tokens for i in items])))
        with self._cache_lock:
            for h, emb in found.items():
                self.cache.put(h, emb)
        return found


def _unique(items) -> List[MultimodalDataItem]:
    seen: Dict[int, MultimodalDataItem] = {}
    for item in items:
        seen.setdefault(item.hash, item)
    return list(seen.values())

