"""Benchmarks, one module each: `python -m benchmarks.<name>` from the repository root runs one
(`--help` says what it measures). Shared code: `common.py` (checkpoints, workloads, timing, result
files), `engine_process.py` (an offline engine in a process of its own), `server_process.py`
(`stagewise serve` as a child process), `peers_procs.py` (running a peer engine's worker under
its own interpreter, `peers_engines.py` / `quantized_worker.py`). Results go to `results/` and
`RESULTS.md`. This file imports nothing: workers run under interpreters without torch."""
