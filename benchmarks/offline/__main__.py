"""The offline engine (`LLM`, `stagewise generate`)."""
from benchmarks import run_subcommand

run_subcommand("benchmarks.offline", __doc__, {
    "throughput": ("benchmarks.offline.throughput", "offline throughput and prefill latency vs HF generate"),
    "startup": ("benchmarks.offline.startup", "`stagewise generate` wall time as a new user runs it"),
    "speculative": ("benchmarks.offline.speculative", "n-gram speculative decoding on and off (and llama.cpp's)"),
    "cpu-limit": ("benchmarks.offline.cpu_limit", "batch-1 decode at the machine's limit, vs llama.cpp"),
    "kv-quant": ("benchmarks.offline.kv_quant", "q8_0/q4_0 KV cache vs bf16: bytes per token, 4K decode, agreement"),
    "invariance": ("benchmarks.offline.invariance", "split-invariant attention on vs off: throughput, prefill, decode"),
})
