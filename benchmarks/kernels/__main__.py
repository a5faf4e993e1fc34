"""CPU kernels and speed on one machine."""
from benchmarks import run_subcommand

run_subcommand("benchmarks.kernels", __doc__, {
    "cpu-kernels": ("benchmarks.kernels.cpu_kernels", "the CPU kernels side by side on the default model's shapes"),
    "quant-kernels": ("benchmarks.kernels.quant_kernels", "quantized linear kernels side by side"),
    "dispatch": ("benchmarks.kernels.dispatch", "what a kernel op costs around its kernel"),
    "threads": ("benchmarks.kernels.threads", "threads on a busy machine: OpenMP wait policies and keepers"),
    "cpu-speed": ("benchmarks.kernels.cpu_speed", "CPU speed levers side by side on the default model"),
})
