"""Isolation and limits below the HTTP layer: a reply is matched to its own query, the grammar
cache is bounded, one request's broken detokenization ends only that request, sessions expire
and stay bounded, and one request's broken stop check ends only that request."""

from __future__ import annotations

import asyncio
import time
from typing import Any, List

import pytest

from radixserve.constrained.base_grammar_backend import BaseGrammarBackend, BaseGrammarObject
from radixserve.engine import Engine
from radixserve.managers.detokenizer import DETOKENIZE_ERROR, DetokenizerManager
from radixserve.managers.session import MAX_REQS_PER_SESSION, SessionStore
from radixserve.managers.tokenizer_manager import RequestError, _Communicator
from radixserve.protocol import BatchTokenIDOutput, GetInternalStateReq, GetInternalStateReqOutput, OpenSessionReqInput


def test_a_late_reply_does_not_answer_the_next_query():
    """Query 1 times out; its reply arrives while query 2 waits: query 2 gets its own reply."""

    async def run() -> Any:
        sent: List[Any] = []
        comm = _Communicator(sent.append)
        with pytest.raises(RequestError, match="did not answer in time"):
            await comm(GetInternalStateReq(), timeout=0.01)
        second = asyncio.ensure_future(comm(GetInternalStateReq(), timeout=5))
        await asyncio.sleep(0)
        first_id, second_id = sent[0].query_id, sent[1].query_id
        assert first_id != second_id
        comm.handle(GetInternalStateReqOutput({"answer": 1}, first_id))  # late: dropped
        await asyncio.sleep(0.01)
        assert not second.done()
        comm.handle(GetInternalStateReqOutput({"answer": 2}, second_id))
        return await second

    assert asyncio.run(run()).internal_state == {"answer": 2}


class _Grammar(BaseGrammarObject):
    def copy(self) -> "_Grammar":
        return self


class _CountingBackend(BaseGrammarBackend):
    def __init__(self, cache_size: int):
        super().__init__(vocab_size=16, max_workers=1, cache_size=cache_size)
        self.compiled: List[str] = []

    def dispatch_regex(self, regex: str) -> BaseGrammarObject:
        self.compiled.append(regex)
        return _Grammar()


def test_grammar_cache_keeps_the_most_recently_used():
    backend = _CountingBackend(cache_size=2)
    try:
        for rx in ("a", "b", "a", "c", "a", "b"):  # "b" was evicted by "c" (least recently used)
            value, hit = backend.get_cached_or_future_value(("regex", rx))
            if not hit:
                value.result()
        assert backend.compiled == ["a", "b", "c", "b"]
        assert len(backend.cache) == 2
    finally:
        backend.shutdown()


class _BrittleTokenizer:
    """Decodes ids as letters; id 13 makes decode raise (a tokenizer bug one output reaches)."""

    def decode(self, ids: List[int], **kw: Any) -> str:
        if 13 in ids:
            raise RuntimeError("cannot decode 13")
        return "".join(chr(ord("a") + i % 26) for i in ids)


def _token_out(rids: List[str], ids: List[List[int]], finished: List[Any]) -> BatchTokenIDOutput:
    n = len(rids)
    return BatchTokenIDOutput(rids, finished, ids, [len(x) for x in ids], [1] * n, [len(x) for x in ids], [0] * n,
                              [True] * n, [True] * n, [False] * n)


def test_broken_detokenization_ends_only_that_request():
    detok = DetokenizerManager(_BrittleTokenizer())
    out = detok.handle_batch_token_id_out(_token_out(["good", "bad"], [[1, 2], [3, 13]], [None, None]))
    assert out.output_strs[0] == "bc" and out.finished_reasons[0] is None
    reason = out.finished_reasons[1]
    assert reason["type"] == "abort" and reason["status_code"] == 500 and reason["err_type"] == DETOKENIZE_ERROR
    # later outputs of the failed request are dropped; the good one goes on
    out = detok.handle_batch_token_id_out(_token_out(["good", "bad"], [[4], [5]], [{"type": "length", "length": 3}] * 2))
    assert out.rids == ["good"] and out.output_strs == ["e"]
    assert not detok.states and not detok.failed


def test_sessions_expire_and_stay_bounded():
    store = SessionStore()
    sid = store.open(OpenSessionReqInput(), "s1")
    for i in range(MAX_REQS_PER_SESSION + 5):
        store.record(sid, f"r{i}", [i])
    assert len(store.sessions[sid].tokens) == MAX_REQS_PER_SESSION
    assert "r0" not in store.sessions[sid].tokens  # the oldest went first
    store.expire(ttl=3600)
    assert sid in store.sessions
    store.sessions[sid].last_used = time.monotonic() - 10
    store.expire(ttl=5)
    assert sid not in store.sessions


def test_broken_stop_check_ends_only_that_request(monkeypatch):
    """Isolation in result processing: an exception in one request's finish check aborts that
    request (500) and frees its KV; the others in the same batch finish normally."""
    from radixserve.managers.schedule_batch import Req

    engine = Engine(max_total_tokens=4096)
    check = Req.check_finished

    def brittle(self: Req) -> None:
        if self.rid == "bad" and len(self.output_ids) == 3:
            raise RuntimeError("stop check blew up")
        check(self)

    monkeypatch.setattr(Req, "check_finished", brittle)
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    outs = engine.generate(input_ids=[[5, 6, 7], [8, 9, 10], [11, 12]], sampling_params=params, rid=["a", "bad", "b"])
    bad = outs[1]["meta_info"]["finish_reason"]
    assert bad["type"] == "abort" and bad["status_code"] == 500 and "stop check blew up" in bad["message"]
    assert [len(o["output_ids"]) for o in (outs[0], outs[2])] == [6, 6]
    engine.scheduler.check_memory()


def test_broken_grammar_mask_ends_only_that_request(monkeypatch):
    import xgrammar  # noqa: F401 - in the test extra (pyproject.toml): missing is a failure, not a skip
    from radixserve.constrained.xgrammar_backend import XGrammarGrammar

    def broken(self: Any, bitmask: Any, idx: int) -> None:
        raise RuntimeError("mask blew up")

    monkeypatch.setattr(XGrammarGrammar, "fill_vocab_mask", broken)
    engine = Engine(max_total_tokens=4096)
    plain = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    outs = engine.generate(input_ids=[[5, 6, 7], [8, 9, 10]], sampling_params=[{**plain, "regex": "[0-9]+"}, plain])
    bad = outs[0]["meta_info"]["finish_reason"]
    assert bad["type"] == "abort" and bad["status_code"] == 500 and "mask blew up" in bad["message"]
    assert len(outs[1]["output_ids"]) == 5
    engine.wait_until_idle()
    engine.scheduler.check_memory()


def test_chat_template_flag_takes_a_file_or_the_template(tmp_path):
    from radixserve.hf_transformers_utils import LoadError, get_tokenizer
    from radixserve.server_args import ServerArgs

    template = "{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    messages = [{"role": "user", "content": "hi"}]
    for value in (str(path), template):
        tok = get_tokenizer(ServerArgs(chat_template=value))
        assert tok.apply_chat_template(messages, tokenize=False) == "<<user>>hi"
    with pytest.raises(LoadError, match="no such file"):
        get_tokenizer(ServerArgs(chat_template="missing.jinja"))


def test_sampling_defaults_from_the_model_fill_only_unset_fields(tmp_path):
    """--sampling-defaults model: unset sampling fields take the model's generation_config.json
    values (a request's own values win); openai (the default) keeps SamplingParams' defaults.
    The OpenAI routes leave unset fields out, so the same defaults reach them."""
    import json as _json

    from radixserve.entrypoints.openai_protocol import ChatCompletionRequest
    from radixserve.hf_transformers_utils import load_sampling_defaults
    from radixserve.managers.request_frontend import RequestFrontend
    from radixserve.server_args import ServerArgs
    from radixserve.tiny_model import get_tiny_model_path
    import shutil

    model = tmp_path / "m"
    shutil.copytree(get_tiny_model_path(), model)
    (model / "generation_config.json").write_text(_json.dumps({"temperature": 0.3, "top_k": 7, "do_sample": True}))
    defaults = load_sampling_defaults(ServerArgs(model_path=str(model), sampling_defaults="model"))
    assert defaults == {"temperature": 0.3, "top_k": 7}
    assert load_sampling_defaults(ServerArgs(model_path=str(model))) == {}  # openai: none
    frontend = RequestFrontend(None, 4096, 8192, defaults)
    sp = frontend.make_sampling_params(None)
    assert (sp.temperature, sp.top_k, sp.top_p) == (0.3, 7, 1.0)
    assert frontend.make_sampling_params({"temperature": 0.9}).temperature == 0.9
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    unset = chat.sampling_params(8)
    assert "temperature" not in unset and "top_k" not in unset
    assert frontend.make_sampling_params(unset).temperature == 0.3
    assert RequestFrontend(None, 4096, 8192).make_sampling_params(unset).temperature == 1.0
