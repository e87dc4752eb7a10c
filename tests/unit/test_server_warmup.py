"""The warm-up's request and readiness logic (entrypoints/warmup.py) without a server: its body
(SGLang's: one prompt per DP rank, /encode for embeddings, token ids without a tokenizer), the
wildcard bind address it connects through, and /health's status: Starting until the warm-up is
answered or skipped; a failed warm-up reports and leaves the server Starting."""

import socket
from types import SimpleNamespace

from radixserve.entrypoints import warmup
from radixserve.managers.tokenizer_manager import ServerStatus, TokenizerManager
from radixserve.server_args import ServerArgs


def test_the_warmup_request_body():
    route, body = warmup.warmup_request(ServerArgs(), True, 1000)
    assert route == "/generate" and body == {
        "text": warmup.WARMUP_PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
    route, body = warmup.warmup_request(ServerArgs(dp_size=2, skip_tokenizer_init=True), True, 11)
    assert body["input_ids"] == [[10, 0, 1], [10, 0, 1]]  # one per DP rank, within the vocabulary
    route, body = warmup.warmup_request(ServerArgs(is_embedding=True), False, 1000)
    assert route == "/encode" and body == {"text": warmup.WARMUP_PROMPT}


def test_a_wildcard_bind_address_is_reached_through_loopback():
    assert warmup.local_url("0.0.0.0", 80) == "http://127.0.0.1:80"
    assert warmup.local_url("::", 80) == "http://[::1]:80"
    assert warmup.local_url("10.1.2.3", 80) == "http://10.1.2.3:80"


def _tm() -> SimpleNamespace:
    return SimpleNamespace(server_status=ServerStatus.Starting, vocab_size=1000, dead_reason=None, draining=False,
                           last_heartbeat={0: 1e18}, server_args=SimpleNamespace(health_check_timeout=20.0),
                           weight_updates=SimpleNamespace(loading_from_disk=False))


def _run(args: ServerArgs, tm: SimpleNamespace) -> list:
    failures: list = []
    warmup.wait_and_warmup(args, tm, listening=lambda: True, stopping=lambda: False, on_failure=failures.append)
    return failures


def test_health_is_503_until_the_warmup_is_skipped_or_answered():
    tm = _tm()
    assert "starting" in TokenizerManager.health_problem(tm)
    assert _run(ServerArgs(skip_server_warmup=True), tm) == []
    assert tm.server_status is ServerStatus.Up and TokenizerManager.health_problem(tm) is None
    tm = _tm()  # PD disaggregation: no warm-up (a request needs its peer), ready at once
    assert _run(ServerArgs(disaggregation_mode="decode"), tm) == []
    assert tm.server_status is ServerStatus.Up


def test_a_failed_warmup_reports_and_the_server_stays_unready():
    tm = _tm()
    with socket.socket() as bound:  # a port that is ours, where nothing listens: refused
        bound.bind(("127.0.0.1", 0))
        failures = _run(ServerArgs(port=bound.getsockname()[1]), tm)
    assert len(failures) == 1 and "warm-up request failed" in failures[0]
    assert tm.server_status is ServerStatus.Starting and "starting" in TokenizerManager.health_problem(tm)
