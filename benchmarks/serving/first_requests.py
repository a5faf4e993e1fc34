"""Serving from the first request: `stagewise serve` is started, and as soon as /health answers 200
N streaming clients send the first batch of requests (fixed token-id prompts, fixed output length,
ignore_eos), then the same number again (the steady state). Reports output tokens/s of each batch and
their ratio, TTFT and time per output token medians, the seconds to a healthy server and the peak RSS
of the server's processes, per configuration (extra server flags), configurations side by side,
alternating round by round (the machine is shared; the best round of each is reported).

    python -m benchmarks.serving first-requests [--model PATH] [--configs default,eager,compiled-first]
                                                [--requests 64] [--clients 16] [--rounds 1] [--quick]

Configurations: `default` (no extra flags), `eager` (--prefill-graph off), `compiled` (--prefill-graph
compiled, compiled in the background as by default), `compiled-first` (--prefill-graph compiled
--no-compile-in-background: compiled before /health turns 200), or `NAME=FLAGS` for any other.
The target (issue 49): the first batch gets >= 0.9x the steady state's tokens/s.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import tempfile
import time
from pathlib import Path

from benchmarks.common import load_line, markdown_table, met, percentile, write_result
from benchmarks.server_process import ServerProcess
from benchmarks.serving.load import run_load

PRESETS = {
    "default": "",
    "eager": "--prefill-graph off",
    "compiled": "--prefill-graph compiled",
    "compiled-first": "--prefill-graph compiled --no-compile-in-background",
}
TARGET = 0.9


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint dir or .gguf file (default: the default model)")
    p.add_argument("--configs", default="default,eager",
                   help=f"comma-separated: {', '.join(PRESETS)} or NAME=FLAGS (default: default,eager)")
    p.add_argument("--requests", type=int, default=64, help="requests in each batch (first, then steady)")
    p.add_argument("--clients", type=int, default=16, help="concurrent streaming clients")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="rounds; configurations alternate their order")
    p.add_argument("--server-args", default="", help="flags added to every configuration")
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds per batch, then stop")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="16 requests per batch, 8 clients, 32 output tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.clients, args.output_len = 16, 8, 32
    return args


def configurations(text: str) -> list[tuple[str, list[str]]]:
    out = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        name, _, flags = item.partition("=")
        if not flags and name not in PRESETS:
            raise SystemExit(f"unknown configuration {name!r}: one of {', '.join(PRESETS)} or NAME=FLAGS")
        out.append((name, shlex.split(flags or PRESETS[name])))
    return out


def prompts(args, vocab_size: int) -> list[tuple[list[int], int]]:
    """2 x --requests distinct prompts: the first batch's, then the steady batch's (no prefix-cache hits)."""
    rng = random.Random(args.seed)
    # NOTE: low ids are special tokens in the usual tokenizers; prompts keep to ordinary ones
    return [([rng.randrange(100, vocab_size) for _ in range(args.prompt_len)], args.output_len)
            for _ in range(2 * args.requests)]


def peak_rss_mb(server: ServerProcess) -> float:
    """The sum of VmHWM (peak resident) over the server and the processes below it."""
    total = 0
    for pid in [server.proc.pid, *server.descendants()]:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def phase(results: list[dict], wall: float) -> dict:
    tokens = sum(r["tokens"] for r in results)
    return {"n": len(results), "tok_s": tokens / wall if wall else 0.0, "wall": wall,
            "ttft": percentile([r["ttft"] * 1000 for r in results], 50) if results else float("nan"),
            "tpot": percentile([r["tpot"] * 1000 for r in results if r["tpot"] is not None], 50)
            if results else float("nan")}


def bench_one(args, model: str | None, flags: list[str], requests, log_path: Path) -> dict:
    extra = [*shlex.split(args.server_args), *flags]
    t0 = time.perf_counter()
    server = ServerProcess(model, log_path, *extra)
    try:
        server.wait_healthy(timeout_s=600)
        healthy_s = time.perf_counter() - t0
        n = args.requests
        first = phase(*asyncio.run(run_load(server.url, requests[:n], args.clients, args.time_limit)))
        steady = phase(*asyncio.run(run_load(server.url, requests[n:], args.clients, args.time_limit)))
        return {"healthy_s": healthy_s, "first": first, "steady": steady, "rss": peak_rss_mb(server),
                "load": load_line()}
    finally:
        server.stop(grace_s=30)


def main(argv=None) -> None:
    args = parse_args(argv)
    from stagewise.checkpoint.facts import read_facts
    from stagewise.model.source import resolve_model
    model = resolve_model(args.model)
    requests = prompts(args, int(read_facts(model).hf.vocab_size))
    configs = configurations(args.configs)
    runs: dict[str, list[dict]] = {name: [] for name, _ in configs}
    with tempfile.TemporaryDirectory(prefix="stagewise-first-") as tmp:
        for r in range(args.rounds):
            for name, flags in (configs if r % 2 == 0 else configs[::-1]):
                res = bench_one(args, model, flags, requests, Path(tmp) / f"{name}-{r}.log")
                runs[name].append(res)
                print(f"round {r} {name}: healthy after {res['healthy_s']:.1f} s, first {res['first']['tok_s']:.1f} "
                      f"tok/s, steady {res['steady']['tok_s']:.1f} tok/s ({res['load']})", flush=True)
    print(report(args, model, configs, runs))


def report(args, model: str, configs, runs) -> str:
    headers = ["configuration", "healthy after s", "first tok/s", "steady tok/s", "first / steady",
               "first TTFT p50 ms", "steady TTFT p50 ms", "first TPOT p50 ms", "steady TPOT p50 ms",
               "peak RSS MB", "load"]
    rows, verdicts = [], []
    for name, flags in configs:
        # NOTE: the round whose first batch got the largest share of its steady state: the least disturbed
        best = max(runs[name], key=lambda o: o["first"]["tok_s"] / max(o["steady"]["tok_s"], 1e-9))
        f, s = best["first"], best["steady"]
        ratio = f["tok_s"] / s["tok_s"] if s["tok_s"] else 0.0
        rows.append([f"{name} `{' '.join(flags) or '(defaults)'}`", round(best["healthy_s"], 1), round(f["tok_s"], 1),
                     round(s["tok_s"], 1), f"{ratio:.2f}x", round(f["ttft"]), round(s["ttft"]), round(f["tpot"], 1),
                     round(s["tpot"], 1), round(best["rss"]), best["load"].removeprefix("load average ")])
        verdicts.append(f"- {name}: first {args.requests} requests at {ratio:.2f}x the steady state "
                        f"(target >= {TARGET}x): {met(ratio, TARGET)}")
    text = "\n".join([
        f"# Serving from the first request{' (quick)' if args.quick else ''}", "",
        f"model `{model}`; {args.clients} streaming clients, {args.requests} requests sent as soon as /health is 200 "
        f"(first), then {args.requests} more (steady); {args.prompt_len}-token prompts, {args.output_len} output "
        f"tokens (ignore_eos); common server args `{args.server_args or '(none)'}`; best of {args.rounds} "
        f"alternating round(s); load = 1-minute load average after the run (2 CPUs).", "",
        markdown_table(headers, rows), "", *verdicts])
    path = write_result("first_requests", text, args.quick)
    return text + f"\n\n(written to {path})"
