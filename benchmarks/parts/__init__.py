"""What one part of the engine costs, before and after a change: `python -m benchmarks.parts NAME`
(sampler.py, outputs.py, structured.py, compiled_steps.py, regions.py)."""
