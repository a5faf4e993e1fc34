"""Where the CPU of a pipeline goes: `stagewise bench` on N nodes of one CPU each (the cluster
harness), every process and thread of every node sampled from /proc/<pid>/task/*/stat, and the CPU
seconds of each (driver, stages, spares, keepers and other threads) reported per engine step, with
the seconds each waited, runnable, for a CPU (/proc/<pid>/task/*/schedstat).
CPU time, unlike wall time, means something on a loaded machine: what runs beside a stage on its
one CPU is time the stage does not get.

    python -m benchmarks.pipeline cpu-account [--model M] [--nodes 2] [--env STAGEWISE_KEEP_AWAKE=0]

Prints a table and writes benchmarks/results/cpu-account.json. Needs root (namespaces, cgroups).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import RESULTS_DIR
from benchmarks.harness.cluster import Cluster, NodeSpec

TICK = os.sysconf("SC_CLK_TCK")
STEPS_RE = re.compile(r"(\d+) engine steps")
MASTER_PORT = 29500
MARKER = "bench: timing"


def threads_of(pid: int) -> dict[int, tuple[str, float, float]]:
    """tid -> (thread name, CPU seconds so far, seconds it waited runnable for a CPU so far) of one
    process (empty once it is gone). The wait is what others running beside it cost it."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            text = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        name = text[text.index("(") + 1:text.rindex(")")]
        fields = text[text.rindex(")") + 2:].split()
        try:
            waited = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1]) / 1e9
        except (OSError, IndexError):
            waited = 0.0
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / TICK, waited)
    return out


class Sampler:
    """Polls every process of the nodes; keeps each thread's latest CPU seconds (they only grow)."""

    def __init__(self, cluster: Cluster, interval_s: float):
        self.cluster, self.interval_s = cluster, interval_s
        # (node, pid, tid) -> (process, thread, CPU s, s waited for a CPU)
        self.seen: dict[tuple[int, int, int], tuple[str, str, float, float]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        for node in self.cluster.nodes:
            for pid in node.pids():
                try:
                    proc = Path(f"/proc/{pid}/comm").read_text().strip()
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if not any(cmd):         # exiting: it keeps the role it had
                    continue
                role = _role(pid, proc, cmd)
                for tid, (name, cpu, waited) in threads_of(pid).items():
                    thread = "main" if tid == pid else name
                    self.seen[(node.index, pid, tid)] = (role, thread, cpu, waited)


def _role(pid: int, comm: str, cmd: list[bytes]) -> str:
    """What a process is: a stage or spare (they name themselves), the node's command (the driver on
    node 0), or its command line's start."""
    if comm.startswith("stagewise-"):
        return f"{comm} ({pid})"
    if b"stagewise" in cmd and b"bench" in cmd:
        return f"bench command ({pid})"
    words = [c.decode(errors="replace").rsplit("/", 1)[-1] for c in cmd if c][:4]
    return f"{' '.join(words)[:40]} ({pid})"


def _await_marker(err: Path, proc: subprocess.Popen, sampler: Sampler, timeout_s: float) -> dict:
    """Every thread's CPU seconds when the driver starts timing (it logs MARKER): what ran before
    (imports, loading, compiling) is not the pipeline's steady state."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if err.exists() and MARKER in err.read_text(errors="replace"):
            sampler.sample()
            return dict(sampler.seen)
        time.sleep(0.05)
    raise RuntimeError(f"the driver never started timing: {err.read_text(errors='replace')[-2000:]}")


def account(args) -> dict:
    specs = [NodeSpec(cpus=str(i % (os.cpu_count() or 1)), delay_ms=args.delay_ms) for i in range(args.nodes)]
    env = dict(e.split("=", 1) for e in args.env)
    env["STAGEWISE_CLUSTER_TOKEN"] = "cpu-account-token"
    bench = ["--num-requests", str(args.num_requests), "--prompt-len", str(args.prompt_len), "--output-len",
             str(args.output_len), "--prefill-graph", "off", *(["--model", args.model] if args.model else []),
             *(["--no-pipeline-spares"] if not args.spares else []), *args.flags]
    with tempfile.TemporaryDirectory(prefix="stagewise-cpu-") as tmp, Cluster(specs, env=env) as c:
        sampler = Sampler(c, args.interval_s)
        sampler.thread.start()
        procs = []
        for rank, node in enumerate(c.nodes):
            cluster = ["--nnodes", str(args.nodes), "--node-rank", str(rank), "--master-addr", c.nodes[0].address,
                       "--master-port", str(MASTER_PORT)] if args.nodes > 1 else []
            level = "INFO" if rank == 0 else "WARNING"       # node 0 logs when it starts timing
            cmd = [sys.executable, "-m", "stagewise", "--log-level", level, "bench", "--pp-size", str(args.nodes),
                   *cluster, *bench]
            out, err = open(f"{tmp}/n{rank}.out", "w"), open(f"{tmp}/n{rank}.err", "w")
            procs.append(node.popen(cmd, stdout=out, stderr=err))
        try:
            baseline = _await_marker(Path(f"{tmp}/n0.err"), procs[0], sampler, args.timeout_s)
            procs[0].wait(timeout=args.timeout_s)
            sampler.sample()
        finally:
            sampler.stop.set()
            sampler.thread.join()
            for p in procs:
                p.kill()
            for node in c.nodes:
                node.kill_all()
        out = Path(f"{tmp}/n0.out").read_text()
        err = Path(f"{tmp}/n0.err").read_text()
    if procs[0].returncode != 0 or not (m := STEPS_RE.search(out)):
        raise RuntimeError(f"bench on node 0 ended with {procs[0].returncode}: {out[-500:]}\n{err[-2000:]}")
    steps = int(m.group(1))
    rows: dict[tuple[int, str, str], tuple[float, float]] = {}
    for ident, (role, thread, cpu, waited) in sampler.seen.items():
        key = (ident[0], role, thread if thread == "main" else f"other threads ({thread})")
        _, _, cpu0, waited0 = baseline.get(ident, ("", "", 0.0, 0.0))
        had = rows.get(key, (0.0, 0.0))
        rows[key] = (had[0] + cpu - cpu0, had[1] + waited - waited0)
    table = [{"node": n, "process": role, "thread": thread, "cpu_s": round(s, 2),
              "ms_per_step": round(1e3 * s / steps, 2), "waited_for_cpu_s": round(w, 2)}
             for (n, role, thread), (s, w) in sorted(rows.items())]
    return {"bench": out.strip().splitlines()[-1], "steps": steps, "env": args.env, "flags": args.flags,
            "threads_seen": len(sampler.seen), "rows": table}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--spares", action=argparse.BooleanOptionalAction, default=True,
                    help="spare stage processes as a user gets them (default: on)")
    ap.add_argument("--env", action="append", default=[], help="VAR=VALUE for every node, e.g. STAGEWISE_KEEP_AWAKE=0")
    ap.add_argument("--flags", default="", help="more bench flags, space-separated")
    ap.add_argument("--interval-s", type=float, default=0.2)
    ap.add_argument("--timeout-s", type=float, default=900.0)
    args = ap.parse_args(argv)
    args.flags = args.flags.split()
    result = account(args)
    print(result["bench"])
    print(f"{result['steps']} engine steps; CPU per process and thread:")
    for r in result["rows"]:
        print(f"  node {r['node']}  {r['process']:<48} {r['thread']:<30} {r['cpu_s']:8.2f} s "
              f"{r['ms_per_step']:8.2f} ms/step  waited for a CPU {r['waited_for_cpu_s']:6.2f} s")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "cpu-account.json").write_text(json.dumps(result, indent=1))
