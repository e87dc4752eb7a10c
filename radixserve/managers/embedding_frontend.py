"""EmbeddingFrontend: the embedding side of the request front end, shared (like RequestFrontend,
whose tokenizer, limits and request states it uses) by the TokenizerManager's /encode and
/v1/embeddings and by the offline Engine.encode, so both validate alike and answer in one shape:

    EmbeddingReqInput --prepare--> [TokenizedEmbeddingReqInput] (one per prompt)
    BatchEmbeddingOutput --handle_batch_embedding_output--> EmbeddingReqState
    EmbeddingReqState --make_output--> {"embedding": [...], "meta_info": {...}}   (SGLang's shape)
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from radixserve.managers.request_frontend import ReqState, RequestError, RequestFrontend, public_finish_reason
from radixserve.protocol import BatchEmbeddingOutput, EmbeddingReqInput, TokenizedEmbeddingReqInput
from radixserve.sampling_params import SamplingParams, input_ids_error, unicode_error

NOT_AN_EMBEDDING_SERVER = (
    "This server serves a generation model; embedding requests need a server started with --is-embedding."
)
NOT_A_GENERATION_SERVER = (
    "This server serves an embedding model (--is-embedding): use /encode or /v1/embeddings; it does not generate."
)


def check_request_kind(is_embedding_server: bool, is_embedding_request: bool) -> None:
    """An embedding server only embeds, a generation server only generates: 400 otherwise."""
    if is_embedding_server and not is_embedding_request:
        raise RequestError(NOT_A_GENERATION_SERVER)
    if is_embedding_request and not is_embedding_server:
        raise RequestError(NOT_AN_EMBEDDING_SERVER)


@dataclass
class EmbeddingReqState(ReqState):
    """A ReqState (so the TokenizerManager's waiting, abort and metrics work unchanged) that
    ends with an embedding instead of text."""

    embedding: Optional[List[float]] = None


class EmbeddingFrontend:
    def __init__(self, frontend: RequestFrontend, hidden_size: Optional[int]):
        self.frontend = frontend
        self.hidden_size = hidden_size  # what `dimensions` may ask for (None: unknown, nothing)

    # ---- intake ---------------------------------------------------------------------------
    def prepare(self, obj: EmbeddingReqInput) -> Tuple[List[TokenizedEmbeddingReqInput], bool]:
        """Validate the request: (one TokenizedEmbeddingReqInput per prompt, is it one prompt
        rather than a batch). Touches no state (the TokenizerManager runs it off the event loop)."""
        self._check_dimensions(obj.dimensions)
        texts, ids_list, is_batch = self.frontend._prompts(obj)  # the same prompt checks as /generate
        if not ids_list:
            raise RequestError("The batch is empty.")
        if any(t == "" for t in texts):
            raise RequestError("The input is empty: give a non-empty text or input_ids.")
        rids = self._rids(obj.rid, len(ids_list), is_batch)
        reqs: List[TokenizedEmbeddingReqInput] = []
        for text, ids, rid in zip(texts, ids_list, rids):
            error = input_ids_error(ids, self.frontend.context_len, self.frontend.vocab_size)
            if error is not None:
                raise RequestError(error)
            if rid in self.frontend.rid_to_state:
                raise RequestError(f"Duplicate request id: {rid!r} is still running.")
            reqs.append(TokenizedEmbeddingReqInput(rid, text, list(ids), priority=obj.priority))
        return reqs, not is_batch

    def _check_dimensions(self, dimensions: Any) -> None:
        if dimensions is None:
            return
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
            raise RequestError(f"dimensions must be a positive integer, got {dimensions!r}.")
        if dimensions != self.hidden_size:
            raise RequestError(
                f"dimensions={dimensions} is not supported: this model's embeddings have {self.hidden_size} "
                "dimensions and it cannot truncate them (it is not a Matryoshka model); omit dimensions.")

    @staticmethod
    def _rids(rid: Any, num: int, is_batch: bool) -> List[str]:
        if rid is None:
            return [uuid.uuid4().hex for _ in range(num)]
        rids = rid if is_batch and isinstance(rid, list) else [rid]
        if len(rids) != num or not all(isinstance(r, str) and r for r in rids):
            raise RequestError("rid must be a non-empty string (a list with one per prompt for a batch).")
        for r in rids:
            error = unicode_error(r, "rid")
            if error is not None:
                raise RequestError(error)
        if len(set(rids)) != len(rids):
            raise RequestError("Duplicate request id: a rid appears twice in this batch.")
        return list(rids)

    def register(self, reqs: List[TokenizedEmbeddingReqInput]) -> List[EmbeddingReqState]:
        for r in reqs:  # checked again here: a request with this rid may have come meanwhile
            if r.rid in self.frontend.rid_to_state:
                raise RequestError(f"Duplicate request id: {r.rid!r} is still running.")
        states = []
        for r in reqs:
            state = EmbeddingReqState(r.rid, r.input_ids, SamplingParams(max_new_tokens=0), stream=False,
                                      return_logprob=False, top_logprobs_num=0, return_text_in_logprobs=False)
            self.frontend.rid_to_state[r.rid] = state
            states.append(state)
        return states

    # ---- outputs --------------------------------------------------------------------------
    def handle_batch_embedding_output(self, out: BatchEmbeddingOutput) -> List[EmbeddingReqState]:
        """Apply the scheduler's news to the request states; returns the states updated."""
        updated = []
        for i, rid in enumerate(out.rids):
            state = self.frontend.rid_to_state.get(rid)
            if not isinstance(state, EmbeddingReqState) or state.finished:
                continue
            state.embedding = out.embeddings[i]
            state.cached_tokens = out.cached_tokens[i]
            state.finished_reason, state.finished = out.finished_reasons[i], True
            updated.append(state)
        return updated

    def make_output(self, state: EmbeddingReqState) -> Dict[str, Any]:
        """SGLang's output of /encode and Engine.encode."""
        return {
            "embedding": state.embedding,
            "meta_info": {
                "id": state.rid,
                "finish_reason": public_finish_reason(state.finished_reason),
                "prompt_tokens": len(state.input_ids),
                "cached_tokens": state.cached_tokens,
                "e2e_latency": time.monotonic() - state.created,
                "weight_version": self.frontend.weight_version,
            },
        }
