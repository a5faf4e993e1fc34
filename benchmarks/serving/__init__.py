"""What `stagewise serve` delivers: `python -m benchmarks.serving NAME` (load.py, overhead.py,
profile.py, kv_tier.py); servers run as child processes (benchmarks/server_process.py) under the one
streaming load generator (benchmarks/stream_load.py)."""
