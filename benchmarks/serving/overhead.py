"""How much of the offline engine's throughput `stagewise serve` delivers, on one workload in one
run: random token-id prompts (128 tokens), 64 output tokens each (ignore_eos, greedy), 16
concurrent streaming clients on /v1/completions, bf16, the default model. The offline engine runs
the same prompts in a fresh process each time (no prefix-cache hits): one `generate` call with all
of them, and a closed loop keeping 16 in flight (what the server's engine sees). The server runs
its engine in its own process (the only layout since the in-thread one was removed; the results
file keeps the earlier thread-layout rows); `--heavy-mb` adds a client posting large bodies, to
load the front end.

Reports output tok/s, server / offline, median and p99 TTFT and TPOT (as `vllm bench serve`
defines them), per engine step the wall ms and the worker's busy ms (prepare, forward, sample),
so time a step spends outside the model shows, and /health latency. The machine is shared: every
row carries the 1-minute load average at its start.

    python -m benchmarks.serving overhead [--model PATH] [--rounds 2] [--heavy-mb 4]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks import stream_load
from benchmarks.common import RESULTS_DIR, percentile
from benchmarks.server_process import ServerProcess

RESULTS = RESULTS_DIR / "serving_overhead.md"
WARMUP = [[100 + i] * 40 for i in range(2)]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint dir or GGUF file (default: the default model)")
    p.add_argument("--layouts", default="process", help=argparse.SUPPRESS)   # one layout left: the process
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--heavy-mb", type=float, default=0.0,
                   help="meanwhile one more client posts request bodies of this many MB in a loop (parsed and "
                        "validated, then refused: too many prompts): the front end under pressure")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the engine (--threads-per-stage)")
    p.add_argument("--rounds", type=int, default=1, help="repeat the comparison (layout order alternates)")
    p.add_argument("--no-offline", action="store_true", help="server runs only")
    p.add_argument("--stagewise-src", default=None, help="import stagewise from this src/ (e.g. a clean export)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.output_len < 2 or args.concurrency < 1 or args.num_prompts < 1:
        p.error("--output-len must be at least 2, --concurrency and --num-prompts at least 1.")
    return args


def engine_flags(args) -> list[str]:
    return ["--dtype", args.dtype, "--kv-cache-memory", "2GiB", "--max-model-len", "2048",
            "--threads-per-stage", str(args.threads)]


def child_env(args, layout: str | None = None) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    if args.stagewise_src:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(args.stagewise_src).resolve()),
                                                         env.get("PYTHONPATH")) if p)
    return env


def model_and_vocab(args) -> tuple[str, int]:
    code = ("import json, sys; from stagewise.model.source import resolve_model; "
            "from stagewise.checkpoint.facts import read_facts; "
            "m = str(resolve_model(sys.argv[1] or None)); "
            "print(json.dumps([m, read_facts(m).vocab]))")
    out = subprocess.run([sys.executable, "-c", code, args.model or ""], capture_output=True, text=True,
                         env=child_env(args), check=True).stdout
    model, vocab = json.loads(out.strip().splitlines()[-1])
    return model, vocab


def prompts_for(args, vocab_size: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    # NOTE: the lowest ids are special tokens in the default model's vocabulary; keep to ordinary ones.
    return [[rng.randrange(100, vocab_size) for _ in range(args.input_len)] for _ in range(args.num_prompts)]


# ---- the load: stream_load.py's requests; vllm bench serve's metrics (TTFT: first token, TPOT: (e2e - TTFT) / (n - 1))

async def load(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
               heavy_body: bytes | None = None) -> tuple[list[dict], float, dict]:
    """A closed loop of `concurrency` streaming clients over `prompts`, /health polled every 50 ms and,
    with `heavy_body`, one client posting it in a loop. Returns (per-request results, wall s, extras)."""
    httpx = stream_load.httpx
    todo, results, health, heavy = list(reversed(prompts)), [], [], [0]

    async def client(http):
        while todo:
            rec = await stream_load.one_request(http, url, todo.pop(), max_tokens)
            if rec["error"] or not rec["times"]:
                raise RuntimeError(f"a streamed completion failed: {rec['error'] or 'no token streamed'}")
            ttft = rec["times"][0] - rec["start"]
            results.append({"ttft": ttft, "tpot": (rec["end"] - rec["start"] - ttft) / (max_tokens - 1)})

    async def poll_health(http):
        while todo or len(results) < len(prompts):
            t0 = time.perf_counter()
            await http.get(url + "/health")
            health.append((time.perf_counter() - t0) * 1e3)
            await asyncio.sleep(0.05)

    async def post_heavy(http):
        while todo or len(results) < len(prompts):
            await http.post(url + "/v1/completions", content=heavy_body, headers={"content-type": "application/json"})
            heavy[0] += 1

    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as http:
        t0 = time.perf_counter()
        side = [poll_health(http)] + ([post_heavy(http)] if heavy_body else [])
        await asyncio.gather(*(client(http) for _ in range(concurrency)), *side)
        wall = time.perf_counter() - t0
    return results, wall, {"health_p50": percentile(health, 50), "health_p99": percentile(health, 99),
                           "heavy_posts": heavy[0]}


def heavy_body(megabytes: float) -> bytes | None:
    """A /v1/completions body of about `megabytes` MB: lists of token ids, more prompts than one
    request may hold, so the server parses and validates all of it, then answers 400."""
    if megabytes <= 0:
        return None
    rows = max(65, int(megabytes * 1e6 / 3000))            # "7, " is 3 bytes; 1000 ids a row
    return json.dumps({"prompt": [[7] * 1000] * rows, "max_tokens": 4}).encode()


def engine_counters(server: ServerProcess) -> tuple[float, float]:
    """(engine steps, worker busy seconds summed over stages) from /metrics."""
    return sum(server.metric("stagewise_engine_steps_total")), sum(server.metric("stagewise_stage_busy_seconds_total"))


def serve_run(args, model: str, layout: str, prompts, tmp: Path) -> dict:
    server = ServerProcess(model, tmp / f"server-{layout}.log", *engine_flags(args), "--max-request-bytes",
                           f"{max(2.0, 2 * args.heavy_mb):.0f}MiB", env=child_env(args, layout))
    try:
        server.wait_healthy(900)
        asyncio.run(load(server.url, WARMUP, 8, 2))                 # warm-up, not counted
        load_avg, (steps0, busy0) = os.getloadavg()[0], engine_counters(server)
        results, wall, extras = asyncio.run(load(server.url, prompts, args.output_len, args.concurrency,
                                                 heavy_body(args.heavy_mb)))
        steps1, busy1 = engine_counters(server)
        name = f"serve, engine in a {layout}" + (f" + {args.heavy_mb:g} MB bodies" if args.heavy_mb else "")
        row = summary(name, results, wall, args, load_avg, steps1 - steps0, busy1 - busy0)
        return dict(row, **extras)
    finally:
        server.stop(grace_s=60)


def summary(name: str, results: list[dict], wall: float, args, load_avg: float, steps: float, busy_s: float) -> dict:
    row = {"name": name, "wall_s": wall, "tok_s": len(results) * args.output_len / wall, "load": load_avg,
           "step_ms": wall / steps * 1e3 if steps else None, "busy_ms": busy_s / steps * 1e3 if steps else None}
    if results:
        ttft = [r["ttft"] * 1e3 for r in results]
        tpot = [r["tpot"] * 1e3 for r in results]
        row.update(ttft_p50=percentile(ttft, 50), ttft_p99=percentile(ttft, 99), tpot_p50=percentile(tpot, 50),
                   tpot_p99=percentile(tpot, 99))
    return row


# ---- the offline engine, in a process of its own (as the server's engine runs)

OFFLINE_CHILD = r"""
import json, sys, time
from stagewise import LLM, SamplingParams
spec = json.loads(sys.stdin.read())
llm = LLM(model=spec["model"], dtype=spec["dtype"], kv_cache_memory="2GiB", max_model_len=2048,
          threads_per_stage=spec["threads"], compile_in_background=False)
params = SamplingParams(max_tokens=spec["output_len"], temperature=0, ignore_eos=True)
llm.generate(prompt_token_ids=spec["warmup"], sampling_params=SamplingParams(max_tokens=8), use_tqdm=False)
prompts, eng, ttft, tpot = spec["prompts"], llm.engine, [], []
s0, t0 = llm.stats(), time.perf_counter()
if spec["concurrency"] is None:         # one generate call with every prompt
    res = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    tokens = sum(len(r.outputs[0].token_ids) for r in res)
else:                                   # a closed loop of `concurrency` in flight, as the server's clients keep it
    todo, arrival, first, tokens = list(reversed(prompts)), {}, {}, 0
    while todo or arrival:
        while todo and len(arrival) < spec["concurrency"]:
            req = eng.add_request(params=params, prompt_token_ids=todo.pop())
            arrival[req.request_id] = time.perf_counter()
        for o in eng.step():
            now, rid = time.perf_counter(), o.request_id
            if rid not in first:
                first[rid] = now
                ttft.append(now - arrival[rid])
            if o.finished:
                n = len(o.outputs[0].token_ids)
                tokens += n
                tpot.append((now - first.pop(rid)) / (n - 1))
                del arrival[rid]
wall, s1 = time.perf_counter() - t0, llm.stats()
llm.shutdown()
print("RESULT " + json.dumps({"wall": wall, "tokens": tokens, "ttft": ttft, "tpot": tpot,
                              "steps": s1["num_steps"] - s0["num_steps"],
                              "busy": sum(s1["stage_busy_s"]) - sum(s0["stage_busy_s"])}))
"""


def offline_run(args, model: str, prompts, concurrency: int | None) -> dict:
    """The offline engine in a fresh process (so no prompt is in its prefix cache yet): one generate
    call (`concurrency` None), or a closed loop keeping `concurrency` requests in flight."""
    spec = {"model": model, "dtype": args.dtype, "threads": args.threads, "output_len": args.output_len,
            "prompts": prompts, "concurrency": concurrency, "warmup": WARMUP}
    load_avg = os.getloadavg()[0]
    proc = subprocess.run([sys.executable, "-c", OFFLINE_CHILD], input=json.dumps(spec), capture_output=True,
                          text=True, env=child_env(args), timeout=3600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"the offline run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    r = json.loads(line[len("RESULT "):])
    name = "offline, one generate call" if concurrency is None else f"offline, {concurrency} in flight"
    row = summary(name, [{"ttft": a, "tpot": b} for a, b in zip(r["ttft"], r["tpot"])], r["wall"], args, load_avg,
                  r["steps"], r["busy"])
    row["tok_s"] = r["tokens"] / r["wall"]
    return row


def table(rows: list[dict], concurrency: int) -> str:
    head = ["run", "round", "load at start", "wall s", "output tok/s", "/ offline one call",
            f"/ offline {concurrency} in flight",
            "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "step ms", "worker busy ms / step",
            "/health p50 / p99 ms", "large bodies refused"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["name"], r["round"], f"{r['load']:.1f}", f"{r['wall_s']:.1f}", f"{r['tok_s']:.0f}",
                 _ratio(r, "offline_one"), _ratio(r, "offline_loop")]
        cells += [f"{r[k]:.0f}" if r.get(k) is not None else "-"
                  for k in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")]
        cells += [f"{r[k]:.1f}" if r.get(k) is not None else "-" for k in ("step_ms", "busy_ms")]
        cells += [f"{r['health_p50']:.1f} / {r['health_p99']:.1f}" if "health_p50" in r else "-",
                  r.get("heavy_posts") or "-"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def _ratio(row: dict, key: str) -> str:
    return f"{row['tok_s'] / row[key]:.0%}" if row.get(key) else "-"


def main(argv=None) -> None:
    args = parse_args(argv)
    model, vocab = model_and_vocab(args)
    prompts = prompts_for(args, vocab)
    layouts = args.layouts.split(",")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="stagewise-overhead-") as tmp:
        for rnd in range(1, args.rounds + 1):
            ref = {}
            if not args.no_offline:
                one = offline_run(args, model, prompts, None)
                loop = offline_run(args, model, prompts, args.concurrency)
                ref = {"offline_one": one["tok_s"], "offline_loop": loop["tok_s"]}
                rows += [dict(one, round=rnd), dict(loop, round=rnd)]
                print("\n".join(table(rows[-2:], args.concurrency).splitlines()[2:]), flush=True)
            for layout in layouts if rnd % 2 else layouts[::-1]:
                rows.append(dict(serve_run(args, model, layout, prompts, Path(tmp)), round=rnd, **ref))
                print(table(rows[-1:], args.concurrency).splitlines()[-1], flush=True)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    src = f"; stagewise imported from `{args.stagewise_src}`" if args.stagewise_src else ""
    text = (f"## Server vs offline engine, {stamp}\n\nmodel `{Path(model).name}`, {args.dtype}, {args.threads} torch "
            f"threads{src}; {args.num_prompts} prompts x {args.input_len} random token ids, {args.output_len} output "
            f"tokens (ignore_eos, greedy); server: {args.concurrency} concurrent streaming clients on /v1/completions "
            f"over loopback (the client shares the machine); Python {platform.python_version()}, "
            f"{os.cpu_count()} CPUs; "
            f"1-minute load average {os.getloadavg()[0]:.1f} at the end.\n\n{table(rows, args.concurrency)}\n")
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        f.write(text + "\n")
