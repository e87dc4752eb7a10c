"""The SWA pool's memory for one long context (issue 42): Gemma 3 270M (the real Q4_K_M file,
3 global layers, 15 local ones with a 512-token window) served one request of N tokens with
--enable-hybrid-swa-memory and a SWA pool as small as the server starts with, next to the pool
that keeps every layer's KV for the same context. Prints a table and writes JSON.

    python benchmarks/cpu/swa_pool_memory.py --context 4096 --chunk 512 --out benchmarks/cpu/swa_pool_memory.json

Measured: the KV bytes each configuration allocates, the SWA slots in use at their peak (after
every scheduler step) and the full ones, and whether the greedy tokens of the two agree."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from real_model import gemma3_gguf  # noqa: E402

from radixserve import Engine  # noqa: E402


def _kv_bytes(pool) -> int:
    pools = (getattr(pool, "full_kv_pool", pool), getattr(pool, "swa_kv_pool", None))
    bufs = [b for p in pools if p is not None for b in (*p.k_buffer, *p.v_buffer)]
    return sum(b.numel() * b.element_size() for b in bufs)


def run(swa: bool, context: int, chunk: int, new_tokens: int) -> dict:
    window = 512
    swa_slots = 3 * window + chunk + 8
    engine = Engine(model_path=str(gemma3_gguf()), dtype="float32", max_total_tokens=context + new_tokens + 8,
                    chunked_prefill_size=chunk, enable_hybrid_swa_memory=swa, disable_radix_cache=True,
                    swa_full_tokens_ratio=swa_slots / (context + new_tokens + 8), test_check_memory=swa)
    sched = engine.scheduler
    peak = {"swa": 0, "full": 0}
    check = sched.check_slot_conservation

    def measure() -> None:
        check()
        st = sched.internal_state()
        peak["full"] = max(peak["full"], st["max_total_num_tokens"] - st["available_tokens"])
        if swa:
            peak["swa"] = max(peak["swa"], st["swa_used_tokens"])

    sched.check_slot_conservation = measure
    sched.server_args.test_check_memory = True
    try:
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(1000, 200000, (context,), generator=g).tolist()
        t = time.perf_counter()
        out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": new_tokens, "temperature": 0,
                                                                 "ignore_eos": True}, progress=False)
        secs = time.perf_counter() - t
        pool = sched.ledger.kv_pool
        return dict(swa_pool=swa, context=context, chunk=chunk, kv_bytes=_kv_bytes(pool),
                    full_slots=sched.max_total_num_tokens,
                    swa_slots=sched.internal_state().get("swa_max_total_num_tokens"),
                    peak_full_used=peak["full"], peak_swa_used=peak["swa"] if swa else None,
                    output_ids=out["output_ids"], seconds=round(secs, 1))
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--out", default="benchmarks/cpu/swa_pool_memory.json")
    a = ap.parse_args()
    rows = [run(swa, a.context, a.chunk, a.new_tokens) for swa in (False, True)]
    print(f"{'pool':>10} {'KV MiB':>8} {'full slots':>10} {'swa slots':>9} {'peak full':>9} {'peak swa':>8} {'s':>6}")
    for r in rows:
        print(f"{'SWA' if r['swa_pool'] else 'one':>10} {r['kv_bytes'] / 2**20:8.1f} {r['full_slots']:10d} "
              f"{str(r['swa_slots']):>9} {r['peak_full_used']:9d} {str(r['peak_swa_used']):>8} {r['seconds']:6.1f}")
    same = rows[0]["output_ids"] == rows[1]["output_ids"]
    print(f"KV bytes, SWA pool / one pool: {rows[1]['kv_bytes'] / rows[0]['kv_bytes']:.3f}; same greedy tokens: {same}")
    Path(a.out).write_text(json.dumps(dict(rows=rows, same_tokens=same), indent=1))


if __name__ == "__main__":
    main()
