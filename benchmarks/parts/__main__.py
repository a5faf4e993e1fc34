"""What one part of the engine costs."""
from benchmarks import run_subcommand

run_subcommand("benchmarks.parts", __doc__, {
    "sampler": ("benchmarks.parts.sampler", "the sampler's cost per decode step, before and after a change"),
    "outputs": ("benchmarks.parts.outputs", "per-step detokenization and stop-string checks"),
    "structured": ("benchmarks.parts.structured", "structured outputs' cost per step and per compile"),
    "compiled-steps": ("benchmarks.parts.compiled_steps", "compiled CPU steps and their kernels against eager"),
    "regions": ("benchmarks.parts.regions", "OpenMP parallel regions per batch-1 decode step (counted, gdb)"),
})
