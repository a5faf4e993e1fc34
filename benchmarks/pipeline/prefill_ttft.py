"""The prefill case of the elastic benchmark: time to the first token of one long prompt (default
4,096 tokens, one output token) on one node of one CPU against 2 (and 4, where the machine has the
CPUs) nodes of one CPU each, at 0 and 20 ms links (at 20 ms also with one more plan in flight),
and at 0 ms with the partition balanced for prefill (`--pp-cost-mix prefill`). The chunks of the
prompt flow through the stages concurrently (docs/pipelines.md, Prompts across the pipeline); with
C chunks over P equal stages the ideal ratio is (C + P - 1) / (C * P). Targets (issue 61): <= 0.55
of one node on 2 nodes, <= 0.3 on 4; with 512-token chunks (the engine's default budget) even the
ideal is 0.56 and 0.34, with --prefill-chunk 256 it is 0.53 and 0.30.

Each run is `stagewise bench --num-requests 1 --output-len 1` on every node (elastic.py runs it),
which prints the time to the first token.
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable

from benchmarks.harness.cluster import NodeSpec

TTFT_RE = re.compile(r"time to first token ([\d.]+) s mean")
TARGETS = {2: 0.55, 4: 0.3}


def cases(args) -> list[tuple[str, int, list[NodeSpec], list[str]]]:
    """(case, nodes, specs, extra flags); node n runs on CPU n. Cases needing more CPUs than the
    machine has are left out (printed)."""
    rate = args.prefill_rate_mbit
    out: list[tuple[str, int, list[NodeSpec], list[str]]] = [("1 node, 1 CPU, PP=1", 1, [NodeSpec(cpus="0")], [])]
    for n in args.prefill_nodes:
        if n > (os.cpu_count() or 1):
            print(f"  prefill on {n} nodes left out: it needs {n} CPUs, this machine has {os.cpu_count()}")
            continue
        for delay in args.prefill_delays_ms:
            link = f"{delay:g} ms" + (f" + {rate:g} Mbit/s" if rate and delay else "")
            specs = [NodeSpec(cpus=str(i), delay_ms=delay, rate_mbit=rate if delay else 0.0) for i in range(n)]
            out.append((f"{n} nodes x 1 CPU, PP={n}, {link}", n, specs, []))
            if delay:           # one more plan in flight covers the link's round trip
                out.append((f"{n} nodes x 1 CPU, PP={n}, {link}, --pp-depth {n + 1}", n, specs,
                            ["--pp-depth", str(n + 1)]))
        out.append((f"{n} nodes x 1 CPU, PP={n}, 0 ms, --pp-cost-mix prefill", n,
                    [NodeSpec(cpus=str(i)) for i in range(n)], ["--pp-cost-mix", "prefill"]))
    return out


def prefill(args, quiet, log_dir, bench_run: Callable[..., dict], loadavg: Callable[[], list[float]]) -> list[dict]:
    """Run every case once; each row has the TTFT and, against one node, its ratio and the target."""
    sizes = (1, args.prefill_prompt_len, 1)
    extra = ["--chunked-prefill-size", str(args.prefill_chunk)] + (["--model", args.prefill_model]
                                                                    if args.prefill_model else [])
    rows, base = [], None
    for i, (case, n, specs, flags) in enumerate(cases(args)):
        load = quiet.wait(f"prefill: {case}")
        res = bench_run(args, specs, n, [*extra, *flags], log_dir, f"prefill{i}", sizes=sizes)
        match = TTFT_RE.search(res["text"])
        if match is None:
            raise RuntimeError(f"prefill {case}: bench printed no time to first token: {res['text'][-500:]}")
        row = {"case": case, "nodes": n, "prompt_tokens": args.prefill_prompt_len, "chunk": args.prefill_chunk,
               "ttft_s": float(match.group(1)), **load, "load_after": loadavg()}
        if n == 1:
            base = row["ttft_s"]
        elif base:
            row["ratio"] = round(row["ttft_s"] / base, 3)
            row["target"] = TARGETS.get(n)
            row["ideal"] = round(ideal_ratio(args.prefill_prompt_len, args.prefill_chunk, n), 3)
        shown = f" ({row['ratio']:.2f} of one node; ideal {row['ideal']}, target {row['target']})" \
            if "ratio" in row else ""
        print(f"  {case}: TTFT {row['ttft_s']:.2f} s{shown}", flush=True)
        rows.append(row)
    return rows


def ideal_ratio(prompt: int, chunk: int, stages: int) -> float:
    """(C + P - 1) / (C * P): one prompt of C equal chunks over P equal stages, no link cost."""
    c = -(-prompt // chunk)
    return (c + stages - 1) / (c * stages)


def add_args(ap) -> None:
    ap.add_argument("--prefill-prompt-len", type=int, default=4096, help="prompt tokens of the prefill case")
    ap.add_argument("--prefill-chunk", type=int, default=512, help="--chunked-prefill-size of the prefill case")
    ap.add_argument("--prefill-nodes", default="2,4", help="node counts of the prefill case (one CPU each)")
    ap.add_argument("--prefill-delays-ms", default="0,20", help="one-way link delays of the prefill case")
    ap.add_argument("--prefill-rate-mbit", type=float, default=0.0, help="link rate with a delay (0: unlimited)")
    ap.add_argument("--prefill-model", default=None, help="model of the prefill case (default: --model)")


def parse(args) -> None:
    args.prefill_nodes = [int(x) for x in str(args.prefill_nodes).split(",") if x]
    args.prefill_delays_ms = [float(x) for x in str(args.prefill_delays_ms).split(",") if x]
