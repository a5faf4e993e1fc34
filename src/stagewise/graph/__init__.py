"""Captured graphs for one pipeline stage: bucket ladders and policy (plain Python, for the
driver), static buffers, binding and trim, the StageGraphRunner, and its backends (CUDA
breakable/full, compiled, and CPU emulators). Import the submodules directly; this package
imports nothing so `graph.policy` stays cheap for the driver.
"""
