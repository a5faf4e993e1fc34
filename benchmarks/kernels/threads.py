"""Threads on a busy machine: offline output tok/s and batch-1 decode on the default model, on a
quiet machine and with one core kept busy by another process, for each OpenMP wait policy, with
and without the stage's keepers (SCHED_IDLE threads that keep its CPUs awake within a step) and
with pinned threads.

Each policy runs in its own child process (the policy must be in the environment before OpenMP
starts); the children stay alive and take turns, round by round, quiet then loaded, so drifting
background load on a shared machine falls on every policy alike; every cell is the best of its rounds.
The load is `python -c 'while True: pass'` pinned to
core 0 with taskset, started and killed here. Writes benchmarks/results/threads.md.

    python -m benchmarks.kernels threads [--rounds 2] [--num-requests 16] [--only LABEL,...]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager, nullcontext

# NOTE: benchmarks.common is imported in the parent only, late: importing it sets OMP_WAIT_POLICY,
# which a policy child (this module, started through `python -m benchmarks.kernels threads --child`) must not get.
MARK = "THREADS-RESULT "
# label -> (environment for the child, extra engine options)
NO_KEEPERS = {"STAGEWISE_KEEP_AWAKE": "0"}
POLICIES = {
    "PASSIVE + keepers, small models decode on one thread (the default)": ({"OMP_WAIT_POLICY": "PASSIVE"}, {}),
    "PASSIVE + keepers, every step on all threads": ({"OMP_WAIT_POLICY": "PASSIVE", "STAGEWISE_ADAPT_THREADS": "0"},
                                                     {}),
    "PASSIVE, no keepers": ({"OMP_WAIT_POLICY": "PASSIVE", **NO_KEEPERS}, {}),
    "PASSIVE + keepers, pinned": ({"OMP_WAIT_POLICY": "PASSIVE", "STAGEWISE_PIN_THREADS": "1"}, {}),
    "GOMP_SPINCOUNT=1000 + keepers": ({"GOMP_SPINCOUNT": "1000"}, {}),
    "GOMP_SPINCOUNT=1000, no keepers": ({"GOMP_SPINCOUNT": "1000", **NO_KEEPERS}, {}),
    "GOMP_SPINCOUNT=10000, no keepers": ({"GOMP_SPINCOUNT": "10000", **NO_KEEPERS}, {}),
    "unset (GNU default: spin 300k), no keepers": (dict(NO_KEEPERS), {}),
    "OMP_WAIT_POLICY=ACTIVE, no keepers": ({"OMP_WAIT_POLICY": "ACTIVE", **NO_KEEPERS}, {}),
    "--threads-per-stage 1 (reference)": ({"OMP_WAIT_POLICY": "PASSIVE"}, {"threads_per_stage": 1}),
}
OMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "STAGEWISE_KEEP_AWAKE", "STAGEWISE_PIN_THREADS",
            "STAGEWISE_ADAPT_THREADS")
CELL_LIMIT_S = 30.0


@contextmanager
def busy_core(core: int = 0):
    """Another process keeping one core busy for the duration (`python -c 'while True: pass'` pinned
    with taskset); standard library only, so the policy children can use it too."""
    proc = subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-c", "while True: pass"])
    time.sleep(0.5)
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def child(num_requests: int, options: dict) -> None:
    """Load the engine, then answer 'quiet' / 'loaded' lines on stdin with one JSON line of results."""
    import torch  # NOTE: first, so OpenMP starts with exactly the parent's environment, not stagewise's default

    from stagewise import LLM
    llm = LLM(kv_cache_memory="256MiB", compile_in_background=False, **options)
    _offline(llm, _prompts(llm, 4, seed=-1))        # warm-up: one-time costs out of the timings
    print(MARK + json.dumps({"threads": torch.get_num_threads()}), flush=True)
    for seed, command in enumerate(sys.stdin):
        if command.strip() == "quit":
            break
        prompts = _prompts(llm, num_requests, seed)
        with busy_core() if command.strip() == "loaded" else nullcontext():
            cell = {"tps": _offline(llm, prompts), "ms": _decode_ms(llm, prompts[0])}
        print(MARK + json.dumps(cell), flush=True)
    llm.shutdown()


def _prompts(llm, n: int, seed: int, prompt_len: int = 64) -> list[list[int]]:
    """Fresh seeded prompts for every cell: no prefix-cache hits, as in one `stagewise bench` run."""
    import random
    rng, vocab = random.Random(seed), llm.engine.tok.vocab_size
    return [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(n)]


def _offline(llm, prompts, output_len: int = 32, limit_s: float = CELL_LIMIT_S) -> float:
    """Output tok/s of one offline batch, as `stagewise bench` measures it, over at most `limit_s`
    (a policy that collapses under load would otherwise take many minutes per cell)."""
    from stagewise import SamplingParams
    engine = llm.engine
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    reqs = [engine.add_request(prompt_token_ids=p, params=params) for p in prompts]
    while engine.has_unfinished() and time.perf_counter() - t0 < limit_s:
        engine.step()
    tps = sum(len(r.output_token_ids) for r in reqs) / (time.perf_counter() - t0)
    for r in reqs:                                  # past the limit: drop the rest, untimed
        engine.abort(r.request_id)
    while engine.has_unfinished():
        engine.step()
    return tps


def _decode_ms(llm, prompt, steps: int = 32) -> float:
    """Batch-1 decode ms/token: (time for 1 + steps tokens - time for 1 token) / steps."""
    from stagewise import SamplingParams

    def run(n, ids):
        t0 = time.perf_counter()
        llm.generate(prompt_token_ids=[ids], use_tqdm=False,
                     sampling_params=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - t0
    return (run(1 + steps, prompt) - run(1, prompt[::-1])) / steps * 1e3


class PolicyProcess:
    """One child per wait policy, kept alive so the policies take turns round by round; stopped
    (SIGSTOP) between its turns so nothing it leaves running touches another policy's cells."""

    def __init__(self, env_extra: dict, options: dict, num_requests: int):
        env = {k: v for k, v in os.environ.items() if k not in OMP_VARS}
        env.update(env_extra, TOKENIZERS_PARALLELISM="false")
        from benchmarks.common import REPO
        cmd = [sys.executable, "-m", "benchmarks.kernels", "threads", "--child", json.dumps(options),
               "--num-requests", str(num_requests)]
        self.proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.threads = None

    def ready(self) -> None:
        """Wait for start-up, then stop the process: an idle ACTIVE pool would spin through other cells."""
        self.threads = self._answer()["threads"]
        self.proc.send_signal(signal.SIGSTOP)

    def measure(self, condition: str) -> dict:
        self.proc.send_signal(signal.SIGCONT)
        self.proc.stdin.write(condition + "\n")
        self.proc.stdin.flush()
        answer = self._answer()
        self.proc.send_signal(signal.SIGSTOP)
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=120)

    def _answer(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        raise RuntimeError(f"policy child exited with code {self.proc.wait()}")


def run_rounds(labels: list[str], args) -> dict:
    """Every round, each policy measures quiet then loaded; the policy order rotates between rounds."""
    children = {}
    try:
        for label in labels:                        # all at once; each is stopped once ready
            children[label] = PolicyProcess(*POLICIES[label], args.num_requests)
        for child in children.values():
            child.ready()
        results = {label: {"threads": c.threads, "quiet_tps": [], "loaded_tps": [], "quiet_ms": [],
                           "loaded_ms": []} for label, c in children.items()}
        for r in range(args.rounds):
            print(f"round {r + 1}: load average {os.getloadavg()[0]:.1f}", flush=True)
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                for condition in ("quiet", "loaded"):
                    cell = children[label].measure(condition)
                    results[label][f"{condition}_tps"].append(cell["tps"])
                    results[label][f"{condition}_ms"].append(cell["ms"])
                    print(f"  {label} {condition}: {cell['tps']:.1f} tok/s, {cell['ms']:.1f} ms/tok", flush=True)
        return results
    finally:
        for c in children.values():
            c.close()


def report(results: dict, args, header: list[str]) -> str:
    rows = ["| wait policy | threads | quiet tok/s | loaded tok/s | loaded / quiet | quiet tok/s vs the first "
            "| batch-1 decode quiet ms/tok | loaded ms/tok |", "|" + "---|" * 8]
    base = max(results[next(iter(results))]["quiet_tps"])
    for label, r in results.items():
        q, lo = max(r["quiet_tps"]), max(r["loaded_tps"])
        rows.append(f"| {label} | {r['threads']} | {q:.1f} | {lo:.1f} | {lo / q:.2f}x | {q / base:.2f}x "
                    f"| {min(r['quiet_ms']):.1f} | {min(r['loaded_ms']):.1f} |")
    return "\n".join(header + ["", *rows, "", "All rounds (tok/s quiet / loaded):", ""] +
                     [f"- {label}: {_fmt(r['quiet_tps'])} / {_fmt(r['loaded_tps'])}" for label, r in results.items()])


def _fmt(values) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--only", default=None, help="comma-separated substrings of policy labels to run")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.num_requests, json.loads(args.child))
        return 0
    from benchmarks.common import cpu_line, write_result
    header = ["# Threads on a busy machine: OpenMP wait policy, quiet vs one core kept busy", "",
              f"CPU: {cpu_line()}; {os.cpu_count()} CPUs",
              f"Default model (SmolLM2-135M GGUF, dtype auto), offline: {args.num_requests} requests "
              f"x 64 prompt / 32 output tokens, greedy; fresh prompts every cell, each cell cut at "
              f"{CELL_LIMIT_S:.0f} s (tok/s counts what was made by then); batch-1 decode: one 64-token prompt, "
              "32 decode steps. "
              f"Loaded = `python -c 'while True: pass'` pinned to core 0. Best of {args.rounds} rounds per cell, "
              "one process per policy, kept alive and stopped (SIGSTOP) between its turns; each round every policy "
              "measures quiet then loaded, in an "
              f"order that rotates between rounds, so background load from the other jobs on this shared "
              f"machine falls on every policy alike. 1-min load average at start: {os.getloadavg()[0]:.1f}."]
    print("\n".join(header), flush=True)
    labels = [label for label in POLICIES if not args.only or any(x in label for x in args.only.split(","))]
    results = run_rounds(labels, args)
    text = report(results, args, header)
    print(text)
    print(f"\nwritten to {write_result('threads', text)}")
    return 0
