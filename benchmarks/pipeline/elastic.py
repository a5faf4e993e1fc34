"""Elastic pipelines on a simulated cluster (issue 43, item 5), on benchmarks/harness/cluster.py:
network namespaces with delayed / rate-limited links and cgroup CPU limits, the default model
(SmolLM2-135M-Instruct, its Q4_1 GGUF file) unless --model says otherwise.

1. Strong scaling, decode-heavy: `stagewise bench` (32 requests x 64 output tokens, 16-token
   prompts) on 2 nodes of one CPU each (cpuset) at PP=2 against one node of one CPU at PP=1, with
   links of 0, 1 and 20 ms one-way delay (20 ms also 100 Mbit/s), at 20 ms also with more plans in
   flight (--pp-depth); and 4 nodes of half a CPU each (CFS quota) at PP=4 against one such node,
   1 ms links.
2. Join, leave and kill under load: `stagewise serve` across 3 nodes (--min-nodes 2: nodes 0 and 1
   start), 32 closed-loop streaming clients (benchmarks/stream_load.py, in node 0's network
   namespace but outside its cgroups: a client machine), then node 2 starts (join), node 2 gets
   SIGTERM (leave), every process of node 1 gets SIGKILL (kill). Per event: the time to the first
   token on the new partition, the longest gap any client saw, requests lost, tokens/s before
   and after.
3. Prefill across the pipeline: the time to the first token of one 4,096-token prompt on 1 node
   against 2 and 4 nodes of one CPU each, at 0 and 20 ms links (benchmarks/pipeline/prefill_ttft.py).
4. Speculation per round trip: one user's greedy decode over 2 and 4 one-CPU nodes at 20 ms, with
   n-gram drafts and (with --spec-draft-model) a draft model, against none, on copy-heavy and fresh
   chats (benchmarks/pipeline/spec_link.py).

Before each timed run it waits (up to --quiet-budget-s in all) for the 1-minute load average to
drop below --quiet-load, and records the load before and after.

    python -m benchmarks.pipeline elastic [--parts scaling,elastic,prefill,speculation] [--quick]

Writes benchmarks/results/elastic.json and elastic.png (elastic-quick.* with --quick). Needs root
(namespaces, cgroups).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO, RESULTS_DIR, cpu_line, machine_line
from benchmarks.harness.cluster import Cluster, NodeSpec, scrubbed_env
from benchmarks.pipeline import prefill_ttft, spec_link

TOKEN = "elastic-benchmark-token"
PARTS = ("scaling", "elastic", "prefill", "speculation")
MASTER_PORT = 29500
HTTP_PORT = 8000
TOK_S_RE = re.compile(r"(\d+) output tokens in ([\d.]+) s: ([\d.]+) tok/s \(([^)]*)\)")


# --- quiet machine ----------------------------------------------------------------------------

def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


class Quiet:
    """Waits for a quiet machine before each timed run, within one budget for the whole benchmark."""

    def __init__(self, threshold: float, budget_s: float) -> None:
        self.threshold, self.left = threshold, budget_s

    def wait(self, what: str) -> dict:
        t0 = time.monotonic()
        while loadavg()[0] >= self.threshold and self.left - (time.monotonic() - t0) > 0:
            time.sleep(5)
        waited = time.monotonic() - t0
        self.left = max(0.0, self.left - waited)
        load = loadavg()
        quiet = load[0] < self.threshold
        print(f"[{what}] load {load[0]:.2f} after waiting {waited:.0f} s"
              f"{'' if quiet else ' (NOT quiet: the wait budget is spent)'}", flush=True)
        return {"load_before": load, "waited_s": round(waited, 1), "quiet": quiet}


# --- processes on nodes -----------------------------------------------------------------------

def stagewise_args(command: str, args, pp: int, nnodes: int, rank: int, master: str, extra: list[str]) -> list[str]:
    model = ["--model", args.model] if args.model else []
    cluster = (["--nnodes", str(nnodes), "--node-rank", str(rank), "--master-addr", master,
                "--master-port", str(MASTER_PORT)] if nnodes > 1 else [])
    return [sys.executable, "-m", "stagewise", "--log-level", "WARNING", command, *model, "--pp-size", str(pp),
            *cluster, "--prefill-graph", "off", *extra]


def relay_cpu_s(cluster: Cluster) -> float:
    """CPU seconds the link relays (host processes outside the nodes' cgroups) have used."""
    total = 0.0
    for node in cluster.nodes:
        if node.relay is not None:
            fields = Path(f"/proc/{node.relay.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def stop_node(node, procs: list[subprocess.Popen], grace_s: float = 20.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    node.kill_all()


# --- part 1: strong scaling -------------------------------------------------------------------

def cluster_run(args, specs: list[NodeSpec], pp: int, command: str, extra: list[str], log_dir: Path,
                name: str) -> tuple[str, str]:
    """`stagewise COMMAND` on every node of a new cluster (node n > 0 takes the worker role); node
    0's stdout and stderr once it is done (RuntimeError if it failed)."""
    with Cluster(specs, env={"STAGEWISE_CLUSTER_TOKEN": TOKEN}) as c:
        master = c.nodes[0].address
        procs = []
        for rank, node in enumerate(c.nodes):
            out = open(log_dir / f"{name}-n{rank}.out", "w")
            err = open(log_dir / f"{name}-n{rank}.err", "w")
            procs.append(node.popen(stagewise_args(command, args, pp, len(specs), rank, master, extra),
                                    stdout=out, stderr=err))
        try:
            rc = procs[0].wait(timeout=args.run_timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        cluster_run.relay_s = relay_cpu_s(c)          # type: ignore[attr-defined]
        for node, p in zip(c.nodes[1:], procs[1:]):
            stop_node(node, [p], grace_s=30)
        c.nodes[0].kill_all()
    text, err = ((log_dir / f"{name}-n0.{kind}").read_text() for kind in ("out", "err"))
    if rc != 0:
        raise RuntimeError(f"{name}: {command} on node 0 ended with {rc}: {text[-500:]}\n{err[-2000:]}")
    return text, err


def bench_run(args, specs: list[NodeSpec], pp: int, extra: list[str], log_dir: Path, name: str,
              sizes: tuple[int, int, int] | None = None) -> dict:
    """`stagewise bench` on every node of a new cluster; `sizes`: (requests, prompt, output tokens)
    instead of the command line's."""
    requests, prompt, output = sizes or (args.num_requests, args.prompt_len, args.output_len)
    bench = ["--num-requests", str(requests), "--prompt-len", str(prompt),
             "--output-len", str(output), "--no-pipeline-spares", *extra]
    text, err = cluster_run(args, specs, pp, "bench", bench, log_dir, name)
    match = TOK_S_RE.search(text)
    if match is None:
        raise RuntimeError(f"{name}: bench on node 0 printed no tokens/s: {text[-500:]}\n{err[-2000:]}")
    return {"tokens": int(match.group(1)), "seconds": float(match.group(2)), "tok_s": float(match.group(3)),
            "steps": match.group(4), "relay_cpu_s": round(cluster_run.relay_s, 1),  # type: ignore[attr-defined]
            "text": match.string[match.start():]}


def scaling(args, quiet: Quiet, log_dir: Path) -> list[dict]:
    one_cpu = [NodeSpec(cpus="0")]
    half = NodeSpec(cpu_quota=0.5)
    cases = [  # (case, baseline key, specs, pp, extra)
        ("1 node, 1 CPU, PP=1", None, one_cpu, 1, []),
        ("2 nodes x 1 CPU, PP=2, 0 ms", "1cpu", [NodeSpec(cpus="0"), NodeSpec(cpus="1")], 2, []),
        ("2 nodes x 1 CPU, PP=2, 1 ms", "1cpu", [NodeSpec(cpus="0", delay_ms=1), NodeSpec(cpus="1", delay_ms=1)],
         2, []),
    ]
    for depth in args.depths_20ms:
        specs20 = [NodeSpec(cpus="0", delay_ms=20, rate_mbit=100), NodeSpec(cpus="1", delay_ms=20, rate_mbit=100)]
        flag = f"--pp-depth {depth}" if depth else "plans in flight grown for the link (--pp-depth unset)"
        cases.append((f"2 nodes x 1 CPU, PP=2, 20 ms + 100 Mbit/s, {flag}", "1cpu", specs20, 2,
                      ["--pp-depth", str(depth)] if depth else []))
    cases += [
        ("1 node, 0.5 CPU, PP=1", None, [half], 1, []),
        ("4 nodes x 0.5 CPU, PP=4, 1 ms", "half", [NodeSpec(cpu_quota=0.5, delay_ms=1)] * 4, 4, []),
    ]
    rows, base = [], {}
    for i, (case, against, specs, pp, extra) in enumerate(cases):
        if args.only_cases and i not in args.only_cases:
            continue
        load = quiet.wait(case)
        res = bench_run(args, specs, pp, extra, log_dir, f"scaling{i}")
        res.update(case=case, nodes=len(specs), pp=pp, **load, load_after=loadavg())
        res.pop("text")
        if against is None:
            base["1cpu" if specs[0].cpus else "half"] = res["tok_s"]
        elif against in base:
            res["speedup"] = round(res["tok_s"] / base[against], 3)
        ratio = f" ({res['speedup']:.2f}x)" if "speedup" in res else ""
        print(f"  {case}: {res['tok_s']:.1f} tok/s{ratio} [{res['steps']}; relay CPU {res['relay_cpu_s']} s]",
              flush=True)
        rows.append(res)
    return rows


# --- part 2: join, leave, kill under load -----------------------------------------------------

def wait_line(path: Path, needle: str, timeout_s: float, proc: subprocess.Popen | None = None) -> float | None:
    """The unix time `needle` first shows in the file at `path` (polled every 0.1 s), or None."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and needle in path.read_text(errors="replace"):
            return time.time()
        if proc is not None and proc.poll() is not None:
            return None
        time.sleep(0.1)
    return None


def wait_rebuilt(driver_log: Path, before: int, timeout_s: float) -> None:
    """Until the driver has logged more than `before` rebuilds (or `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while driver_log.read_text(errors="replace").count("pipeline rebuilt in") <= before \
            and time.monotonic() < deadline:
        time.sleep(0.2)


def elastic(args, quiet: Quiet, log_dir: Path) -> dict:
    specs = [NodeSpec(cpu_quota=args.elastic_quota, delay_ms=args.elastic_delay_ms)] * 3
    load = quiet.wait("elastic")
    with Cluster(specs, env={"STAGEWISE_CLUSTER_TOKEN": TOKEN}) as c:
        n0, n1, n2 = c.nodes
        master = n0.address
        serve_extra = ["--min-nodes", "2", "--host", master, "--port", str(HTTP_PORT), *args.serve_flags]

        def start(node, rank: int) -> tuple[subprocess.Popen, Path]:
            err = log_dir / f"elastic-n{rank}.err"
            cmd = stagewise_args("serve", args, args.elastic_pp, 3, rank, master, serve_extra)
            return node.popen(cmd, stdout=open(log_dir / f"elastic-n{rank}.out", "w"), stderr=open(err, "w")), err

        (p0, err0), (_p1, err1) = start(n0, 0), start(n1, 1)
        stop_file, out_file = log_dir / "stop", log_dir / "stream_load.json"
        # The client is a machine of its own on node 0's network: its network namespace, not its cgroups.
        client = subprocess.Popen(["nsenter", f"--net=/run/netns/{n0.netns}", sys.executable, "-m",
                                   "benchmarks.stream_load", "--url", f"http://{master}:{HTTP_PORT}",
                                   "--streams", str(args.streams), "--max-tokens", str(args.max_tokens),
                                   "--prompt-len", str(args.prompt_len), "--stop-file", str(stop_file),
                                   "--out", str(out_file)],
                                  stdout=subprocess.PIPE, stderr=open(log_dir / "client.err", "w"), text=True,
                                  env=scrubbed_env(), cwd=REPO)
        assert client.stdout is not None
        line = client.stdout.readline().strip()
        if not line.startswith("started"):
            raise RuntimeError(f"the client did not start: {line!r}; node 0: {err0.read_text()[-3000:]}")
        t0 = float(line.split()[1])
        events: list[dict] = []

        def at(offset: float) -> None:
            time.sleep(max(0.0, t0 + offset - time.time()))

        at(args.join_at)
        events.append({"event": "join", "t": time.time(), "what": "node 2 started"})
        p2, err2 = start(n2, 2)
        # node 2 is up once it says it is ready to join ("... it joins the next one")
        events[-1].update(node_ready=wait_line(err2, "joins the ", 180, p2))
        # Each event is measured alone: the next one waits until the move is done (node 2 runs its
        # stages; node 2 has exited) and then at least --settle-s more.
        joined = wait_line(err2, "joins the driver's pipeline", args.run_timeout_s, p2) or time.time()
        at(max(args.join_at + args.gap_s, joined + args.settle_s - t0))
        events.append({"event": "leave", "t": time.time(), "what": "SIGTERM to node 2"})
        rebuilt = err0.read_text(errors="replace").count("pipeline rebuilt in")
        p2.send_signal(signal.SIGTERM)
        try:
            p2.wait(timeout=args.run_timeout_s)
        except subprocess.TimeoutExpired:
            pass
        wait_rebuilt(err0, rebuilt, args.run_timeout_s)     # the pipeline without node 2 serves
        at(max(args.join_at + 2 * args.gap_s, time.time() + args.settle_s - t0))
        events.append({"event": "kill", "t": time.time(), "what": "SIGKILL to every process of node 1"})
        rebuilt = err0.read_text(errors="replace").count("pipeline rebuilt in")
        n1.kill_all()
        wait_rebuilt(err0, rebuilt, args.run_timeout_s)
        at(max(args.join_at + 3 * args.gap_s, time.time() + args.settle_s - t0))
        stop_file.touch()
        client.wait(timeout=args.run_timeout_s)
        try:
            p2.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        exit_codes = {"node 2 after SIGTERM": p2.poll()}
        stop_node(n0, [p0])
        exit_codes["node 0"] = p0.poll()
        for node in (n1, n2):
            node.kill_all()
    load_after = loadavg()
    log = json.loads(out_file.read_text())
    driver_log = err0.read_text(errors="replace")
    return {**analyse(log, events, args), **load, "load_after": load_after, "exit_codes": exit_codes,
            "driver_moves": [ln for ln in driver_log.splitlines() if "pipeline runs on" in ln
                             or "stopping the pipeline" in ln or "standby" in ln],
            "node_logs_tail": {f"node {i}": e.read_text(errors="replace")[-1500:]
                               for i, e in enumerate((err0, err1, err2))}}


def analyse(log: dict, events: list[dict], args) -> dict:
    t0 = log["started"]
    reqs = log["requests"]
    times = sorted(t for r in reqs for t in r["times"])
    lost = [r for r in reqs if r["error"] or r["finish"] not in ("length", "stop")
            or (r["finish"] == "length" and r["tokens"] != r["max_tokens"])]
    end = max(times) if times else t0
    nbins = int(end - t0) + 1
    tok_per_bin = [0] * nbins
    gap_per_bin = [0.0] * nbins
    for t in times:
        tok_per_bin[int(t - t0)] += 1
    # a client's gap: between its request's consecutive chunks, or from the request's start to its first
    for r in reqs:
        prev = r["start"]
        for t in r["times"]:
            b = int(t - t0)
            if 0 <= b < nbins:
                gap_per_bin[b] = max(gap_per_bin[b], t - prev)
            prev = t
    polls = log["polls"]
    out_events = []
    for i, ev in enumerate(events):
        t_ev = ev["t"]
        t_next = events[i + 1]["t"] if i + 1 < len(events) else end
        # the move: the first poll after the event whose move count grew
        moves_before = next((p.get("moves") for p in reversed(polls) if p["t"] <= t_ev and "moves" in p), 0) or 0
        moved = next((p for p in polls if p["t"] > t_ev and (p.get("moves") or 0) > moves_before), None)
        move_at = (moved.get("last_move") or {}).get("at") if moved else None
        # the stall: the longest pause of the aggregate token stream after the event (before the next)
        window = [t for t in times if t_ev <= t < t_next]
        stall_end, stall = None, 0.0
        prev = max([t for t in times if t < t_ev], default=t_ev)
        for t in window:
            if t - prev > stall:
                stall, stall_end = t - prev, t
            prev = t
        # the longest gap any one client saw, for chunks arriving in this event's window
        longest = 0.0
        for r in reqs:
            prev = r["start"]
            for t in r["times"]:
                if t_ev <= t < t_next:
                    longest = max(longest, t - prev)
                prev = t
        first_after_move = next((t for t in window if move_at and t > move_at), None)
        ref = ev.get("node_ready") or t_ev
        before = [t for t in times if t_ev - args.rate_window_s <= t < t_ev]
        after_from = (first_after_move or stall_end or t_ev) + 2.0
        after = [t for t in times if after_from <= t < min(t_next, after_from + args.rate_window_s)]
        after_span = min(t_next, after_from + args.rate_window_s) - after_from
        out_events.append({
            **{k: (round(v - t0, 2) if isinstance(v, float) and k in ("t", "node_ready") else v)
               for k, v in ev.items()},
            "move": (moved or {}).get("last_move"), "layout_after": (moved or {}).get("layout"),
            "standby_after": (moved or {}).get("standby"),
            "move_at_s": round(move_at - t0, 2) if move_at else None,
            "first_token_new_partition_s": round(first_after_move - ref, 2) if first_after_move else None,
            "measured_from": "node ready" if ev.get("node_ready") else "event",
            "stream_stall_s": round(stall, 2), "stall_end_s": round(stall_end - t0, 2) if stall_end else None,
            "longest_client_gap_s": round(longest, 2),
            "tok_s_before": round(len(before) / args.rate_window_s, 1),
            "tok_s_after": round(len(after) / after_span, 1) if after_span > 0 else None,
        })
    final_metrics = next((p["metrics"] for p in reversed(polls) if "metrics" in p), {})
    return {"t0": t0, "requests": len(reqs), "lost": len(lost), "lost_examples": lost[:3],
            "tokens_usage": sum(r["tokens"] or 0 for r in reqs), "chunks": len(times),
            "events": out_events, "tok_per_s_bins": tok_per_bin,
            "max_gap_per_bin_s": [round(g, 3) for g in gap_per_bin],
            "final_metrics": final_metrics, "streams": log["streams"], "max_tokens": log["max_tokens"]}


# --- plot and main ----------------------------------------------------------------------------

def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    el = result["elastic"]
    fig, (a, b) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    xs = list(range(len(el["tok_per_s_bins"])))
    a.plot(xs, el["tok_per_s_bins"], drawstyle="steps-post", color="tab:blue")
    a.set_ylabel("tokens/s (1 s bins)")
    b.plot(xs, el["max_gap_per_bin_s"], drawstyle="steps-post", color="tab:red")
    b.set_ylabel("max inter-token gap (s)")
    b.set_xlabel("seconds since the load started")
    colors = {"join": "tab:green", "leave": "tab:orange", "kill": "black"}
    for ev in el["events"]:
        for ax in (a, b):
            ax.axvline(ev["t"], color=colors.get(ev["event"], "gray"), ls="--", lw=1)
        a.annotate(ev["event"], (ev["t"], max(el["tok_per_s_bins"] or [1])), rotation=90, va="top", ha="right",
                   fontsize=8)
        if ev.get("node_ready") is not None:
            a.axvline(ev["node_ready"], color=colors["join"], ls=":", lw=1)
    fig.suptitle(f"{result['model']}: PP={result['elastic_pp']} on 3 nodes of {result['elastic_quota']} CPU, "
                 f"{el['streams']} streams x {el['max_tokens']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--quick", action="store_true", help="smoke run: fewer requests, short events; -quick files")
    ap.add_argument("--model", default=None, help="default: stagewise's default model")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--depths-20ms", default="auto,2",
                    help="--pp-depth values at 20 ms (auto: unset, grown for the link; 2: pp_size, fixed)")
    ap.add_argument("--only-cases", default="", help="indices of the scaling cases to run (default: all)")
    ap.add_argument("--elastic-pp", type=int, default=3,
                    help="stages of the served pipeline (at 2, a third node joins as a standby: no move)")
    ap.add_argument("--elastic-quota", type=float, default=0.6, help="CPUs' worth of quota per node")
    ap.add_argument("--elastic-delay-ms", type=float, default=0.0)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--join-at", type=float, default=30.0, help="seconds after the load starts")
    ap.add_argument("--gap-s", type=float, default=45.0, help="seconds between events (and after the last)")
    ap.add_argument("--settle-s", type=float, default=25.0, help="seconds after a move is done before the next event")
    ap.add_argument("--rate-window-s", type=float, default=10.0, help="tokens/s before/after an event over this")
    ap.add_argument("--serve-flags", default="", help="more flags for every node's serve, space-separated")
    ap.add_argument("--quiet-load", type=float, default=0.6)
    ap.add_argument("--quiet-budget-s", type=float, default=1200.0)
    ap.add_argument("--run-timeout-s", type=float, default=900.0)
    prefill_ttft.add_args(ap)
    spec_link.add_args(ap)
    args = ap.parse_args(argv)
    prefill_ttft.parse(args)
    spec_link.parse(args)
    args.depths_20ms = [0 if x == "auto" else int(x) for x in args.depths_20ms.split(",") if x]
    args.only_cases = {int(x) for x in args.only_cases.split(",") if x}
    args.serve_flags = args.serve_flags.split()
    if args.quick:
        args.num_requests, args.output_len, args.streams = 8, 16, 8
        args.prefill_prompt_len, args.prefill_chunk = 512, 64
        args.spec_prompts, args.spec_max_tokens = 1, 32
        args.join_at, args.gap_s, args.rate_window_s = 15.0, 25.0, 5.0
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    parts = set(args.parts.split(","))
    quiet = Quiet(args.quiet_load, args.quiet_budget_s)
    suffix = "-quick" if args.quick else ""
    result: dict = {"model": args.model or "SmolLM2-135M-Instruct Q4_1 GGUF (the default model)",
                    "cpu": cpu_line(), "machine": machine_line(), "elastic_pp": args.elastic_pp,
                    "elastic_quota": args.elastic_quota, "argv": sys.argv[1:], "loadavg_start": loadavg()}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="stagewise-elastic-") as tmp:
        log_dir = Path(tmp)
        print(f"logs in {log_dir}", flush=True)
        try:
            if "scaling" in parts:
                result["scaling"] = scaling(args, quiet, log_dir)
            if "elastic" in parts:
                result["elastic"] = elastic(args, quiet, log_dir)
            if "prefill" in parts:
                result["prefill"] = prefill_ttft.prefill(args, quiet, log_dir, bench_run, loadavg)
            if "speculation" in parts:
                result["speculation"] = spec_link.speculation(args, quiet, log_dir, cluster_run, loadavg)
        finally:
            result["loadavg_end"] = loadavg()
            keep = RESULTS_DIR / f"elastic{suffix}-logs"
            if os.environ.get("ELASTIC_KEEP_LOGS"):
                subprocess.run(["cp", "-r", str(log_dir), str(keep)], check=False)
            path = RESULTS_DIR / f"elastic{suffix}.json"
            if path.exists() and not all(part in result for part in PARTS):
                old = json.loads(path.read_text())     # a run of some parts keeps the other parts' numbers
                result = {**old, **result, **{part: result.get(part, old.get(part)) for part in PARTS}}
            path.write_text(json.dumps(result, indent=1))
            print(f"wrote {path}", flush=True)
    if result.get("elastic"):
        plot(result, RESULTS_DIR / f"elastic{suffix}.png")
        print(json.dumps({k: v for k, v in result["elastic"].items() if k not in ("tok_per_s_bins",
                                                                               "max_gap_per_bin_s")}, indent=1))
