"""Batch-1 decode at the machine's limit (issue 49), side by side in one run: stagewise at 1 and 2
threads, eager (no graph) and compiled, llama.cpp on the same GGUF file where its venv exists, and
a STREAM-like read-bandwidth probe, so each figure is also a fraction of what the memory can give.

Every configuration runs in its own process, rounds alternate, each cell is the best of its rounds
(the machine is shared). Prints one markdown table; `--json` writes the raw figures too.

    python -m benchmarks.offline cpu-limit [--rounds 2] [--tokens 64] [--llamacpp-python PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MARK = "CPU-LIMIT "
DEFAULT_GGUF = Path("~/.cache/stagewise/models/SmolLM2-135M-Instruct.Q4_1.gguf").expanduser()
# NOTE: the default of benchmarks.common.peer_python("llamacpp"), spelled out: this module also runs
# as its own worker (`--worker`) under llama.cpp's interpreter, which has no torch for benchmarks.common
LLAMACPP_PY = os.environ.get("STAGEWISE_BENCH_LLAMACPP_PYTHON") or str(
    Path(os.environ.get("STAGEWISE_CACHE") or Path.home() / ".cache" / "stagewise") / "peers/llamacpp/bin/python")
PROMPT = [1, 504, 3458, 282, 4649, 314, 1978, 30, 216, 504, 3458, 282, 4649, 314]


def stagewise_worker(spec: dict) -> dict:
    import torch

    from stagewise import LLM, SamplingParams
    options = dict(device="cpu", kv_cache_memory="256MiB", max_model_len=1024, compile_in_background=False,
                   threads_per_stage=spec["threads"])
    if spec["eager"]:
        options["prefill_graph"] = "off"
    llm = LLM(model=spec["model"], **options)
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)   # noqa: E731

    cpu: dict[int, list[float]] = {}

    def timed(n: int) -> float:
        t, c = time.perf_counter(), time.process_time()
        llm.generate(prompt_token_ids=[PROMPT], sampling_params=greedy(n), use_tqdm=False)
        cpu.setdefault(n, []).append(time.process_time() - c)
        return time.perf_counter() - t
    timed(8)
    n = spec["tokens"]
    ones = [timed(1) for _ in range(3)]
    best = (min(timed(1 + n) for _ in range(3)) - min(ones)) / n
    # CPU time per token (all threads, spinning included): at one thread, the work itself, little
    # changed by a busy machine's load
    out = {"ms": 1e3 * best, "cpu_ms": 1e3 * (min(cpu[1 + n]) - min(cpu[1])) / n, "threads": torch.get_num_threads(), "load": os.getloadavg()[0],
           "rss_mb": peak_rss_mb()}
    try:
        from stagewise.kernels import team      # jobs whose worker was descheduled (each began a backoff)
        out["late_jobs"] = team.late_jobs()
    except ImportError:
        pass
    llm.shutdown()
    return out


def llamacpp_worker(spec: dict) -> dict:
    import llama_cpp
    default = llama_cpp.llama_cpp.llama_model_default_params

    def params():                      # ggml's AMX path segfaults on Q4_1 here (cpu-peers note)
        p = default()
        p.use_extra_bufts = False
        return p
    llama_cpp.llama_cpp.llama_model_default_params = params
    llm = llama_cpp.Llama(model_path=spec["model"], n_threads=spec["threads"], n_threads_batch=spec["threads"],
                          n_ctx=1024, verbose=False)

    def timed(n: int) -> float:
        llm.reset()
        t = time.perf_counter()
        for i, _ in enumerate(llm.generate(PROMPT, top_k=1, temp=0.0, repeat_penalty=1.0)):
            if i + 1 >= n:
                break
        return time.perf_counter() - t
    timed(8)
    n = spec["tokens"]
    ones = [timed(1) for _ in range(3)]
    best = (min(timed(1 + n) for _ in range(3)) - min(ones)) / n
    return {"ms": 1e3 * best, "threads": spec["threads"], "load": os.getloadavg()[0],
            "rss_mb": peak_rss_mb()}


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss it does not carry the parent's
    peak across exec)."""
    line = next(ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


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
    proc = subprocess.run([python, "-m", "benchmarks.offline", "cpu-limit", "--worker", json.dumps(spec)], env=env,
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
    ap.add_argument("--worker")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--model", default=str(DEFAULT_GGUF))
    ap.add_argument("--llamacpp-python", default=str(LLAMACPP_PY))
    ap.add_argument("--only", default="")
    ap.add_argument("--env", default="", help="extra environment for the stagewise children, K=V,K=V")
    ap.add_argument("--before", default="", help="a `git archive REV src` tree: its stagewise runs beside "
                    "this one's, as 'before' cells in the same rounds")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        fn = llamacpp_worker if spec["engine"] == "llama.cpp" else stagewise_worker
        print(MARK + json.dumps(fn(spec)), flush=True)
        return
    extra = dict(kv.split("=", 1) for kv in args.env.split(",") if kv)
    cells = {}
    for threads in (1, 2):
        for eager in (True, False):
            cells[f"stagewise {'eager' if eager else 'compiled'} {threads}t"] = dict(
                engine="stagewise", threads=threads, eager=eager, env=extra)
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



if __name__ == "__main__":      # the workers run this file directly (llama.cpp's in its own venv)
    main()
