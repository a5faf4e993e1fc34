"""A model larger than each node, split over the cluster harness's nodes: `stagewise serve` of one
GGUF file (make-shapes' gpt-oss-20b by default) on N nodes that each have a memory limit of a share
of the file (default: a third) and 2/N of a CPU, against one node with both CPUs and no limit.
Per configuration: greedy token ids of four fixed token-id prompts (the split must give the same
ids as the one node), output tokens/s of `--streams` concurrent streams, and each stage process's
peak RSS against its share of the file.

    python -m benchmarks.quantized moe-nodes --model FILE.gguf [--nodes 4] [--streams 32]

Needs root (namespaces, cgroups). Writes benchmarks/results/moe-nodes.json and prints a table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import REPO, RESULTS_DIR, cpu_line, machine_line
from benchmarks.harness.cluster import Cluster, NodeSpec, scrubbed_env
from benchmarks.pipeline.elastic import HTTP_PORT, TOKEN, stagewise_args, stop_node

PROMPTS = [[300 + 17 * i + j for j in range(24)] for i in range(4)]      # fixed token ids, any vocabulary


async def _client(url: str, streams: int, max_tokens: int, prompt_len: int, timeout_s: float) -> dict:
    """Greedy ids of PROMPTS (16 tokens each), then `streams` concurrent requests of `max_tokens`."""
    import httpx
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if (await client.get(f"{url}/health")).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the server never became healthy")
            await asyncio.sleep(1.0)
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]

        async def one(prompt: list[int], n: int) -> list[int]:
            body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                    "return_tokens_as_token_ids": True, "logprobs": 1}
            reply = (await client.post(f"{url}/v1/completions", json=body)).json()
            return [int(t.removeprefix("token_id:")) for t in reply["choices"][0]["logprobs"]["tokens"]]

        ids = [await one(p, 16) for p in PROMPTS]
        await one(PROMPTS[0], 4)        # warm: the timed streams start on a served model
        loads = [[400 + (7 * s + j) % 5000 for j in range(prompt_len)] for s in range(streams)]
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(p, max_tokens) for p in loads))
        wall = time.perf_counter() - t0
    return {"ids": ids, "tokens": sum(len(o) for o in outs), "wall_s": wall,
            "tok_s": sum(len(o) for o in outs) / wall}


def _peak_rss(cluster: Cluster, peaks: dict[str, float], stop: threading.Event) -> None:
    """Each stagewise process's peak RSS (VmHWM), by node and process name, until `stop`."""
    while not stop.wait(0.5):
        for node in cluster.nodes:
            for pid in node.pids():
                try:
                    name = Path(f"/proc/{pid}/comm").read_text().strip()
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                hwm = next((int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmHWM")),
                           0.0)
                key = f"node {node.index}: {name} ({pid})"
                peaks[key] = max(peaks.get(key, 0.0), hwm)


def run_config(args, specs: list[NodeSpec], log_dir: Path, name: str) -> dict:
    """`stagewise serve` over `specs` (PP = the node count) and the client in node 0's network."""
    pp = len(specs)
    extra = ["--max-model-len", "2048", "--max-num-seqs", str(max(args.streams, 4)), "--no-pipeline-spares",
             *(["--threads-per-stage", "2"] if pp == 1 else [])]
    peaks: dict[str, float] = {}
    with Cluster(specs, env={"STAGEWISE_CLUSTER_TOKEN": TOKEN}) as c:
        master = c.nodes[0].address
        serve = [*extra, "--host", master, "--port", str(HTTP_PORT)]
        procs = [node.popen(stagewise_args("serve", args, pp, pp, rank, master, serve),
                            stdout=open(log_dir / f"{name}-n{rank}.out", "w"),
                            stderr=open(log_dir / f"{name}-n{rank}.err", "w")) for rank, node in enumerate(c.nodes)]
        stop = threading.Event()
        sampler = threading.Thread(target=_peak_rss, args=(c, peaks, stop), daemon=True)
        sampler.start()
        t0 = time.monotonic()
        try:
            client = subprocess.run(
                ["nsenter", f"--net=/run/netns/{c.nodes[0].netns}", sys.executable, "-m",
                 "benchmarks.quantized", "moe-nodes", "--client", f"http://{master}:{HTTP_PORT}",
                 "--streams", str(args.streams), "--max-tokens", str(args.max_tokens),
                 "--prompt-len", str(args.prompt_len), "--timeout-s", str(args.timeout_s)],
                capture_output=True, text=True, env=scrubbed_env(), cwd=REPO, timeout=args.timeout_s + 60)
        finally:
            stop.set()
            sampler.join()
            for node, p in zip(c.nodes, procs):
                stop_node(node, [p], grace_s=20)
    if client.returncode != 0:
        err = (log_dir / f"{name}-n0.err").read_text()[-3000:]
        raise RuntimeError(f"{name}: the client failed: {client.stderr[-1500:]}\nnode 0: {err}")
    result = json.loads(client.stdout.strip().splitlines()[-1])
    result.update(name=name, nodes=pp, total_s=round(time.monotonic() - t0, 1),
                  peak_rss_mib={k: round(v) for k, v in sorted(peaks.items()) if v > 200})
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.quantized moe-nodes", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="the GGUF file (make-shapes' gpt-oss-20b)")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--memory-share", type=float, default=3.0, help="each node's memory limit: the file / this")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument("--skip-one-node", action="store_true", help="only the split run")
    ap.add_argument("--client", default=None, help=argparse.SUPPRESS)      # the in-namespace client
    args = ap.parse_args(argv)
    if args.client:
        print(json.dumps(asyncio.run(_client(args.client, args.streams, args.max_tokens, args.prompt_len,
                                             args.timeout_s))))
        return
    if not args.model:
        ap.error("--model FILE.gguf is required")
    size = os.path.getsize(args.model)
    limit = int(size / args.memory_share)
    quota = (os.cpu_count() or 2) / args.nodes
    runs = []
    with tempfile.TemporaryDirectory(prefix="stagewise-moe-nodes-") as tmp:
        split = [NodeSpec(memory_bytes=limit, cpu_quota=quota)] * args.nodes
        runs.append(run_config(args, split, Path(tmp), f"{args.nodes} nodes"))
        if not args.skip_one_node:
            runs.append(run_config(args, [NodeSpec()], Path(tmp), "1 node"))
    same = len(runs) < 2 or runs[0]["ids"] == runs[1]["ids"]
    out = {"cpu": cpu_line(), "machine": machine_line(), "model": args.model, "file_gib": round(size / 2**30, 2),
           "node_memory_gib": round(limit / 2**30, 2), "node_cpu_quota": quota, "streams": args.streams,
           "max_tokens": args.max_tokens, "same_greedy_ids": same, "runs": runs}
    for r in runs:
        print(f"{r['name']}: {r['tok_s']:.1f} tok/s ({r['tokens']} tokens in {r['wall_s']:.1f} s)")
        for k, v in r["peak_rss_mib"].items():
            print(f"    {k}: peak RSS {v} MiB")
    print(f"greedy ids equal: {same}")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "moe-nodes.json").write_text(json.dumps(out, indent=1))
    if not same:
        sys.exit("the split run's greedy ids differ from the one node's")
