"""Pipelines and tensor parallelism."""
from benchmarks import run_subcommand

run_subcommand("benchmarks.pipeline", __doc__, {
    "microbatch": ("benchmarks.pipeline.microbatch", "PP=2 micro-batched vs synchronous vs PP=1 on the same cores"),
    "levers": ("benchmarks.pipeline.levers", "balanced pipelines: each lever on and off, PP=2 vs PP=1"),
    "prefill-graphs": ("benchmarks.pipeline.prefill_graphs", "prefill graphs vs eager: per-bucket latency, PP=2 TTFT"),
    "tp": ("benchmarks.pipeline.tp", "a stage's all-reduce, and TP=2 against one process"),
    "recovery": ("benchmarks.pipeline.recovery", "how long a PP=2 pipeline takes to heal a killed stage"),
    "elastic": ("benchmarks.pipeline.elastic", "elastic pipelines on a simulated cluster: scaling, join/leave/kill"),
    "cpu-account": ("benchmarks.pipeline.cpu_account", "CPU seconds per step of each process and thread"),
    "link-crypto": ("benchmarks.pipeline.link_crypto", "what sealed links (authenticated encryption) cost a pipeline"),
})
