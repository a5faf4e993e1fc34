"""Per-stage memory plan: weights, static graph buffers, graph pools and the
activation peak are accounted first; the KV pool gets the rest of the budget.

An explicit `kv_cache_memory` sizes the KV pool directly. Otherwise the budget is 90% of
the device's memory (shared evenly by the stages on it) on CUDA, 2 GiB per stage on CPU,
and on CPU the pool is capped at what `max_num_seqs` full-length sequences can use.
"""
from __future__ import annotations

from dataclasses import dataclass

CPU_STAGE_BUDGET = 2 << 30
CUDA_UTILIZATION = 0.9


@dataclass
class MemoryPlan:
    stage: int
    layers: tuple[int, int]
    budget_bytes: int
    weights_bytes: int
    graph_buffer_bytes: int
    graph_pool_bytes: int
    activation_bytes: int
    kv_bytes: int
    num_blocks: int
    block_bytes: int

    def row(self) -> list[str]:
        mib = lambda b: f"{b / (1 << 20):.1f}"
        return [str(self.stage), f"[{self.layers[0]},{self.layers[1]})", mib(self.weights_bytes),
                mib(self.graph_buffer_bytes), mib(self.graph_pool_bytes), mib(self.activation_bytes),
                mib(self.kv_bytes), str(self.num_blocks)]


def estimate_activation_bytes(num_tokens: int, hidden: int, intermediate: int, vocab: int,
                              max_num_seqs: int, itemsize: int) -> int:
    """A forward's transient peak: a few hidden-sized tensors, the MLP, and the sampled logits."""
    return num_tokens * (8 * hidden + 3 * intermediate) * itemsize + max_num_seqs * vocab * 4 * 2


def plan_kv(stage: int, layers: tuple[int, int], *, weights: int, graph_buffers: int, graph_pools: int,
            activation: int, block_bytes: int, explicit_kv: int | None, device_total: int | None,
            stages_on_device: int, cap_blocks: int) -> MemoryPlan:
    if explicit_kv is not None:
        budget, kv = explicit_kv, explicit_kv
    elif device_total is not None:
        budget = int(device_total * CUDA_UTILIZATION) // stages_on_device
        kv = budget - weights - graph_buffers - graph_pools - activation
    else:
        budget = CPU_STAGE_BUDGET
        kv = min(budget - weights - graph_buffers - graph_pools - activation, cap_blocks * block_bytes)
    if kv < 2 * block_bytes:
        raise ValueError(f"Stage {stage} has no memory left for the KV cache ({kv / (1 << 20):.1f} MiB after "
                         f"weights and graphs); raise kv_cache_memory or use more pipeline stages.")
    num_blocks = kv // block_bytes
    return MemoryPlan(stage, layers, budget, weights, graph_buffers, graph_pools, activation,
                      num_blocks * block_bytes, num_blocks, block_bytes)


def format_memory_table(plans: list[MemoryPlan]) -> str:
    head = ["stage", "layers", "weights MiB", "graph bufs MiB", "graph pools MiB", "activations MiB",
            "KV MiB", "KV blocks"]
    rows = [head] + [p.row() for p in plans]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)
