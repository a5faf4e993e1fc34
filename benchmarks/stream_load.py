"""Closed-loop streaming load that records every streamed token's arrival: N streams against a
`stagewise serve`, each sending /v1/completions (token-id prompt, `max_tokens`, greedy, ignore_eos,
stream) and the next one when it ends, until a stop file appears; then the open requests finish
(none is cut) and the log is written. `/health` and `/metrics` are polled once a second beside it.

    python -m benchmarks.stream_load --url http://HOST:PORT --streams 32 --max-tokens 64 \
        --stop-file PATH --out PATH.json

Prints `started <unix time>` once the server is healthy and the streams go. Every request in the
log has its start, each content chunk's arrival (unix seconds), finish_reason, completion_tokens
and the error if it failed; benchmarks/pipeline/elastic.py reads it (a request is lost unless it ends with
finish_reason length/stop and the tokens asked for).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from pathlib import Path

try:
    import httpx2 as httpx
except ImportError:
    import httpx

METRIC_RE = re.compile(r"^(stagewise_pipeline_(?:rebuilds_total|moves_total|nodes|recovering)(?:\{[^}]*\})?) (\S+)$",
                       re.M)


async def one_request(client, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    rec: dict = {"start": time.time(), "times": [], "finish": None, "tokens": None, "error": None,
                 "max_tokens": max_tokens}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec["error"] = str(chunk["error"])[:300]
                for choice in chunk.get("choices") or ():
                    if choice.get("text"):
                        rec["times"].append(time.time())
                    if choice.get("finish_reason"):
                        rec["finish"] = choice["finish_reason"]
                if chunk.get("usage"):
                    rec["tokens"] = chunk["usage"]["completion_tokens"]
    except Exception as exc:  # noqa: BLE001 - a failed request is recorded as lost, never retried
        rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
    rec["end"] = time.time()
    return rec


async def wait_healthy(client, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if (await client.get(url + "/health", timeout=2.0)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.5)
    raise SystemExit(f"the server at {url} was not healthy within {timeout_s:.0f} s")


async def poll(client, url: str, stop: asyncio.Event, log: list[dict]) -> None:
    """Once a second: /health's status and recovery section, and the pipeline's counters."""
    while not stop.is_set():
        entry: dict = {"t": time.time()}
        try:
            health = (await client.get(url + "/health", timeout=2.0)).json()
            rec = health.get("pipeline") or {}          # /health's section on where the pipeline runs
            entry.update(status=health.get("status"), layout=rec.get("layout"), standby=rec.get("standby"),
                         moves=rec.get("moves"), last_move=rec.get("last_move"), partition=rec.get("partition"))
            text = (await client.get(url + "/metrics", timeout=2.0)).text
            entry["metrics"] = {k: float(v) for k, v in METRIC_RE.findall(text)}
        except (httpx.HTTPError, ValueError) as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"[:200]
        log.append(entry)
        try:
            await asyncio.wait_for(stop.wait(), timeout=1.0)
        except asyncio.TimeoutError:
            pass


async def main_async(args) -> dict:
    rng = random.Random(args.seed)
    stop_file = Path(args.stop_file)
    limits = httpx.Limits(max_connections=args.streams + 4, max_keepalive_connections=args.streams + 4)
    requests: list[dict] = []
    polls: list[dict] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout_s), limits=limits) as client:
        await wait_healthy(client, args.url, args.health_timeout_s)
        stop_poll = asyncio.Event()
        poller = asyncio.ensure_future(poll(client, args.url, stop_poll, polls))
        started = time.time()
        print(f"started {started:.3f}", flush=True)

        async def stream_loop(i: int) -> None:
            while not stop_file.exists():
                prompt = [rng.randrange(args.min_id, args.vocab) for _ in range(args.prompt_len)]
                rec = await one_request(client, args.url, prompt, args.max_tokens)
                rec["stream"] = i
                requests.append(rec)

        await asyncio.gather(*(stream_loop(i) for i in range(args.streams)))
        stop_poll.set()
        await poller
    return {"started": started, "ended": time.time(), "streams": args.streams, "max_tokens": args.max_tokens,
            "prompt_len": args.prompt_len, "requests": requests, "polls": polls}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=49152, help="prompt ids are drawn below this")
    ap.add_argument("--min-id", type=int, default=100, help="prompt ids are drawn from this up (no special ids)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop-file", required=True, help="streams stop sending once this file exists")
    ap.add_argument("--out", required=True)
    ap.add_argument("--health-timeout-s", type=float, default=600.0)
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    args = ap.parse_args(argv)
    result = asyncio.run(main_async(args))
    Path(args.out).write_text(json.dumps(result))
    print(f"done: {len(result['requests'])} requests", flush=True)


if __name__ == "__main__":
    main()
