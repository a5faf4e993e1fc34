"""Round 6's cases (issue 59) that need no server: images bounded by what the model's processor makes
of them, formats no VLM needs refused, decoder failures and fetch failures as one sentence without
reprs or what a remote answered, redirects only to allowed hosts, a whole-download deadline, and a
disk tier that ignores what it did not write in its directory. (test_round6_served.py: the same
through `stagewise serve`, and fair queues per tenant.)"""
from __future__ import annotations

import base64
import logging
import os
import re
import threading
import time

import pytest
from round6_helpers import Host, answer, crafted_files, png, redirect, small_png, trickle

from stagewise.kvcache.disk_tier import HEADER, DiskTier
from stagewise.multimodal.fetch import fetch
from stagewise.multimodal.images import ImageError, ImageLimits, load_image

WHERE = "messages[0].content[1]"
LEAKS = re.compile(r"0x[0-9a-f]{6,}|object at|<_io|/tmp/|/home/|/root/|Traceback")


@pytest.fixture(scope="module")
def processor():
    """The tiny LLaVA's image processor (tests/multimodal/mm_helpers.py): short side scaled to 56."""
    from transformers import CLIPImageProcessor
    return CLIPImageProcessor(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})


def refused(source, limits: ImageLimits, processor=None) -> str:
    with pytest.raises(ImageError) as err:
        load_image(source, limits, WHERE, processor)
    msg = str(err.value)
    assert err.value.where == WHERE and WHERE in msg and not LEAKS.search(msg), msg
    return msg


def test_a_thin_strip_is_refused_from_its_header_by_what_the_processor_makes_of_it(processor):
    """Issue 59 #1: a 1 x 100,000 PNG (274 bytes) is 100,000 pixels, but the processor would scale it to
    56 x 5,600,000; it took 22 s and 3 GB. Now: refused by its aspect ratio, before any decoding."""
    t0 = time.perf_counter()
    assert "aspect ratio" in refused(png(1, 100_000), ImageLimits(), processor)
    assert "aspect ratio" in refused(png(30_000, 1), ImageLimits(), processor)
    # within the ratio, the pixels after resizing: 20 x 380 (7,600 pixels) becomes 56 x 1,064 = 59,584
    msg = refused(png(20, 380), ImageLimits(max_image_pixels=50_000), processor)
    assert "resizes to 56x1064 = 59584 pixels" in msg, msg
    assert time.perf_counter() - t0 < 1.0
    assert load_image(png(20, 380), ImageLimits(max_image_pixels=60_000), processor=processor).size == (20, 380)


@pytest.mark.parametrize("fmt", sorted(crafted_files()))
def test_formats_no_vlm_needs_are_never_opened(fmt):
    """Issue 59 #2 and #8: crafted DDS, BLP, TIFF and SPIDER files made the decoder raise
    NotImplementedError (a 500) or name a heap address; now each is one sentence naming the part."""
    msg = refused(crafted_files()[fmt], ImageLimits())
    assert "could not be decoded as an image" in msg and "PNG, JPEG, GIF and WebP" in msg, msg


def test_broken_files_of_allowed_formats_are_one_clean_sentence():
    data = small_png()
    for broken in (data[:60], data[:8] + b"garbage", data[:-20] + b"\0" * 20, b"GIF89a" + b"\xff" * 30,
                   b"RIFF\x10\0\0\0WEBPVP8 " + b"\0" * 12, b"\xff\xd8\xff\xe0" + b"\0" * 40):
        refused(broken, ImageLimits())
    assert load_image(data, ImageLimits()).size == (40, 30)


@pytest.fixture
def hosts():
    made: list[Host] = []
    yield lambda routes: made.append(Host(routes)) or made[-1]
    for h in made:
        h.close()


def test_a_redirect_to_a_host_not_allowed_is_not_followed(hosts):
    """Issue 59 #3: with localhost allowed, a 302 to 127.0.0.1 was fetched and the error told what the
    internal address answered. Now every hop is checked, and no answer shows in the message."""
    secret = hosts({"/internal-secret": answer(b"top secret", 200, "text/plain"),
                    "/missing": answer(b"nope", 404, "text/plain")})
    front = hosts({"/redir": redirect(f"http://127.0.0.1:{secret.port}/internal-secret"),
                   "/to-image": redirect(f"http://localhost:{secret.port}/image")})
    limits = ImageLimits(allowed_hosts=("localhost",), fetch_timeout_s=5)
    msg = refused(f"http://localhost:{front.port}/redir", limits)
    assert "redirects to a host" in msg and "secret" not in msg, msg
    assert secret.hits == []
    # an allowed redirect is followed; the message says the same whatever the remote answered
    secret.routes["/image"] = answer(small_png())
    assert load_image(f"http://localhost:{front.port}/to-image", limits).size == (40, 30)
    a = refused(f"http://localhost:{secret.port}/internal-secret", limits)      # a 200 that is no image
    b = refused(f"http://localhost:{secret.port}/missing", limits)              # a 404
    c = refused(f"http://localhost:{secret.port}/none", limits)
    assert "could not be fetched" not in a and "could not be fetched" in b and b == c, (a, b, c)


def test_an_allowed_name_may_not_resolve_to_a_private_address(hosts):
    """Only a loopback name or an address literal the operator allowed reaches a private address."""
    if not _resolves("localhost.localdomain"):
        pytest.skip("this machine has no second loopback name")
    host = hosts({"/x": answer(small_png())})
    msg = refused(f"http://localhost.localdomain:{host.port}/x", ImageLimits(allowed_hosts=("localhost.localdomain",)))
    assert "private or loopback address" in msg and host.hits == [], msg


def _resolves(name: str) -> bool:
    import socket
    try:
        return bool(socket.getaddrinfo(name, 80))
    except OSError:
        return False


def test_a_slow_host_is_cut_at_the_whole_download_deadline(hosts):
    """Issue 59 #4: the timeout was per read, so a host sending a byte every 3 s held a fetch for ever."""
    slow = hosts({"/slow.png": trickle(small_png(), 0.2)})
    limits = ImageLimits(allowed_hosts=("127.0.0.1",), fetch_timeout_s=1.0)
    t0 = time.perf_counter()
    msg = refused(f"http://127.0.0.1:{slow.port}/slow.png", limits)
    assert "could not be fetched" in msg and "within 1 s" in msg, msg
    assert time.perf_counter() - t0 < 2.0


def test_the_byte_cap_holds_without_a_content_length(hosts):
    def endless(h) -> None:
        h.send_response(200)
        h.end_headers()
        try:
            for _ in range(1000):
                h.wfile.write(b"\0" * 65536)
        except OSError:
            pass
    host = hosts({"/big": endless})
    with pytest.raises(ImageError, match="over the limit of 100000 bytes"):
        fetch(f"http://127.0.0.1:{host.port}/big", ImageLimits(allowed_hosts=("127.0.0.1",), max_image_bytes=100_000))


KEY = {"model": "m", "layers": [0, 2]}
PAGE = 256


def _tier(root) -> DiskTier:
    return DiskTier(root, KEY, PAGE, 1 << 20)


def test_the_disk_tier_ignores_what_it_did_not_write(tmp_path, caplog):
    """Issue 59 #5: a stray file named 64 'z's + '.kvp' made the server exit at start; FIFOs in place
    of page files hung the engine. Now: ignored with one warning, and never opened."""
    tier = _tier(tmp_path)
    page = os.urandom(PAGE)
    digests = [bytes([i]) * 32 for i in range(4)]
    for d in digests:
        assert tier.save(d, bytearray(page))
    tier.flush()
    d = tier.dir
    (d / ("z" * 64 + ".kvp")).write_bytes(b"x")
    (d / ("A" * 64 + ".kvp")).write_bytes(b"x")
    os.mkfifo(d / (bytes([9]) * 32).hex().__add__(".kvp"))
    (d / (bytes([8]) * 32).hex().__add__(".kvp")).symlink_to("/dev/zero")
    os.mkfifo(d / "fifo.tmp")
    with caplog.at_level(logging.WARNING, "stagewise.kv_disk"):
        tier = _tier(tmp_path)
    assert tier.enabled and sorted(tier.index) == sorted(digests)
    warnings = [r for r in caplog.records if "did not write" in r.getMessage()]
    assert len(warnings) == 1 and "5 entries" in warnings[0].getMessage(), caplog.text
    # a FIFO, a symlink or a device put in place of an indexed page after the scan: refused at once
    buf = memoryview(bytearray(HEADER.size + PAGE))
    os.unlink(tier._path(digests[0]))
    os.mkfifo(tier._path(digests[0]))
    tier._path(digests[1]).unlink()
    tier._path(digests[1]).symlink_to("/dev/zero")
    done: list[bool] = []
    reader = threading.Thread(target=lambda: done.extend(tier.read_into(x, buf) for x in digests[:3]), daemon=True)
    reader.start()
    reader.join(5)
    assert done == [False, False, True], "a planted FIFO or symlink hung or passed the read"
    assert tier.stats.pages_corrupt == 2


def test_image_data_urls_of_hostile_bytes_are_refused_the_same_way():
    """The data-URL path (what a client sends) reaches the same checks."""
    url = "data:image/png;base64," + base64.b64encode(crafted_files()["DDS"]).decode()
    assert "could not be decoded" in refused(url, ImageLimits())


def test_the_scheduler_alternates_between_tenants_with_waiting_work():
    """#6: one tenant's burst (or its n choices) stood in front of every later tenant's request; now the
    first plan that admits two requests admits one of each tenant."""
    from stagewise.engine.scheduler import Scheduler
    from stagewise.kvcache.block_manager import BlockManager
    from stagewise.request import Request, SamplingParams

    def req(rid: str, tenant: int | None) -> Request:
        r = Request(rid, list(range(3, 11)), SamplingParams(max_tokens=4, temperature=0))
        r.tenant = tenant
        return r

    s = Scheduler(BlockManager(64, 4), max_num_seqs=2, token_budget=64)
    for i in range(16):
        s.add(req(f"a{i}", 1))
    s.add(req("b0", 2))
    s.add(req("b1", 2))
    s.add(req("c0", 3))
    assert [r.request_id for r in s.waiting][:7] == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]
    plan = s.schedule()
    assert plan is not None and {q.request_id for q in plan.seqs} == {"a0", "b0"}
    untenanted = Scheduler(BlockManager(64, 4), max_num_seqs=2, token_budget=64)
    for rid in ("x", "y", "z"):
        untenanted.add(req(rid, None))
    assert [r.request_id for r in untenanted.waiting] == ["x", "y", "z"]      # no tenants: first come first
