"""Tensor parallelism on one machine: what a stage's all-reduce costs, and TP=2 against one process.

- all-reduce: two rank processes, each with both groups of parallel/groups.py open (the
  shared-memory kernel and gloo over loopback), sum float32 tensors of the default model's hidden
  size (576) for 1, 32 and 512 rows, the two groups taking turns round by round so the load of a
  shared machine falls on both; microseconds per call, median of the rounds;
- offline decode throughput at batch 32 on a Llama of hidden 512 (8 heads, 2 KV heads, 8 layers,
  fp32, made here): one process with 2 threads against `--tp-size 2` with 1 thread per rank (the
  issue's target: TP at least 0.9x), output tok/s, best of the rounds.

    python -m benchmarks.pipeline tp [--rounds 5] [--quick]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time

import torch

from benchmarks.common import cpu_line, load_line, machine_line, markdown_table, temp_checkpoint, write_result

HIDDEN, ROWS = 576, (1, 32, 512)


def _rank(directory: str, rank: int, rounds: int, calls: int, out) -> None:
    from stagewise.kernels import comm
    from stagewise.parallel.groups import GlooGroup, open_group
    torch.set_num_threads(1)
    groups = {"shared memory": open_group(directory, rank, 2, 60.0),
              "gloo": GlooGroup(os.path.join(directory, "gloo-bench"), rank, 2, 60.0)}
    assert isinstance(groups["shared memory"], comm.ShmGroup), "the shared-memory kernel did not build"
    times: dict = {(name, rows): [] for name in groups for rows in ROWS}
    for _ in range(rounds):
        for rows in ROWS:
            x = torch.randn(rows, HIDDEN)
            for name, group in groups.items():
                for _ in range(10):
                    group.all_reduce(x)
                t0 = time.perf_counter()
                for _ in range(calls):
                    group.all_reduce(x)
                times[(name, rows)].append((time.perf_counter() - t0) / calls * 1e6)
    if rank == 0:
        out.send({k: statistics.median(v) for k, v in times.items()})
    os._exit(0)          # NOTE: gloo's threads abort at interpreter teardown; every collective is done here


def all_reduce_table(rounds: int, calls: int) -> str:
    from stagewise.parallel import groups
    directory = tempfile.mkdtemp(prefix="stagewise-tp-bench-")
    groups.prepare(directory, 2)
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=_rank, args=(directory, r, rounds, calls, writer)) for r in range(2)]
    for p in procs:
        p.start()
    result = reader.recv()
    for p in procs:
        p.join()
    rows = [[f"{n} x {HIDDEN}", result[("shared memory", n)], result[("gloo", n)],
             result[("gloo", n)] / result[("shared memory", n)]] for n in ROWS]
    return markdown_table(["float32 rows", "shared memory us", "gloo us", "gloo / shared memory"], rows)


def decode_tok_s(model_dir: str, options: dict, num_requests: int, max_tokens: int) -> float:
    from stagewise import LLM, SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    prompts = [[(7 * i + j) % 900 + 3 for j in range(16)] for i in range(num_requests)]
    with LLM(model=model_dir, dtype="float32", max_num_seqs=num_requests,
             compile_in_background=False, **options) as llm:
        llm.generate(prompt_token_ids=prompts[:2], sampling_params=params, use_tqdm=False)      # warm
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 round, few calls, short outputs")
    args = ap.parse_args()
    rounds, calls, max_tokens = (1, 50, 8) if args.quick else (args.rounds, 500, 64)
    table = all_reduce_table(rounds, calls)
    runs = {"one process, 2 threads": dict(threads_per_stage=2), "--tp-size 2, 1 thread per rank": dict(tp_size=2)}
    best = {name: 0.0 for name in runs}
    with temp_checkpoint(vocab_size=1024, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2) as model_dir:
        for _ in range(1 if args.quick else 2):
            for name, options in runs.items():
                best[name] = max(best[name], decode_tok_s(str(model_dir), options, 32, max_tokens))
    one, tp = best.values()
    text = (f"# Tensor parallelism on one machine\n\n{cpu_line()}; {machine_line()}; {load_line()} at the end.\n\n"
            f"## All-reduce per call (two rank processes)\n\n{table}\n\n"
            f"## Decode at batch 32 (Llama, hidden 512, 8 layers, fp32; output tok/s, best of the rounds)\n\n"
            + markdown_table(["run", "tok/s"], [[name, v] for name, v in best.items()])
            + f"\n\nTP / one process: {tp / one:.2f} (target 0.9)\n")
    print(text)
    print(write_result("tp", text, args.quick))
