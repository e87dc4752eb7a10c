"""Qwen2.5-VL and Qwen3-VL with images against transformers, float32 (issue 46): tiny random
checkpoints that transformers 5 builds (tests/vl_model.py; every test runs for both families), the Engine's greedy tokens and logprobs equal to
transformers' generate on the same images (within 1e-3), for one image, several images in one
request, image requests batched with text-only ones, and a chunked prefill that splits an image.
Then the cache path: the same image twice hits the radix cache and does not run the vision
encoder again; a different image with the same text shares nothing from the image on."""

from __future__ import annotations

import threading
from typing import List, Sequence, Tuple

import pytest
import torch
import transformers

from vl_model import FAMILIES, IMAGE_PLACEHOLDER, data_url, make_vl_model_dir, random_image
from vl_model import hf_greedy as _hf_greedy

from radixserve.engine import Engine
from radixserve.models.model_config import LoadError

TOL = 1e-3
NEW = 6
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
# a small KV pool: the tests hold two engines at a time, on a machine shared with other jobs
SMALL = dict(device="cpu", max_total_tokens=4096)


@pytest.fixture(scope="module", params=list(FAMILIES))
def vl_dir(request, tmp_path_factory) -> str:
    return make_vl_model_dir(str(tmp_path_factory.mktemp(request.param)), family=request.param)


@pytest.fixture(scope="module")
def hf(vl_dir):
    model = transformers.AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(vl_dir)
    return model, tok, transformers.AutoImageProcessor.from_pretrained(vl_dir)


def hf_greedy(hf, prompt: str, images: Sequence) -> Tuple[List[int], List[float]]:
    return _hf_greedy(hf, prompt, images, NEW)


@pytest.fixture(scope="module")
def engine(vl_dir):
    e = Engine(model_path=vl_dir, dtype="float32", **SMALL)
    yield e
    e.shutdown()


def assert_matches(result: dict, expected: Tuple[List[int], List[float]]) -> None:
    tokens, logprobs = expected
    assert result["output_ids"] == tokens
    ours = [lp for lp, _, _ in result["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(ours, logprobs)) < TOL, (ours, logprobs)


def model_of(engine: Engine):
    return engine.scheduler.tp_worker.model_runner.model


def test_one_image_matches_transformers_and_the_image_matters(engine, hf):
    prompt = f"look {IMAGE_PLACEHOLDER} and say"
    a, b = random_image(1), random_image(2)
    ra = engine.generate(prompt, GREEDY, image_data=[data_url(a)], return_logprob=True)
    rb = engine.generate(prompt, GREEDY, image_data=data_url(b), return_logprob=True)  # a lone image, not a list
    assert_matches(ra, hf_greedy(hf, prompt, [a]))
    assert_matches(rb, hf_greedy(hf, prompt, [b]))
    # the image reaches the logits (else the test above would pass with the images ignored)
    first = [r["meta_info"]["output_token_logprobs"][0][0] for r in (ra, rb)]
    assert abs(first[0] - first[1]) > 1e-3


def test_several_images_of_several_sizes_in_one_request(engine, hf):
    prompt = f"{IMAGE_PLACEHOLDER} first, then {IMAGE_PLACEHOLDER} second, and {IMAGE_PLACEHOLDER}"
    images = [random_image(3, (40, 28)), random_image(4, (20, 44)), random_image(5, (48, 48))]
    result = engine.generate(prompt, GREEDY, image_data=[data_url(i) for i in images], return_logprob=True)
    assert_matches(result, hf_greedy(hf, prompt, images))


def test_image_requests_batched_with_text_only_requests(engine, hf):
    prompts = [f"a {IMAGE_PLACEHOLDER} b", "only text here, no picture", f"{IMAGE_PLACEHOLDER}{IMAGE_PLACEHOLDER} two",
               "more text"]
    images = [[random_image(6)], None, [random_image(7, (16, 36)), random_image(8)], None]
    results = engine.generate(prompts, GREEDY, image_data=[[data_url(i) for i in im] if im else None for im in images],
                              return_logprob=True)
    for prompt, im, result in zip(prompts, images, results):
        assert_matches(result, hf_greedy(hf, prompt, im or []))


def test_chunked_prefill_splits_an_image(vl_dir, hf):
    """Chunks of 16 tokens: the 40x28 image's 20 tokens (and the 48x48 one's 36) fall across
    chunk boundaries; each chunk takes its rows of the image's embedding, encoded once."""
    prompt = f"see {IMAGE_PLACEHOLDER} and {IMAGE_PLACEHOLDER} now"
    images = [random_image(9), random_image(10, (48, 48))]
    e = Engine(model_path=vl_dir, dtype="float32", **SMALL, chunked_prefill_size=16)
    try:
        result = e.generate(prompt, GREEDY, image_data=[data_url(i) for i in images], return_logprob=True)
        assert result["meta_info"]["prompt_tokens"] > 3 * 16  # several chunks
        assert_matches(result, hf_greedy(hf, prompt, images))
        assert model_of(e).images_encoded == 2  # not once per chunk
    finally:
        e.shutdown()


def test_the_same_image_again_hits_the_prefix_cache_and_skips_the_encoder(engine, hf):
    prompt = f"about {IMAGE_PLACEHOLDER} this picture, tell"
    image = random_image(11)
    engine.flush_cache()
    model = model_of(engine)
    before = model.images_encoded
    first = engine.generate(prompt, GREEDY, image_data=[data_url(image)], return_logprob=True)
    assert model.images_encoded == before + 1
    # the same image again, as PNG bytes this time: the hash is of the pixels, not the URL
    second = engine.generate(prompt, GREEDY, image_data=[image], return_logprob=True)
    assert model.images_encoded == before + 1  # the encoder did not run again
    prompt_len = first["meta_info"]["prompt_tokens"]
    if hasattr(model, "mamba_state_shape"):
        # Qwen3.5 (hybrid): its MambaRadixCache hits only where a state snapshot is, here where the
        # first request ended (its prompt, image included, and its outputs fed): a second turn
        turn = engine.tokenizer.encode(prompt) + first["output_ids"] + engine.tokenizer.encode(" and more")
        again = engine.generate(input_ids=turn, sampling_params=GREEDY, image_data=[image], return_logprob=True)
        assert again["meta_info"]["cached_tokens"] >= prompt_len + NEW - 1
        assert model.images_encoded == before + 1
    else:
        assert second["meta_info"]["cached_tokens"] >= prompt_len - 1
    assert second["output_ids"] == first["output_ids"]
    assert_matches(second, hf_greedy(hf, prompt, [image]))

    # A different image (same size, same text): the prefix is shared up to the image only.
    other = engine.generate(prompt, GREEDY, image_data=[data_url(random_image(12))], return_logprob=True)
    text_before_image = len(engine.tokenizer.encode("about <|vision_start|>"))
    assert other["meta_info"]["cached_tokens"] <= text_before_image
    assert model.images_encoded == before + 2


def test_the_encoder_runs_beside_the_decode_of_others(engine, hf):
    """Issue 46 item 2: a new request's images are encoded on the encoder thread while the running
    requests keep decoding (held here until the test lets the encoder finish), then its prefill takes
    them from the cache; both answers equal transformers'."""
    model = model_of(engine)
    visual, gate, threads, modes = model.visual, threading.Event(), [], []
    encode, forward = visual.forward, model.forward

    def held_encode(*a, **k):
        threads.append(threading.current_thread().name)
        assert gate.wait(120)
        return encode(*a, **k)

    def spy(input_ids, positions, forward_batch, *a, **k):
        modes.append(forward_batch.forward_mode.name)
        return forward(input_ids, positions, forward_batch, *a, **k)

    visual.forward, model.forward = held_encode, spy
    prompt, image = f"while {IMAGE_PLACEHOLDER} others decode", random_image(30)
    try:
        engine.flush_cache()
        params = dict(sampling_params=dict(GREEDY, max_new_tokens=10), return_logprob=True)
        states = engine.submit(text="plain text decoding", **params)
        engine.step()  # its prefill
        states += engine.submit(text=prompt, image_data=[data_url(image)], **params)
        for _ in range(3):
            engine.step()
        assert len(engine.scheduler.encode_queue) == 1  # still encoding ...
        assert modes[-3:] == ["DECODE"] * 3  # ... while the text request decodes
        gate.set()
        while not all(s.finished for s in states):
            engine.step()
        assert threads == ["vit-encoder_0"]  # encoded once, on the encoder thread, not in the prefill
        assert_matches(engine.frontend.make_output(states[0]), _hf_greedy(hf, "plain text decoding", [], 10))
        assert_matches(engine.frontend.make_output(states[1]), _hf_greedy(hf, prompt, [image], 10))
    finally:
        gate.set()
        del visual.forward, model.forward


def test_the_embedding_cache_is_bounded_and_least_recently_used(engine):
    """An encoder output evicted from the (tiny here) cache is recomputed, with the same answer;
    the one used last stays."""
    model = model_of(engine)
    cache = model.mm_cache
    saved = cache.max_bytes
    images = [random_image(20 + i) for i in range(3)]
    prompt = f"x {IMAGE_PLACEHOLDER} y"
    try:
        engine.flush_cache()  # no radix prefix: every request needs its image's embedding
        cache.clear()
        runs = [engine.generate(prompt, GREEDY, image_data=[images[0]])["output_ids"]]
        one = cache.used_bytes  # one image's embedding (same size for all three)
        cache.max_bytes = 2 * one
        runs += [engine.generate(prompt, GREEDY, image_data=[img])["output_ids"] for img in images[1:]]
        assert len(cache) == 2 and cache.used_bytes <= cache.max_bytes
        engine.flush_cache()
        before = model.images_encoded
        assert engine.generate(prompt, GREEDY, image_data=[images[2]])["output_ids"] == runs[2]
        assert model.images_encoded == before  # the last one is still cached
        engine.flush_cache()
        assert engine.generate(prompt, GREEDY, image_data=[images[0]])["output_ids"] == runs[0]
        assert model.images_encoded == before + 1  # the first was evicted: encoded again
    finally:
        cache.max_bytes = saved


@pytest.mark.parametrize("flags, what", [
    (dict(speculative_algorithm="NGRAM"), "--speculative-algorithm"),
    (dict(enable_hierarchical_cache=True), "--enable-hierarchical-cache"),
])
def test_what_does_not_combine_with_images_yet_is_refused_at_start(vl_dir, flags, what):
    # (Qwen3.5: its hybrid language model's check refuses these first, in the same words)
    with pytest.raises(LoadError, match=f"a (vision-language|hybrid linear-attention) model does not run with {what}( NGRAM)? yet"):
        Engine(model_path=vl_dir, dtype="float32", **SMALL, **flags)


def test_mixed_chunks_an_image_request_decodes_while_others_prefill(vl_dir, hf):
    """--enable-mixed-chunk: an image request's decode tokens ride in the forwards of other
    requests' prefill chunks (a text one, another image one): there its token sits at its
    position + its M-RoPE delta, the chunks' tokens at their own positions."""
    e = Engine(model_path=vl_dir, dtype="float32", **SMALL, chunked_prefill_size=16, enable_mixed_chunk=True)
    model = model_of(e)
    modes = []
    forward = model.forward

    def spy(input_ids, positions, forward_batch, *a, **k):
        modes.append((forward_batch.forward_mode.name, forward_batch.multimodal_inputs is not None))
        return forward(input_ids, positions, forward_batch, *a, **k)

    model.forward = spy
    try:
        prompts = [f"first {IMAGE_PLACEHOLDER} go", "a longer plain text prompt " * 4, f"then {IMAGE_PLACEHOLDER} late"]
        images = [[random_image(13)], None, [random_image(14, (48, 48))]]
        params = dict(sampling_params=dict(GREEDY, max_new_tokens=10), return_logprob=True)
        states = e.submit(text=prompts[0], image_data=[data_url(images[0][0])], **params)
        e.step()  # the first image request is decoding when the others arrive
        states += e.submit(text=prompts[1], **params)
        states += e.submit(text=prompts[2], image_data=[data_url(images[2][0])], **params)
        while not all(s.finished for s in states):
            e.step()
        assert ("MIXED", True) in modes
        for prompt, im, state in zip(prompts, images, states):
            assert_matches(e.frontend.make_output(state), _hf_greedy(hf, prompt, im or [], 10))
    finally:
        e.shutdown()


def test_overlap_loop_and_penalties_with_images(vl_dir, hf, engine):
    """The overlap loop (the default on CUDA) serves an image request as the plain loop does;
    a repetition penalty over a prompt with images counts its text tokens only (the pad values
    are not vocabulary ids)."""
    prompt = f"over {IMAGE_PLACEHOLDER} lap"
    image = random_image(15)
    e = Engine(model_path=vl_dir, dtype="float32", **SMALL, disable_overlap_schedule=False)
    try:
        assert_matches(e.generate(prompt, GREEDY, image_data=[image], return_logprob=True),
                       hf_greedy(hf, prompt, [image]))
    finally:
        e.shutdown()
    penalized = engine.generate(prompt, dict(GREEDY, repetition_penalty=1.5), image_data=[image])
    assert penalized["meta_info"]["finish_reason"]["type"] == "length"
    assert len(penalized["output_ids"]) == NEW


def test_bfloat16_serves_images(vl_dir, hf):
    """bf16 weights (on the CPU: the C++ GEMM's bf16 LM, the vision encoder in float32): an image
    request runs, and its first token's logprob stays near transformers' float32 one."""
    prompt = f"half {IMAGE_PLACEHOLDER} precision"
    image = random_image(16)
    e = Engine(model_path=vl_dir, dtype="bfloat16", **SMALL)
    try:
        result = e.generate(prompt, GREEDY, image_data=[image], return_logprob=True)
    finally:
        e.shutdown()
    tokens, logprobs = hf_greedy(hf, prompt, [image])
    assert len(result["output_ids"]) == NEW and result["output_ids"][0] == tokens[0]
    assert abs(result["meta_info"]["output_token_logprobs"][0][0] - logprobs[0]) < 0.1
