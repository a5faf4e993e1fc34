"""Where a served run's CPU time goes: `stagewise serve` on the default model (or --model), driven by
16 closed-loop streaming clients (random 128-token prompts, 64 output tokens, ignore_eos, greedy:
the `vllm bench serve` workload of benchmarks/peers/bench.py), with py-spy sampling every Python process of
the server's tree. Reports output tok/s, median TTFT / TPOT, each process's CPU ms per output token
(from /proc, so native threads count too) and, per process, the share of its samples in each part
of the code (the innermost stagewise frame of a sample decides; samples with no stagewise frame go
by their library).

    python -m benchmarks.serving profile [--model PATH] [--src DIR] [--label NAME] [--out FILE.json]

`--src DIR` serves another checkout's `src` (e.g. `git worktree add /tmp/before <commit>`; then
`--src /tmp/before/src`), for a before/after pair; `--report A.json B.json` prints them side by side.
Needs py-spy (`pip install py-spy`) and a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks.common import cpu_line, load_line, machine_line
from benchmarks.peers.serving import SERVED_NAME, compiling, own_load
from benchmarks.server_process import ServerProcess, descendants

# (part of the code, path fragments of the innermost stagewise frame): the first match decides
PARTS = [
    ("model step (layers, kernels, graphs)", ("/model/", "/kernels/", "/graph/", "/runtime/worker", "/runtime/")),
    ("sampling", ("/sampler", "sampling")),
    ("scheduling and KV blocks", ("/engine/scheduler", "/kvcache/block_manager", "/engine/inputs")),
    ("outputs: detokenize, stop checks, deltas", ("/engine/outputs", "/core/deltas", "/engine/stats")),
    ("engine loop and messages", ("/engine/", "/core/", "/recovery/", "/grammar/", "/executor/")),
    ("HTTP server (routes, streaming)", ("/server/",)),
]
LIBRARIES = [("HTTP server (routes, streaming)", ("uvicorn", "starlette", "fastapi", "h11", "httptools", "pydantic")),
             ("asyncio event loop", ("asyncio",)), ("tokenizers", ("tokenizers", "transformers")),
             ("model step (layers, kernels, graphs)", ("torch",)),
             ("messages (pickle, pipes)", ("pickle", "multiprocessing"))]


COMPILING = ("convert_frame", "compile_fx")      # Dynamo tracing, Inductor compiling: not a step


def part_of(stack: str) -> str:
    if any(k in stack for k in COMPILING):
        return "compiling graphs"
    frames = stack.split(";")
    for frame in reversed(frames):
        if "stagewise/" in frame:
            path = frame[frame.find("stagewise/") + len("stagewise"):]
            return next((name for name, keys in PARTS if any(k in path for k in keys)), "other stagewise")
    leaf = frames[-1] if frames else ""
    return next((name for name, keys in LIBRARIES if any(k in leaf for k in keys)), "other")


def children(pid: int) -> list[int]:
    return [pid, *descendants(pid)]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def role(pid: int) -> str:
    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return "HTTP process" if " serve " in f" {cmd} " else ("engine process" if "multiprocessing" in cmd else cmd[:60])


def warm_up(url: str, log: Path, budget_s: float) -> None:
    """Load the server until its graphs are compiled and a round of load is no faster than the one
    before (within 10%): the profile is of the steady state, not of a fresh server's first minute."""
    deadline, last = time.monotonic() + budget_s, 0.0
    while time.monotonic() < deadline:
        res = own_load(url, SERVED_NAME, 16)
        rate = res["total_output_tokens"] / res["duration"]
        if not compiling(log) and rate < 1.1 * last:
            return
        last = rate
    print(f"(warm-up: not steady after {budget_s:.0f} s)", flush=True)


def measure(args) -> dict:
    env = dict(os.environ)
    if args.src:
        env["PYTHONPATH"] = os.pathsep.join([args.src, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory(prefix="stagewise-serve-profile-") as tmp:
        server = ServerProcess(args.model, Path(tmp) / "server.log", "--served-model-name", SERVED_NAME,
                               log_level="info", env=env)
        try:
            server.wait_healthy(1800)
            pids = [p for p in children(server.proc.pid) if "python" in Path(f"/proc/{p}/exe").resolve().name]
            warm_up(server.url, server.log_path, args.warm_up_s)
            spies = {p: subprocess.Popen(["py-spy", "record", "--pid", str(p), "--rate", str(args.rate), "--format",
                                          "raw", "--nonblocking", "--output", f"{tmp}/{p}.txt"],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in pids}
            time.sleep(2)
            cpu0, load0 = {p: cpu_seconds(p) for p in pids}, load_line()
            res = own_load(server.url, SERVED_NAME, args.num_prompts)
            cpu1 = {p: cpu_seconds(p) for p in pids}
            for spy in spies.values():
                spy.send_signal(signal.SIGINT)
            for spy in spies.values():
                spy.wait(60)
            tokens = res["total_output_tokens"]
            procs = {}
            for p in pids:
                counts: Counter = Counter()
                raw = Path(f"{tmp}/{p}.txt")
                for line in (raw.read_text().splitlines() if raw.exists() else []):
                    stack, _, n = line.rpartition(" ")
                    if n.isdigit():                                   # py-spy may end with a message line
                        counts[part_of(stack)] += int(n)
                procs[f"{role(p)} ({p})"] = {"cpu_ms_per_token": (cpu1[p] - cpu0[p]) * 1e3 / tokens,
                                            "samples": dict(counts.most_common())}
        finally:
            server.stop(grace_s=30)
    return {"label": args.label, "src": args.src or "this checkout", "model": args.model or "the default model",
            "machine": f"{cpu_line()}; {machine_line()}", "load": load0, "serving": res, "processes": procs}


def report(runs: list[dict]) -> str:
    lines = [f"{runs[0]['machine']}", ""]
    lines += ["| run | output tok/s | median TTFT ms | median TPOT ms | load at start |", "|---|---|---|---|---|"]
    lines += [f"| {r['label']} | {r['serving']['output_throughput']:.1f} | {r['serving']['median_ttft_ms']:.0f} | "
              f"{r['serving']['median_tpot_ms']:.1f} | {r['load']} |" for r in runs]
    for r in runs:
        lines += ["", f"**{r['label']}** ({r['src']}, {r['model']})", "",
                  "| process | CPU ms per output token | part of the code | share of its samples |",
                  "|---|---|---|---|"]
        for name, p in sorted(r["processes"].items(), key=lambda kv: -kv[1]["cpu_ms_per_token"]):
            total = sum(p["samples"].values()) or 1
            first = True
            for part, n in p["samples"].items():
                if n / total < 0.005:
                    continue
                lines.append(f"| {name if first else ''} | {p['cpu_ms_per_token']:.2f} |" if first else "| | |")
                lines[-1] += f" {part} | {n / total:.1%} |"
                first = False
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default=None, help="model to serve (default: the server's default model)")
    ap.add_argument("--src", default=None, help="serve the stagewise under this src directory instead")
    ap.add_argument("--label", default="stagewise serve")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--warm-up-s", type=float, default=600.0, help="most seconds of warm-up load")
    ap.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    ap.add_argument("--out", default=None, help="also write the measurements as JSON here")
    ap.add_argument("--report", nargs="+", default=None, metavar="JSON", help="only print saved runs side by side")
    args = ap.parse_args(argv)
    if args.report:
        print(report([json.loads(Path(f).read_text()) for f in args.report]))
        return 0
    run = measure(args)
    if args.out:
        Path(args.out).write_text(json.dumps(run, indent=1))
    print(report([run]))
    return 0
