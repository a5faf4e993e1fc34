"""Image decoding with Pillow, bounded: byte size, the formats a VLM takes (PNG, JPEG, WebP, GIF;
no other Pillow plugin ever sees the bytes), and the pixels both of the file and of what the
model's processor will resize it to, with its aspect ratio, all checked from the header before any
pixel is decoded (so a bomb or a 1 x 100,000 strip costs nothing). Sources: data URLs, PIL images,
raw bytes; http(s) URLs only for hosts an allow-list names (fetch.py). Every refusal is an
`ImageError`: one sentence naming the request part (`where`), never the decoder's own words."""
from __future__ import annotations

import base64
import binascii
import io
import warnings
from typing import Any

from .fetch import fetch
from .limits import ImageError, ImageLimits

__all__ = ["ImageError", "ImageLimits", "check_size", "decode", "limits_of", "load_image", "processed_size"]

# the formats a vision-language model needs; Pillow's other plugins (BLP, DDS, SPIDER, TIFF, ...)
# are parsers of formats no client sends a VLM, and several fail with errors of their own
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
_SIZE_KEYS = ("height", "width", "shortest_edge", "longest_edge")


def load_image(source, limits: ImageLimits, where: str = "image", processor: Any = None):
    """An RGB `PIL.Image` from a PIL image, bytes, a `data:image/...;base64,` URL or an allowed http(s)
    URL. `processor`: the model's image processor, whose resize target is bounded too."""
    from PIL import Image
    if isinstance(source, Image.Image):
        check_size(source.width, source.height, limits, where, processor)
        return source.convert("RGB")
    if isinstance(source, (bytes, bytearray)):
        return decode(bytes(source), limits, where, processor)
    if not isinstance(source, str):
        raise ImageError(f"{where} must be a data URL, an http(s) URL or an image, not {type(source).__name__}.", where)
    if source.startswith("data:"):
        return decode(_data_url_bytes(source, limits, where), limits, where, processor)
    if source.startswith(("http://", "https://")):
        return decode(fetch(source, limits, where), limits, where, processor)
    raise ImageError(f"{where} must be a data URL (data:image/png;base64,...) or an http(s) URL.", where)


def decode(data: bytes, limits: ImageLimits, where: str = "image", processor: Any = None):
    """Bytes -> RGB image: size checked, header read (allowed formats only), sizes checked, then decoded.
    Any failure of the decoder is an ImageError: a crafted file is the client's fault, never a 500."""
    from PIL import Image, UnidentifiedImageError
    if len(data) > limits.max_image_bytes:
        raise ImageError(f"{where} is {len(data)} bytes, over the limit of {limits.max_image_bytes} "
                         f"(--max-image-bytes).", where)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=FORMATS)          # reads the header only
            check_size(img.width, img.height, limits, where, processor)
            img.load()
            return img.convert("RGB")
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):   # Pillow's own guard, at open
        raise ImageError(f"{where} is a decompression bomb; the limit is {limits.max_image_pixels} pixels "
                         f"(--max-image-pixels).", where) from None
    except UnidentifiedImageError:
        raise ImageError(f"{where} could not be decoded as an image (this server takes PNG, JPEG, GIF and WebP); "
                         f"send one of those.", where) from None
    except MemoryError:
        raise ImageError(f"{where} needs more memory to decode than this server gives an image; send a "
                         f"smaller one.", where) from None
    except Exception:          # noqa: BLE001  (every decoder failure: the file is malformed)
        # NOTE: the decoder's own message may hold object reprs and addresses; it names nothing useful
        raise ImageError(f"{where} is a corrupt or truncated image; send a valid PNG, JPEG, GIF or WebP "
                         f"file.", where) from None


def processed_size(processor: Any, width: int, height: int) -> tuple[int, int]:
    """The size the model's image processor resizes a width x height image to, before any crop
    (transformers' `size`: shortest_edge, longest_edge or height and width); the input size when
    the processor does not resize or names no size it understands."""
    size = getattr(processor, "size", None) if getattr(processor, "do_resize", True) else None
    get = dict(size) if isinstance(size, dict) else {k: getattr(size, k, None) for k in _SIZE_KEYS}
    to_h, to_w, shortest, longest = (int(get.get(k) or 0) for k in _SIZE_KEYS)
    if to_h and to_w:
        return to_w, to_h
    if shortest:
        scale = shortest / min(width, height)
    elif longest:
        scale = longest / max(width, height)
    else:
        return width, height
    return max(1, round(width * scale)), max(1, round(height * scale))


def check_size(width: int, height: int, limits: ImageLimits, where: str, processor: Any = None) -> None:
    """The file's pixels, its aspect ratio and the pixels the processor would resize it to, each
    under its limit (all from the header: nothing decoded yet)."""
    if width <= 0 or height <= 0:
        raise ImageError(f"{where} has no pixels ({width}x{height}).", where)
    if width * height > limits.max_image_pixels:
        raise ImageError(f"{where} is {width}x{height} = {width * height} pixels, over the limit of "
                         f"{limits.max_image_pixels} (--max-image-pixels).", where)
    ratio = max(width, height) / min(width, height)
    if ratio > limits.max_aspect_ratio:
        raise ImageError(f"{where} is {width}x{height}, an aspect ratio of {ratio:.0f}:1, over the limit of "
                         f"{limits.max_aspect_ratio:g}:1 (--max-image-aspect-ratio); crop or pad it.", where)
    w2, h2 = processed_size(processor, width, height)
    if w2 * h2 > limits.max_image_pixels:
        raise ImageError(f"{where} is {width}x{height}, which this model's processor resizes to {w2}x{h2} = "
                         f"{w2 * h2} pixels, over the limit of {limits.max_image_pixels} (--max-image-pixels).",
                         where)


def _data_url_bytes(url: str, limits: ImageLimits, where: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:image/") or not head.endswith(";base64"):
        raise ImageError(f"{where} must be a base64 image data URL (data:image/<type>;base64,<data>).", where)
    if len(payload) * 3 // 4 > limits.max_image_bytes + 3:       # refuse before decoding the base64
        raise ImageError(f"{where} is about {len(payload) * 3 // 4} bytes, over the limit of "
                         f"{limits.max_image_bytes} (--max-image-bytes).", where)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{where} holds invalid base64 data.", where) from None


def limits_of(limits) -> ImageLimits:
    """The image limits of the engine's request limits (`EngineConfig.limits`: max_image_* and
    allowed_image_hosts)."""
    hosts = tuple(h.strip().lower() for h in (limits.allowed_image_hosts or "").split(",") if h.strip())
    for name in ("max_image_bytes", "max_image_pixels", "max_images_per_request"):
        if int(getattr(limits, name)) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(limits, name)}.")
    for name in ("max_image_aspect_ratio", "image_fetch_timeout_s"):
        if not float(getattr(limits, name)) > 0:
            raise ValueError(f"{name} must be positive, got {getattr(limits, name)}.")
    return ImageLimits(int(limits.max_image_bytes), int(limits.max_image_pixels), int(limits.max_images_per_request),
                       hosts, float(limits.max_image_aspect_ratio), float(limits.image_fetch_timeout_s))
