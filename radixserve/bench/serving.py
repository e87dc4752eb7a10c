"""`radixserve bench serving`: a load generator for a running server, reporting what SGLang's
bench_serving reports (completed, duration, request / input / output / total throughput,
TTFT / TPOT / ITL / E2E mean, median, p90, p99, the server's cache hit rate).

    radixserve serve &                                     # the tiny model on :30000
    radixserve bench serving --num-prompts 64 --max-concurrency 16 \\
        --random-input-len 256 --random-output-len 64 --plot /tmp/serving.png

Backends: `sglang` (POST /generate, SSE with cumulative text and meta_info) or `openai`
(POST /v1/completions with stream and usage), so other engines can be measured too.

`--dataset-name multi-turn` runs chat sessions instead of independent requests:

    radixserve bench serving --backend openai --dataset-name multi-turn --num-users 16 \\
        --num-turns 4 --system-prompt-len 600 --turn-input-len 32 --random-output-len 64

Each user is a coroutine running its turns one after another; the prompt of turn t is the
text of the conversation so far with the server's real answers in it (see
datasets.build_turn_prompt). Users start at once (or at --request-rate), and --max-concurrency
bounds the requests in flight, as for the other datasets (default: all users). The metrics
cover all turns; the JSON line adds per-turn aggregates ("per_turn") and one row per request
("turn_requests"). A failed turn ends its user's conversation; the turns not sent count as
failed.

Per request: TTFT = first streamed chunk with output - send time; ITL = the gaps between
later chunks; TPOT = (E2E - TTFT) / (output tokens - 1); E2E = last chunk - send time. The send
time is after the --max-concurrency semaphore is taken (SGLang's definition). ignore_eos is on
(unless --disable-ignore-eos), so output lengths are the dataset's. The --warmup-requests (output
cut to 16 tokens) of the random datasets and of multi-turn are prompts of their own, so no
measured prompt is in the server's cache before the run (other datasets warm up on their first
rows).

The metrics (bench/metrics.py) and the report (bench/report.py) are shared with `radixserve simulate`
(virtual times instead of wall times).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import time
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Sequence

import orjson

from radixserve.bench.datasets import (DatasetRow, MultiTurnWorkload, add_dataset_args, arrival_times,
                                       build_turn_prompt, get_dataset, load_tokenizer_or_tiny, random_text,
                                       sample_multi_turn, sample_random)
from radixserve.bench.metrics import RequestOutput, calculate_metrics, percentile
from radixserve.bench.report import append_jsonl, format_report, plot_results

WARMUP_SEED_OFFSET = 104729  # warm-up prompts come from another seed than the measured ones


# ---- the load generator ----------------------------------------------------------------------------
class _StreamError(Exception):
    pass


async def _byte_lines(resp: Any):
    """The lines of a response body as bytes. httpx's aiter_lines decodes the body to text
    and splits it in Python, character by character: the client's largest cost after the
    JSON (issue 57: it shares the CPU with the server it measures)."""
    pending = b""
    async for chunk in resp.aiter_bytes():
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        for line in lines:
            yield line
    if pending:
        yield pending


async def _stream_json(client: Any, url: str, payload: Dict[str, Any], headers: Any):
    """The JSON objects of an SSE response until `[DONE]`; a non-200 status or an error event
    raises _StreamError with its message."""
    async with client.stream("POST", url, json=payload, headers=headers) as resp:
        if resp.status_code != 200:
            raise _StreamError(f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}")
        async for line in _byte_lines(resp):
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            obj = orjson.loads(data)  # (a stream chunk carries all the output ids so far: ~4x json.loads)
            if "error" in obj:
                raise _StreamError(str(obj["error"]))
            yield obj


async def request_sglang(client: Any, base_url: str, row: DatasetRow, args: argparse.Namespace,
                         t_bench0: float) -> RequestOutput:
    sp = {"max_new_tokens": row.output_len, "temperature": 0.0, "ignore_eos": not args.disable_ignore_eos}
    payload: Dict[str, Any] = {"sampling_params": sp, "stream": True}
    if row.input_ids is not None:
        payload["input_ids"] = row.input_ids
    else:
        payload["text"] = row.prompt
    out = RequestOutput(prompt_len=row.prompt_len)
    st = time.perf_counter()
    out.start_time = st - t_bench0
    last, tokens = st, 0
    try:
        async for obj in _stream_json(client, f"{base_url}/generate", payload, args.headers):
            meta = obj.get("meta_info", {})
            n = int(meta.get("completion_tokens", tokens))
            now = time.perf_counter()
            if n > tokens:
                if tokens == 0:
                    out.ttft = now - st
                else:
                    out.itl.append(now - last)
                out.chunks.append((now - t_bench0, n - tokens))
                last, tokens = now, n
            out.prompt_len = int(meta.get("prompt_tokens", out.prompt_len))
            out.cached_tokens = int(meta.get("cached_tokens", 0))
            if isinstance(obj.get("text"), str):  # cumulative
                out.generated_text = obj["text"]
        out.latency = time.perf_counter() - st
        out.output_len = tokens
        out.success = tokens > 0
        if not out.success:
            out.error = "no output tokens"
    except _StreamError as e:
        out.error = str(e)
    except Exception as e:  # network errors count as failed requests, the run goes on
        out.error = f"{type(e).__name__}: {e}"
    return out


async def request_openai(client: Any, base_url: str, row: DatasetRow, args: argparse.Namespace,
                         t_bench0: float) -> RequestOutput:
    payload: Dict[str, Any] = {
        "model": args.model, "prompt": row.input_ids if row.input_ids is not None else row.prompt,
        "max_tokens": row.output_len, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": not args.disable_ignore_eos,
    }
    out = RequestOutput(prompt_len=row.prompt_len)
    st = time.perf_counter()
    out.start_time = st - t_bench0
    last, chunks = st, 0
    try:
        async for obj in _stream_json(client, f"{base_url}/v1/completions", payload, args.headers):
            usage = obj.get("usage")
            if usage:
                out.output_len = int(usage.get("completion_tokens", 0))
                out.prompt_len = int(usage.get("prompt_tokens", out.prompt_len))
                details = usage.get("prompt_tokens_details") or {}
                out.cached_tokens = int(details.get("cached_tokens", 0) or 0)
            choices = obj.get("choices") or []
            if choices and choices[0].get("text"):
                out.generated_text += choices[0]["text"]
                now = time.perf_counter()
                if chunks == 0:
                    out.ttft = now - st
                else:
                    out.itl.append(now - last)
                out.chunks.append((now - t_bench0, 1))
                last, chunks = now, chunks + 1
        out.latency = time.perf_counter() - st
        out.output_len = out.output_len or chunks
        out.success = chunks > 0
        if not out.success:
            out.error = "no output text"
    except _StreamError as e:
        out.error = str(e)
    except Exception as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


_PROM_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([0-9.eE+\-naNinf]+)$")


def parse_prometheus(text: str) -> Dict[str, float]:
    """Unlabeled samples (and labeled ones summed by name) of a Prometheus text page."""
    out: Dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _PROM_LINE.match(line.strip())
        if m:
            try:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
            except ValueError:
                pass
    return out


def _find(metrics: Dict[str, float], suffix: str) -> Optional[float]:
    """radixserve:cached_tokens_total, sglang:cached_tokens_total, ...: the first name ending so."""
    for k, v in metrics.items():
        if k.endswith(suffix) and not k.endswith("_created"):
            return v
    return None


async def scrape_server_counters(client: Any, base_url: str, headers: Dict[str, str]) -> Dict[str, float]:
    """The server's request / token counters from /metrics, and its cache hit rate from
    /get_server_info when there is one. Missing routes give an empty answer."""
    out: Dict[str, float] = {}
    try:
        r = await client.get(f"{base_url}/metrics", headers=headers)
        if r.status_code == 200:
            prom = parse_prometheus(r.text)
            for key, suffix in (("num_requests", "num_requests_total"), ("prompt_tokens", "prompt_tokens_total"),
                                ("generation_tokens", "generation_tokens_total"),
                                ("cached_tokens", "cached_tokens_total"), ("cache_hit_rate", "cache_hit_rate")):
                v = _find(prom, suffix)
                if v is not None:
                    out[key] = v
    except Exception:
        pass
    try:
        r = await client.get(f"{base_url}/get_server_info", headers=headers)
        if r.status_code == 200:
            info = r.json()
            if "cache_hit_rate" in info:
                out["server_info_cache_hit_rate"] = float(info["cache_hit_rate"])
    except Exception:
        pass
    return out


def server_deltas(before: Dict[str, float], after: Dict[str, float]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key in ("num_requests", "prompt_tokens", "generation_tokens", "cached_tokens"):
        if key in before and key in after:
            out[f"server_{key}"] = int(round(after[key] - before[key]))
    if out.get("server_prompt_tokens") and "server_cached_tokens" in out:
        out["cache_hit_rate"] = out["server_cached_tokens"] / out["server_prompt_tokens"]
    elif "cache_hit_rate" in after:
        out["cache_hit_rate"] = after["cache_hit_rate"]
    elif "server_info_cache_hit_rate" in after:
        out["cache_hit_rate"] = after["server_info_cache_hit_rate"]
    return out


async def _get_json(client: Any, url: str, headers: Dict[str, str]) -> Optional[Dict[str, Any]]:
    try:
        r = await client.get(url, headers=headers)
        return r.json() if r.status_code == 200 else None
    except Exception:
        return None


# ---- multi-turn chat sessions -----------------------------------------------------------------------
async def run_conversations(workload: MultiTurnWorkload, send: Any, tokenizer: Any,
                            max_concurrency: Optional[int] = None, start_times: Optional[Sequence[float]] = None,
                            on_done: Any = None) -> List[RequestOutput]:
    """Every user a coroutine running its turns in order; turn t's prompt is build_turn_prompt of
    the answers so far (`send(row)` -> RequestOutput with generated_text). At most
    max_concurrency requests in flight; user u starts at start_times[u] (s from now). Returns
    the outputs user by user, turn by turn (num_users x num_turns of them)."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()
    T = workload.num_turns

    async def user(u: int) -> List[RequestOutput]:
        if start_times is not None:
            delay = start_times[u] - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
        msgs = workload.user_messages[u]
        answers: List[str] = []
        outs: List[RequestOutput] = []
        for t in range(T):
            prompt = build_turn_prompt(workload.system_prompt, msgs, answers)
            row = DatasetRow(prompt, None, len(tokenizer.encode(prompt)), workload.output_len, group=u)
            if sem is None:
                out = await send(row)
            else:
                async with sem:
                    out = await send(row)
            out.user, out.turn = u, t
            outs.append(out)
            if on_done is not None:
                on_done(out)
            if not out.success:  # the conversation cannot go on without its answer
                for t2 in range(t + 1, T):
                    skipped = RequestOutput(error=f"not sent: turn {t} failed", user=u, turn=t2)
                    outs.append(skipped)
                    if on_done is not None:
                        on_done(skipped)
                break
            answers.append(out.generated_text)
        return outs

    per_user = await asyncio.gather(*(user(u) for u in range(workload.num_users)))
    return [o for outs in per_user for o in outs]


def per_turn_metrics(outputs: Sequence[RequestOutput]) -> List[Dict[str, Any]]:
    """One row per turn index: how prompts grow and what that does to TTFT and the cache."""
    rows = []
    for t in sorted({o.turn for o in outputs if o.turn is not None}):
        all_t = [o for o in outputs if o.turn == t]
        ok = [o for o in all_t if o.success]
        n = max(len(ok), 1)
        itls = [x for o in ok for x in o.itl]
        prompt = sum(o.prompt_len for o in ok)
        rows.append(dict(
            turn=t, requests=len(all_t), completed=len(ok),
            mean_prompt_len=prompt / n, mean_output_len=sum(o.output_len for o in ok) / n,
            cached_tokens=sum(o.cached_tokens for o in ok),
            usage_cache_hit_rate=sum(o.cached_tokens for o in ok) / prompt if prompt else 0.0,
            mean_ttft_ms=sum(o.ttft for o in ok) / n * 1e3, median_ttft_ms=percentile([o.ttft for o in ok], 50) * 1e3,
            mean_itl_ms=sum(itls) / len(itls) * 1e3 if itls else 0.0,
            mean_e2e_latency_ms=sum(o.latency for o in ok) / n * 1e3,
        ))
    return rows


def turn_request_rows(outputs: Sequence[RequestOutput]) -> List[Dict[str, Any]]:
    """One row per request of a multi-turn run (no texts)."""
    return [dict(user=o.user, turn=o.turn, success=o.success, prompt_len=o.prompt_len, output_len=o.output_len,
                 cached_tokens=o.cached_tokens, start_time=o.start_time, ttft_ms=o.ttft * 1e3,
                 e2e_latency_ms=o.latency * 1e3, mean_itl_ms=sum(o.itl) / len(o.itl) * 1e3 if o.itl else 0.0,
                 error=o.error)
            for o in outputs]


def format_turn_table(rows: Sequence[Dict[str, Any]]) -> str:
    lines = [f"{'turn':>4} {'done':>6} {'prompt len':>10} {'cached':>8} {'TTFT ms':>9} {'ITL ms':>8} {'E2E ms':>9}"]
    for r in rows:
        lines.append(f"{r['turn'] + 1:>4} {r['completed']:>3}/{r['requests']:<2} {r['mean_prompt_len']:>10.0f} "
                     f"{r['cached_tokens']:>8} {r['mean_ttft_ms']:>9.1f} {r['mean_itl_ms']:>8.2f} "
                     f"{r['mean_e2e_latency_ms']:>9.1f}")
    return "\n".join(lines)


async def benchmark(args: argparse.Namespace, transport: Any = None) -> Dict[str, Any]:
    """transport: an httpx transport instead of the network (tests)."""
    import httpx
    from tqdm import tqdm

    base_url = args.base_url or f"http://{args.host}:{args.port}"
    args.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    multi_turn = args.dataset_name == "multi-turn"
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits, transport=transport) as client:
        model_info = await _get_json(client, f"{base_url}/get_model_info", args.headers) or {}
        if args.backend == "openai" and not args.model:
            models = await _get_json(client, f"{base_url}/v1/models", args.headers) or {}
            data = models.get("data") or [{}]
            args.model = data[0].get("id", "default")
        tokenizer = load_tokenizer_or_tiny(args.tokenizer or model_info.get("tokenizer_path") or model_info.get("model_path"))
        vocab = args.vocab_size or (model_info.get("vocab_size") or (len(tokenizer) if tokenizer is not None else 8192))
        request_fn = request_sglang if args.backend == "sglang" else request_openai
        if multi_turn:
            workload = sample_multi_turn(args.num_users, args.num_turns, args.system_prompt_len, args.turn_input_len,
                                         args.random_output_len, vocab, args.seed, tokenizer)
            # warm up on unrelated text, so no conversation starts with a cached system prompt
            rng = random.Random(args.seed + WARMUP_SEED_OFFSET)
            warm = [DatasetRow(random_text(rng, max(args.turn_input_len, 8), vocab, tokenizer), None,
                               args.turn_input_len, workload.output_len) for _ in range(args.warmup_requests)]
        else:
            rows = get_dataset(args, vocab, tokenizer)
            if args.dataset_name in ("random", "random-ids"):  # prompts of their own: none of the run is cached
                warm = sample_random(args.warmup_requests, args.random_input_len, args.random_output_len,
                                     args.random_range_ratio, vocab, args.seed + WARMUP_SEED_OFFSET, tokenizer,
                                     as_text=args.dataset_name == "random")
            else:
                warm = [rows[i % len(rows)] for i in range(args.warmup_requests)]

        if warm:
            w = [DatasetRow(r.prompt, r.input_ids, r.prompt_len, min(r.output_len, 16)) for r in warm]
            outs = await asyncio.gather(*(request_fn(client, base_url, r, args, time.perf_counter()) for r in w))
            bad = [o.error for o in outs if not o.success]
            if bad:
                raise RuntimeError(f"warm-up request failed: {bad[0]}")
        if args.flush_cache:
            r = await client.post(f"{base_url}/flush_cache", headers=args.headers)
            if r.status_code != 200:
                print(f"warning: /flush_cache answered {r.status_code}: {r.text[:200]}")
        before = await scrape_server_counters(client, base_url, args.headers)

        if multi_turn:
            bar = tqdm(total=workload.num_users * workload.num_turns, disable=True if args.disable_tqdm else None,  # None: quiet off a terminal
                       desc="bench serving (multi-turn)")
            t0 = time.perf_counter()
            outputs = await run_conversations(
                workload, lambda row: request_fn(client, base_url, row, args, t0), tokenizer, args.max_concurrency,
                arrival_times(workload.num_users, args.request_rate, args.burstiness, args.seed),
                on_done=lambda _: bar.update(1))
            duration = time.perf_counter() - t0
            bar.close()
            after = await scrape_server_counters(client, base_url, args.headers)
            return _result(outputs, duration, before, after, base_url, multi_turn=True)

        times = [r.arrival_time for r in rows] if all(r.arrival_time is not None for r in rows) else \
            arrival_times(len(rows), args.request_rate, args.burstiness, args.seed)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = tqdm(total=len(rows), disable=True if args.disable_tqdm else None, desc="bench serving")  # None: quiet off a terminal
        t0 = time.perf_counter()

        async def one(row: DatasetRow, at: float) -> RequestOutput:
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                out = await request_fn(client, base_url, row, args, t0)
            else:
                async with sem:
                    out = await request_fn(client, base_url, row, args, t0)
            bar.update(1)
            return out

        outputs = await asyncio.gather(*(one(r, t) for r, t in zip(rows, times)))
        duration = time.perf_counter() - t0
        bar.close()
        after = await scrape_server_counters(client, base_url, args.headers)
    return _result(outputs, duration, before, after, base_url)


def _result(outputs: List[RequestOutput], duration: float, before: Dict[str, float], after: Dict[str, float],
            base_url: str, multi_turn: bool = False) -> Dict[str, Any]:
    metrics = calculate_metrics(outputs, duration)
    metrics.update(server_deltas(before, after))
    # cached prompt tokens as the responses' usage reports them (servers without /metrics too)
    if metrics["total_input_tokens"]:
        metrics["usage_cache_hit_rate"] = metrics["cached_tokens"] / metrics["total_input_tokens"]
    errors = [o.error for o in outputs if not o.success]
    res = dict(outputs=outputs, metrics=metrics, errors=errors, base_url=base_url, num_requests=len(outputs))
    if multi_turn:
        res["per_turn"] = per_turn_metrics(outputs)
        res["turn_requests"] = turn_request_rows(outputs)
    return res


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serving", help="load-test a running server (SGLang native or OpenAI API)")
    p.add_argument("--backend", choices=("sglang", "openai"), default="sglang")
    p.add_argument("--base-url", default=None, help="default: http://HOST:PORT")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="openai backend: model name (default: the first of /v1/models)")
    p.add_argument("--tokenizer", default=None, help="for text prompts (default: the server's model, else the tiny one)")
    p.add_argument("--vocab-size", type=int, default=None, help="range of random token ids (default: the server's)")
    add_dataset_args(p)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--disable-ignore-eos", action="store_true", help="let requests stop at EOS")
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--flush-cache", action="store_true", help="flush the server's prefix cache before the run")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--output-file", default=None, help="append one JSON line with the metrics and the arguments")
    p.add_argument("--output-details", action="store_true", help="include per-request TTFT / ITL / lengths in the JSON line")
    p.add_argument("--plot", default=None, help="PNG: TTFT and ITL distributions, throughput over time")
    p.add_argument("--tag", default=None, help="a label stored in the JSON line")
    p.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    res = asyncio.run(benchmark(args))
    m = res["metrics"]
    header = [("Backend", args.backend), ("Dataset", args.dataset_name),
              ("Traffic request rate", args.request_rate), ("Max request concurrency", args.max_concurrency or "not set")]
    multi_turn = "per_turn" in res
    if multi_turn:
        header += [("Users x turns", f"{args.num_users} x {args.num_turns}"),
                   ("System prompt / user msg / answer", f"{args.system_prompt_len} / {args.turn_input_len} / "
                                                         f"{args.random_output_len} tokens")]
    print(format_report(m, "Serving Benchmark Result", header))
    if multi_turn:
        print(format_turn_table(res["per_turn"]))
    if res["errors"]:
        print(f"{len(res['errors'])} failed; first error: {res['errors'][0]}")
    if args.output_file:
        record = dict(tag=args.tag, backend=args.backend, base_url=res["base_url"], dataset_name=args.dataset_name,
                      request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                      num_prompts=res["num_requests"] if multi_turn else args.num_prompts, seed=args.seed, **m)
        if multi_turn:
            record.update(num_users=args.num_users, num_turns=args.num_turns, system_prompt_len=args.system_prompt_len,
                          turn_input_len=args.turn_input_len, output_len=args.random_output_len,
                          per_turn=res["per_turn"], turn_requests=res["turn_requests"])
        record["args"] = {k: v for k, v in vars(args).items() if k not in ("func", "headers", "api_key")}
        if args.output_details:
            record["details"] = [asdict(o) for o in res["outputs"]]
        append_jsonl(args.output_file, record)
        print(f"appended to {args.output_file}")
    if args.plot:
        plot_results(res["outputs"], m, args.plot, f"bench serving: {args.dataset_name}, concurrency {args.max_concurrency}")
        print(f"wrote {args.plot}")
    return 0 if m["completed"] else 1
