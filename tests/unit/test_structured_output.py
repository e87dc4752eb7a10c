"""Structured output (issue 6): JSON schema, regex and EBNF grammars through the grammar
queue and the per-step token mask, on the tiny model with random sampling (temperature 1,
many seeds), in both event loops. Every constrained output must parse / match / validate
and end by the grammar (finish_reason "stop"), never by length."""

from __future__ import annotations

import json
import random
import re
import time
from typing import Dict, List

import jsonschema
import pytest
import torch

from radixserve.constrained import response_format_to_constraint
from radixserve.constrained.base_grammar_backend import (
    TokenBitmask,
    allocate_token_bitmask,
    unpack_banned,
)
from radixserve.engine import Engine

VOCAB_LO = 3  # ids 0-2 are the tiny model's special tokens
MAX_NEW = 200  # compact JSON of the schemas below ends well inside this

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "score": {"type": "number", "minimum": -1, "maximum": 1},
            "member": {"type": "boolean"},
        },
        "required": ["name", "age", "member"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "owner": {
                "type": "object",
                "properties": {
                    "role": {"enum": ["admin", "user", "guest"]},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
                },
                "required": ["role", "tags"],
            },
        },
        "required": ["id", "owner"],
    },
    "array": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -50, "maximum": 50}, "ok": {"type": "boolean"}},
            "required": ["x", "ok"],
        },
        "minItems": 1,
        "maxItems": 3,
    },
    "enum_const": {
        "type": "object",
        "properties": {
            "color": {"type": "string", "enum": ["red", "green", "blue"]},
            "kind": {"const": "pixel"},
            "level": {"type": "integer", "enum": [1, 2, 3]},
        },
        "required": ["color", "kind", "level"],
    },
}

REGEXES = [
    r"\d{3}-\d{4}",
    r"(yes|no|maybe)",
    r"[a-z]{1,6}@[a-z]{1,5}\.(com|org)",
    r"#[0-9a-f]{6}",
]

# EBNF: a list of numbers and words, and its exact Python regex equivalent.
EBNF = r"""
root ::= "[" item ("," item){0,3} "]"
item ::= number | word
number ::= "-"? [1-9] [0-9]{0,2}
word ::= "\"" [a-z]{1,5} "\""
"""
EBNF_REGEX = r'\[(-?[1-9][0-9]{0,2}|"[a-z]{1,5}")(,(-?[1-9][0-9]{0,2}|"[a-z]{1,5}")){0,3}\]'

_ENGINES: Dict[tuple, Engine] = {}


def get_engine(**kw) -> Engine:
    """One engine per configuration for the whole module (building one costs ~1 s)."""
    key = tuple(sorted(kw.items()))
    if key not in _ENGINES:
        _ENGINES[key] = Engine(max_total_tokens=8192, **kw)
    return _ENGINES[key]


@pytest.fixture(scope="module", autouse=True)
def _shutdown_engines():
    yield
    for e in _ENGINES.values():
        e.shutdown()
    _ENGINES.clear()


def prompts(n: int, seed: int = 0) -> List[List[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_LO, 8192) for _ in range(rng.randint(4, 40))] for _ in range(n)]


def sampled(constraint: Dict, seed: int, **extra) -> Dict:
    return {"max_new_tokens": MAX_NEW, "temperature": 1.0, "sampling_seed": seed, **constraint, **extra}


def assert_stopped_by_grammar(out: Dict) -> None:
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "stop", (reason, out["text"])
    assert reason["matched"] in (0, 2)  # the model's EOS ids: the only tokens a complete grammar allows


def assert_idle_and_clean(engine: Engine) -> None:
    sched = engine.scheduler
    while sched.has_work():
        engine.step()
    assert not sched.grammar_queue and not sched.waiting_queue
    sched.check_memory()


# ---- JSON schema / regex / EBNF ---------------------------------------------------------------
def test_json_schemas_validate(loop):
    engine = get_engine(**loop)
    names, sps = [], []
    for name, schema in SCHEMAS.items():
        for seed in range(5):
            names.append(name)
            sps.append(sampled({"json_schema": json.dumps(schema)}, seed))
    outs = engine.generate(input_ids=prompts(len(sps)), sampling_params=sps)
    for name, out in zip(names, outs):
        assert_stopped_by_grammar(out)
        value = json.loads(out["text"])
        jsonschema.validate(value, SCHEMAS[name])
    # Compact by default: no whitespace outside strings.
    for out in outs:
        outside_strings = re.sub(r'"(?:\\.|[^"\\])*"', '""', out["text"])
        assert not re.search(r"\s", outside_strings), out["text"]
    assert_idle_and_clean(engine)


def test_regex_outputs_fullmatch(loop):
    engine = get_engine(**loop)
    cases = [(rx, seed) for rx in REGEXES for seed in range(4)]
    outs = engine.generate(input_ids=prompts(len(cases), seed=1),
                           sampling_params=[sampled({"regex": rx}, seed) for rx, seed in cases])
    for (rx, _), out in zip(cases, outs):
        assert_stopped_by_grammar(out)
        assert re.fullmatch(rx, out["text"]), (rx, out["text"])
    assert_idle_and_clean(engine)


def test_ebnf_outputs_parse(loop):
    engine = get_engine(**loop)
    outs = engine.generate(input_ids=prompts(8, seed=2), sampling_params=[sampled({"ebnf": EBNF}, s) for s in range(8)])
    for out in outs:
        assert_stopped_by_grammar(out)
        assert re.fullmatch(EBNF_REGEX, out["text"]), out["text"]
        assert isinstance(json.loads(out["text"]), list)  # the grammar is a subset of JSON
    assert_idle_and_clean(engine)


def test_greedy_constrained_is_deterministic(loop):
    engine = get_engine(**loop)
    sp = {"max_new_tokens": MAX_NEW, "temperature": 0, "json_schema": json.dumps(SCHEMAS["person"])}
    a = engine.generate(input_ids=prompts(1, seed=3)[0], sampling_params=sp)
    b = engine.generate(input_ids=prompts(1, seed=3)[0], sampling_params=sp)
    assert a["output_ids"] == b["output_ids"]
    jsonschema.validate(json.loads(a["text"]), SCHEMAS["person"])


# ---- one batch: constrained and unconstrained together --------------------------------------------
MIXED_CONFIGS = {
    "default": {},
    "forced_retract": {"test_retract_interval": 3},
    "mixed_chunk": {"chunked_prefill_size": 32, "enable_mixed_chunk": True},
}


@pytest.mark.parametrize("config", list(MIXED_CONFIGS))
def test_32_concurrent_constrained_and_unconstrained(config, loop):
    """16 constrained (json / regex / ebnf) and 16 unconstrained greedy requests in one batch.
    The constrained ones are valid; the unconstrained ones equal their outputs alone (the
    grammar rows' masks never touch other rows), up to near-ties of the logits."""
    engine = get_engine(**loop, **MIXED_CONFIGS[config])
    ps = prompts(32, seed=4)
    kinds = [("json", {"json_schema": json.dumps(SCHEMAS["nested"])}), ("regex", {"regex": REGEXES[2]}),
             ("ebnf", {"ebnf": EBNF}), ("json", {"json_schema": json.dumps(SCHEMAS["array"])})]
    sps, checks = [], []
    for i in range(32):
        if i % 2 == 0:
            kind, c = kinds[(i // 2) % len(kinds)]
            sps.append(sampled(c, seed=i))
            checks.append((kind, c))
        else:
            sps.append({"max_new_tokens": 12, "temperature": 0})
            checks.append(("free", None))
    outs = engine.generate(input_ids=ps, sampling_params=sps, return_logprob=True, top_logprobs_num=2)
    for i, ((kind, c), out) in enumerate(zip(checks, outs)):
        if kind == "free":
            assert_same_greedy(out, greedy_alone(ps[i], sps[i]))
            continue
        assert_stopped_by_grammar(out)
        if kind == "json":
            jsonschema.validate(json.loads(out["text"]), json.loads(c["json_schema"]))
        elif kind == "regex":
            assert re.fullmatch(c["regex"], out["text"]), out["text"]
        else:
            assert re.fullmatch(EBNF_REGEX, out["text"]), out["text"]
    if config == "forced_retract":
        assert engine.stats().num_retracted_reqs > 0
    assert_idle_and_clean(engine)


_ALONE: Dict[tuple, Dict] = {}


def greedy_alone(prompt: List[int], sp: Dict) -> Dict:
    """The request run by itself (cached: the reference does not depend on the config)."""
    key = tuple(prompt)
    if key not in _ALONE:
        _ALONE[key] = get_engine().generate(input_ids=prompt, sampling_params=sp, return_logprob=True, top_logprobs_num=2)
    return _ALONE[key]


def assert_same_greedy(got: Dict, ref: Dict, near_tie: float = 1e-4) -> None:
    a, b = got["output_ids"], ref["output_ids"]
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            top2 = ref["meta_info"]["output_top_logprobs"][k]
            assert top2[0][0] - top2[1][0] < near_tie, f"diverged at token {k}"
            return
    assert len(a) == len(b)


# ---- errors ---------------------------------------------------------------------------------------
INVALID = [
    ({"json_schema": "{not json"}, "not valid JSON"),
    ({"json_schema": json.dumps({"type": "objectx"})}, "objectx"),
    ({"regex": "[a-"}, "Unclosed"),
    ({"ebnf": 'root ::= "a" undefined_rule'}, "undefined_rule"),
]


def test_invalid_grammar_aborts_with_400_and_engine_keeps_serving(loop):
    engine = get_engine(**loop)
    for constraint, fragment in INVALID:
        for attempt in range(2):  # the second one hits the cached invalid grammar: fails fast
            out = engine.generate(input_ids=prompts(1, seed=5)[0], sampling_params={"max_new_tokens": 8, **constraint})
            reason = out["meta_info"]["finish_reason"]
            assert reason["type"] == "abort" and reason["status_code"] == 400, reason
            assert fragment in reason["message"], reason["message"]
            assert out["output_ids"] == []
    # Invalid and valid requests in one submission: the valid ones are untouched.
    sps = [{"max_new_tokens": 8, "regex": "[a-"}, sampled({"regex": REGEXES[0]}, 0), {"max_new_tokens": 6, "temperature": 0}]
    outs = engine.generate(input_ids=prompts(3, seed=6), sampling_params=sps)
    assert outs[0]["meta_info"]["finish_reason"]["status_code"] == 400
    assert re.fullmatch(REGEXES[0], outs[1]["text"])
    assert len(outs[2]["output_ids"]) == 6
    assert_idle_and_clean(engine)


def test_grammar_timeout_aborts_then_fails_fast(loop):
    engine = Engine(max_total_tokens=4096, grammar_timeout=0.05, **loop)
    backend = engine.scheduler.grammar_backend
    slow_regex = "(slow)+"
    original = backend.dispatch_regex
    calls = []

    def slow_dispatch(regex):
        if regex == slow_regex:
            calls.append(regex)
            time.sleep(0.5)
        return original(regex)

    backend.dispatch_regex = slow_dispatch
    try:
        backend.get_cached_or_future_value(("regex", REGEXES[1]))[0].result()  # warm: import, tokenizer info
        sps = [{"max_new_tokens": 8, "regex": slow_regex}, sampled({"regex": REGEXES[1]}, 0)]
        outs = engine.generate(input_ids=prompts(2, seed=7), sampling_params=sps)
        reason = outs[0]["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and reason["status_code"] == 400
        assert "timed out" in reason["message"] and "--grammar-timeout" in reason["message"]
        assert re.fullmatch(REGEXES[1], outs[1]["text"])
        time.sleep(0.6)  # the abandoned compile has finished by now; the key stays invalid
        again = engine.generate(input_ids=prompts(1, seed=7)[0], sampling_params=sps[0])
        assert "timed out" in again["meta_info"]["finish_reason"]["message"]
        assert calls == [slow_regex]  # failed fast from the cache: no second compile
        assert_idle_and_clean(engine)
    finally:
        engine.shutdown()


def test_abort_while_compiling_and_grammar_queue_counts_as_work(loop):
    engine = Engine(max_total_tokens=4096, **loop)
    backend = engine.scheduler.grammar_backend
    original = backend.dispatch_regex
    backend.dispatch_regex = lambda rx: (time.sleep(0.2), original(rx))[1]
    try:
        sched = engine.scheduler
        req = engine.submit(input_ids=prompts(1, seed=8)[0], sampling_params=sampled({"regex": "[0-9]{4}"}, 0))[0]
        engine.step()
        assert [r.rid for r in sched.grammar_queue] == [req.rid] and sched.has_work()
        assert sched.internal_state()["num_grammar_queue_reqs"] == 1
        engine.abort(req.rid)
        assert not sched.grammar_queue
        engine.step()
        assert req.finished_reason["type"] == "abort"
        assert_idle_and_clean(engine)
    finally:
        engine.shutdown()


def test_no_grammar_backend_rejects_with_400():
    engine = Engine(max_total_tokens=4096, grammar_backend="none")
    try:
        out = engine.generate(input_ids=prompts(1)[0], sampling_params={"max_new_tokens": 4, "regex": "a+"})
        reason = out["meta_info"]["finish_reason"]
        assert reason["status_code"] == 400 and "--grammar-backend none" in reason["message"]
        assert len(engine.generate(input_ids=prompts(1)[0], sampling_params={"max_new_tokens": 4})["output_ids"]) == 4
    finally:
        engine.shutdown()


# ---- JSON whitespace ------------------------------------------------------------------------------
def test_json_whitespace_pattern():
    """--constrained-json-whitespace-pattern allows exactly that whitespace between tokens."""
    engine = get_engine(constrained_json_whitespace_pattern=r"[ \n]{0,2}")
    schema = SCHEMAS["nested"]
    outs = engine.generate(input_ids=prompts(6, seed=9), sampling_params=[sampled({"json_schema": json.dumps(schema)}, s) for s in range(6)])
    for out in outs:
        assert_stopped_by_grammar(out)
        jsonschema.validate(json.loads(out["text"]), schema)
        outside_strings = re.sub(r'"(?:\\.|[^"\\])*"', '""', out["text"])
        assert not re.search(r"[\t\r]|[ \n]{3}", outside_strings), out["text"]
    assert_idle_and_clean(engine)


# ---- pieces ---------------------------------------------------------------------------------------
def test_token_bitmask_apply_matches_reference():
    torch.manual_seed(0)
    b, v = 5, 1000
    allowed = torch.rand(b, v) < 0.3
    bitmask = allocate_token_bitmask(b, v)
    packed = torch.zeros(b, bitmask.shape[1] * 32, dtype=torch.int64)
    packed[:, :v] = allowed.long()
    words = (packed.view(b, -1, 32) << torch.arange(32)).sum(-1)  # bits -> uint32 value
    bitmask.copy_(torch.where(words >= 2**31, words - 2**32, words).to(torch.int32))  # two's complement
    assert torch.equal(unpack_banned(bitmask, v), ~allowed)
    rows = [0, 2, 3]
    logits = torch.randn(b, v)
    expect = logits.clone()
    expect[rows] = expect[rows].masked_fill(~allowed[rows], float("-inf"))
    got_xgr = TokenBitmask(bitmask, rows).apply_(logits.clone(), v)  # xgrammar's CPU kernel
    got_torch = TokenBitmask(bitmask, rows).apply_(logits.clone().t().contiguous().t(), v)  # torch path
    assert torch.equal(got_xgr, expect) and torch.equal(got_torch, expect)


def test_structural_tag_constrains_the_output(loop):
    """Issue 43: SGLang's structural_tag (xgrammar's format): a tag whose content is a JSON schema
    (a number: xgrammar's structural tags allow any whitespace inside an object, which a random
    model fills until max_new_tokens)."""
    engine = get_engine(**loop)
    schema = {"type": "integer", "minimum": 0, "maximum": 999}
    tag = json.dumps({"format": {"type": "tag", "begin": "<tool>", "end": "</tool>",
                                 "content": {"type": "json_schema", "json_schema": schema}}})
    outs = engine.generate(input_ids=prompts(4, seed=5), sampling_params=[sampled({"structural_tag": tag}, s) for s in range(4)])
    for out in outs:
        assert_stopped_by_grammar(out)
        text = out["text"]
        assert text.startswith("<tool>") and text.endswith("</tool>"), text
        jsonschema.validate(json.loads(text[len("<tool>"):-len("</tool>")]), schema)
    # the OpenAI-style shape (structures + triggers: free text until a trigger) compiles and runs
    legacy = json.dumps({"structures": [{"begin": "<f=a>", "schema": SCHEMAS["person"], "end": "</f>"}], "triggers": ["<f="]})
    out = engine.generate(input_ids=prompts(1, seed=6)[0], sampling_params=sampled({"structural_tag": legacy}, 0, max_new_tokens=8))
    assert out["meta_info"]["finish_reason"]["type"] in ("length", "stop"), out["meta_info"]
    # a bad one is the request's 400, not the scheduler's problem
    bad = engine.generate(input_ids=prompts(1)[0], sampling_params=sampled({"structural_tag": json.dumps({"structures": []})}, 0))
    reason = bad["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 400 and "Invalid structural_tag" in reason["message"], reason
    with pytest.raises(ValueError, match="Only one of regex, json_schema, ebnf or structural_tag"):
        engine.generate(input_ids=prompts(1)[0], sampling_params=sampled({"structural_tag": tag, "regex": "a"}, 0))
    assert_idle_and_clean(engine)


def test_response_format_to_constraint():
    assert response_format_to_constraint(None) == {}
    assert response_format_to_constraint({"type": "text"}) == {}
    assert json.loads(response_format_to_constraint({"type": "json_object"})["json_schema"]) == {"type": "object"}
    schema = SCHEMAS["person"]
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}}
    assert json.loads(response_format_to_constraint(rf)["json_schema"]) == schema
    st = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}], "triggers": ["<f"]}
    assert json.loads(response_format_to_constraint(st)["structural_tag"]) == {k: v for k, v in st.items() if k != "type"}
    for bad in ({"type": "yaml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": "{x"}}, "json"):
        with pytest.raises(ValueError):
            response_format_to_constraint(bad)


def test_bench_offline_json_schema_rows(tmp_path, capsys):
    """`radixserve bench offline --json-schema FILE` adds the constrained row and the
    unconstrained row at the same output lengths (no timing asserts)."""
    from radixserve.cli import main

    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMAS["person"]))
    out = tmp_path / "offline.json"
    rc = main(["bench", "offline", "--num-prompts", "4", "--min-input-len", "8", "--max-input-len", "16",
               "--min-output-len", "40", "--max-output-len", "60", "--skip-hf", "--max-total-tokens", "4096",
               "--skip-other-loop", "--json-schema", str(schema_file), "--output", str(out)])
    assert rc == 0
    assert "constrained costs" in capsys.readouterr().out
    _ours, constrained, same_len = json.loads(out.read_text())["results"]
    assert constrained["system"] == "radixserve + json_schema" and constrained["num_stopped"] == 4
    assert same_len["output_tokens"] == constrained["output_tokens"] > 0
    assert constrained["compile_s"] > 0 and constrained["mask_fill_ms_per_step"] > 0


# ---- overlap kept with a grammar request (issue 43 item 5) -----------------------------------------
def overlap_share(engine: Engine, ps: List[List[int]], sps: List[Dict]) -> tuple:
    """Run a batch; returns (outputs, results processed after the next batch was launched /
    all results processed)."""
    before = engine.stats()
    outs = engine.generate(input_ids=ps, sampling_params=sps, return_logprob=True, top_logprobs_num=2)
    after = engine.stats()
    done = after.results_processed - before.results_processed
    return outs, (after.results_processed_overlapped - before.results_processed_overlapped) / done


def test_grammar_request_keeps_the_batch_overlapped():
    """A JSON-schema request decoding beside 8 plain greedy requests: the overlap loop still
    launches each step before processing the one before (its mask is filled while the forward
    runs), the JSON is valid, and the plain requests equal the normal loop's outputs."""
    engine = get_engine(disable_overlap_schedule=False)
    assert engine.scheduler.enable_overlap
    ps = prompts(9, seed=11)
    plain = [{"max_new_tokens": 24, "temperature": 0}] * 8
    schema = {"json_schema": json.dumps(SCHEMAS["person"])}
    _, share_plain = overlap_share(engine, ps[:8], plain)
    outs, share_grammar = overlap_share(engine, ps, plain + [sampled(schema, seed=3)])
    print(f"overlap share: plain {share_plain:.2f}, with a grammar request {share_grammar:.2f}")
    assert share_plain > 0.8 and share_grammar > 0.8, (share_plain, share_grammar)
    assert_stopped_by_grammar(outs[8])
    jsonschema.validate(json.loads(outs[8]["text"]), SCHEMAS["person"])
    normal = get_engine(disable_overlap_schedule=True).generate(
        input_ids=ps[:8], sampling_params=plain, return_logprob=True, top_logprobs_num=2)
    for got, ref in zip(outs[:8], normal):
        assert_same_greedy(got, ref)
    assert_idle_and_clean(engine)
