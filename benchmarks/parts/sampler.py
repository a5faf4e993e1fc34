"""The sampler's cost per decode step, before and after a change, side by side in one run.

Batches of rows over a 49,152-token vocabulary (SmolLM2's) with logits `4 * randn` (the top 1024
tokens hold ~99% of the mass, as in a real model's peaked rows), for the sampling settings clients
send: greedy, temperature 1 (`vllm bench serve`'s default), top-k, top-p, seeded. Each code version
runs in its own process; rounds alternate the order; the figure is the median ms per `sample` call.

    python -m benchmarks.parts sampler [--before-rev REV] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import REPO, export_src, load_line, machine_line, markdown_table, write_result

VOCAB = 49152
BATCHES = (1, 16, 64)
SETTINGS = {"greedy": dict(temperature=0.0), "temperature 1": dict(temperature=1.0),
            "temperature 1, top-k 50": dict(temperature=1.0, top_k=50),
            "temperature 0.8, top-p 0.95": dict(temperature=0.8, top_p=0.95),
            "temperature 1, seeded": dict(temperature=1.0, seed=7)}


@dataclass
class Row:
    params: object
    token_ids: list[int] = field(default_factory=lambda: list(range(40)))
    num_prompt_tokens: int = 32
    input_embeds: object = None


def worker() -> dict:
    import torch

    from stagewise.request import SamplingParams
    from stagewise.runtime.sampler import Sampler
    torch.set_num_threads(2)
    logits = 4 * torch.randn(max(BATCHES), VOCAB, generator=torch.Generator().manual_seed(0))
    out = {}
    for name, kwargs in SETTINGS.items():
        for batch in BATCHES:
            sampler, rows, x = Sampler(0), [Row(SamplingParams(**kwargs))] * batch, logits[:batch]
            sampler.sample(x, rows)
            times = []
            for _ in range(15):
                t0 = time.perf_counter()
                sampler.sample(x, rows)
                times.append(time.perf_counter() - t0)
            out[f"{name}|{batch}"] = 1e3 * statistics.median(times)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before-rev", default="fc3e472^", help="git revision of the 'before' code")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker()))
        return 0
    load0 = load_line()
    os.environ.pop("OMP_WAIT_POLICY", None)          # OpenMP's default in the workers, as a user runs it
    with tempfile.TemporaryDirectory(prefix="stagewise-sampler-") as tmp:
        srcs = {"before": export_src(args.before_rev, Path(tmp)), "now": REPO / "src"}
        runs: dict[str, list[dict]] = {"before": [], "now": []}
        for r in range(args.rounds):
            for code in (("before", "now") if r % 2 == 0 else ("now", "before")):
                env = dict(os.environ, PYTHONPATH=str(srcs[code]))
                proc = subprocess.run([sys.executable, "-m", "benchmarks.parts", "sampler", "--worker"], env=env,
                                      capture_output=True, text=True, check=True)
                runs[code].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    rows = []
    for key in runs["now"][0]:
        name, batch = key.split("|")
        before = statistics.median(run[key] for run in runs["before"])
        now = statistics.median(run[key] for run in runs["now"])
        rows.append([name, batch, f"{before:.2f}", f"{now:.2f}", f"{before / now:.1f}x"])
    text = "\n".join([
        "# Sampler cost per decode step", "",
        f"`python -m benchmarks.parts sampler --before-rev {args.before_rev} --rounds {args.rounds}`; "
        f"{machine_line()}; "
        f"{load0} at the start. Logits `[batch, {VOCAB}]` = 4 * randn; median ms per `Sampler.sample` call "
        "(median over rounds), 2 threads.", "",
        markdown_table(["setting", "batch", "before (ms)", "now (ms)", "speed-up"], rows)])
    print(text)
    print(f"\nwritten to {write_result('sampler', text)}")
    return 0
