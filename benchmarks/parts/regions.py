"""OpenMP parallel regions per batch-1 decode step on the default model, counted, not timed: gdb
attaches to an engine process, counts calls of `GOMP_parallel` by the library that made them (the
linear and attention kernels, Inductor's generated loops, ATen), and the per-step count is the
difference between a 1-token and a (1 + N)-token generation, divided by N. Each region wakes the
stage's other threads once (more with barriers inside), so the count is what a wait policy pays
for. Needs gdb; timing-free, so a busy machine gives the same answer.

    python -m benchmarks.parts regions [--tokens 16] [--graph auto|off] [--decode-graph off]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MARK = "REGIONS-READY"
GDB_SCRIPT = r'''
import collections, json, os, gdb
counts, phases = collections.Counter(), []
class Region(gdb.Breakpoint):
    def stop(self):
        frame = gdb.newest_frame().older()
        path = gdb.solib_name(frame.pc()) or "main"
        if "inductor" in path:           # generated code: one library per kernel
            counts["Inductor's generated loops"] += 1
        else:
            counts[os.path.basename(path).split(".so")[0] + ": " + (frame.name() or "?")[:60]] += 1
        return False
class Mark(gdb.Breakpoint):
    def stop(self):
        phases.append(dict(counts)); counts.clear()
        return False
gdb.execute("set pagination off")
Region("GOMP_parallel")
Mark("getppid")
gdb.execute("continue")
print("PHASES " + json.dumps(phases))
'''


def child(args) -> None:
    """The engine process: load, warm up, say ready, then generate between getppid() marks."""
    import random

    from stagewise import LLM, SamplingParams
    options = {"prefill_graph": args.graph, "compile_in_background": False}
    if args.decode_graph:
        options["decode_graph"] = args.decode_graph
    llm = LLM(kv_cache_memory="512MiB", max_model_len=2048, enable_prefix_caching=False, **options)
    rng = random.Random(0)

    def gen(n: int) -> None:
        prompt = [rng.randrange(1000, 40000) for _ in range(32)]
        llm.generate(prompt_token_ids=[prompt], use_tqdm=False,
                     sampling_params=SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    gen(4)
    print(MARK, flush=True)
    sys.stdin.readline()                 # gdb is attached
    os.getppid()
    gen(1)
    os.getppid()
    gen(1 + args.tokens)
    os.getppid()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--graph", default="auto", help="--prefill-graph of the engine")
    parser.add_argument("--decode-graph", default=None, help="--decode-graph of the engine (off: one compiled graph)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    if shutil.which("gdb") is None:
        print("regions.py needs gdb on PATH", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "benchmarks.parts", "regions", "--child", "--tokens", str(args.tokens),
           "--graph", args.graph]
    cmd += ["--decode-graph", args.decode_graph] if args.decode_graph else []
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.startswith(MARK):
                break
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write(GDB_SCRIPT)
        gdb = subprocess.Popen(["gdb", "-p", str(proc.pid), "-batch", "-x", f.name], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
        time.sleep(5)                    # attached and the breakpoints set
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out, _ = gdb.communicate(timeout=1800)
        Path(f.name).unlink()
    finally:
        proc.wait(timeout=600)
    phases = json.loads(next(line for line in out.splitlines() if line.startswith("PHASES "))[7:])
    one, many = collections.Counter(phases[1]), collections.Counter(phases[2])
    per_step = {k: (many[k] - one[k]) / args.tokens for k in set(one) | set(many)}
    print(f"parallel regions per batch-1 decode step (--prefill-graph {args.graph}"
          f"{', --decode-graph ' + args.decode_graph if args.decode_graph else ''}): "
          f"{sum(per_step.values()):.1f}")
    for key, n in sorted(per_step.items(), key=lambda kv: -kv[1]):
        if n >= 0.5:
            print(f"  {n:7.1f}  {key}")
    return 0
