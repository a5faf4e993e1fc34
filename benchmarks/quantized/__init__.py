"""stagewise against llama.cpp on quantized GGUF files: `python -m benchmarks.quantized make-models`
once (models.py: the files, made reproducibly), then `python -m benchmarks.quantized run` (bench.py:
the driver; numerics.py: perplexity and agreement; report.py and section.py: tables, the plot and
the part RESULTS.md takes). Each engine runs in its own process (benchmarks/workers/gguf_engine.py)."""
