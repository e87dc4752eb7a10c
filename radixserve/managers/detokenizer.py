"""Incremental detokenization (seed 001 §21.3) and stop-string trimming.

Decoding token by token breaks multi-byte characters and merges of byte-level BPE; so we
decode a window: ids[surr_offset:] against ids[surr_offset:read_offset]. The text they
differ by is new, and is emitted only once it does not end in an incomplete UTF-8 sequence."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set

from radixserve.protocol import LOGPROB_KEYS, SPEC_KEYS, BatchStrOutput

logger = logging.getLogger("radixserve.detokenizer")

# err_type of a request ended because its text could not be made: the TokenizerManager also
# aborts it in the scheduler, which did not end it.
DETOKENIZE_ERROR = "DetokenizeError"

# Per-request fields of features (logprobs, speculation, hidden states, HiCache's tiers) that the
# scheduler leaves empty when no request of its batch uses them.
OPTIONAL_KEYS = (*LOGPROB_KEYS, *SPEC_KEYS, "output_hidden_states", "cached_tokens_details")

# Tokens before the first output token used as decoding context (SGLang's INIT offset).
INIT_INCREMENTAL_DETOKENIZATION_OFFSET = 5


@dataclass
class DecodeStatus:
    decode_ids: List[int] = field(default_factory=list)
    decoded_text: str = ""
    surr_offset: int = 0
    read_offset: int = 0


def incremental_decode(
    tokenizer: Any,
    status: DecodeStatus,
    new_ids: List[int],
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
    finished: bool = False,
) -> str:
    """Append new_ids and return the text that became final (all of it when finished)."""
    status.decode_ids.extend(new_ids)
    kw = dict(skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaces_between_special_tokens)
    ids = status.decode_ids
    surr_text = _decode(tokenizer, ids[status.surr_offset : status.read_offset], kw)
    full_text = _decode(tokenizer, ids[status.surr_offset :], kw)
    new_text = full_text[len(surr_text) :]
    if finished or (new_text and not new_text.endswith("\ufffd")):
        status.decoded_text += new_text
        status.surr_offset = status.read_offset
        status.read_offset = len(ids)
        return new_text
    return ""


def _decode(tokenizer: Any, ids: List[int], kw: Dict[str, Any]) -> str:
    if not ids:
        return ""
    try:
        return tokenizer.decode(ids, **kw)
    except TypeError:  # tokenizers without spaces_between_special_tokens
        return tokenizer.decode(ids, skip_special_tokens=kw["skip_special_tokens"])


def trim_matched_stop(text: str, finished_reason: Optional[Dict[str, Any]], no_stop_trim: bool) -> str:
    """Cut the output at a matched stop string (SGLang trims unless no_stop_trim)."""
    if no_stop_trim or not finished_reason or finished_reason.get("type") != "stop":
        return text
    matched = finished_reason.get("matched")
    if isinstance(matched, str) and matched:
        pos = text.find(matched)
        if pos != -1:
            return text[:pos]
    return text


def output_ids_for_text(output_ids: List[int], finished_reason: Optional[Dict[str, Any]], no_stop_trim: bool) -> List[int]:
    """A matched stop token is not part of the text (it is still in output_ids)."""
    if not no_stop_trim and finished_reason and finished_reason.get("type") == "stop" and isinstance(finished_reason.get("matched"), int):
        return output_ids[:-1]
    return output_ids


# ---- the detokenizer process (served runtime) -------------------------------------------------
@dataclass
class _DetokState:
    status: DecodeStatus = field(default_factory=DecodeStatus)
    sent_offset: int = 0  # characters of text already sent to the tokenizer manager


class DetokenizerManager:
    """BatchTokenIDOutput -> BatchStrOutput: incremental text per request, never a broken UTF-8
    sequence in a chunk, a matched stop string trimmed off a finished request's text."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.states: Dict[str, _DetokState] = {}
        self.failed: Set[str] = set()  # rids whose detokenization failed, until their end

    def handle_batch_token_id_out(self, out: Any) -> Any:
        res = BatchStrOutput([], [], [], [], [], [], [], [])
        for i, rid in enumerate(out.rids):
            reason = out.finished_reasons[i]
            if rid in self.failed:  # its text broke earlier: its error went out already
                if reason is not None:
                    self.failed.discard(rid)
                continue
            finished = reason is not None
            state = self.states.pop(rid, None) if finished else self.states.setdefault(rid, _DetokState())
            state = state or _DetokState()
            new_ids = out.decode_ids[i]
            try:
                text = self._text(state, out, i, finished)
            except Exception as e:  # one request's text broke: end that request, serve the rest
                logger.exception("Detokenizing request %s failed; it is aborted", rid)
                self.states.pop(rid, None)
                if not finished:
                    self.failed.add(rid)
                text, reason = "", {"type": "abort", "message": f"Internal error while detokenizing: {type(e).__name__}: {e}",
                                    "status_code": 500, "err_type": DETOKENIZE_ERROR}
            offset = min(state.sent_offset, len(text))
            state.sent_offset = len(text)
            res.rids.append(rid)
            res.finished_reasons.append(reason)
            res.output_strs.append(text[offset:])
            res.text_offsets.append(offset)
            res.output_ids.append(list(new_ids))
            res.prompt_tokens.append(out.prompt_tokens[i])
            res.completion_tokens.append(out.completion_tokens[i])
            res.cached_tokens.append(out.cached_tokens[i])
            res.retraction_counts.append(out.retraction_counts[i] if i < len(out.retraction_counts) else 0)
            res.queue_times.append(out.queue_times[i] if i < len(out.queue_times) else None)
            # The features' fields pass through only where the scheduler filled them: an empty
            # list means no request of the batch uses the feature (output_processor.stream_output).
            for key in OPTIONAL_KEYS:
                src = getattr(out, key, ())
                if src:
                    getattr(res, key).append(src[i])
        return res

    def _text(self, state: _DetokState, out: Any, i: int, finished: bool) -> str:
        """The request's whole text so far (a matched stop string trimmed off at the end)."""
        if self.tokenizer is None:  # --skip-tokenizer-init: ids only
            return ""
        reason, no_stop_trim = out.finished_reasons[i], out.no_stop_trim[i]
        ids = output_ids_for_text(out.decode_ids[i], reason, no_stop_trim) if finished else out.decode_ids[i]
        incremental_decode(self.tokenizer, state.status, ids, out.skip_special_tokens[i],
                           out.spaces_between_special_tokens[i], finished=finished)
        text = state.status.decoded_text
        return trim_matched_stop(text, reason, no_stop_trim) if finished else text


def run_detokenizer_process(server_args: Any, port_args: Any, pipe: Any, decoder: Any = None) -> None:
    """Process entry: PULL token outputs from the scheduler, PUSH text to the tokenizer manager.
    decoder: the launcher's TextDecoder (managers/text_decoder.py); None: load the tokenizer here."""
    import os
    import traceback

    from radixserve.managers.process_utils import (become_server_child, configure_process_logging,
                                                   leave_stop_signals_to_launcher)

    become_server_child(port_args.ipc_dir)  # never outlive the launcher
    configure_process_logging(server_args, "detokenizer")
    try:
        import zmq

        from radixserve.protocol import BatchTokenIDOutput

        if decoder is not None and decoder.verified():
            tokenizer = decoder
        else:  # no `tokenizers` backend, a decode of its own (or --skip-tokenizer-init: None)
            from radixserve.hf_transformers_utils import get_tokenizer

            tokenizer = get_tokenizer(server_args)
        ctx = zmq.Context(1)
        recv_sock = ctx.socket(zmq.PULL)
        recv_sock.bind(port_args.detokenizer_ipc_name)
        send_sock = ctx.socket(zmq.PUSH)
        send_sock.setsockopt(zmq.SNDHWM, 0)
        send_sock.connect(port_args.tokenizer_ipc_name)
        manager = DetokenizerManager(tokenizer)
    except Exception as e:  # a model path that cannot load (LoadError): its one-line message, no traceback
        pipe.send({"status": "error", "error": str(e) if type(e).__name__ == "LoadError" else traceback.format_exc()})
        raise SystemExit(1)
    leave_stop_signals_to_launcher()  # from now on SIGTERM / SIGINT are the launcher's
    pipe.send({"status": "ready", "pid": os.getpid()})
    try:
        while True:
            obj = recv_sock.recv_pyobj()
            if isinstance(obj, BatchTokenIDOutput):
                obj = manager.handle_batch_token_id_out(obj)
            send_sock.send_pyobj(obj)  # anything else passes through unchanged
    except Exception:
        logging.getLogger("radixserve.detokenizer").error("Detokenizer hit an exception:\n%s", traceback.format_exc())
        os._exit(1)
