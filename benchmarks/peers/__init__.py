"""stagewise side by side with HF transformers, vLLM-CPU and llama.cpp on a real model:
`python -m benchmarks.peers` (bench.py: the driver; model.py: the model every engine loads;
serving.py: the served half; report.py: tables and the plot). Each engine runs in its own
process under its own interpreter (benchmarks/peer_process.py, benchmarks/workers/peer_engine.py)."""
