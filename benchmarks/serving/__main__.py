"""What `stagewise serve` delivers."""
from benchmarks import run_subcommand

run_subcommand("benchmarks.serving", __doc__, {
    "load": ("benchmarks.serving.load", "throughput, TTFT and TPOT under N streaming clients, per pipeline size"),
    "overhead": ("benchmarks.serving.overhead", "how much of the offline engine's throughput the server delivers"),
    "profile": ("benchmarks.serving.profile", "where a served run's CPU time goes, per process (py-spy)"),
    "first-requests": ("benchmarks.serving.first_requests",
                       "tokens/s of the first requests after /health turns 200 vs the steady state"),
    "kv-tier": ("benchmarks.serving.kv_tier", "the prefix cache's disk tier: hits, restarts, TTFT"),
})
