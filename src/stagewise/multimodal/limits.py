"""What bounds one request's images (`ImageLimits`, from the request-limit flags) and how a refused
image is told (`ImageError`: one sentence naming the request part)."""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_IMAGE_BYTES = 10 * 2**20
DEFAULT_MAX_IMAGE_PIXELS = 16_000_000
DEFAULT_MAX_IMAGES = 8
DEFAULT_MAX_ASPECT_RATIO = 20.0
DEFAULT_FETCH_TIMEOUT_S = 10.0


class ImageError(ValueError):
    """A refused image; the message names the part (`where`), so the server returns it as a 400."""

    def __init__(self, message: str, where: str = "image"):
        super().__init__(message)
        self.where = where


@dataclass(frozen=True)
class ImageLimits:
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES       # encoded size of one image
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS     # of one image, as sent and as resized (from its header)
    max_images: int = DEFAULT_MAX_IMAGES                 # images in one request
    allowed_hosts: tuple[str, ...] = ()                  # hosts whose http(s) image URLs may be fetched
    max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO   # long side / short side
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S     # a whole download, redirects included
