"""NGRAM speculative decoding served over HTTP: SmolLM2-135M-Instruct (the CPU's bf16 mode), two
`radixserve serve` servers side by side, one with `--speculative-algorithm NGRAM` and one
without, greedy POST /generate (chat-templated prompts as input_ids, 128 new tokens), on the
workloads of spec_ngram.py:

  repetitive  "repeat this text", code editing, extraction: the answer copies its prompt
  random      short open questions (answers that copy little)

at 1 concurrent request (the 16 prompts one after another) and 16 (all at once). Output
tokens/s (output tokens / wall time of the batch of requests) and the accepted length (tokens per
verify step, SGLang's spec_accept_length: completion tokens / spec_verify_ct). The servers take
turns in rounds (the order flips each round); both are flushed (prefix cache and n-gram store)
before each measurement, so no round finds an earlier round's answers. An idle server uses no
CPU (its loop blocks on its socket).

    python benchmarks/cpu/spec_ngram_served.py --out benchmarks/cpu/spec_ngram_served.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "integration"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))

from conftest import ServerProcess  # noqa: E402  (tests/integration: a server subprocess on a free port)
from real_model import AGREEMENT_QUESTIONS, chat_prompt_ids, smollm2_gguf  # noqa: E402
from spec_ngram import repetitive_questions  # noqa: E402

from radixserve.hf_transformers_utils import get_tokenizer  # noqa: E402
from radixserve.server_args import ServerArgs  # noqa: E402


def run_batch(srv: ServerProcess, prompts: List[List[int]], concurrency: int, max_new: int) -> Dict[str, Any]:
    """All prompts, `concurrency` in flight at a time; wall time, tokens, verify steps, outputs."""
    with srv.client(timeout=600) as http:
        assert http.post("/flush_cache").status_code == 200, "the server did not flush (requests still running?)"

        def one(ids: List[int]) -> Dict[str, Any]:
            r = http.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}})
            assert r.status_code == 200, r.text
            return r.json()

        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            outs = list(pool.map(one, prompts))
        seconds = time.perf_counter() - t0
    metas = [o["meta_info"] for o in outs]
    verify = sum(m.get("spec_verify_ct", 0) for m in metas)
    tokens = sum(m["completion_tokens"] for m in metas)
    return {"seconds": seconds, "tokens": tokens, "verify": verify, "outputs": [o["output_ids"] for o in outs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--workloads", default="repetitive,random")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    path = str(smollm2_gguf())
    tok = get_tokenizer(ServerArgs(model_path=path))
    workloads = {
        "repetitive": [chat_prompt_ids(tok, q) for q in repetitive_questions()],
        "random": [chat_prompt_ids(tok, q) for q in AGREEMENT_QUESTIONS[:16]],
    }
    common = ["--model-path", path, "--dtype", args.dtype, "--max-total-tokens", "32768", "--log-level", "warning"]
    servers = {"off": ServerProcess(*common, wait=False),
               "ngram": ServerProcess(*common, "--speculative-algorithm", "NGRAM", wait=False)}
    try:
        for srv in servers.values():
            srv.wait_healthy()
        for srv in servers.values():  # warm up (first-call allocations), not measured
            run_batch(srv, workloads["random"][:2], 2, 8)
        rows = []
        for wname in args.workloads.split(","):
            for conc in [int(c) for c in args.concurrency.split(",")]:
                runs: Dict[str, List[Dict[str, Any]]] = {name: [] for name in servers}
                for r in range(args.rounds):
                    order = list(servers) if r % 2 == 0 else list(reversed(servers))
                    for name in order:
                        runs[name].append(run_batch(servers[name], workloads[wname], conc, args.max_new_tokens))
                rows.append(summarize(wname, conc, runs))
                row = rows[-1]
                print(f"{wname:>10} c={conc:<3} off {row['off_tokens_per_s']:7.1f} tok/s  ngram {row['ngram_tokens_per_s']:7.1f} tok/s"
                      f"  x{row['speedup']:.2f} (rounds {', '.join(f'{x:.2f}' for x in row['speedup_per_round'])})"
                      f"  accept_length {row['spec_accept_length']:.2f}  equal {row['outputs_equal']}", flush=True)
    finally:
        for srv in servers.values():
            srv.stop()
    if args.out:
        Path(args.out).write_text(json.dumps({
            "model": Path(path).name, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens, "rounds": args.rounds,
            "command": " ".join(sys.argv), "rows": rows}, indent=1) + "\n")


def summarize(wname: str, conc: int, runs: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Any]:
    """tokens/s per server (all rounds' tokens / all rounds' seconds), the per-round ratios, and
    the accepted length."""
    tps = {name: sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs) for name, rs in runs.items()}
    per_round = [n["tokens"] / n["seconds"] / (o["tokens"] / o["seconds"]) for o, n in zip(runs["off"], runs["ngram"])]
    ng = runs["ngram"]
    same = sum(a == b for a, b in zip(runs["off"][0]["outputs"], ng[0]["outputs"]))
    return {
        "workload": wname, "concurrency": conc, "num_prompts": len(ng[0]["outputs"]),
        "off_tokens_per_s": tps["off"], "ngram_tokens_per_s": tps["ngram"], "speedup": tps["ngram"] / tps["off"],
        "speedup_per_round": per_round, "speedup_median": statistics.median(per_round),
        "spec_accept_length": sum(r["tokens"] for r in ng) / max(sum(r["verify"] for r in ng), 1),
        "outputs_equal": f"{same}/{len(ng[0]['outputs'])}",
        "off_seconds": [r["seconds"] for r in runs["off"]], "ngram_seconds": [r["seconds"] for r in ng],
    }


if __name__ == "__main__":
    main()
