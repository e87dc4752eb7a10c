"""Engine: the offline API. It drives the production Scheduler in this process (no ZeroMQ):
requests go in through the scheduler's recv_fn, outputs come back through its send_fn.

    engine = Engine()                       # the embedded tiny model
    engine.generate("Hello", {"max_new_tokens": 16, "temperature": 0})
    for chunk in engine.generate("Hello", stream=True): print(chunk["text"])
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Union

from tqdm import tqdm

from radixserve.managers.detokenizer import (
    DecodeStatus,
    incremental_decode,
    output_ids_for_text,
    trim_matched_stop,
)
from radixserve.managers.scheduler import Scheduler
from radixserve.protocol import (
    AbortReq,
    BatchTokenIDOutput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    TokenizedGenerateReqInput,
)
from radixserve.sampling_params import SamplingParams, context_length_error
from radixserve.server_args import ServerArgs

SamplingArg = Optional[Union[Dict[str, Any], List[Dict[str, Any]]]]


@dataclass
class _ReqState:
    rid: str
    prompt_tokens: int
    sampling_params: SamplingParams
    start: float
    output_ids: List[int] = field(default_factory=list)
    status: DecodeStatus = field(default_factory=DecodeStatus)
    finished_reason: Optional[Dict[str, Any]] = None
    cached_tokens: int = 0
    logprobs: Dict[str, list] = field(default_factory=lambda: {k: [] for k in _LOGPROB_KEYS})
    finished: bool = False


_LOGPROB_KEYS = ("input_token_logprobs_val", "input_token_logprobs_idx", "output_token_logprobs_val", "output_token_logprobs_idx", "output_top_logprobs_val", "output_top_logprobs_idx")


class Engine:
    def __init__(self, model_path: Optional[str] = None, **kwargs: Any):
        self.server_args = ServerArgs(model_path=model_path, **kwargs)
        self._inbox: List[Any] = []
        self._outbox: List[Any] = []
        self.scheduler = Scheduler(self.server_args, recv_fn=self._drain_inbox, send_fn=self._outbox.append)
        self.tokenizer = self.scheduler.tokenizer
        self._states: Dict[str, _ReqState] = {}

    def _drain_inbox(self) -> List[Any]:
        items, self._inbox = self._inbox, []
        return items

    # ---- requests -------------------------------------------------------------------------------
    def _make_requests(self, prompt, input_ids, sampling_params: SamplingArg, **kw) -> List[TokenizedGenerateReqInput]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("Give exactly one of prompt and input_ids.")
        if prompt is not None:
            prompts = [prompt] if isinstance(prompt, str) else list(prompt)
            ids_list = [self.tokenizer.encode(p) for p in prompts]
        else:
            single = bool(input_ids) and isinstance(input_ids[0], int)
            ids_list = [list(input_ids)] if single else [list(x) for x in input_ids]
            prompts = [None] * len(ids_list)
        n = len(ids_list)
        sp_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
        if len(sp_list) != n:
            raise ValueError(f"{len(sp_list)} sampling_params for {n} prompts.")
        rids = kw.pop("rid", None)
        rids = [rids] if isinstance(rids, str) else rids
        reqs = []
        for i, (text, ids, sp_dict) in enumerate(zip(prompts, ids_list, sp_list)):
            sp = SamplingParams.from_dict(sp_dict)
            sp.verify(self.scheduler.vocab_size)
            explicit = sp_dict.get("max_new_tokens") if isinstance(sp_dict, dict) else None
            error = context_length_error(len(ids), explicit, self.scheduler.context_len)
            if error is not None:
                raise ValueError(error)
            sp.normalize(self.tokenizer)
            rid = rids[i] if rids else uuid.uuid4().hex
            reqs.append(TokenizedGenerateReqInput(rid, text, ids, sp, **kw))
        return reqs

    def generate(
        self,
        prompt: Optional[Union[str, List[str]]] = None,
        sampling_params: SamplingArg = None,
        input_ids: Optional[Union[List[int], List[List[int]]]] = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        stream: bool = False,
        priority: Optional[int] = None,
        rid: Optional[Union[str, List[str]]] = None,
        progress: bool = True,
    ) -> Union[Dict[str, Any], List[Dict[str, Any]], Iterator[Dict[str, Any]]]:
        """SGLang-shaped results: {"text", "output_ids", "meta_info": {...}}; a list for a list
        of prompts; with stream=True an iterator of such dicts with the text so far."""
        reqs = self._make_requests(
            prompt, input_ids, sampling_params, return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num, logprob_start_len=logprob_start_len, stream=stream,
            priority=priority, rid=rid,
        )
        is_single = isinstance(prompt, str) or (input_ids is not None and bool(input_ids) and isinstance(input_ids[0], int))
        for r in reqs:
            self._submit(r)
        if stream:
            if len(reqs) != 1:
                raise ValueError("stream=True takes a single prompt.")
            return self._stream(reqs[0].rid)
        rids = [r.rid for r in reqs]
        bar = tqdm(total=len(rids), desc="generate", disable=not progress or len(rids) < 16)
        done = 0
        while not all(self._states[r].finished for r in rids):
            self.step()
            now_done = sum(self._states[r].finished for r in rids)
            bar.update(now_done - done)
            done = now_done
        bar.close()
        results = [self._result(self._states.pop(r)) for r in rids]
        return results[0] if is_single else results

    def _submit(self, req: TokenizedGenerateReqInput) -> None:
        self._states[req.rid] = _ReqState(req.rid, len(req.input_ids), req.sampling_params, time.monotonic())
        self._inbox.append(req)

    def _stream(self, rid: str) -> Iterator[Dict[str, Any]]:
        state = self._states[rid]
        sent = 0
        try:
            while True:
                self.step()
                if len(state.output_ids) > sent or state.finished:
                    sent = len(state.output_ids)
                    yield self._result(state)
                if state.finished:
                    return
        finally:
            if not state.finished:
                self.abort(rid)
            self._states.pop(rid, None)

    def step(self) -> None:
        """One scheduler iteration, then route its outputs to the request states."""
        sched = self.scheduler
        sched.process_input_requests(sched.recv_requests())
        sched.run_step()
        outputs, self._outbox[:] = list(self._outbox), []
        for out in outputs:
            if isinstance(out, BatchTokenIDOutput):
                self._handle_output(out)

    def _handle_output(self, out: BatchTokenIDOutput) -> None:
        for i, rid in enumerate(out.rids):
            state = self._states.get(rid)
            if state is None:
                continue
            state.output_ids.extend(out.decode_ids[i])
            state.cached_tokens = out.cached_tokens[i]
            for key in _LOGPROB_KEYS:
                state.logprobs[key].extend(getattr(out, key)[i])
            finished = out.finished_reasons[i] is not None
            sp = state.sampling_params
            if self.tokenizer is not None:  # --skip-tokenizer-init: output_ids only, text stays ""
                ids = output_ids_for_text(out.decode_ids[i], out.finished_reasons[i], sp.no_stop_trim) if finished else out.decode_ids[i]
                incremental_decode(self.tokenizer, state.status, ids, sp.skip_special_tokens,
                                   sp.spaces_between_special_tokens, finished=finished)
            if finished:
                state.finished_reason = out.finished_reasons[i]
                state.finished = True

    def _result(self, state: _ReqState) -> Dict[str, Any]:
        text = trim_matched_stop(state.status.decoded_text, state.finished_reason, state.sampling_params.no_stop_trim)
        meta: Dict[str, Any] = {
            "id": state.rid,
            "finish_reason": state.finished_reason,
            "prompt_tokens": state.prompt_tokens,
            "completion_tokens": len(state.output_ids),
            "cached_tokens": state.cached_tokens,
            "e2e_latency": time.monotonic() - state.start,
        }
        if state.logprobs["input_token_logprobs_idx"]:
            meta["input_token_logprobs"] = list(zip(state.logprobs["input_token_logprobs_val"], state.logprobs["input_token_logprobs_idx"]))
        if state.logprobs["output_token_logprobs_val"]:
            meta["output_token_logprobs"] = list(zip(state.logprobs["output_token_logprobs_val"], state.logprobs["output_token_logprobs_idx"]))
            if state.logprobs["output_top_logprobs_val"]:
                meta["output_top_logprobs"] = [
                    list(zip(v, i)) for v, i in zip(state.logprobs["output_top_logprobs_val"], state.logprobs["output_top_logprobs_idx"])
                ]
        return {"text": text, "output_ids": list(state.output_ids), "meta_info": meta}

    # ---- control ----------------------------------------------------------------------------------
    def abort(self, rid: str) -> None:
        self._inbox.append(AbortReq(rid=rid))
        self.scheduler.process_input_requests(self._drain_inbox())

    def flush_cache(self) -> bool:
        self._inbox.append(FlushCacheReqInput())
        self.scheduler.process_input_requests(self._drain_inbox())
        outs = [o for o in self._outbox if isinstance(o, FlushCacheReqOutput)]
        self._outbox[:] = [o for o in self._outbox if not isinstance(o, FlushCacheReqOutput)]
        return bool(outs and outs[-1].success)

    def get_server_info(self) -> Dict[str, Any]:
        return self.scheduler.internal_state()

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self._states.clear()
        self._inbox.clear()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
