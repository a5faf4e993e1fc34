"""Image decoding with Pillow, bounded: byte size, pixel count (checked from the header before any
pixel is decoded, so a decompression bomb costs nothing) and the sources a request may name (data
URLs, PIL images, raw bytes; http(s) URLs only for hosts an allow-list names). Every refusal is an
`ImageError`: one sentence naming the request part (`where`)."""
from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass

DEFAULT_MAX_IMAGE_BYTES = 10 * 2**20
DEFAULT_MAX_IMAGE_PIXELS = 16_000_000
DEFAULT_MAX_IMAGES = 8
FETCH_TIMEOUT_S = 10.0


class ImageError(ValueError):
    """A refused image; the message names the part (`where`), so the server returns it as a 400."""

    def __init__(self, message: str, where: str = "image"):
        super().__init__(message)
        self.where = where


@dataclass(frozen=True)
class ImageLimits:
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES       # encoded size of one image
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS     # width x height of one image, from its header
    max_images: int = DEFAULT_MAX_IMAGES                 # images in one request
    allowed_hosts: tuple[str, ...] = ()                  # hosts whose http(s) image URLs may be fetched


def load_image(source, limits: ImageLimits, where: str = "image"):
    """An RGB `PIL.Image` from a PIL image, bytes, a `data:image/...;base64,` URL or an allowed http(s) URL."""
    from PIL import Image
    if isinstance(source, Image.Image):
        _check_pixels(source.width, source.height, limits, where)
        return source.convert("RGB")
    if isinstance(source, (bytes, bytearray)):
        return decode(bytes(source), limits, where)
    if not isinstance(source, str):
        raise ImageError(f"{where} must be a data URL, an http(s) URL or an image, not {type(source).__name__}.", where)
    if source.startswith("data:"):
        return decode(_data_url_bytes(source, limits, where), limits, where)
    if source.startswith(("http://", "https://")):
        return decode(_fetch(source, limits, where), limits, where)
    raise ImageError(f"{where} must be a data URL (data:image/png;base64,...) or an http(s) URL; "
                     f"got {source[:40]!r}.", where)


def decode(data: bytes, limits: ImageLimits, where: str = "image"):
    """Bytes -> RGB image: size checked, header read, pixel count checked, then decoded."""
    from PIL import Image, UnidentifiedImageError
    if len(data) > limits.max_image_bytes:
        raise ImageError(f"{where} is {len(data)} bytes, over the limit of {limits.max_image_bytes} "
                         f"(--max-image-bytes).", where)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))          # reads the header only
            _check_pixels(img.width, img.height, limits, where)
            img.load()
            return img.convert("RGB")
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:   # Pillow's own guard, at open
        raise ImageError(f"{where} is a decompression bomb ({_why(exc)}); the limit is {limits.max_image_pixels} "
                         f"pixels (--max-image-pixels).", where) from None
    except UnidentifiedImageError as exc:
        raise ImageError(f"{where} could not be decoded as an image ({_why(exc)}); send a PNG, JPEG, GIF or "
                         f"WebP file.", where) from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ImageError(f"{where} is a corrupt or truncated image ({_why(exc)}).", where) from None


def _why(exc: Exception) -> str:
    return str(exc).split("\n")[0][:120] or type(exc).__name__


def _check_pixels(width: int, height: int, limits: ImageLimits, where: str) -> None:
    if width <= 0 or height <= 0:
        raise ImageError(f"{where} has no pixels ({width}x{height}).", where)
    if width * height > limits.max_image_pixels:
        raise ImageError(f"{where} is {width}x{height} = {width * height} pixels, over the limit of "
                         f"{limits.max_image_pixels} (--max-image-pixels).", where)


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


def _fetch(url: str, limits: ImageLimits, where: str) -> bytes:
    host = urllib.parse.urlsplit(url).hostname or ""
    if host not in limits.allowed_hosts:
        raise ImageError(f"{where} is a remote URL (host {host!r}); this server fetches no remote images unless "
                         f"--allowed-image-hosts names the host, so send the image as a data URL.", where)
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as resp:   # noqa: S310 (host allow-listed)
            data = resp.read(limits.max_image_bytes + 1)
    except OSError as exc:
        raise ImageError(f"{where} could not be fetched from {host}: {_why(exc)}.", where) from None
    return data


def limits_of(limits) -> ImageLimits:
    """The image limits of the engine's request limits (`EngineConfig.limits`: max_image_* and
    allowed_image_hosts)."""
    hosts = tuple(h.strip().lower() for h in (limits.allowed_image_hosts or "").split(",") if h.strip())
    for name in ("max_image_bytes", "max_image_pixels", "max_images_per_request"):
        if int(getattr(limits, name)) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(limits, name)}.")
    return ImageLimits(int(limits.max_image_bytes), int(limits.max_image_pixels), int(limits.max_images_per_request),
                       hosts)
