"""A real `radixserve serve` of a tiny random Qwen2.5-VL (tests/vl_model.py), issue 46: the official
openai client sends an image through the chat API and gets transformers' answer for that image;
/generate takes image_data (a file under --allowed-local-media-path) and a second request about
the same image hits the prefix cache; bad images are 400s naming the part, and the server keeps
serving; the text-only server refuses images with one line."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor
import sys
from pathlib import Path

import openai
import pytest
import torch
import transformers
from conftest import ServerProcess, greedy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vl_model import IMAGE_PLACEHOLDER, data_url, hf_greedy, make_vl_model_dir, png_bytes, random_image  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_multimodal import huge_png_header  # noqa: E402


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl_server")
    model_dir = make_vl_model_dir(str(root / "model"))
    media = root / "media"
    media.mkdir()
    (media / "cat.png").write_bytes(png_bytes(random_image(31)))
    (root / "outside.png").write_bytes(png_bytes(random_image(32)))
    srv = ServerProcess("--model-path", model_dir, "--dtype", "float32", "--max-total-tokens", "4000",
                        "--allowed-local-media-path", str(media))
    yield srv, model_dir, root
    assert srv.stop() == 0, srv.read_log()[-3000:]


@pytest.fixture(scope="module")
def vl_http(vl):
    with vl[0].client() as c:
        yield c


def chat_body(part: dict, text: str = "What is in the picture?") -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": text}, part]}],
            "max_tokens": 4, "temperature": 0}


def test_the_openai_client_sends_an_image_and_gets_the_models_answer(vl):
    srv, model_dir, _ = vl
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    image = random_image(30)
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is in the picture?"},
                                             {"type": "image_url", "image_url": {"url": data_url(image)}}]}]
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0, logprobs=True)
    answer = chat.choices[0].message.content
    assert isinstance(answer, str) and answer and chat.usage.completion_tokens == 6
    # transformers' answer for the same rendered prompt and image
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "What is in the picture?"},
                                                                   {"type": "image"}]}],
                                     tokenize=False, add_generation_prompt=True)
    assert IMAGE_PLACEHOLDER in prompt
    hf = (transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval(), tok,
          transformers.AutoImageProcessor.from_pretrained(model_dir))
    tokens, logprobs = hf_greedy(hf, prompt, [image], 6)
    assert answer == tok.decode(tokens)
    ours = [t.logprob for t in chat.choices[0].logprobs.content]
    assert max(abs(a - b) for a, b in zip(ours, logprobs)) < 1e-3
    assert chat.usage.prompt_tokens == len(tok.encode(prompt)) - 1 + 20  # the 40x28 image's 20 tokens


def test_generate_takes_an_allowed_file_and_the_same_image_hits_the_cache(vl, vl_http):
    _, _, root = vl
    body = {"text": f"look: {IMAGE_PLACEHOLDER} so", "image_data": [str(root / "media" / "cat.png")],
            "sampling_params": greedy(4)}
    first = vl_http.post("/generate", json=body)
    assert first.status_code == 200, first.text
    # the same picture again, as a data URL now: same pixels, same pad values, a prefix hit
    body["image_data"] = [data_url(random_image(31))]
    second = vl_http.post("/generate", json=body).json()
    assert second["output_ids"] == first.json()["output_ids"]
    assert second["meta_info"]["cached_tokens"] >= first.json()["meta_info"]["prompt_tokens"] - 1


@pytest.mark.parametrize("what", ["not an image", "100 MP", "network URL", "outside the allowed dir", "missing file"])
def test_a_bad_image_is_a_400_naming_the_part_and_the_server_keeps_serving(vl, vl_http, what):
    _, _, root = vl
    url = {
        "not an image": "data:image/png;base64," + base64.b64encode(b"just some text").decode(),
        "100 MP": "data:image/png;base64," + base64.b64encode(huge_png_header(10000, 10000)).decode(),
        "network URL": "https://example.com/cat.png",
        "outside the allowed dir": str(root / "outside.png"),
        "missing file": str(root / "media" / "nope.png"),
    }[what]
    expected = {"not an image": "not an image", "100 MP": "100.0 MP", "network URL": "--enable-media-url-fetch",
                "outside the allowed dir": "outside the allowed directory", "missing file": "cannot read"}[what]
    r = vl_http.post("/v1/chat/completions", json=chat_body({"type": "image_url", "image_url": {"url": url}}))
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("messages[0].content[1]: ") and expected in message, message
    r = vl_http.post("/generate", json={"text": IMAGE_PLACEHOLDER, "image_data": [url], "sampling_params": greedy(2)})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("image_data[0]: ")
    ok = vl_http.post("/v1/chat/completions", json=chat_body({"type": "image_url", "image_url": {"url": data_url(random_image(33))}}))
    assert ok.status_code == 200, ok.text


def test_video_audio_and_miscounted_images_are_refused_with_one_line(vl_http):
    for part in ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
                 {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}):
        r = vl_http.post("/v1/chat/completions", json=chat_body(part))
        assert r.status_code == 400 and "video and audio input are not supported" in r.json()["error"]["message"], r.text
    r = vl_http.post("/generate", json={"text": "no placeholder", "image_data": [data_url(random_image(1))],
                                        "sampling_params": greedy(2)})
    assert r.status_code == 400 and "0 image placeholders for 1 images" in r.json()["error"]["message"]


def test_a_text_model_refuses_images(http):
    r = http.post("/v1/chat/completions", json=chat_body({"type": "image_url", "image_url": {"url": data_url(random_image(1))}}))
    assert r.status_code == 400 and "takes text only" in r.json()["error"]["message"], r.text


def test_dp_replicas_each_encode_their_own_images(vl, vl_http):
    """--dp-size 2 (round robin): the replicas encode the images of the requests they get (ViT
    data parallel); each answer is the one-replica server's answer for that image."""
    _, model_dir, _ = vl
    bodies = [chat_body({"type": "image_url", "image_url": {"url": data_url(random_image(40 + i))}}) for i in range(4)]
    expected = [vl_http.post("/v1/chat/completions", json=b).json()["choices"][0]["message"]["content"] for b in bodies]
    srv = ServerProcess("--model-path", model_dir, "--dtype", "float32", "--max-total-tokens", "3000",
                        "--dp-size", "2", "--load-balance-method", "round_robin")
    try:
        with srv.client() as c, ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda b: c.post("/v1/chat/completions", json=b), bodies))
        assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
        assert [r.json()["choices"][0]["message"]["content"] for r in replies] == expected
    finally:
        assert srv.stop() == 0, srv.read_log()[-3000:]
