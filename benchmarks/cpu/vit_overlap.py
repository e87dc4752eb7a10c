"""The vision encoder off the decode path (issue 46 item 2): the running requests' decode steps
while another request's image is encoded, with the encoder in the prefill step
(--disable-mm-encode-ahead, before) and on the encoder thread (the default, after).

A random Qwen3-VL (tests/vl_model.py's, with a larger vision tower: depth 8, width 256) serves
--running text requests that decode; once they are decoding, one request with a 224x224 image
(3136 patches) arrives. Each Engine.step() is timed from the arrival until the image request's
first token: the running requests get one token per decode step, none in a step that prefills.

    OMP_NUM_THREADS=1 PYTHONPATH=.:tests python benchmarks/cpu/vit_overlap.py [--out benchmarks/cpu/vit_overlap.json]

Prints a table (per mode: the decode steps the running requests got between the image's arrival
and its first token, their median and longest time, the longest wait for a token, the image
request's TTFT) and writes JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Dict, List

import transformers

import vl_model
from radixserve.engine import Engine

# Qwen3-VL's tower (Qwen3.5's too): attention over the whole image, no windows
VISION_BIG = dict(vl_model.VISION_QWEN3, depth=8, hidden_size=256, intermediate_size=512, num_heads=4,
                  deepstack_visual_indexes=[3, 7])
FAMILY = "qwen3_vl"


def build(out_dir: str) -> str:
    config_class, model_class, text, _ = vl_model.FAMILIES[FAMILY]
    vl_model.FAMILIES[FAMILY] = (config_class, model_class, text, VISION_BIG)
    path = vl_model.make_vl_model_dir(out_dir, family=FAMILY)
    transformers.Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=8 * 8,
                                          max_pixels=224 * 224).save_pretrained(path)
    return path


def run(path: str, encode_ahead: bool, running: int, seed: int) -> Dict[str, float]:
    e = Engine(model_path=path, dtype="float32", device="cpu", max_total_tokens=16384,
               disable_mm_encode_ahead=not encode_ahead)
    try:
        params = dict(max_new_tokens=1500, temperature=0, ignore_eos=True)
        # warm-up: one image request alone (first-call costs out of the measurement)
        e.generate(f"warm {vl_model.IMAGE_PLACEHOLDER}", dict(params, max_new_tokens=2),
                   image_data=[vl_model.random_image(seed + 1, (224, 224))])
        e.flush_cache()
        texts = [s for i in range(running) for s in e.submit(text=f"text request {i} " * 4, sampling_params=params)]
        for _ in range(5):  # all decoding
            e.step()
        plain = []
        for _ in range(10):
            t0 = time.perf_counter()
            e.step()
            plain.append(time.perf_counter() - t0)
        image = e.submit(text=f"an image {vl_model.IMAGE_PLACEHOLDER} now",
                         sampling_params=dict(params, max_new_tokens=4),
                         image_data=[vl_model.random_image(seed, (224, 224))])[0]
        decode: List[float] = []  # the running requests' steps (one token each) until the image's first token
        other: List[float] = []  # the image request's prefill chunks (the running requests wait)
        t_arrive = time.perf_counter()
        while not image.output_ids:
            t0 = time.perf_counter()
            e.step()
            dt = time.perf_counter() - t0
            batch = e.scheduler.last_batch
            if batch is not None:
                (decode if batch.forward_mode.is_decode() else other).append(dt)
        ttft = time.perf_counter() - t_arrive
        for s in texts:
            e.abort(s.rid)
        return dict(decode_step_alone_ms=1e3 * statistics.median(plain),
                    decode_steps_meanwhile=len(decode),
                    decode_step_meanwhile_median_ms=1e3 * statistics.median(decode) if decode else 0.0,
                    decode_step_meanwhile_max_ms=1e3 * max(decode) if decode else 0.0,
                    longest_wait_for_a_token_ms=1e3 * max(decode + other),
                    image_ttft_ms=1e3 * ttft)
    finally:
        e.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--running", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/cpu/vit_overlap.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = build(tmp)
        rows = {mode: [run(path, mode == "encode_ahead", args.running, 100 + r) for r in range(args.repeats)]
                for mode in ("in_prefill", "encode_ahead")}
    keys = list(rows["in_prefill"][0])
    print(f"{'mode':<14}" + "".join(f"{k:>34}" for k in keys))
    summary = {}
    for mode, runs in rows.items():
        summary[mode] = {k: statistics.median(r[k] for r in runs) for k in keys}
        print(f"{mode:<14}" + "".join(f"{summary[mode][k]:>34.1f}" for k in keys))
    with open(args.out, "w") as f:
        json.dump({"command": "OMP_NUM_THREADS=1 PYTHONPATH=.:tests python benchmarks/cpu/vit_overlap.py",
                   "running": args.running, "repeats": args.repeats, "median": summary, "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
