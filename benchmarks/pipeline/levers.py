"""Balanced pipelines on the default model: each lever on and off, PP=2 vs PP=1 on the same cores.

Run with `python -m benchmarks.pipeline levers`. The default model
(SmolLM2-135M-Instruct, its Q4_1 GGUF dequantized; dtype auto, which is fp32 on CPUs without
native bf16), the machine's 2 cores: PP=1 runs 2 intra-op threads in one process, PP=2 one thread
per stage process. Levers: the layer partition (`even` vs `auto`, the cost model), balanced
micro-batches (`STAGEWISE_BALANCE_MICRO_BATCHES=0` turns them off) and dynamic chunking
(`enable_dynamic_chunking`). Each configuration is an engine in its own process, all up at once
(prefix caching off); runs interleave them so load drift on the shared machine hits each alike,
and the load is printed with every run.

Measured, in phases (the report is rewritten after each, raw numbers in the .json beside it):
offline throughput of a decode-heavy mix (32 requests, prompts 32–256, 64 out), TTFT of one
4,096-token prompt, a prefill-heavy mix (8 requests, prompts 512–1536, 8 out), TTFT of one
8,191-token prompt (the longest that leaves room for one output token in the model's 8,192
positions); per-stage busy share (compute seconds / wall) over each generate call.

    python -m benchmarks.pipeline levers [--quick] [--rounds 2] [--skip PHASE]
"""
from __future__ import annotations

import argparse

from benchmarks.common import (
    RESULTS_DIR,
    cpu_line,
    load_line,
    machine_line,
    markdown_table,
    met,
    parallel_capacity,
    random_workload,
    write_result,
)
from benchmarks.engine_process import EngineProcess

PP1 = "PP=1, 2 threads"
PP2 = dict(pp_size=2, threads_per_stage=1, kv_cache_memory="320MiB")
FCFS = {"STAGEWISE_BALANCE_MICRO_BATCHES": "0"}       # the benchmark lever: micro-batches not balanced
OLD = "PP=2 even, FCFS"
NEW = "PP=2 auto, balanced"
DYN = "PP=2 auto, balanced, dynamic chunks"
CONFIGS = {              # label -> (engine options, environment of its process); one engine each
    PP1: (dict(pp_size=1, threads_per_stage=2, kv_cache_memory="512MiB"), {}),
    OLD: (dict(PP2, pp_layer_partition="even"), FCFS),
    "PP=2 even, balanced": (dict(PP2, pp_layer_partition="even"), {}),
    "PP=2 auto, FCFS": (dict(PP2, pp_layer_partition="auto"), FCFS),
    NEW: (dict(PP2, pp_layer_partition="auto"), {}),
    DYN: (dict(PP2, pp_layer_partition="auto", enable_dynamic_chunking=True), {}),
}
PHASES = [               # (phase, workload, configurations), in order of importance
    ("decode-heavy", (32, (32, 256), (64, 64)), [PP1, OLD, "PP=2 even, balanced", "PP=2 auto, FCFS", NEW]),
    ("TTFT 4096", (1, (4096, 4096), (1, 1)), [PP1, "PP=2 even, balanced", NEW, DYN]),
    ("prefill-heavy", (8, (512, 1536), (8, 8)), [PP1, "PP=2 even, balanced", NEW, DYN]),
    ("TTFT 8191", (1, (8191, 8191), (1, 1)), [PP1, NEW, DYN]),
]
QUICK = {"decode-heavy": (8, (32, 64), (8, 8)), "TTFT 4096": (1, (600, 600), (1, 1)),
         "prefill-heavy": (4, (300, 600), (4, 4)), "TTFT 8191": (1, (1100, 1100), (1, 1))}
VOCAB = 49152
TPUT_TARGET, TTFT_TARGET, BUBBLE_TARGET, STAGE_SPREAD = 1.15, 0.7, 0.10, 0.10


def run_phases(model: str | None, args, on_phase) -> dict:
    """phase -> label -> best (wall, busy per stage, tokens) over the rounds; interleaved per round.
    `on_phase(results)` runs after each phase (the report is rewritten as results come in)."""
    phases = [labels for phase, _, labels in PHASES if phase not in args.skip]
    wanted = [label for label in CONFIGS if any(label in labels for labels in phases)]
    engines = {label: EngineProcess(model, {"dtype": "auto", **CONFIGS[label][0]}, CONFIGS[label][1])
               for label in wanted}
    results: dict = {}
    try:
        for engine in engines.values():
            engine.ready()
        for phase, workload, labels in PHASES:
            if phase in args.skip:
                continue
            n, plen, olen = QUICK[phase] if args.quick else workload
            results[phase] = {label: [] for label in labels}
            outs = {}
            for r in range(args.rounds):
                prompts, out_lens = random_workload(n, plen, olen, VOCAB, seed=10 + r)
                for label in (labels if r % 2 == 0 else labels[::-1]):
                    wall, busy, outs[label] = engines[label].run(prompts, out_lens)
                    results[phase][label].append((wall, busy, sum(out_lens)))
                    print(f"round {r} {phase}: {label}: {wall:.2f} s, busy {[round(b, 2) for b in busy]}, "
                          f"{load_line()}", flush=True)
            results[phase]["_same"] = len({tuple(map(tuple, o)) for o in outs.values()}) == 1
            on_phase(results)
    finally:
        for engine in engines.values():
            engine.close()
    return results


def _best(runs):
    return max(runs, key=lambda x: x[2] / x[0])


def report(args, results: dict) -> str:
    lines = ["# Balanced pipelines: partition by cost, chunk by cost, balanced micro-batches", "",
             f"SmolLM2-135M-Instruct (default model, Q4_1 GGUF dequantized; dtype auto = fp32 here: no native "
             f"bf16); {cpu_line()}; {machine_line()}. Load: {args.load_before} at the start, {load_line()} at "
             f"the end; two single-thread processes got {args.capacity:.2f} of 2 cores (common.parallel_capacity) "
             f"before the runs. {args.rounds} interleaved round(s), best per configuration; greedy, ignore_eos, "
             "prefix caching off, chunks of 512. One engine per configuration, all up at once; unbalanced "
             "micro-batches are STAGEWISE_BALANCE_MICRO_BATCHES=0 in that engine's process.", ""]
    for phase, by_label in results.items():
        lines += _phase_lines(phase, by_label)
    lines += _targets(results)
    if args.quick:
        lines += ["", "_--quick smoke run: small workloads, numbers not representative._"]
    return "\n".join(lines)


def _phase_lines(phase: str, by_label: dict) -> list[str]:
    labels = [label for label in by_label if label != "_same"]
    base = _best(by_label[PP1])
    rows = []
    for label in labels:
        wall, busy, tokens = _best(by_label[label])
        speed = (base[0] / wall) if phase.startswith("TTFT") else (tokens / wall) / (base[2] / base[0])
        rows.append([label, f"{wall:.2f}", f"{tokens / wall:.1f}", f"{wall / base[0]:.2f}x" if phase.startswith(
            "TTFT") else f"{speed:.2f}x", " / ".join(f"{b / wall:.0%}" for b in busy),
            f"{max(busy) / min(busy):.2f}" if len(busy) > 1 and min(busy) > 0 else "—"])
    what = "TTFT s" if phase.startswith("TTFT") else "wall s"
    return [f"## {phase}", "", markdown_table(
        ["configuration", what, "out tok/s", "time vs PP=1" if phase.startswith("TTFT") else "tok/s vs PP=1",
         "stage busy", "busiest / idlest stage"], rows), "",
        f"identical tokens across configurations: {'yes' if by_label['_same'] else 'NO'}", ""]


def _targets(results: dict) -> list[str]:
    lines = ["## Targets", ""]
    if "decode-heavy" in results:
        by = results["decode-heavy"]
        new, pp1 = _best(by[NEW]), _best(by[PP1])
        ratio = (new[2] / new[0]) / (pp1[2] / pp1[0])
        idle = [1 - b / new[0] for b in new[1]]
        spread = max(new[1]) / min(new[1]) - 1
        lines += [
            f"- PP=2 (auto, balanced) / PP=1 offline throughput, decode-heavy: **{ratio:.2f}x** (target ≥ "
            f"{TPUT_TARGET}x: {met(ratio, TPUT_TARGET)})",
            f"- stage idle (1 - busy / wall) at decode-heavy load: {' / '.join(f'{i:.0%}' for i in idle)} (target "
            f"bubble ≤ {BUBBLE_TARGET:.0%}: {met(-max(idle), -BUBBLE_TARGET)}; idle includes transport and driver)",
            f"- auto partition's measured stage compute, busiest / idlest: {spread + 1:.2f} (target within "
            f"{STAGE_SPREAD:.0%}: {met(-spread, -STAGE_SPREAD)})"]
    if "prefill-heavy" in results:
        by = results["prefill-heavy"]
        new, pp1 = _best(by[NEW]), _best(by[PP1])
        lines.append(f"- PP=2 (auto, balanced) / PP=1, prefill-heavy: {(new[2] / new[0]) / (pp1[2] / pp1[0]):.2f}x")
    for phase in ("TTFT 4096", "TTFT 8191"):
        if phase in results:
            by = results[phase]
            fixed, dyn = _best(by[NEW])[0] / _best(by[PP1])[0], _best(by[DYN])[0] / _best(by[PP1])[0]
            target = f" (target ≤ {TTFT_TARGET}x: {met(-min(fixed, dyn), -TTFT_TARGET)})" if "4096" in phase else ""
            lines.append(f"- {phase} PP=2 / PP=1: **{fixed:.2f}x** fixed chunks, {dyn:.2f}x dynamic chunks{target}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny workloads, one round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip", action="append", default=[], help="a phase to skip (repeatable): " + ", ".join(
        phase for phase, _, _ in PHASES))
    ap.add_argument("--tag", default="", help="results go to pipeline-levers-TAG.md")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds = 1
    model = None                 # the default model (what `LLM()` loads)
    args.load_before, args.capacity = load_line(), parallel_capacity()
    name = "pipeline-levers" + (f"-{args.tag}" if args.tag else "")

    def on_phase(results):
        import json
        raw = RESULTS_DIR / f"{name}{'-quick' if args.quick else ''}.json"
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        raw.write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, "results": results}, indent=1))
        try:
            text = report(args, results)
        except Exception:   # noqa: BLE001  (the raw .json is written; a report bug must not stop the runs)
            import traceback
            traceback.print_exc()
            return
        print(text, flush=True)
        print(f"\nwritten to {write_result(name, text, args.quick)}", flush=True)
    run_phases(model, args, on_phase)
    return 0
