"""stagewise against llama.cpp on quantized GGUF files."""
from benchmarks import run_subcommand

run_subcommand("benchmarks.quantized", __doc__, {
    "make-models": ("benchmarks.quantized.models", "make the GGUF files the runs compare on (once)"),
    "make-shapes": ("benchmarks.quantized.shapes", "random-weight GGUF files at real MoE and 8B shapes"),
    "moe-nodes": ("benchmarks.quantized.moe_nodes", "one GGUF file over N memory-limited nodes vs one node"),
    "run": ("benchmarks.quantized.bench", "decode and prefill speed, memory and numerics per file, vs llama.cpp"),
})
