"""Serving for benchmarks/peers/bench.py: `stagewise serve` and `vllm serve` (bf16, or fp32 under
`--dtypes float32`) one after the other on 127.0.0.1, each driven by `vllm bench serve` (random 128-token prompts, 64
output tokens, ignore_eos, 16 concurrent). Without vLLM, the serving benchmarks' load
generator (benchmarks/serving/load.py) drives the same workload against stagewise alone.
"""
from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.common import percentile
from benchmarks.peer_process import VLLM_CLI, ProcTree, stagewise_env, vllm_env
from benchmarks.server_process import free_port, wait_healthy

HOST = "127.0.0.1"             # loopback only
INPUT_LEN, OUTPUT_LEN, CONCURRENCY = 128, 64, 16
SERVED_NAME = "smollm2-135m-instruct"


def serving(args, paths: dict, num_prompts: int, tmp: Path, notes: list[str]) -> dict:
    hf_dir = paths["hf_dir"]
    have_vllm = bool(args.vllm_python) and Path(args.vllm_python).exists()
    if not have_vllm:
        notes.append("Serving: no vLLM venv, so no `vllm serve` and no `vllm bench serve`; stagewise was "
                     "driven by the serving benchmarks' load generator (benchmarks/serving/load.py).")
    servers = {"stagewise serve": [sys.executable, "-m", "stagewise", "serve", "--model", str(hf_dir),
                                   "--dtype", args.serve_dtype, "--threads-per-stage", str(args.threads),
                                   "--kv-cache-memory", "2GiB", "--max-model-len", "2048",
                                   "--served-model-name", SERVED_NAME, "--no-compile-in-background"],
               # the default model as users serve it: the Q4_1 file, no flags but the port
               "stagewise serve (Q4_1 file, defaults)": [sys.executable, "-m", "stagewise", "serve",
                                                         "--model", str(paths["q4_1"]),
                                                         "--served-model-name", SERVED_NAME]}
    if have_vllm:
        servers["vllm serve"] = [args.vllm_python, "-c", VLLM_CLI, "serve", str(hf_dir), "--dtype", args.serve_dtype,
                                 "--max-model-len", "2048", "--seed", "0", "--served-model-name", SERVED_NAME]
    out = {}
    for name, cmd in servers.items():
        port = free_port()
        preload = None if args.vllm_no_preload else args.vllm_python
        env = vllm_env(args.threads, preload) if name.startswith("vllm") else stagewise_env(args.stagewise_src)
        print(f"[serving] {name} ...", flush=True)
        tag = name.replace(" ", "_")
        server = ProcTree(cmd + ["--host", HOST, "--port", str(port)], env, tmp / f"{tag}.log", tmp)
        try:
            out[name] = _drive(args, server, f"http://{HOST}:{port}", hf_dir, num_prompts, tmp, tag, have_vllm)
        except RuntimeError as exc:
            out[name] = {"error": str(exc), "log_tail": server.tail()}
        finally:
            server.kill()
        print(f"    {out[name] if 'error' in out[name] else _short(out[name])}", flush=True)
    return out


def compiling(log: Path) -> bool:
    """Whether a stagewise server still compiles its graphs in the background (its info log says when
    that starts and when it is done; a server that compiles before it answers says neither)."""
    text = log.read_text(errors="replace")
    return "in the background" in text and "background compile done" not in text


def _short(res: dict) -> str:
    return (f"{res['output_throughput']:.0f} output tok/s, TTFT p50 {res['median_ttft_ms']:.0f} ms, "
            f"TPOT p50 {res['median_tpot_ms']:.1f} ms")


def _drive(args, server: ProcTree, url: str, hf_dir: Path, num_prompts: int, tmp: Path, tag: str,
           have_vllm: bool) -> dict:
    t0 = time.monotonic()
    _wait_healthy(server, url, timeout_s=args.engine_timeout)
    startup_s = time.monotonic() - t0
    for i in range(2):                                  # warm-up, not counted
        _post(url, {"model": SERVED_NAME, "prompt": list(range(100 + i, 140 + i)), "max_tokens": 8, "temperature": 0})
    deadline = time.monotonic() + args.engine_timeout    # a stagewise server compiling in the background: load
    while compiling(server.log_path) and time.monotonic() < deadline:   # it until done (vLLM compiles before
        own_load(url, SERVED_NAME, CONCURRENCY)                          # it answers /health)
    if have_vllm:
        res = _vllm_bench(args, server, url, str(hf_dir), num_prompts, tmp, tag)
    else:
        res = own_load(url, SERVED_NAME, num_prompts)
    server.sample()
    res.update(startup_s=startup_s, peak_rss_mib=server.peak_rss / 2**20)
    return res


def _wait_healthy(server: ProcTree, url: str, timeout_s: float) -> None:
    def exited() -> int | None:                     # polled: the server's peak RSS sampled meanwhile
        if not server.alive():
            return server.proc.returncode
        server.sample()
        return None
    wait_healthy(url, timeout_s, exited, interval_s=0.5)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def _vllm_bench(args, server: ProcTree, url: str, model: str, num_prompts: int, tmp: Path, tag: str) -> dict:
    result = tmp / f"{tag}-bench.json"
    cmd = [args.vllm_python, "-c", VLLM_CLI, "bench", "serve", "--backend", "openai", "--base-url", url,
           "--endpoint", "/v1/completions", "--model", model, "--served-model-name", SERVED_NAME, "--tokenizer", model,
           "--dataset-name", "random",
           "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
           "--num-prompts", str(num_prompts), "--max-concurrency", str(CONCURRENCY), "--ignore-eos",
           "--seed", "0", "--disable-tqdm", "--save-result", "--result-dir", str(tmp),
           "--result-filename", result.name]
    client = ProcTree(cmd, vllm_env(args.threads), tmp / f"{tag}-bench.log", tmp)
    t0 = time.monotonic()
    try:
        while client.alive() and time.monotonic() - t0 < args.engine_timeout:
            server.sample()
            time.sleep(0.5)
    finally:
        client.kill()
    if not result.exists():
        raise RuntimeError(f"vllm bench serve wrote no result:\n{client.tail()}")
    data = json.loads(result.read_text())
    keep = ("completed", "duration", "total_input_tokens", "total_output_tokens", "output_throughput",
            "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")
    return {k: data.get(k) for k in keep} | {"client": "vllm bench serve"}


def own_load(url: str, model: str, num_prompts: int, seed: int = 0) -> dict:
    """Closed loop of CONCURRENCY streaming clients over random token-id prompts (ignore_eos), by the
    serving benchmark's load generator (benchmarks/serving/load.py, over benchmarks/stream_load.py).
    `model` is not sent: only a stagewise server is driven this way (`vllm bench serve` drives vLLM)."""
    import asyncio
    import random

    from benchmarks.serving.load import run_load
    rng = random.Random(seed)
    requests = [([rng.randrange(17, 49152) for _ in range(INPUT_LEN)], OUTPUT_LEN) for _ in range(num_prompts)]
    stats, wall = asyncio.run(run_load(url, requests, CONCURRENCY, time_limit=3600))
    if len(stats) < num_prompts:
        raise RuntimeError(f"{num_prompts - len(stats)} of {num_prompts} streamed completions failed")
    return {"completed": len(stats), "duration": wall, "total_output_tokens": sum(s["tokens"] for s in stats),
            "output_throughput": sum(s["tokens"] for s in stats) / wall,
            "median_ttft_ms": percentile([s["ttft"] for s in stats], 50) * 1e3,
            "median_tpot_ms": percentile([s["tpot"] for s in stats], 50) * 1e3, "client": "benchmarks.serving.load"}
