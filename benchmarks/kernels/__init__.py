"""CPU kernels and speed: `python -m benchmarks.kernels NAME` (cpu_kernels.py, quant_kernels.py,
dispatch.py, threads.py, cpu_speed.py); configurations that need an environment of their own run in
child processes started through this area (`python -m benchmarks.kernels NAME --worker/--child`)."""
