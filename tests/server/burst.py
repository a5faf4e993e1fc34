"""A burst of HTTP requests and a /health prober, each a process of its own (a client thread pool in
the test's process would hold its GIL and slow the prober): `python burst.py URL N CONCURRENCY
[KEY]` prints one JSON line {"status": {code: count}, "retry_after": [...], "messages": [...],
"wall_s": ...}; `python burst.py --probe URL` probes /health every 20 ms until stdin closes and
prints the latencies. Plain asyncio streams, one connection per request (`Connection: close`), so
the client costs little beside the server."""
from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.parse
from collections import Counter

PROMPT = " ".join(f"w{i}" for i in range(100))


async def _one(host: str, port: int, body: bytes, key: str | None) -> tuple[int, str | None, str]:
    reader, writer = await asyncio.open_connection(host, port)
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n{auth}Connection: close\r\n\r\n".encode() + body)
    await writer.drain()
    data = await reader.read()
    writer.close()
    head, _, payload = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    retry = next((v for k, v in headers.items() if k.lower() == "retry-after"), None)
    message = ""
    if not lines[0].split()[1].startswith("2"):
        try:
            message = json.loads(payload)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = payload[:200].decode("latin-1")
    return int(lines[0].split()[1]), retry, message


async def burst(url: str, n: int, concurrency: int, key: str | None = None, max_tokens: int = 16) -> dict:
    parts = urllib.parse.urlsplit(url)
    body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}).encode()
    gate = asyncio.Semaphore(concurrency)

    async def one():
        async with gate:
            try:
                return await _one(parts.hostname, parts.port, body, key)
            except OSError as exc:
                return 0, None, f"connection failed: {exc}"

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one() for _ in range(n)))
    return {"status": dict(Counter(str(s) for s, _, _ in results)),
            "retry_after": sorted({r for _, r, _ in results if r}),
            "messages": sorted({m for _, _, m in results if m})[:5],
            "wall_s": time.perf_counter() - t0}


def probe(url: str) -> None:
    import threading
    import urllib.request
    stop, out = threading.Event(), []
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    while not stop.is_set():
        t = time.perf_counter()
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            assert r.status == 200
        out.append(time.perf_counter() - t)
        time.sleep(0.02)
    print(" ".join(f"{x:.4f}" for x in out))


if __name__ == "__main__":
    if sys.argv[1] == "--probe":
        probe(sys.argv[2])
    else:
        key = sys.argv[4] if len(sys.argv) > 4 else None
        print(json.dumps(asyncio.run(burst(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), key))))
