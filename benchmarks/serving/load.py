"""Online serving benchmark: N concurrent streaming clients against `stagewise serve` on
127.0.0.1, for each pipeline size. Reports output throughput, TTFT p50/p99 and time per output
token p50/p99, prints a markdown table and appends it to --out.

Closed loop: each client sends its next request when the previous one ends. Seeded token-id
prompts, fixed output lengths (ignore_eos), /v1/completions with stream + include_usage.

    python -m benchmarks.serving load [--model DIR] [--pp-sizes 1,2] [--num-clients 16] [--num-requests 64]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks import stream_load
from benchmarks.common import RESULTS_DIR, markdown_table, percentile
from benchmarks.server_process import ServerProcess

httpx = stream_load.httpx

HOST = "127.0.0.1"             # loopback only, by design
MAX_CLIENTS, MAX_REQUESTS = 128, 2000
DEFAULT_OUT = RESULTS_DIR / "serving.md"
BUSY = "stagewise_stage_busy_seconds_total"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF checkpoint dir or GGUF file (default: the built-in demo model)")
    p.add_argument("--pp-sizes", default="1,2", help="comma-separated pipeline sizes to compare")
    p.add_argument("--num-clients", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", default="32,128", help="min,max prompt tokens (seeded uniform)")
    p.add_argument("--output-len", default="32,64", help="min,max output tokens (seeded uniform)")
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds per configuration, then stop")
    p.add_argument("--server-args", default="", help="extra flags for the server, e.g. '--max-num-seqs 32'")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 1 <= args.num_clients <= MAX_CLIENTS or not 1 <= args.num_requests <= MAX_REQUESTS:
        p.error(f"--num-clients must be in [1, {MAX_CLIENTS}] and --num-requests in [1, {MAX_REQUESTS}].")
    return args


def _range(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def workload(args, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    (p_lo, p_hi), (o_lo, o_hi) = _range(args.prompt_len), _range(args.output_len)
    # NOTE: ids below 6 are the demo tokenizer's special tokens; keep prompts to ordinary ones.
    return [([rng.randrange(6, vocab_size) for _ in range(rng.randint(p_lo, p_hi))], rng.randint(o_lo, o_hi))
            for _ in range(args.num_requests)]


def start_server(model_dir: str, pp_size: int, extra: list[str], log_path: Path) -> ServerProcess:
    # NOTE: compiled before serving: this measures the served steady state
    return ServerProcess(model_dir, log_path, "--pp-size", str(pp_size), "--no-compile-in-background", *extra)


async def one_request(client, url: str, prompt: list[int], max_tokens: int) -> dict | None:
    """One streamed request (stream_load.py's), as TTFT, time per output token, e2e and tokens."""
    rec = await stream_load.one_request(client, url, prompt, max_tokens)
    if rec["error"] or not rec["times"]:
        print(f"request failed: {rec['error'] or 'no tokens streamed'}", file=sys.stderr)
        return None
    first, last, tokens = rec["times"][0], rec["times"][-1], rec["tokens"] or len(rec["times"])
    return {"ttft": first - rec["start"], "tpot": (last - first) / (tokens - 1) if tokens > 1 else None,
            "e2e": last - rec["start"], "tokens": tokens}


async def run_load(url: str, requests: list[tuple[list[int], int]], num_clients: int, time_limit: float):
    queue = list(reversed(requests))
    results: list[dict] = []
    deadline = time.perf_counter() + time_limit

    async def client_loop(client):
        while queue and time.perf_counter() < deadline:
            prompt, n = queue.pop()
            res = await one_request(client, url, prompt, n)
            if res:
                results.append(res)

    limits = httpx.Limits(max_connections=num_clients, max_keepalive_connections=num_clients)
    async with httpx.AsyncClient(timeout=time_limit, limits=limits) as client:
        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(client_loop(client)) for _ in range(num_clients)]
        done, pending = await asyncio.wait(tasks, timeout=time_limit)
        for t in pending:
            t.cancel()          # over the time limit: the server aborts what these leave behind
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - t0
    return results, wall


def summarize(pp: int, results: list[dict], wall: float, busy: list[float]) -> list:
    ttft = [r["ttft"] * 1000 for r in results]
    tpot = [r["tpot"] * 1000 for r in results if r["tpot"] is not None]
    tokens = sum(r["tokens"] for r in results)
    return [pp, len(results), round(wall, 1), round(tokens / wall, 1), round(percentile(ttft, 50), 1),
            round(percentile(ttft, 99), 1), round(percentile(tpot, 50), 2), round(percentile(tpot, 99), 2),
            " / ".join(f"{b:.2f}" for b in busy) or "-"]


def bench_one(args, model_dir: str, pp: int, requests, tmp: Path) -> list:
    server = start_server(model_dir, pp, args.server_args.split(), tmp / f"server-pp{pp}.log")
    try:
        server.wait_healthy()
        asyncio.run(run_load(server.url, requests[:2], 2, 60))          # warm-up, not counted
        before = server.metric(BUSY)
        results, wall = asyncio.run(run_load(server.url, requests, args.num_clients, args.time_limit))
        busy = [(b - a) / wall for a, b in zip(before, server.metric(BUSY))]   # over the load window only
        return summarize(pp, results, wall, busy)
    finally:
        server.stop(grace_s=30)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.model is None:
        from stagewise.model.demo import ensure_demo_model
        model_dir = str(ensure_demo_model())
    else:
        model_dir = args.model
    if Path(model_dir).is_file():          # a GGUF file: its embedding's rows
        from stagewise.checkpoint.gguf_meta import gguf_facts
        vocab = gguf_facts(model_dir).shapes["token_embd.weight"][0]
    else:
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    requests = workload(args, vocab)
    headers = ["PP", "requests", "wall s", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
               "TPOT p99 ms", "stage busy (per stage)"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="stagewise-serving-") as tmp:
        for pp in (int(x) for x in args.pp_sizes.split(",")):
            rows.append(bench_one(args, model_dir, pp, requests, Path(tmp)))
            print(markdown_table(headers, [list(map(str, rows[-1]))]).splitlines()[-1], flush=True)
    table = markdown_table(headers, [list(map(str, row)) for row in rows])       # rounded already
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = (f"## Serving benchmark, {stamp}\n\nmodel `{model_dir}`; {args.num_clients} concurrent streaming clients, "
            f"{args.num_requests} requests, prompt {args.prompt_len} tokens, output {args.output_len} tokens "
            f"(ignore_eos), /v1/completions over loopback; server args `{args.server_args or '(defaults)'}`; "
            f"{platform.python_version()}, {os.cpu_count()} CPUs.\n\n{table}\n")
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        f.write(text + "\n")
    print(f"appended to {args.out}")
