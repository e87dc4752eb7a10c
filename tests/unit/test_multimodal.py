"""The front end's half of images in (radixserve/multimodal/, issue 46): where an image may come
from and its limits, the placeholder expansion and pad_input_ids, the M-RoPE positions against
transformers' get_rope_index, and the bounded LRU embedding cache."""

from __future__ import annotations

import base64
import struct
import sys
import threading
import types
import zlib
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/vl_model.py
from vl_model import data_url, png_bytes, random_image  # noqa: E402

from radixserve.managers.encode_queue import EncodeQueue  # noqa: E402
from radixserve.multimodal.embedder import ImageEmbedder  # noqa: E402
from radixserve.multimodal.image_loader import MediaLimits, load_image  # noqa: E402
from radixserve.multimodal.mm_cache import MultimodalEmbeddingCache  # noqa: E402
from radixserve.multimodal.mm_inputs import MM_PAD_BASE, MultimodalDataItem, MultimodalInputError, pad_input_ids  # noqa: E402
from radixserve.multimodal.processor import Qwen2_5VLProcessor, mrope_positions, placeholder_runs  # noqa: E402

IMAGE_TOKEN = 99


def huge_png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (a tiny image's IHDR rewritten, its CRC fixed):
    the limit must refuse it from the header, before decoding anything."""
    data = bytearray(png_bytes(random_image(0, (2, 2))))
    ihdr = 8 + 8  # signature, then the IHDR chunk's length and type
    data[ihdr:ihdr + 8] = struct.pack(">II", width, height)
    data[ihdr + 13:ihdr + 17] = struct.pack(">I", zlib.crc32(bytes(data[ihdr - 4:ihdr + 13])))
    return bytes(data)


def test_a_data_url_and_bytes_decode_to_the_same_rgb_image():
    image = random_image(1)
    a = load_image(data_url(image), "image_data[0]", MediaLimits())
    b = load_image(png_bytes(image), "image_data[0]", MediaLimits())
    assert a.mode == "RGB" and a.size == image.size and a.tobytes() == b.tobytes() == image.tobytes()


@pytest.mark.parametrize("source, limits, message", [
    ("data:image/png;base64," + base64.b64encode(b"not an image at all").decode(), MediaLimits(), "not an image"),
    ("data:image/png;base64,@@@@", MediaLimits(), "base64 is invalid"),
    ("data:image/png," + "x" * 10, MediaLimits(), "data:<type>;base64"),
    ("http://example.com/cat.png", MediaLimits(), "--enable-media-url-fetch"),
    ("https://example.com/cat.png", MediaLimits(), "--enable-media-url-fetch"),
    ("/etc/passwd", MediaLimits(), "--allowed-local-media-path"),
    ("ftp://example.com/cat.png", MediaLimits(), "unsupported image URL scheme"),
    (12, MediaLimits(), "got int"),
])
def test_refusals_name_the_part(source, limits, message):
    with pytest.raises(MultimodalInputError) as e:
        load_image(source, "messages[0].content[1]", limits)
    assert str(e.value).startswith("messages[0].content[1]: ") and message in str(e.value)


def test_a_100_megapixel_image_is_refused_from_its_header():
    with pytest.raises(MultimodalInputError, match=r"image_data\[0\]: the image is 10000x10000 = 100.0 MP"):
        load_image(huge_png_header(10000, 10000), "image_data[0]", MediaLimits())
    url = "data:image/png;base64," + base64.b64encode(huge_png_header(10000, 10000)).decode()
    with pytest.raises(MultimodalInputError, match="100.0 MP, more than the limit of 16.8 MP"):
        load_image(url, "image_data[0]", MediaLimits())
    # Beyond Pillow's own bomb limit too (it refuses to open those): still our message
    with pytest.raises(MultimodalInputError, match="MP"):
        load_image(huge_png_header(30000, 30000), "image_data[0]", MediaLimits())


def test_the_byte_limit():
    data = png_bytes(random_image(2, (40, 40)))
    limits = MediaLimits(max_image_bytes=len(data) - 1)
    with pytest.raises(MultimodalInputError, match="bytes, more than the limit"):
        load_image(data, "x", limits)
    with pytest.raises(MultimodalInputError, match="more than the limit"):
        load_image("data:image/png;base64," + base64.b64encode(data * 2).decode(), "x", limits)


def test_local_files_only_under_the_allowed_directory(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "cat.png").write_bytes(png_bytes(random_image(3)))
    (tmp_path / "secret.png").write_bytes(png_bytes(random_image(4)))
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    limits = MediaLimits(allowed_local_media_path=str(allowed))
    assert load_image(str(allowed / "cat.png"), "x", limits).size == (40, 28)
    assert load_image(f"file://{allowed / 'cat.png'}", "x", limits).size == (40, 28)
    for outside in (str(tmp_path / "secret.png"), str(allowed / ".." / "secret.png"), str(allowed / "link.png")):
        with pytest.raises(MultimodalInputError, match="outside the allowed directory"):
            load_image(outside, "x", limits)
    with pytest.raises(MultimodalInputError, match="cannot read"):
        load_image(str(allowed / "missing.png"), "x", limits)


def test_placeholder_runs_and_pad_input_ids():
    ids = [1, IMAGE_TOKEN, 2, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, 3]
    assert placeholder_runs(ids, IMAGE_TOKEN) == [(1, 2), (3, 6)]
    a = MultimodalDataItem(hash=5, offset=1, num_tokens=1, pixel_values=torch.zeros(4, 3), image_grid_thw=(1, 2, 2))
    b = MultimodalDataItem(hash=2**63 + 7, offset=3, num_tokens=3, pixel_values=torch.zeros(12, 3),
                           image_grid_thw=(1, 2, 6))
    padded = pad_input_ids(ids, [a, b])
    assert padded == [1, a.pad_value, 2, b.pad_value, b.pad_value, b.pad_value, 3]
    assert a.pad_value != b.pad_value and all(MM_PAD_BASE <= p < 2**31 for p in (a.pad_value, b.pad_value))


@pytest.fixture(scope="module")
def processor():
    image_processor = transformers.Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                                            min_pixels=64, max_pixels=48 * 48)
    return Qwen2_5VLProcessor(image_processor, IMAGE_TOKEN, 2, MediaLimits())


def test_the_processor_expands_pads_and_hashes_by_pixels(processor):
    a, b = random_image(5, (40, 28)), random_image(6, (20, 44))
    ids, mm = processor.process([7, IMAGE_TOKEN, 8, IMAGE_TOKEN, 9], [data_url(a), png_bytes(b)], ["i0", "i1"])
    first, second = mm.items
    # sides rounded to the patch x merge size (8 px): 40x28 -> 40x32, 20x44 -> 16x48; 4 patches a token
    assert [first.image_grid_thw, second.image_grid_thw] == [(1, 8, 10), (1, 12, 4)]
    assert (first.offset, first.num_tokens, second.offset, second.num_tokens) == (1, 20, 22, 12)
    assert ids == [7] + [first.pad_value] * 20 + [8] + [second.pad_value] * 12 + [9]
    assert mm.unpadded(ids) == [7] + [0] * 20 + [8] + [0] * 12 + [9]
    assert mm.mrope_positions.shape == (3, len(ids))
    # the same pixels by another route hash alike; other pixels do not
    _, again = processor.process([IMAGE_TOKEN], [a], ["i0"])
    assert again.items[0].hash == first.hash != second.hash
    with pytest.raises(MultimodalInputError, match="2 image placeholders for 1 images"):
        processor.process([IMAGE_TOKEN, 1, IMAGE_TOKEN], [a], ["i0"])
    with pytest.raises(MultimodalInputError, match="^i1: not an image"):
        processor.process([IMAGE_TOKEN, IMAGE_TOKEN + 1, IMAGE_TOKEN], [a, "data:image/png;base64,AAAA"], ["i0", "i1"])


def test_mrope_positions_equal_transformers_get_rope_index(processor):
    ids, mm = processor.process([5, 6, IMAGE_TOKEN, 7, IMAGE_TOKEN, IMAGE_TOKEN + 1, 8, 9],
                                [random_image(7, (40, 28)), random_image(8, (20, 44))], ["a", "b"])
    grid = torch.tensor([item.image_grid_thw for item in mm.items])
    hf_ids = torch.tensor([mm.unpadded(ids, IMAGE_TOKEN)])
    fake = types.SimpleNamespace(config=types.SimpleNamespace(vision_config=types.SimpleNamespace(
        spatial_merge_size=2, tokens_per_second=2)))
    fake.get_vision_position_ids = lambda *a, **k: transformers.Qwen2_5_VLModel.get_vision_position_ids(fake, *a, **k)
    positions, delta = transformers.Qwen2_5_VLModel.get_rope_index(
        fake, hf_ids, mm_token_type_ids=(hf_ids == IMAGE_TOKEN).int(), image_grid_thw=grid)
    assert torch.equal(mm.mrope_positions, positions[:, 0])
    assert mm.mrope_position_delta == int(delta) < 0
    # text only: the three axes are the token's position
    text, _ = mrope_positions(4, [], 2)
    assert torch.equal(text, torch.arange(4).expand(3, -1))


def test_the_embedding_cache_evicts_the_least_recently_used_to_stay_in_bounds():
    row = torch.zeros(10, 4)  # 160 bytes
    cache = MultimodalEmbeddingCache(max_bytes=400)
    cache.put(1, row)
    cache.put(2, row.clone())
    assert cache.get(1) is row  # 1 is now the most recently used
    cache.put(3, row.clone())  # 480 > 400: 2 goes
    assert 2 not in cache and 1 in cache and 3 in cache and cache.used_bytes == 320
    assert cache.get(2) is None
    assert (cache.stats.hits, cache.stats.misses, cache.stats.evictions) == (1, 1, 1)
    cache.put(4, torch.zeros(200, 4))  # larger than the whole cache: not kept, nothing evicted
    assert 4 not in cache and len(cache) == 2


# ---- the encoder off the decode path (managers/encode_queue.py, multimodal/embedder.py) ----------
def _item(seed: int) -> MultimodalDataItem:
    g = torch.Generator().manual_seed(seed)
    return MultimodalDataItem(hash=seed, offset=0, num_tokens=1, pixel_values=torch.randn(4, 3, generator=g),
                              image_grid_thw=(1, 2, 2))


class _Visual(torch.nn.Module):
    """An encoder that records the thread it runs on, and may be held until released."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3, 5))
        self.gate = threading.Event()
        self.gate.set()
        self.threads = []

    def forward(self, pixels, grids):
        self.threads.append(threading.current_thread().name)
        assert self.gate.wait(30)
        return (pixels @ self.w).view(len(grids), 4, 5).sum(1)  # one row per image


def test_encode_ahead_runs_on_the_encoder_thread_and_the_forward_finds_it_cached():
    visual = _Visual()
    embedder = ImageEmbedder(visual, MultimodalEmbeddingCache(), lambda: torch.device("cpu"))
    try:
        a, b = _item(1), _item(2)
        visual.gate.clear()
        future = embedder.encode_ahead([a, b, a])
        queue = EncodeQueue(embedder)
        assert queue.pop_ready(scheduler_idle=True) == []
        assert not future.done()  # held: the encode is in progress
        visual.gate.set()
        future.result(timeout=30)
        assert visual.threads == ["vit-encoder_0"] and embedder.images_encoded_ahead == 2
        out = embedder.embeddings([b, a])  # the forward's lookup: cached, no second run
        assert visual.threads == ["vit-encoder_0"] and embedder.images_encoded == 2
        assert torch.equal(out[a.hash], visual(a.pixel_values, [a.image_grid_thw]))
        assert embedder.encode_ahead([a]) is None  # cached: nothing to do
    finally:
        embedder.shutdown()


class _Req:
    def __init__(self, rid, items):
        self.rid = rid
        self.multimodal_inputs = types.SimpleNamespace(items=items) if items else None


class _Embedder:
    """encode_ahead hands out futures the test completes by hand."""

    def __init__(self):
        self.futures = []

    def encode_ahead(self, items):
        if all(i == "cached" for i in items):
            return None
        self.futures.append(Future())
        return self.futures[-1]

    def shutdown(self):
        pass


def test_the_encode_queue_holds_requests_until_their_images_are_encoded():
    emb = _Embedder()
    queue = EncodeQueue(emb)
    text, cached, first, second, third = (_Req("t", None), _Req("c", ["cached"]), _Req("a", ["x"]), _Req("b", ["y"]),
                                          _Req("c2", ["z"]))
    assert queue.admit(text) and queue.admit(cached)  # nothing to wait for
    assert not queue.admit(first) and not queue.admit(second) and not queue.admit(third)
    assert list(queue) == [first, second, third] and queue.pop_ready(scheduler_idle=True) == []
    emb.futures[1].set_result(None)
    assert queue.pop_ready(scheduler_idle=False) == [second] and list(queue) == [first, third]
    assert queue.remove(lambda r: r.rid == "c2") == [third] and list(queue) == [first]
    emb.futures[0].set_exception(RuntimeError("encoder crashed"))
    with pytest.raises(RuntimeError, match="encoder crashed"):  # loud, on the scheduler's thread
        queue.pop_ready(scheduler_idle=False)
    off = EncodeQueue(None)  # --disable-mm-encode-ahead
    assert off.admit(first) and len(off) == 0


def test_wait_idle_waits_for_every_encode_a_removed_requests_too():
    """A release of the weights waits for it: the encoder thread reads them."""
    import threading

    emb = _Embedder()
    queue = EncodeQueue(emb)
    req = _Req("a", ["x"])
    assert not queue.admit(req)
    assert queue.remove(lambda r: True) == [req] and len(queue) == 0  # aborted: its encode still runs
    waited = threading.Event()
    waiter = threading.Thread(target=lambda: (queue.wait_idle(), waited.set()))
    waiter.start()
    assert not waited.wait(0.3)  # still encoding
    emb.futures[0].set_result(None)
    assert waited.wait(10)
    waiter.join()
