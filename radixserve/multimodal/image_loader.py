"""An image part of a request -> a decoded RGB image, within the server's limits.

Accepted sources: a data URL (data:image/...;base64,...), a local file (a path or file:// URL)
under --allowed-local-media-path only, an http(s) URL only with --enable-media-url-fetch, and in
the offline Engine also raw bytes or a PIL image. Every refusal names the part (its label)."""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass
from typing import Any, Optional

from radixserve.multimodal.mm_inputs import MultimodalInputError

DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096  # ~16.8 MP: larger photos are resized down anyway
URL_FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class MediaLimits:
    allowed_local_media_path: Optional[str] = None  # None: no local file may be read
    enable_url_fetch: bool = False  # http(s) URLs: refused unless set
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # encoded size
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # width * height, checked before decoding

    @classmethod
    def from_server_args(cls, args: Any) -> "MediaLimits":
        return cls(args.allowed_local_media_path, args.enable_media_url_fetch, args.max_image_bytes, args.max_image_pixels)


def load_image(source: Any, label: str, limits: MediaLimits):
    """The image `source` names, as a PIL RGB image. Raises MultimodalInputError('label: why')."""
    from PIL import Image  # Pillow: transformers' image processors decode and resize with it

    if isinstance(source, Image.Image):
        return _checked(source, label, limits).convert("RGB")
    if isinstance(source, dict):  # OpenAI's {"url": ...}
        source = source.get("url")
    if isinstance(source, (bytes, bytearray)):
        data = bytes(source)
    elif isinstance(source, str):
        data = _read_source(source, label, limits)
    else:
        raise MultimodalInputError(f"{label}: an image must be a data URL, a file path or a URL, got {type(source).__name__}")
    if len(data) > limits.max_image_bytes:
        raise MultimodalInputError(f"{label}: the image is {len(data)} bytes, more than the limit of {limits.max_image_bytes}")
    try:
        with warnings.catch_warnings():  # Pillow warns of big images; the limit below is ours
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))  # reads the header only: the size is known before decoding
    except Image.DecompressionBombError:
        raise MultimodalInputError(f"{label}: the image has more than the limit of "
                                   f"{limits.max_image_pixels / 1e6:.1f} MP") from None
    except Exception:
        raise MultimodalInputError(f"{label}: not an image (cannot decode it)") from None
    image = _checked(image, label, limits)
    try:
        return image.convert("RGB")
    except Exception as e:  # a truncated or corrupt file whose header was fine
        raise MultimodalInputError(f"{label}: cannot decode the image: {e}") from None


def _checked(image, label: str, limits: MediaLimits):
    w, h = image.size
    if w * h > limits.max_image_pixels:
        raise MultimodalInputError(f"{label}: the image is {w}x{h} = {w * h / 1e6:.1f} MP, more than the limit of "
                                   f"{limits.max_image_pixels / 1e6:.1f} MP")
    if w == 0 or h == 0:
        raise MultimodalInputError(f"{label}: the image is empty ({w}x{h})")
    return image


def _read_source(url: str, label: str, limits: MediaLimits) -> bytes:
    scheme = urllib.parse.urlsplit(url).scheme.lower() if "://" in url or url.startswith("data:") else ""
    if scheme == "data":
        return _decode_data_url(url, label, limits)
    if scheme in ("http", "https"):
        if not limits.enable_url_fetch:
            raise MultimodalInputError(f"{label}: fetching images from the network is off (start the server with "
                                       f"--enable-media-url-fetch); send a data URL instead")
        return _fetch(url, label, limits)
    if scheme == "file":
        return _read_local(urllib.parse.unquote(urllib.parse.urlsplit(url).path), label, limits)
    if scheme:
        raise MultimodalInputError(f"{label}: unsupported image URL scheme {scheme!r} (data:, file:, http(s):)")
    return _read_local(url, label, limits)


def _decode_data_url(url: str, label: str, limits: MediaLimits) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise MultimodalInputError(f"{label}: a data URL must be data:<type>;base64,<data>")
    if len(payload) * 3 // 4 > limits.max_image_bytes + 3:  # before decoding it
        raise MultimodalInputError(f"{label}: the image is more than the limit of {limits.max_image_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MultimodalInputError(f"{label}: the data URL's base64 is invalid") from None


def _read_local(path: str, label: str, limits: MediaLimits) -> bytes:
    if limits.allowed_local_media_path is None:
        raise MultimodalInputError(f"{label}: local image files are off (start the server with "
                                   f"--allowed-local-media-path DIR); send a data URL instead")
    root = os.path.realpath(limits.allowed_local_media_path)
    real = os.path.realpath(path)  # symlinks and .. resolved before the check
    if os.path.commonpath([root, real]) != root:
        raise MultimodalInputError(f"{label}: {path!r} is outside the allowed directory (--allowed-local-media-path)")
    try:
        size = os.path.getsize(real)
        if size > limits.max_image_bytes:
            raise MultimodalInputError(f"{label}: the image is {size} bytes, more than the limit of {limits.max_image_bytes}")
        with open(real, "rb") as f:
            return f.read()
    except OSError as e:
        raise MultimodalInputError(f"{label}: cannot read {path!r}: {e.strerror or e}") from None


def _fetch(url: str, label: str, limits: MediaLimits) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=URL_FETCH_TIMEOUT_S) as resp:
            data = resp.read(limits.max_image_bytes + 1)
    except Exception as e:
        raise MultimodalInputError(f"{label}: cannot fetch the image: {e}") from None
    if len(data) > limits.max_image_bytes:
        raise MultimodalInputError(f"{label}: the image is more than the limit of {limits.max_image_bytes} bytes")
    return data
