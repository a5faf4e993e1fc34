"""Compiled CPU steps against eager, the small-row linear kernel against MKL, and the in-place
decode kernel against the KV gather, on the default model, in one process with the configurations
interleaved round by round (so the load of a shared machine falls on all of them alike), then
start-up times in fresh processes.

One engine is built with `--prefill-graph compiled`; "eager" rounds swap the driver's graph policy
to `off` (every stage then runs the eager body), "one graph" rounds send decode steps to the prefill
graph instead of the few-rows (serial loops) one, "MKL GEMMs" rounds set the small-row kernel's row
limit to 0 (every linear layer is `F.linear`), "KV gather" rounds make the attention op take the
SDPA path. The same greedy token-id workload runs in every configuration. `--busy` repeats the
rounds with another process keeping core 0 busy.

    python -m benchmarks.parts compiled-steps [--rounds 3] [--busy] [--model PATH]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.common import RESULTS_DIR, cpu_line, markdown_table, random_workload, write_result
from benchmarks.kernels.threads import busy_core

VOCAB = 49152
CONFIGS = ("compiled", "compiled one graph", "compiled, MKL GEMMs", "eager", "eager, MKL GEMMs",
           "eager, MKL GEMMs, KV gather")
BASE = CONFIGS[-1]      # the code before these levers
METRICS = (("ttft200_ms", "TTFT 200 ms"), ("ttft512_ms", "TTFT 512 ms"), ("decode1_ms", "decode b1 ms/token"),
           ("decode32_ms", "decode b32 ms/step"), ("offline_tok_s", "offline tok/s"))


class Bench:
    def __init__(self, model: str | None, threads: int | None = None):
        from stagewise import LLM
        from stagewise.graph.policy import resolve_graph_policy
        # NOTE: no prefix caching: every configuration runs the same prompts and must prefill them all
        self.llm = LLM(model=model, prefill_graph="compiled", kv_cache_memory="1GiB", max_model_len=2048,
                       compile_in_background=False,
                       enable_prefix_caching=False, threads_per_stage=threads)
        policy = self.llm.engine.policy
        # "one graph": decode steps replay the prefill graph (parallel loops) instead of the few-rows one
        self.policies = {"compiled": policy, "eager": resolve_graph_policy("off"),
                         "compiled one graph": dataclasses.replace(policy, decode_backend="off", decode_buckets=())}
        self.fresh = iter(random_workload(2000, (32, 32), (1, 1), VOCAB, seed=7)[0])

    def set(self, config: str) -> None:
        from stagewise.kernels import attention as cpu_attention
        from stagewise.kernels import gemm as cpu_gemm
        self.llm.engine.policy = self.policies[config.split(",")[0]]
        cpu_gemm.MAX_ROWS = 0 if "MKL GEMMs" in config else _MAX_ROWS
        cpu_gemm.configure()        # the C++ stagewise::linear reads the row limit when told
        cpu_attention.supports = (lambda q, cache: False) if "KV gather" in config else _SUPPORTS

    def gen(self, prompts, n):
        from stagewise import SamplingParams
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        self.llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return time.perf_counter() - t0

    def measure(self, seed: int) -> dict:
        out = {}
        for n in (200, 512):
            prompts = random_workload(3, (n, n), (1, 1), VOCAB, seed=seed * 1000 + n)[0]
            out[f"ttft{n}_ms"] = 1e3 * min(self.gen([p], 1) for p in prompts)
        for batch, steps, key in ((1, 32, "decode1_ms"), (32, 16, "decode32_ms")):
            one = self.gen([next(self.fresh) for _ in range(batch)], 1)
            many = self.gen([next(self.fresh) for _ in range(batch)], 1 + steps)
            out[key] = 1e3 * (many - one) / steps
        prompts = random_workload(16, (64, 192), (64, 64), VOCAB, seed=seed)[0]
        out["offline_tok_s"] = 16 * 64 / self.gen(prompts, 64)
        return out


_SUPPORTS = None
_MAX_ROWS = 0


def rounds(bench: Bench, n: int, label: str) -> dict[str, list[dict]]:
    res: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    for r in range(n):
        for config in (CONFIGS if r % 2 == 0 else CONFIGS[::-1]):
            bench.set(config)
            res[config].append(bench.measure(seed=r))
            print(f"{label} round {r + 1} {config}: {json.dumps({k: round(v, 1) for k, v in res[config][-1].items()})}",
                  flush=True)
    return res


def startup(model: str | None, mode: str, cache: str) -> float:
    code = ("import time, sys; t = time.perf_counter()\nfrom stagewise import LLM\n"
            f"LLM(model={model!r}, prefill_graph={mode!r}, kv_cache_memory='1GiB', max_model_len=2048)\n"
            "print(time.perf_counter() - t)")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return float(out.stdout.strip().splitlines()[-1])


def table(res: dict[str, list[dict]]) -> str:
    rows = []
    for config, runs in res.items():
        row = [config]
        for key, _ in METRICS:
            pick = max if key.endswith("tok_s") else min
            base = [r[key] for r in res[BASE]]
            ratio = statistics.median((b / r[key]) if pick is min else (r[key] / b) for r, b in zip(runs, base))
            row.append(f"{pick(r[key] for r in runs):.1f} ({ratio:.2f}x)")
        rows.append(row)
    return markdown_table(["configuration"] + [h for _, h in METRICS], rows)


def main(argv=None) -> int:
    global _SUPPORTS, _MAX_ROWS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--busy", action="store_true", help="also with another process keeping core 0 busy")
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--no-startup", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="threads of the engine (default: its own choice)")
    args = ap.parse_args(argv)
    from stagewise.kernels import attention as cpu_attention
    from stagewise.kernels import gemm as cpu_gemm
    _SUPPORTS, _MAX_ROWS = cpu_attention.supports, cpu_gemm.MAX_ROWS
    started, load0 = time.time(), os.getloadavg()[0]
    bench = Bench(args.model, args.threads)
    results = {"quiet": rounds(bench, args.rounds, "quiet")}
    if args.busy:
        with busy_core():
            results["one core busy"] = rounds(bench, args.rounds, "busy")
    bench.llm.shutdown()
    starts = {}
    if not args.no_startup:
        with tempfile.TemporaryDirectory() as cold:
            starts = {"eager": startup(args.model, "off", cold),
                      "compiled, cold cache": startup(args.model, "compiled", cold),
                      "compiled, warm cache": startup(args.model, "compiled", cold)}
    lines = ["# Compiled CPU steps and in-place decode attention (`compiled_steps.py`)", "",
             f"Default model unless `--model`; dtype {bench.llm.engine.config.dtype}; {os.cpu_count()} shared CPUs, "
             f"{args.threads or 'default'} engine threads "
             f"({cpu_line()}); torch {torch.__version__}; {args.rounds} interleaved rounds in one process, best per "
             f"figure, ratio = median same-round speed-up against '{BASE}' (the code before these levers). "
             f"Load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; took "
             f"{(time.time() - started) / 60:.0f} min. TTFT: best of 3 fresh prompts; decode: (1+n tokens - 1) / n; "
             "offline: 16 requests, prompts 64-192 tokens, 64 output tokens.", ""]
    for label, res in results.items():
        lines += [f"## {label}", "", table(res), ""]
    if "one core busy" in results:
        q, b = results["quiet"]["compiled"], results["one core busy"]["compiled"]
        lines += [f"Compiled offline throughput with one core busy / quiet: "
                  f"{max(r['offline_tok_s'] for r in b) / max(r['offline_tok_s'] for r in q):.2f}x", ""]
    if starts:
        lines += ["## Start-up (`LLM(...)` construction, fresh process)", "",
                  markdown_table(["configuration", "seconds"], [[k, f"{v:.1f}"] for k, v in starts.items()]), ""]
    text = "\n".join(lines)
    print(text)
    print(f"written to {write_result('compiled_steps', text)}")
    (RESULTS_DIR / "compiled_steps.json").write_text(json.dumps({"results": results, "startup": starts}, indent=1))
    return 0
