"""Image intake under limits: data URLs, PIL images, corrupt and truncated files, decompression bombs
(refused from the header, before any pixel is decoded), remote URLs (refused unless allow-listed), too
many images. Every refusal is one sentence naming the request part."""
from __future__ import annotations

import io
import time

import pytest
from mm_helpers import data_url, make_image, png_bomb, raw_data_url

from stagewise.multimodal.images import ImageError, ImageLimits, load_image
from stagewise.multimodal.messages import split_images

LIMITS = ImageLimits(max_image_bytes=200_000, max_image_pixels=100_000, max_images=2)


def _refused(source, says: str, limits: ImageLimits = LIMITS) -> str:
    with pytest.raises(ImageError) as err:
        load_image(source, limits, "messages[0].content[1]")
    assert says in str(err.value) and "messages[0].content[1]" in str(err.value), str(err.value)
    assert err.value.where == "messages[0].content[1]"
    return str(err.value)


def test_data_url_png_and_jpeg_decode_to_rgb():
    img = make_image(3)
    for fmt in ("PNG", "JPEG", "WEBP"):
        got = load_image(data_url(img, fmt), LIMITS)
        assert got.mode == "RGB" and got.size == img.size
    assert load_image(img.convert("L"), LIMITS).mode == "RGB"


def test_decompression_bomb_is_refused_from_its_header():
    t0 = time.perf_counter()
    _refused(raw_data_url(png_bomb(2_000, 1_000)), "2000x1000 = 2000000 pixels, over the limit of 100000")
    # past Pillow's own guard (MAX_IMAGE_PIXELS, which refuses at open): the same one sentence
    _refused(raw_data_url(png_bomb(60_000, 60_000)), "decompression bomb")
    _refused(raw_data_url(png_bomb(60_000, 60_000)), "decompression bomb", ImageLimits(max_image_pixels=10**12))
    assert time.perf_counter() - t0 < 1.0              # nothing was decoded


def test_corrupt_truncated_and_non_images_are_refused():
    png = io.BytesIO()
    make_image(1).save(png, format="PNG")
    _refused(raw_data_url(b"not an image at all"), "could not be decoded as an image")
    _refused(raw_data_url(png.getvalue()[:200]), "corrupt or truncated")
    _refused("data:text/plain;base64,aGVsbG8=", "base64 image data URL")
    _refused("data:image/png;base64,@@@@", "invalid base64")
    _refused("file:///etc/passwd", "must be a data URL")
    _refused(12, "not int")


def test_byte_limit_is_checked_before_base64_decoding():
    _refused("data:image/png;base64," + "A" * 400_000, "over the limit of 200000")


def test_remote_url_refused_unless_its_host_is_allowed():
    msg = _refused("http://example.com/cat.png", "--allowed-image-hosts")
    assert "example.com" in msg
    allowed = ImageLimits(allowed_hosts=("127.0.0.1",))
    _refused("http://127.0.0.1:9/none.png", "could not be fetched", allowed)     # allowed, but nothing there


def test_parts_are_split_in_order_and_bad_parts_named():
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u1"}},
                                         {"type": "text", "text": "and"}, {"type": "image", "image": "u2"}]}]
    flat, images = split_images(msgs, "<image>")
    assert flat[1]["content"] == "<image>and<image>" and flat[0] == msgs[0]
    assert images == [("u1", "messages[1].content[0]"), ("u2", "messages[1].content[2]")]
    with pytest.raises(ImageError, match=r"messages\[0\]\.content\[0\] has type 'audio'"):
        split_images([{"role": "user", "content": [{"type": "audio"}]}], "<image>")
