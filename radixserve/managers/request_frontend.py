"""RequestFrontend: one request front end for the HTTP server (TokenizerManager) and the offline
Engine, so validation lives in one place and both give results of one shape.

    GenerateReqInput --tokenize--> [TokenizedGenerateReqInput] (one per prompt x sample)
                                        |  scheduler -> BatchTokenIDOutput -> detokenizer
    ReqState <--handle_batch_output-- BatchStrOutput
    ReqState --make_output--> {"text", "output_ids", "meta_info"}   (SGLang's shape)

It is synchronous and owns no sockets: the TokenizerManager adds asyncio and ZeroMQ around it,
the Engine drives the scheduler and the detokenizer in its own thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from radixserve.managers.session import SessionError, SessionStore
from radixserve.multimodal.mm_inputs import MultimodalInputError
from radixserve.protocol import LOGPROB_KEYS, SPEC_KEYS, BatchStrOutput, GenerateReqInput, TokenizedGenerateReqInput
from radixserve.sampling.custom_logit_processor import check_custom_logit_processor
from radixserve.sampling_params import (
    MAX_INT_PARAM,
    SamplingParams,
    context_length_error,
    input_ids_error,
    sample_seed,
    unicode_error,
)
from radixserve.utils import held_suffix_len


MAX_TOKEN_IDS_LOGPROB = 1024  # ids one request may ask logprobs of (each costs a gather every step)


class RequestError(ValueError):
    """A request the server refuses: becomes an HTTP error with this status code (the Engine
    raises it as the ValueError it is)."""

    def __init__(self, message: str, status_code: int = 400, err_type: str = "BadRequestError"):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.err_type = err_type


@dataclass
class ReqState:
    """What the front end knows of one running request (one sample of an n > 1 request)."""

    rid: str
    input_ids: List[int]
    sampling_params: SamplingParams
    stream: bool
    return_logprob: bool
    top_logprobs_num: int
    return_text_in_logprobs: bool
    parent_rid: Optional[str] = None  # the rid an n > 1 request's samples were made from
    token_ids_logprob: Optional[List[int]] = None  # meta_info output_token_ids_logprobs
    return_hidden_states: bool = False  # meta_info.hidden_states
    hidden_states: List[List[float]] = field(default_factory=list)  # row j: output token j's
    session_id: Optional[str] = None
    created: float = field(default_factory=time.monotonic)
    event: asyncio.Event = field(default_factory=asyncio.Event)  # set on news (TokenizerManager)
    text: str = ""
    output_ids: List[int] = field(default_factory=list)
    finished_reason: Optional[Dict[str, Any]] = None
    finished: bool = False
    cached_tokens: int = 0
    cached_tokens_details: Optional[Dict[str, int]] = None  # HiCache: cached_tokens by tier
    completion_tokens: int = 0
    retraction_count: int = 0
    queue_time: Optional[float] = None  # s from the scheduler's waiting queue to the first forward
    spec_verify_ct: int = 0  # speculative decoding (SPEC_KEYS)
    spec_num_correct_drafts: int = 0
    spec_num_proposed_drafts: int = 0
    first_token_time: Optional[float] = None
    last_time: Optional[float] = None
    logprobs: Dict[str, list] = field(default_factory=lambda: {k: [] for k in LOGPROB_KEYS})


def spec_meta_info(state: ReqState) -> Dict[str, Any]:
    """SGLang's speculative meta_info: spec_accept_length = completion_tokens / spec_verify_ct
    (tokens per verify step, the target's own token included; the prefill's token counts too)."""
    proposed, correct = state.spec_num_proposed_drafts, state.spec_num_correct_drafts
    return {
        "spec_verify_ct": state.spec_verify_ct,
        "spec_accept_length": state.completion_tokens / state.spec_verify_ct,
        "spec_accept_rate": correct / proposed if proposed else 0.0,
        "spec_num_correct_drafts": correct,
        "spec_num_proposed_drafts": proposed,
    }


def public_finish_reason(reason: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """SGLang's shapes: {"type": "stop", "matched": ..} / {"type": "length", "length": N} /
    {"type": "abort", "message": ..} (no internal fields left empty)."""
    if reason is None:
        return None
    return {k: v for k, v in reason.items() if v is not None}


def is_single(obj: GenerateReqInput) -> bool:
    """One prompt (not a batch of one): the result is one output, not a list."""
    return not isinstance(obj.text, list) and not (
        isinstance(obj.input_ids, list) and bool(obj.input_ids) and isinstance(obj.input_ids[0], list)
    )


def check_bootstrap(host: Any, port: Any, room: Any) -> None:
    """PD disaggregation fields (sglang-router sets them): all absent, or a host, a port (or
    null: the default) and a room."""
    if host is None and port is None and room is None:
        return
    if not isinstance(host, str) or not host or unicode_error(host, "bootstrap_host") is not None:
        raise RequestError("bootstrap_host must be a non-empty string when bootstrap_port or bootstrap_room is given.")
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535):
        raise RequestError("bootstrap_port must be an integer in [1, 65535].")
    if not isinstance(room, int) or isinstance(room, bool) or not 0 <= room < 2**64:
        raise RequestError("bootstrap_room must be an integer in [0, 2**64).")


class RequestFrontend:
    def __init__(self, tokenizer: Any, context_len: int, vocab_size: int,
                 sampling_defaults: Optional[Dict[str, Any]] = None):
        self.tokenizer = tokenizer
        self.sampling_defaults = dict(sampling_defaults or {})  # what unset fields become (--sampling-defaults)
        self.context_len = context_len
        self.vocab_size = vocab_size
        self.rid_to_state: Dict[str, ReqState] = {}
        self.sessions = SessionStore()
        self.weight_version = "default"  # reported in every meta_info (set by weight updates)
        self.lora_names: Optional[set] = None  # --enable-lora: the adapters a request may name
        # a model that takes images: multimodal.processor's (None: text only, images refused)
        self.mm_processor: Any = None
        self.dp_size = 1  # --dp-size: a request's data_parallel_rank is in [0, dp_size)
        self.allow_auto_truncate = False  # --allow-auto-truncate: too long inputs are cut, not refused
        self.enable_custom_logit_processor = False  # --enable-custom-logit-processor
        # why this server cannot answer token_ids_logprob (a decoding path that does not compute it)
        self.token_ids_logprob_refusal: Optional[str] = None
        self.hidden_states_refusal: Optional[str] = None  # ... return_hidden_states
        self.input_embeds_refusal: Optional[str] = None  # ... input_embeds
        self.hidden_size: Optional[int] = None  # an input_embeds row's length

    # ---- intake ---------------------------------------------------------------------------
    def encode(self, text: str) -> List[int]:
        if self.tokenizer is None:
            raise RequestError("This server runs with --skip-tokenizer-init: send input_ids, not text.")
        return list(self.tokenizer.encode(text))

    def make_sampling_params(self, d: Any) -> SamplingParams:
        """Validate a sampling_params dict: unknown names, wrong types and values out of range
        raise RequestError with SGLang's messages."""
        if isinstance(d, SamplingParams):  # the offline API may pass one: its public fields
            d = {f.name: getattr(d, f.name) for f in dataclasses.fields(d) if f.init and f.repr}
        if isinstance(d, dict) and isinstance(d.get("json_schema"), dict):  # offline: a schema object
            d = {**d, "json_schema": json.dumps(d["json_schema"])}
        if d is not None and not isinstance(d, dict):
            raise RequestError(f"sampling_params must be an object, got {type(d).__name__}.")
        if self.sampling_defaults:
            d = {**self.sampling_defaults, **(d or {})}
        try:
            SamplingParams.from_dict(d)  # unknown names
            sp = _sampling_params_adapter().validate_python(dict(d or {}))
            sp.verify(self.vocab_size)  # before normalize(), which makes temperature < eps greedy
            sp.normalize(self.tokenizer)
        except ValueError as e:
            raise RequestError(validation_message(e, "sampling_params")) from None
        return sp

    def _check_logprob_args(self, obj: GenerateReqInput) -> None:
        top, start = obj.top_logprobs_num, obj.logprob_start_len
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= self.vocab_size:
            raise RequestError(f"top_logprobs_num must be an integer in [0, {self.vocab_size}] (the vocabulary), got {top!r}.")
        if isinstance(start, bool) or not isinstance(start, int) or not -1 <= start <= MAX_INT_PARAM:
            raise RequestError(f"logprob_start_len must be -1 (no input logprobs) or an integer in [0, {MAX_INT_PARAM}], got {start!r}.")

    def _prompts(self, obj: GenerateReqInput) -> Tuple[List[Optional[str]], List[List[int]], bool]:
        """(texts, token ids, is_batch) of the request's prompts."""
        embeds = getattr(obj, "input_embeds", None)  # (GenerateReqInput's; /v1/embeddings has none)
        if sum(x is not None for x in (obj.text, obj.input_ids, embeds)) != 1:
            also = " (or input_embeds alone)" if hasattr(obj, "input_embeds") else ""
            raise RequestError(f"Either text or input_ids should be provided (exactly one of them){also}.")
        if obj.text is not None:
            if isinstance(obj.text, str):
                texts: List[Optional[str]] = [obj.text]
                is_batch = False
            elif isinstance(obj.text, list) and all(isinstance(t, str) for t in obj.text):
                texts, is_batch = list(obj.text), True
            else:
                raise RequestError("text must be a string or a list of strings.")
            for i, t in enumerate(texts):
                error = unicode_error(t, f"text[{i}]" if is_batch else "text")
                if error is not None:
                    raise RequestError(error)
            return texts, [self.encode(t) for t in texts], is_batch
        ids = obj.input_ids
        if not isinstance(ids, list):
            raise RequestError("input_ids must be a list of token ids or a list of such lists.")
        if ids and all(isinstance(x, list) for x in ids):
            ids_list, is_batch = [list(x) for x in ids], True
        else:
            ids_list, is_batch = [list(ids)], False
        for row in ids_list:
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in row):
                raise RequestError("input_ids must contain integers.")
        return [None] * len(ids_list), ids_list, is_batch

    def tokenize(self, obj: GenerateReqInput) -> List[TokenizedGenerateReqInput]:
        """Validate the request and make one TokenizedGenerateReqInput per (prompt, sample),
        in output order, each with a registered ReqState."""
        prepared = self.prepare(obj)
        self.register(obj, *prepared)
        return prepared[0]

    def prepare(self, obj: GenerateReqInput) -> Tuple[List[TokenizedGenerateReqInput], Dict[str, str], Optional[str]]:
        """tokenize() without the registration: the requests, the rid each sample of an n > 1
        request was made from, and the session id. Touches no state, so the TokenizerManager
        runs it off the event loop (a huge prompt does not stall /health)."""
        if obj.input_embeds is not None and obj.text is None and obj.input_ids is None:
            embeds, is_batch = self._input_embeds(obj.input_embeds)
            # placeholder ids: the prompt's length for the scheduler's budgets, never embedded
            texts, ids_list = [None] * len(embeds), [[0] * len(e) for e in embeds]
        else:
            texts, ids_list, is_batch = self._prompts(obj)
            embeds = [None] * len(ids_list)
        num = len(ids_list)
        if num == 0:
            raise RequestError("The batch is empty.")

        def per_prompt(value: Any, name: str, default: Any) -> List[Any]:
            if isinstance(value, list) and (is_batch or name == "sampling_params"):
                if len(value) != num:
                    raise RequestError(f"{name} has {len(value)} entries for {num} prompts.")
                return value
            if is_batch and name == "rid" and value is not None:
                raise RequestError("rid must be a list with one entry per prompt for a batch.")
            return [default if value is None else value] * num

        sp_dicts = per_prompt(obj.sampling_params, "sampling_params", None)
        rids = per_prompt(obj.rid, "rid", None)
        return_logprobs = per_prompt(obj.return_logprob, "return_logprob", False)
        hidden = per_prompt(obj.return_hidden_states, "return_hidden_states", False)
        if not all(isinstance(x, bool) for x in hidden):
            raise RequestError("return_hidden_states must be true or false (a list of them, one per prompt, for a batch).")
        if any(hidden) and self.hidden_states_refusal is not None:
            raise RequestError(self.hidden_states_refusal)
        if obj.input_embeds is not None:
            self._check_input_embeds_request(obj, return_logprobs)
        asked = obj.token_ids_logprob  # one list for every prompt, or (a batch) one list per prompt
        per_prompt_lists = (is_batch and isinstance(asked, list) and any(isinstance(x, list) for x in asked)
                            and all(x is None or isinstance(x, list) for x in asked))
        asked_ids = per_prompt(asked, "token_ids_logprob", None) if per_prompt_lists else [asked] * num
        for rid in rids:
            if rid is not None and not isinstance(rid, str):
                raise RequestError("rid must be a string.")
            error = unicode_error(rid, "rid")
            if error is not None:
                raise RequestError(error)
        if not all(isinstance(x, bool) for x in return_logprobs):
            raise RequestError("return_logprob must be true or false (a list of them, one per prompt, for a batch).")
        self._check_logprob_args(obj)
        self.check_data_parallel_rank(obj.data_parallel_rank)
        bootstraps = list(zip(*(per_prompt(getattr(obj, f"bootstrap_{k}"), f"bootstrap_{k}", None)
                                for k in ("host", "port", "room"))))
        for bootstrap in bootstraps:
            check_bootstrap(*bootstrap)
        for ids, ret_lp in zip(asked_ids, return_logprobs):
            self.check_token_ids_logprob(ids, ret_lp)
        lora_paths = per_prompt(obj.lora_path, "lora_path", None)
        for lora_path in lora_paths:
            self.check_lora_path(lora_path)
        session_id = None
        if obj.session_params is not None:
            if is_batch:
                raise RequestError("session_params takes a single prompt.")
            try:
                ids, session_id = self.sessions.continue_prompt(obj.session_params, ids_list[0])
            except SessionError as e:
                raise RequestError(str(e)) from None
            ids_list = [ids]
        ids_list, mm_list = self._process_images(obj, ids_list, is_batch, return_logprobs)

        reqs: List[TokenizedGenerateReqInput] = []
        parents: Dict[str, str] = {}
        batch_rids: set = set()  # two outputs of one batch could not share one request state
        for text, ids, sp_dict, rid, ret_lp, bootstrap, lora_path, mm, token_ids_lp, ret_hidden, embed in zip(
                texts, ids_list, sp_dicts, rids, return_logprobs, bootstraps, lora_paths, mm_list, asked_ids, hidden, embeds):
            if self.allow_auto_truncate and mm is None and embed is None:  # an image's pad ids, embeddings: never cut
                ids, text = auto_truncate(ids, text, self.context_len)
            error = input_ids_error(ids if mm is None else mm.unpadded(ids), self.context_len, self.vocab_size)
            if error is not None:
                raise RequestError(error)
            sp = self.make_sampling_params(sp_dict)
            explicit = sp_dict.get("max_new_tokens") if isinstance(sp_dict, dict) else (
                sp_dict.max_new_tokens if isinstance(sp_dict, SamplingParams) else None)
            # --allow-auto-truncate: the scheduler clips max_new_tokens to the room left instead
            error = None if self.allow_auto_truncate else context_length_error(len(ids), explicit, self.context_len)
            if error is None:
                error = check_custom_logit_processor(obj.custom_logit_processor, sp.custom_params,
                                                     self.enable_custom_logit_processor, self.vocab_size)
            if error is not None:
                raise RequestError(error)
            n = sp.n
            if n > 1 and session_id is not None:
                raise RequestError("n > 1 cannot continue a session.")
            if n > 1 and bootstrap[2] is not None:
                raise RequestError("n > 1 is not supported with PD disaggregation (one bootstrap_room per sample).")
            base = rid or uuid.uuid4().hex
            for j in range(n):
                sub_rid = base if n == 1 else f"{base}-{j}"
                if sub_rid in self.rid_to_state:
                    raise RequestError(f"Duplicate request id: {sub_rid!r} is still running.")
                if sub_rid in batch_rids:
                    raise RequestError(f"Duplicate request id: {sub_rid!r} appears twice in this batch.")
                batch_rids.add(sub_rid)
                reqs.append(TokenizedGenerateReqInput(
                    sub_rid, text, list(ids),
                    dataclasses.replace(sp, n=1, sampling_seed=sample_seed(sp.sampling_seed, j)) if n > 1 else sp,
                    return_logprob=bool(ret_lp), logprob_start_len=obj.logprob_start_len,
                    top_logprobs_num=obj.top_logprobs_num, stream=bool(obj.stream), priority=obj.priority,
                    bootstrap_host=bootstrap[0], bootstrap_port=bootstrap[1], bootstrap_room=bootstrap[2],
                    lora_path=lora_path, is_health_check=obj.is_health_check, mm_inputs=mm,
                    data_parallel_rank=obj.data_parallel_rank, custom_logit_processor=obj.custom_logit_processor,
                    token_ids_logprob=token_ids_lp, return_hidden_states=ret_hidden, input_embeds=embed,
                ))
                if n > 1:
                    parents[sub_rid] = base
        return reqs, parents, session_id

    def _process_images(self, obj: GenerateReqInput, ids_list: List[List[int]], is_batch: bool,
                        return_logprobs: List[bool]) -> Tuple[List[List[int]], List[Any]]:
        """(the prompts' ids with their images' placeholders expanded and padded, each prompt's
        MultimodalInputs or None). Images are decoded and processed here, off the event loop."""
        images = _images_per_prompt(obj.image_data, len(ids_list), is_batch)
        if all(i is None for i in images):
            return ids_list, [None] * len(ids_list)
        if self.mm_processor is None:
            raise RequestError("This model takes text only: it cannot be sent images (image_data, image_url parts).")
        if obj.session_params is not None:
            raise RequestError("A request with images cannot continue a session yet.")
        if obj.logprob_start_len >= 0 and any(return_logprobs):
            raise RequestError("Input logprobs (logprob_start_len >= 0) are not served for prompts with images.")
        out_ids, out_mm = [], []
        for p, (ids, imgs) in enumerate(zip(ids_list, images)):
            if not imgs:
                out_ids.append(ids)
                out_mm.append(None)
                continue
            labels = obj.image_labels if obj.image_labels is not None and not is_batch else [
                f"image_data[{p}][{i}]" if is_batch else f"image_data[{i}]" for i in range(len(imgs))]
            try:
                ids, mm = self.mm_processor.process(ids, imgs, labels)
            except MultimodalInputError as e:
                raise RequestError(str(e)) from None
            out_ids.append(ids)
            out_mm.append(mm)
        return out_ids, out_mm

    def _input_embeds(self, value: Any) -> Tuple[List[Any], bool]:
        """SGLang's input_embeds: one prompt's [seq, hidden] floats, or a list of such; returns
        (one float32 tensor per prompt, is_batch), or a 400 saying what is wrong."""
        if self.input_embeds_refusal is not None:
            raise RequestError(self.input_embeds_refusal)
        if not isinstance(value, list) or not value:
            raise RequestError("input_embeds must be a non-empty list of embeddings ([seq, hidden] numbers), or a list of such.")
        is_batch = isinstance(value[0], list) and bool(value[0]) and isinstance(value[0][0], list)
        prompts = value if is_batch else [value]
        out = []
        for i, p in enumerate(prompts):
            where = f"input_embeds[{i}]" if is_batch else "input_embeds"
            try:
                t = torch.tensor(p, dtype=torch.float32)
            except (TypeError, ValueError, RuntimeError):
                raise RequestError(f"{where} must be a list of rows of {self.hidden_size} numbers each.") from None
            if t.dim() != 2 or t.shape[0] == 0:
                raise RequestError(f"{where} must be a non-empty list of rows of {self.hidden_size} numbers each.")
            if t.shape[1] != self.hidden_size:
                raise RequestError(f"{where} has rows of {t.shape[1]} numbers; this model's hidden size is {self.hidden_size}.")
            if not torch.isfinite(t).all():
                raise RequestError(f"{where} must hold finite numbers (no NaN or infinity).")
            out.append(t)
        return out, is_batch

    @staticmethod
    def _check_input_embeds_request(obj: GenerateReqInput, return_logprobs: List[bool]) -> None:
        """What an input_embeds prompt cannot do: it has no token ids to score or to continue."""
        if obj.image_data is not None:
            raise RequestError("input_embeds takes no image_data (the prompt's embeddings are given).")
        if obj.session_params is not None:
            raise RequestError("input_embeds cannot continue a session (a session continues token ids).")
        if obj.logprob_start_len >= 0 and any(return_logprobs):
            raise RequestError("Input logprobs (logprob_start_len >= 0) score the prompt's token ids; an input_embeds prompt has none.")

    def check_token_ids_logprob(self, ids: Any, return_logprob: bool) -> None:
        """SGLang's token_ids_logprob: token ids in the vocabulary, with return_logprob."""
        if ids is None:
            return
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise RequestError("token_ids_logprob must be a non-empty list of token ids (one such list per prompt for a batch).")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise RequestError(f"token_ids_logprob must hold token ids in [0, {self.vocab_size}).")
        if len(ids) > MAX_TOKEN_IDS_LOGPROB:
            raise RequestError(f"token_ids_logprob takes at most {MAX_TOKEN_IDS_LOGPROB} token ids, got {len(ids)}.")
        if not return_logprob:
            raise RequestError("token_ids_logprob needs return_logprob: true.")
        if self.token_ids_logprob_refusal is not None:
            raise RequestError(self.token_ids_logprob_refusal)

    def check_data_parallel_rank(self, rank: Any) -> None:
        """SGLang's data_parallel_rank: the replica that must serve the request (400 out of range)."""
        if rank is None:
            return
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.dp_size:
            raise RequestError(f"data_parallel_rank must be an integer in [0, {self.dp_size}) (--dp-size {self.dp_size}), got {rank!r}.")

    def check_lora_path(self, lora_path: Any) -> None:
        """A request's adapter must be one the server has loaded (400 naming it otherwise)."""
        if lora_path is None:
            return
        if not isinstance(lora_path, str):
            raise RequestError("lora_path must be an adapter name (a string), or a list of them for a batch.")
        if self.lora_names is None:
            raise RequestError(f"LoRA adapter {lora_path!r} was requested but the server runs without --enable-lora.")
        if lora_path not in self.lora_names:
            loaded = ", ".join(sorted(self.lora_names)) or "none"
            raise RequestError(f"LoRA adapter {lora_path!r} is not loaded (loaded adapters: {loaded}).")

    def register(self, obj: GenerateReqInput, reqs: List[TokenizedGenerateReqInput],
                 parents: Dict[str, str], session_id: Optional[str]) -> None:
        for r in reqs:  # checked again here: a request with this rid may have come meanwhile
            if r.rid in self.rid_to_state:
                raise RequestError(f"Duplicate request id: {r.rid!r} is still running.")
        for r in reqs:
            self.rid_to_state[r.rid] = ReqState(
                r.rid, r.input_ids, r.sampling_params, r.stream, r.return_logprob, r.top_logprobs_num,
                bool(obj.return_text_in_logprobs), parent_rid=parents.get(r.rid), session_id=session_id,
                token_ids_logprob=r.token_ids_logprob, return_hidden_states=r.return_hidden_states,
            )

    def abort_targets(self, rid: str) -> List[str]:
        """The rids to abort for `rid`: itself, or the samples of an n > 1 request."""
        targets = [rid] if rid in self.rid_to_state else []
        targets += [r for r, s in self.rid_to_state.items() if s.parent_rid == rid and r != rid]
        return targets or [rid]

    # ---- outputs --------------------------------------------------------------------------
    def handle_batch_output(self, out: BatchStrOutput) -> List[Tuple[ReqState, int]]:
        """Apply the detokenizer's news to the request states. Returns (state, number of new
        tokens) for each state updated (the TokenizerManager's metrics read them)."""
        updated = []
        for i, rid in enumerate(out.rids):
            state = self.rid_to_state.get(rid)
            if state is None or state.finished:
                continue
            new_ids = out.output_ids[i]
            state.text = state.text[: out.text_offsets[i]] + out.output_strs[i]
            state.output_ids.extend(new_ids)
            state.completion_tokens = out.completion_tokens[i]
            state.cached_tokens = out.cached_tokens[i]
            if i < len(out.cached_tokens_details) and out.cached_tokens_details[i] is not None:
                state.cached_tokens_details = out.cached_tokens_details[i]
            if i < len(out.retraction_counts):
                state.retraction_count = out.retraction_counts[i]
            if i < len(out.queue_times) and out.queue_times[i] is not None:
                state.queue_time = out.queue_times[i]
            for key in SPEC_KEYS:
                if i < len(getattr(out, key, ())):
                    setattr(state, key, getattr(out, key)[i])
            if state.return_logprob:
                for key in LOGPROB_KEYS:
                    state.logprobs[key].extend(getattr(out, key)[i])
            if state.return_hidden_states and i < len(out.output_hidden_states):
                state.hidden_states.extend(out.output_hidden_states[i])
            reason = out.finished_reasons[i]
            if reason is not None:
                state.finished_reason, state.finished = reason, True
                if reason.get("type") != "abort":
                    self.sessions.record(state.session_id, rid, list(state.input_ids) + list(state.output_ids))
            updated.append((state, len(new_ids)))
        return updated

    def fail_all(self, message: str, status_code: int = 500, err_type: str = "InternalServerError") -> List[ReqState]:
        """A child process died: end every unfinished request with an error."""
        failed = [s for s in self.rid_to_state.values() if not s.finished]
        for state in failed:
            state.finished_reason = {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}
            state.finished = True
        return failed

    def make_output(self, state: ReqState) -> Dict[str, Any]:
        """SGLang's output of /generate and Engine.generate: cumulative text, output_ids,
        meta_info (logprobs as [logprob, token_id, token_text or None] triples)."""
        text = state.text
        sp = state.sampling_params
        if not state.finished and sp.stop_strs and not sp.no_stop_trim:
            text = text[: len(text) - held_suffix_len(text, sp.stop_strs)]  # a stop string may begin there
        meta: Dict[str, Any] = {
            "id": state.rid,
            "finish_reason": public_finish_reason(state.finished_reason) if state.finished else None,
            "prompt_tokens": len(state.input_ids),
            "completion_tokens": state.completion_tokens,
            "cached_tokens": state.cached_tokens,
            **({"cached_tokens_details": dict(state.cached_tokens_details)} if state.cached_tokens_details else {}),
            "e2e_latency": time.monotonic() - state.created,
            "weight_version": self.weight_version,
        }
        meta["num_retractions"] = state.retraction_count  # SGLang's (always present)
        if state.retraction_count:
            meta["retraction_count"] = state.retraction_count  # radixserve's older name, kept for its clients
        if state.queue_time is not None:
            meta["queue_time"] = state.queue_time
        if state.spec_verify_ct:  # speculative decoding, SGLang's fields
            meta.update(spec_meta_info(state))
        if state.return_logprob:
            lp, with_text = state.logprobs, state.return_text_in_logprobs
            meta["output_token_logprobs"] = self._logprob_triples(lp["output_token_logprobs_val"], lp["output_token_logprobs_idx"], with_text)
            # Always present: from logprob_start_len (the last prompt token without one), the
            # first entry None (SGLang's). sglang-router puts a PD prefill server's input logprobs
            # in front of the decode server's (empty) list.
            meta["input_token_logprobs"] = self._logprob_triples(lp["input_token_logprobs_val"], lp["input_token_logprobs_idx"], with_text)
            if state.top_logprobs_num > 0:
                meta["output_top_logprobs"] = [
                    self._logprob_triples(v, ix, with_text)
                    for v, ix in zip(lp["output_top_logprobs_val"], lp["output_top_logprobs_idx"])
                ]
                # ... one list per prompt token from logprob_start_len, None for the first
                meta["input_top_logprobs"] = [
                    None if v is None else self._logprob_triples(v, ix, with_text)
                    for v, ix in zip(lp["input_top_logprobs_val"], lp["input_top_logprobs_idx"])
                ]
            if state.token_ids_logprob is not None:  # SGLang's: one list of the asked ids per output token
                meta["output_token_ids_logprobs"] = [
                    self._logprob_triples(v, ix, with_text)
                    for v, ix in zip(lp["output_token_ids_logprobs_val"], lp["output_token_ids_logprobs_idx"])
                ]
                # ... and per prompt token from logprob_start_len (None: the first token has no context)
                meta["input_token_ids_logprobs"] = [
                    None if v is None else self._logprob_triples(v, ix, with_text)
                    for v, ix in zip(lp["input_token_ids_logprobs_val"], lp["input_token_ids_logprobs_idx"])
                ]
        if state.return_hidden_states:
            meta["hidden_states"] = hidden_states_meta(state.hidden_states)
        return {"text": text, "output_ids": list(state.output_ids), "meta_info": meta}

    def _logprob_triples(self, vals: List[float], ids: List[int], with_text: bool) -> List[list]:
        texts = [self.decode_token(t) for t in ids] if with_text else [None] * len(ids)
        return [[None if v is None else float(v), int(t), s] for v, t, s in zip(vals, ids, texts)]

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([int(token_id)]) if self.tokenizer is not None else ""


def token_ids_logprob_refusal(server_args: Any) -> Optional[str]:
    """Why this server's decoding path cannot answer token_ids_logprob (None: it can). The
    speculative verify, the pipeline's last stage and a PD decode server take their logprobs
    elsewhere; they are not served wrongly but refused."""
    for on, what in ((server_args.speculative_algorithm, "--speculative-algorithm"), (server_args.pp_size > 1, "--pp-size > 1"),
                     (server_args.disaggregation_mode != "null", "--disaggregation-mode")):
        if on:
            return f"token_ids_logprob is not supported with {what}."
    return None


def hidden_states_meta(rows: List[List[float]]) -> List[Any]:
    """SGLang's meta_info.hidden_states: first the prompt's entry (a list of rows: here its last
    position's only, the one the first token came from), then one row per later output token
    (the state it was sampled from; the last token's own state is never computed)."""
    return [[rows[0]], *rows[1:]] if rows else []


def hidden_states_refusal(server_args: Any) -> Optional[str]:
    """Why this server cannot answer return_hidden_states (None: it can): a speculative step, a
    pipeline's last stage and a PD decode server keep no final hidden state per token."""
    for on, what in ((server_args.speculative_algorithm, "--speculative-algorithm"), (server_args.pp_size > 1, "--pp-size > 1"),
                     (server_args.disaggregation_mode != "null", "--disaggregation-mode")):
        if on:
            return f"return_hidden_states is not supported with {what}."
    return None


def input_embeds_refusal(server_args: Any, architecture: Optional[str]) -> Optional[str]:
    """Why this server cannot take input_embeds (None: it can). As in SGLang the prefix cache must
    be off: it keys on token ids, and an input_embeds prompt has only placeholders."""
    from radixserve.models.registry import get_model_class

    if not server_args.disable_radix_cache:
        return "input_embeds needs a server started with --disable-radix-cache (the prefix cache keys on token ids)."
    for on, what in ((server_args.speculative_algorithm, "--speculative-algorithm"), (server_args.pp_size > 1, "--pp-size > 1"),
                     (server_args.disaggregation_mode != "null", "--disaggregation-mode")):
        if on:
            return f"input_embeds is not supported with {what}."
    if architecture is None or not getattr(get_model_class(architecture), "supports_input_embeds", False):
        return f"input_embeds is not supported for {architecture} models."
    return None


def auto_truncate(ids: List[int], text: Optional[str], context_len: int) -> Tuple[List[int], Optional[str]]:
    """--allow-auto-truncate (SGLang's validate_input_length with allow_auto_truncate): an input
    that leaves no room for a new token keeps its first context_len - 2 tokens (room for the one
    a prefill samples; a context_len - 1 input would get none), and its text is dropped: it no
    longer matches the ids."""
    if len(ids) < context_len - 1:
        return ids, text
    return list(ids[: context_len - 2]), None


_ADAPTER = None


def _sampling_params_adapter() -> Any:
    global _ADAPTER
    if _ADAPTER is None:
        from pydantic import TypeAdapter

        _ADAPTER = TypeAdapter(SamplingParams)
    return _ADAPTER


def validation_message(e: Exception, where: str) -> str:
    """A pydantic ValidationError as one readable line; other ValueErrors as they are."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        parts = []
        for err in errors():
            loc = ".".join(str(x) for x in err.get("loc", ()))
            parts.append(f"{where}.{loc}: {err.get('msg')}" if loc else f"{where}: {err.get('msg')}")
        return "; ".join(parts)
    return str(e)


def _images_per_prompt(image_data: Any, num: int, is_batch: bool) -> List[Optional[List[Any]]]:
    """image_data as one list of images per prompt (None: none): a single prompt takes one
    image or a list; a batch, one such entry per prompt."""
    if image_data is None:
        return [None] * num
    if not is_batch:
        return [image_data if isinstance(image_data, list) else [image_data]]
    if not isinstance(image_data, list) or len(image_data) != num:
        raise RequestError(f"image_data must have one entry (an image, a list of them, or null) for each of the {num} prompts.")
    return [None if d is None else (d if isinstance(d, list) else [d]) for d in image_data]
