"""Pipelines and tensor parallelism: `python -m benchmarks.pipeline NAME` (microbatch.py,
levers.py, prefill_graphs.py, tp.py, recovery.py, elastic.py, link_crypto.py); engines run in
processes of their own (benchmarks/engine_process.py), elastic pipelines on a simulated cluster
(benchmarks/harness/)."""
