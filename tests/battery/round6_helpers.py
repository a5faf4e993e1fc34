"""Round 6's hostile inputs (issue 59) by their bytes, and the local HTTP hosts the fetch cases need:
one that redirects, one that trickles, one that holds a secret. Every host binds 127.0.0.1 on a
free port and runs in a daemon thread until `close()`."""
from __future__ import annotations

import io
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def png(width: int, height: int) -> bytes:
    """A real all-black grayscale PNG of width x height (a 1 x 100,000 one is under 500 bytes)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = (b"\0" + b"\0" * width) * height
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b""))


def small_png() -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


def crafted_files() -> dict[str, bytes]:
    """Files of formats no VLM needs, each of which made a Pillow decoder raise something other
    than an image error (a 500 before)."""
    dds = b"DDS " + struct.pack("<I", 124) + struct.pack("<I", 0x1007) + struct.pack("<II", 16384, 16384) + b"\0" * 120
    blp = b"BLP2" + struct.pack("<I", 0) + bytes([1, 8, 0, 0]) + struct.pack("<II", 16, 16) + b"\0" * 2000
    tiff = b"II*\x00" + struct.pack("<I", 8) + struct.pack("<H", 1) + struct.pack("<HHII", 256, 4, 1, 0) + b"\0" * 8
    spider = struct.pack(">27f", *([1.0] * 4 + [-1.0] + [0.0] * 22)) + b"\0" * 64
    return {"DDS": dds, "BLP": blp, "TIFF": tiff, "SPIDER": spider}


class Host:
    """A local HTTP host: `routes` path -> handler(request handler); `hits` lists the paths asked for."""

    def __init__(self, routes: dict):
        self.routes, self.hits = routes, []
        host = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):              # noqa: N802  (http.server's name)
                host.hits.append(self.path)
                route = host.routes.get(self.path)
                if route is None:
                    self.send_error(404)
                    return
                route(self)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def answer(body: bytes, status: int = 200, content_type: str = "image/png"):
    def route(h: BaseHTTPRequestHandler) -> None:
        h.send_response(status)
        h.send_header("Content-Type", content_type)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)
    return route


def redirect(location: str):
    def route(h: BaseHTTPRequestHandler) -> None:
        h.send_response(302)
        h.send_header("Location", location)
        h.send_header("Content-Length", "0")
        h.end_headers()
    return route


def trickle(body: bytes, every_s: float):
    """Sends `body` one byte every `every_s` seconds (a read timeout never fires)."""
    def route(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "image/png")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        try:
            for b in body:
                h.wfile.write(bytes([b]))
                h.wfile.flush()
                time.sleep(every_s)
        except OSError:
            pass
    return route
