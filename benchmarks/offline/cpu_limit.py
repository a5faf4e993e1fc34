"""Batch-1 decode at the machine's limit (issue 49), side by side in one run: stagewise at 1 and 2
threads, eager (no graph) and compiled, llama.cpp on the same GGUF file where its venv exists, and
a STREAM-like read-bandwidth probe, so each figure is also a fraction of what the memory can give.

Every configuration runs in its own process, rounds alternate, each cell is the best of its rounds
(the machine is shared). Prints one markdown table; `--json` writes the raw figures too.

    python -m benchmarks.offline cpu-limit [--rounds 2] [--tokens 64] [--llamacpp-python PATH] [--glibc-too]

stagewise's children run on the allocator the command line would choose (tcmalloc where the machine
has it: runtime/allocator.py); `--glibc-too` adds eager cells on glibc's malloc.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import peer_python
from stagewise.runtime import allocator

MARK = "CPU-LIMIT "
DEFAULT_GGUF = Path("~/.cache/stagewise/models/SmolLM2-135M-Instruct.Q4_1.gguf").expanduser()
# the worker runs as a script (llama.cpp's under its own venv, stagewise's under --before's tree)
WORKER = Path(__file__).resolve().parents[1] / "workers" / "cpu_limit_worker.py"


def read_probe(threads: int) -> float:
    """GB/s of a sum over 1 GiB of float32 (a STREAM-like read: far larger than every cache)."""
    import torch
    torch.set_num_threads(threads)
    x = torch.ones(256 << 20)
    x.sum()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def spawn(spec: dict, python: str = sys.executable) -> dict:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    for var in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        env.pop(var, None)
    if spec.get("env"):
        env.update(spec["env"])
    if spec["engine"] == "stagewise":      # the allocator the command line would run on (runtime/allocator.py)
        env = allocator.preload_env(env) or env
    proc = subprocess.run([python, str(WORKER), json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    if proc.returncode or not lines:
        print(proc.stderr[-3000:], file=sys.stderr)
        return {"ms": float("nan"), "error": proc.stderr[-300:]}
    return json.loads(lines[-1][len(MARK):])


def cpu_line() -> str:
    flags = open("/proc/cpuinfo").read().split("flags", 1)[1].split("\n", 1)[0].split()
    model = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    wide = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma", "f16c", "avx_vnni"))
    return f"{model}, {os.cpu_count()} CPUs; {' '.join(wide)}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--model", default=str(DEFAULT_GGUF))
    ap.add_argument("--llamacpp-python", default=peer_python("llamacpp"))
    ap.add_argument("--only", default="")
    ap.add_argument("--env", default="", help="extra environment for the stagewise children, K=V,K=V")
    ap.add_argument("--before", default="", help="a `git archive REV src` tree: its stagewise runs beside "
                    "this one's, as 'before' cells in the same rounds")
    ap.add_argument("--glibc-too", action="store_true", help="eager cells on glibc's malloc as well "
                    "(STAGEWISE_MALLOC=system), where the command line would preload tcmalloc")
    ap.add_argument("--json")
    args = ap.parse_args()
    extra = dict(kv.split("=", 1) for kv in args.env.split(",") if kv)
    cells = {}
    for threads in (1, 2):
        for eager in (True, False):
            cells[f"stagewise {'eager' if eager else 'compiled'} {threads}t"] = dict(
                engine="stagewise", threads=threads, eager=eager, env=extra)
        if args.glibc_too:
            cells[f"stagewise eager glibc malloc {threads}t"] = dict(
                engine="stagewise", threads=threads, eager=True, env=dict(extra, STAGEWISE_MALLOC="system"))
        cells[f"llama.cpp {threads}t"] = dict(engine="llama.cpp", threads=threads)
        for eager in (True, False):
            if args.before:
                cells[f"before: stagewise {'eager' if eager else 'compiled'} {threads}t"] = dict(
                    engine="stagewise", threads=threads, eager=eager, env=dict(extra, PYTHONPATH=args.before))
    if args.only:
        cells = {k: v for k, v in cells.items() if any(s in k for s in args.only.split(","))}
    has_llamacpp = Path(args.llamacpp_python).exists()
    results: dict[str, list[dict]] = {k: [] for k in cells}
    bandwidth = {1: [], 2: []}
    for r in range(args.rounds):
        for t in (1, 2):
            bandwidth[t].append(read_probe(t))
        for name in (list(cells) if r % 2 == 0 else list(cells)[::-1]):
            spec = dict(cells[name], model=args.model, tokens=args.tokens)
            if spec["engine"] == "llama.cpp":
                if not has_llamacpp:
                    continue
                results[name].append(spawn(spec, args.llamacpp_python))
            else:
                results[name].append(spawn(spec))
            print(f"round {r} {name}: {results[name][-1]}", file=sys.stderr, flush=True)
    bw = {t: max(v) for t, v in bandwidth.items()}
    weights = Path(args.model).stat().st_size
    print(f"CPU: {cpu_line()}")
    print(f"load (1-min avg) at the end: {os.getloadavg()[0]:.2f}; read bandwidth 1t {bw[1]:.1f} GB/s, "
          f"2t {bw[2]:.1f} GB/s; file {weights / 1e6:.0f} MB")
    print("| configuration | ms/token (best) | vs own 1 thread | GB/s of file | % of read bw | CPU ms/token | "
          "peak RSS MB | load |")
    print("|---|---|---|---|---|---|---|---|")
    for name, rs in results.items():
        ok = [x for x in rs if x["ms"] == x["ms"]]
        if not ok:
            print(f"| {name} | n/a | | | | | | |")
            continue
        best = min(ok, key=lambda x: x["ms"])
        one = results.get(name[:-2] + "1t", [])
        one_ms = min((x["ms"] for x in one if x["ms"] == x["ms"]), default=float("nan"))
        t = 2 if name.endswith("2t") else 1
        gbs = weights / best["ms"] * 1e3 / 1e9
        print(f"| {name} | {best['ms']:.2f} | {best['ms'] / one_ms:.2f}x | {gbs:.1f} | {100 * gbs / bw[t]:.0f}% | "
              f"{best.get('cpu_ms', float('nan')):.1f} | {best.get('rss_mb', 0):.0f} | {best['load']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"cells": results, "bandwidth": bandwidth}, indent=1))
