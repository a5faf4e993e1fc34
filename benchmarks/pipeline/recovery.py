"""Pipeline recovery time (README: When a stage fails): the default model at PP=2 on one machine,
offline engine, greedy. With N live requests decoding, stage 1 is SIGKILLed; the time from the
kill to the next generated token is split into detection (kill -> the driver knows), teardown,
start (processes + rendezvous), weight load and recompute (rebuilt -> first token, the KV of
every live request recomputed from its tokens). Rows with stages forked from the warm process (the
default) and without (--no-pipeline-spares: fresh processes import torch and transformers), and
with the KV disk tier (`--pages off,on`: the rebuilt stages read the pages of the live requests'
full blocks and recompute only the rest), the two interleaved over `--rounds`.

    nice -n 19 python -m benchmarks.pipeline recovery [--live 1,8,32] [--pages off,on] [--rounds 2]

Writes benchmarks/results/recovery.md. The numbers depend on the load of the machine (printed).
"""
from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time

from benchmarks.common import RESULTS_DIR
from stagewise import LLM, SamplingParams

COLUMNS = ("spares", "pages", "live requests", "tokens to recompute", "detect s", "teardown s", "start s", "weights s",
           "recompute s", "kill to next token s")


def measure(llm: LLM, live: int, prompt_len: int, warmup_tokens: int) -> dict:
    """One kill with `live` requests decoding (each `warmup_tokens` into its output)."""
    engine = llm.engine
    if engine.config.recovery.pipeline_spares:
        deadline = time.monotonic() + 120      # the warm process (it forked the stages: ready at once)
        while llm.stats()["recovery"]["spares_ready"] < 1 and time.monotonic() < deadline:
            engine.fault()                     # an idle engine's supervisor starts them when due
            time.sleep(0.2)
    vocab = engine.tok.vocab_size
    params = SamplingParams(max_tokens=warmup_tokens + 32, temperature=0, ignore_eos=True)
    reqs = [engine.add_request(params=params, prompt_token_ids=[(7 + 31 * i + 13 * k) % (vocab - 10) + 5
                                                               for k in range(prompt_len)])
            for i in range(live)]
    killed_at = None
    next_token_at = None
    for _out in engine.run_until_done():
        if killed_at is None and all(len(r.output_token_ids) >= warmup_tokens for r in reqs):
            recompute_tokens = sum(r.num_tokens for r in reqs)
            victim = engine.executor.procs[1].pid
            killed_at = time.monotonic()
            os.kill(victim, signal.SIGKILL)
        elif killed_at is not None and next_token_at is None and _recovered_since(engine, killed_at):
            next_token_at = time.monotonic()        # the first output after the rebuilt pipeline's first token
    last = llm.stats()["recovery"]["last"]
    total = (next_token_at or time.monotonic()) - killed_at
    stages = last["teardown_s"] + last["spawn_s"] + last["load_s"] + last["recompute_s"]
    pages = "on" if engine.config.cache.kv_cache_disk else "off"
    spares = "warm" if engine.config.recovery.pipeline_spares else "none"
    return {"spares": spares, "pages": pages, "live requests": live,
            "tokens to recompute": recompute_tokens, "detect s": max(0.0, total - stages),
            "teardown s": last["teardown_s"], "start s": last["spawn_s"], "weights s": last["load_s"],
            "recompute s": last["recompute_s"], "kill to next token s": total}


def _recovered_since(engine, t: float) -> bool:
    last = engine.supervisor.recovery.last
    return last.get("detected_at", 0.0) > t and "recompute_s" in last


def load_line() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} / {five:.2f} / {fifteen:.2f} on {os.cpu_count()} cores"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the default model)")
    ap.add_argument("--live", default="1,8,32")
    ap.add_argument("--cold-live", type=int, default=8, help="live requests of the row without spares (0: skip)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--warmup-tokens", type=int, default=16)
    ap.add_argument("--prefill-graph", default="auto", help="the engine's --prefill-graph (auto, off, ...)")
    ap.add_argument("--pages", default="off", help="KV disk tier per row set: off, on or off,on (interleaved)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default="recovery")
    args = ap.parse_args()
    rows, loads = [], [load_line()]
    common = dict(pp_size=2, max_pipeline_restarts=100, pipeline_spares_delay_s=0, kv_cache_memory="256MiB",
                  max_model_len=1024, prefill_graph=args.prefill_graph)
    for _ in range(args.rounds):
        for pages in args.pages.split(","):
            with tempfile.TemporaryDirectory(prefix="stagewise-recovery-pages-") as pages_dir:
                tier = dict(kv_cache_disk="2GiB", kv_cache_dir=pages_dir) if pages == "on" else {}
                with LLM(args.model, **common, **tier) as llm:
                    for live in (int(x) for x in args.live.split(",")):
                        rows.append(measure(llm, live, args.prompt_len, args.warmup_tokens))
                        print(rows[-1], flush=True)
    if args.cold_live:
        with LLM(args.model, pipeline_spares=False, **common) as llm:
            rows.append(measure(llm, args.cold_live, args.prompt_len, args.warmup_tokens))
            print(rows[-1], flush=True)
    loads.append(load_line())
    lines = ["# Pipeline recovery time (PP=2, one machine, offline engine)", "",
             f"Model: {args.model or 'default (SmolLM2-135M-Instruct)'}; prompts of {args.prompt_len} tokens, "
             f"stage 1 SIGKILLed once every live request has {args.warmup_tokens} output tokens; "
             f"--prefill-graph {args.prefill_graph}. "
             f"Machine: {loads[0]} before, {loads[1]} after (shared machine: approximate numbers).", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in COLUMNS)
                     + " |")
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
