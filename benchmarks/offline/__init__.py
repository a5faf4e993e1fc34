"""The offline engine (`LLM`, `stagewise generate`): `python -m benchmarks.offline NAME`
(throughput.py, startup.py, speculative.py, cpu_limit.py)."""
