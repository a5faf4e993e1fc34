"""The per-stage cost model behind `--pp-layer-partition auto`, and the node rate that weights it.

Costs are multiply-adds per scheduled token, counted on a meta-device copy of the model (no
weights are read): every decoder layer's parameters plus its attention over a typical context,
the embedding gather on the first stage, and the final norm, LM head and sampling on the last,
weighted by how many rows sample in the configured workload mix (decode: every row; prefill:
one row per chunk). A linear layer's time on CPU and GPU tracks its weights at small batches
(memory bound) and its FLOPs at large ones, and both are proportional to its parameters, so one
count serves both. `python -m benchmarks.pipeline microbatch` measures how far predicted shares
are from the stages' measured busy time.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ..checkpoint.facts import ModelFacts, read_facts
from ..config import EngineConfig
from ..model.loader import _architecture, resolve_dtype
from ..model.registry import get_model_class
from ..parallel.partition import StageInfo, balanced_partition, partition_layers, stage_costs, stage_infos

log = logging.getLogger("stagewise.partition")
DECODE_CONTEXT = 512          # tokens a decode row attends to (at most half the model's positions)
SAMPLE_MACS_PER_VOCAB = 4     # fp32 cast, finiteness check (amax, amin) and argmax: ~4 passes over the logits
NORM_MACS_PER_HIDDEN = 4


@dataclass(frozen=True)
class CostModel:
    """Multiply-adds per scheduled token: per layer, the first stage's extra, the last stage's extra."""
    layer_costs: tuple[float, ...]
    first_extra: float
    last_extra: float
    mix: str

    def partition(self, pp_size: int, rates: list[float] | None = None) -> tuple[int, ...]:
        return balanced_partition(list(self.layer_costs), pp_size, self.first_extra, self.last_extra, rates)

    def stage_costs(self, sizes: tuple[int, ...] | list[int]) -> list[float]:
        return stage_costs(sizes, list(self.layer_costs), self.first_extra, self.last_extra)

    def shares(self, sizes: tuple[int, ...] | list[int], rates: list[float] | None = None) -> list[float]:
        """Each stage's predicted share of the pipeline's time (time = cost / rate), summing to 1."""
        times = [c / r for c, r in zip(self.stage_costs(sizes), rates or [1.0] * len(sizes))]
        return [t / sum(times) for t in times]


def cost_model(facts: ModelFacts, model_cls, dtype: torch.dtype, mix: str = "decode",
               chunk_len: int = 512) -> CostModel:
    """Count a model's per-token multiply-adds on the meta device (see the module note)."""
    num_layers = facts.num_layers
    with torch.device("meta"):
        model = model_cls(facts.hf, StageInfo.single(num_layers), dtype)
    hidden = int(model.hidden_size)
    vocab = facts.vocab
    context = min(DECODE_CONTEXT, facts.max_positions // 2) if mix == "decode" else chunk_len
    attention = 2 * context * hidden                   # q·K and p·V over the context, per token
    layers = tuple(float(sum(p.numel() for p in model.layers[i].parameters()) + attention)
                   for i in range(num_layers))
    sampled_share = 1.0 if mix == "decode" else 1.0 / max(chunk_len, 1)
    head = (vocab * hidden + SAMPLE_MACS_PER_VOCAB * vocab) * sampled_share + NORM_MACS_PER_HIDDEN * hidden
    return CostModel(layers, first_extra=float(hidden), last_extra=float(head), mix=mix)


def cost_model_for(config: EngineConfig, facts: ModelFacts) -> CostModel:
    dtype = resolve_dtype(config.load.dtype, facts.hf, config.load.resolved_device)
    cls = get_model_class(_architecture(facts.hf, facts.path))
    return cost_model(facts, cls, dtype, config.parallel.pp_cost_mix, config.scheduler.chunked_prefill_size)


def stage_rates(config: EngineConfig) -> list[float] | None:
    """Each stage's relative speed: its node's entry of `pp_node_rates` (None: all alike)."""
    if config.parallel.pp_node_rates is None:
        return None
    return [config.parallel.pp_node_rates[s // config.stages_per_node] for s in range(config.parallel.pp_size)]


def resolve_partition(config: EngineConfig, facts: ModelFacts | None = None) -> tuple[int, ...]:
    """The layer counts per stage: `auto` from the cost model (weighted by the node rates), `even`
    (or unset) by the even rule, explicit counts as given after validation. Deterministic, so the
    driver and every node's stages resolve the same split from the same flags."""
    if facts is None:
        assert config.load.model is not None, "resolve_partition needs the resolved model path"
        facts = read_facts(config.load.model)
    num_layers = facts.num_layers
    choice = config.parallel.pp_layer_partition
    if choice == "auto" and config.parallel.pp_size > 1:
        if config.parallel.pp_size > num_layers:
            partition_layers(num_layers, config.parallel.pp_size)      # raises the even rule's clear error
        return cost_model_for(config, facts).partition(config.parallel.pp_size, stage_rates(config))
    ranges = partition_layers(num_layers, config.parallel.pp_size, None if choice == "auto" else choice)
    return tuple(b - a for a, b in ranges)


def predicted_shares(config: EngineConfig, facts: ModelFacts, partition: tuple[int, ...] | None) -> list[float]:
    """Each stage's predicted share of a step (the cost model of the resolved `partition`)."""
    if config.parallel.pp_size == 1:
        return [1.0]
    assert partition is not None, "resolved first (resolve_startup)"
    return cost_model_for(config, facts).shares(partition, stage_rates(config))


def resolved_partition(config: EngineConfig, facts: ModelFacts) -> tuple[int, ...]:
    """The layer counts per stage (how they were chosen is logged). A bad partition is a clear error
    here, before any stage process starts; stages get the counts (`auto` runs once)."""
    if config.parallel.pp_size > 1:
        for line in partition_lines(config, facts):
            logging.getLogger("stagewise.engine").info(line)      # the engine's start-up lines
    partition = resolve_partition(config, facts)
    stage_infos(facts.num_layers, config.parallel.pp_size, partition)
    return partition


def partition_lines(config: EngineConfig, facts: ModelFacts) -> list[str]:
    """The chosen split, each stage's predicted share, and the even split for comparison."""
    model = cost_model_for(config, facts)
    rates = stage_rates(config)
    chosen = resolve_partition(config, facts)
    even = tuple(b - a for a, b in partition_layers(len(model.layer_costs), config.parallel.pp_size))
    how = {"auto": f"auto (cost model, {model.mix} mix)", "even": "even"}.get(
        config.parallel.pp_layer_partition if isinstance(config.parallel.pp_layer_partition, str) else "", "explicit")

    def describe(sizes):
        shares = model.shares(sizes, rates)
        return (f"{','.join(map(str, sizes))} — predicted share per stage "
                f"{' / '.join(f'{s:.0%}' for s in shares)}, slowest/mean {max(shares) * len(shares):.2f}")
    lines = [f"partition: {how}: {describe(chosen)}"]
    if chosen != even:
        lines.append(f"even split for comparison: {describe(even)}")
    if rates is not None:
        lines.append(f"stage rates (from --pp-node-rates): {', '.join(f'{r:g}' for r in rates)}")
    return lines


def measure_node_rate(hidden: int = 1024, seconds: float = 1.0, dtype: torch.dtype = torch.float32) -> float:
    """This machine's decode-shaped matmul speed, GMAC/s, with the current torch threads: the rate to
    pass in `--pp-node-rates` (only ratios between nodes matter)."""
    x = torch.randn(16, hidden, dtype=dtype)                 # [16, H] a decode batch
    w = torch.randn(4 * hidden, hidden, dtype=dtype)         # [4H, H] an MLP projection
    x @ w.T
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        x @ w.T
        n += 1
    return n * 16 * 4 * hidden * hidden / (time.perf_counter() - t0) / 1e9
