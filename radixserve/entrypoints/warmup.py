"""The warm-up request a server sends itself once it listens (SGLang's `_wait_and_warmup` and
`_execute_server_warmup` in its http_server.py).

The first request a fresh server answers pays one-time costs no later one does: oneDNN creating
its primitives, the first touch of the KV pool's pages, the thread pool starting, the lazy
imports and first calls on the HTTP path (request validation, JSON responses). The warm-up pays
them before anyone waits: a short /generate (`max_new_tokens` 8, temperature 0; /encode for an
embedding model), one prompt per DP rank, as SGLang sends it.

It goes over HTTP to the server's own port, not to the TokenizerManager directly, so that the
whole path a client's request takes is warmed (and checked): the ASGI server, the middlewares
(with --api-key it sends the key), the route, the validation, the response. Until it is
answered, TokenizerManager.server_status is Starting and /health answers 503, as SGLang's does;
a warm-up that fails stops the server (exit code 1), as SGLang's does: a server that cannot
answer a short prompt should not report healthy. `--skip-server-warmup` skips it (/health then
turns 200 as soon as the server listens). In PD disaggregation a request needs its peer server
(SGLang sends one with a fake bootstrap, which radixserve's transfer does not have): no warm-up.

Like SGLang's, it is an ordinary request: it counts in /metrics (num_requests_total...) and its
prompt stays in the radix cache.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, Tuple

from radixserve.managers.tokenizer_manager import ServerStatus
from radixserve.server_args import ServerArgs

logger = logging.getLogger("radixserve.warmup")

WARMUP_PROMPT = "The capital city of France is"  # SGLang's
WARMUP_INPUT_IDS = [10, 11, 12]  # with --skip-tokenizer-init (SGLang's)
WARMUP_MAX_NEW_TOKENS = 8
WARMUP_TIMEOUT = 600.0  # s: a large model's first forward on a CPU is slow, not broken
LISTEN_POLL_INTERVAL = 0.02  # s between looks at whether the server listens yet


def warmup_request(server_args: ServerArgs, is_generation: bool, vocab_size: int) -> Tuple[str, Dict[str, Any]]:
    """The warm-up's route and body: one prompt per DP rank, so that every replica is warmed."""
    n = server_args.dp_size
    if server_args.skip_tokenizer_init:
        ids = [t % vocab_size for t in WARMUP_INPUT_IDS]
        body: Dict[str, Any] = {"input_ids": ids if n == 1 else [ids] * n}
    else:
        body = {"text": WARMUP_PROMPT if n == 1 else [WARMUP_PROMPT] * n}
    if not is_generation:
        return "/encode", body
    body["sampling_params"] = {"temperature": 0, "max_new_tokens": WARMUP_MAX_NEW_TOKENS}
    return "/generate", body


def local_url(host: str, port: int) -> str:
    """Where this process reaches its own server: a wildcard bind address is not one to connect to."""
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def execute_server_warmup(server_args: ServerArgs, is_generation: bool, vocab_size: int) -> Tuple[str, float]:
    """Send the warm-up request to the server's own port; (its route, its duration in s).
    Raises RuntimeError when it is not answered with 200."""
    import json
    import urllib.error
    import urllib.request

    route, body = warmup_request(server_args, is_generation, vocab_size)
    headers = {"Content-Type": "application/json"}
    if server_args.api_key:
        headers["Authorization"] = f"Bearer {server_args.api_key}"
    req = urllib.request.Request(local_url(server_args.host, server_args.port) + route,
                                 data=json.dumps(body).encode(), headers=headers, method="POST")
    # no proxy: an HTTP_PROXY in the environment must not route our own port elsewhere
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    start = time.perf_counter()
    try:
        with opener.open(req, timeout=WARMUP_TIMEOUT) as r:
            r.read()
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{route} answered {e.code}: {e.read()[:300].decode(errors='replace')}") from None
    except OSError as e:  # refused, reset, timed out
        raise RuntimeError(f"{route}: {e}") from None
    return route, time.perf_counter() - start


def wait_and_warmup(
    server_args: ServerArgs,
    tm: Any,
    listening: Callable[[], bool],
    stopping: Callable[[], bool],
    on_failure: Callable[[str], None],
) -> None:
    """Run in a thread beside the server: once it listens, send the warm-up request (unless
    skipped), then mark the server Up (/health 200) and say so. A failure calls on_failure
    (which stops the server) instead; a server stopping meanwhile ends it quietly."""
    while not listening():
        if stopping():
            return
        time.sleep(LISTEN_POLL_INTERVAL)
    if server_args.skip_server_warmup:
        logger.info("No warm-up request (--skip-server-warmup).")
    elif server_args.disaggregation_mode != "null":
        logger.info("No warm-up request in PD disaggregation (a request needs its peer server).")
    else:
        try:
            route, seconds = execute_server_warmup(server_args, not server_args.is_embedding, tm.vocab_size)
        except RuntimeError as e:
            if not stopping():
                on_failure(f"The warm-up request failed, stopping the server: {e}")
            return
        logger.info("Warm-up request (%s) answered in %.2f s.", route, seconds)
    tm.server_status = ServerStatus.Up
    logger.info("The server is fired up and ready to roll!")
