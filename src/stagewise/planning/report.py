"""Memory plans from metadata: each stage's layers, weight bytes as stored (quantized layers at their
own size) and KV capacity, computed on the meta device from config.json (or a GGUF file's metadata)
alone. `stagewise plan` prints them; `node_budget` refuses, before anything loads, a model this
node cannot hold, with what is missing and the fewest machines (or the quantization) that would.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

import torch
from torch import nn

from ..checkpoint.facts import ModelFacts, read_facts
from ..checkpoint.gguf_meta import gguf_facts
from ..config import EngineConfig
from ..kernels import kv_quant
from ..kernels.quant import SUPPORTED, T
from ..model.loader import _architecture, exact_mode, resolve_dtype, stage_skeleton
from ..model.quantized import weight_bytes
from ..model.registry import get_model_class
from ..parallel import tp as tensor_parallel
from ..parallel.partition import StageInfo, balanced_partition, stage_costs, stage_infos
from .memory import (
    MemoryPlan,
    NotEnoughMemory,
    disk_tier_on,
    format_memory_table,
    in_process,
    kv_bytes_per_block,
    kv_dir,
    kv_layers,
    measured_node_bytes,
    min_kv_blocks,
    process_bytes,
    recurrent_state_bytes,
    shortfall,
    size_text,
    stage_budget_bytes,
    stage_plan,
)
from .stage_cost import partition_lines, resolve_partition


@dataclass(frozen=True)
class ModelBytes:
    """Weight bytes as held: per layer, and what the first / last stage hold besides their layers;
    the KV heads and head size one rank's cache holds."""
    layers: tuple[int, ...]
    first_extra: int
    last_extra: int
    single: int          # one stage holding everything (a tied head shares the embedding)
    kv_heads: int
    head_dim: int

    @classmethod
    def measure(cls, model_dir: str, dtype: torch.dtype, quantization: str | None, exact: bool,
                tp: tuple[int, int] | None = None, device: str = "cpu") -> ModelBytes:
        """With `tp` (rank, size): that tensor-parallel rank's bytes and heads (ranks may differ)."""
        num_layers = read_facts(model_dir).num_layers
        build = lambda stage: stage_skeleton(model_dir, stage, dtype, quantization=quantization, exact=exact, tp=tp,
                                              device=device)
        whole = build(StageInfo.single(num_layers))
        kv_heads, head_dim = whole.kv_cache_spec()       # type: ignore[operator]  # the model contract
        layers = tuple(weight_bytes(cast(nn.ModuleList, whole.layers)[i]) for i in range(num_layers))
        total = weight_bytes(whole)
        if num_layers == 1:
            return cls(layers, total - layers[0], 0, total, kv_heads, head_dim)
        first, last = (weight_bytes(build(s)) for s in stage_infos(num_layers, 2, (1, num_layers - 1)))
        return cls(layers, first - layers[0], last - sum(layers[1:]), total, kv_heads, head_dim)

    def stage_bytes(self, sizes: tuple[int, ...]) -> list[int]:
        if len(sizes) == 1:
            return [self.single]
        out, start = [], 0
        for s in sizes:
            out.append(sum(self.layers[start:start + s]))
            start += s
        out[0] += self.first_extra
        out[-1] += self.last_extra
        return out


def _plans(config: EngineConfig, facts: ModelFacts, weights: ModelBytes, sizes: tuple[int, ...],
           stages_on_node: int, node_bytes: int | None, refuse: bool) -> list[MemoryPlan]:
    dtype = resolve_dtype(config.load.dtype, facts.hf, "cpu")
    itemsize = torch.empty((), dtype=dtype).element_size()
    # NOTE: `node_bytes` is measured by a process that runs (the driver, or `stagewise plan`): its own
    # memory is in use, not available, so it is not taken off again
    budget = stage_budget_bytes(node_bytes=node_bytes, stages_on_node=stages_on_node)
    process = process_bytes(in_process(config))
    plans = []
    for stage, held in zip(stage_infos(len(weights.layers), len(sizes), sizes), weights.stage_bytes(sizes)):
        block_bytes = kv_bytes_per_block(stage, weights.kv_heads, weights.head_dim, config.cache.block_size, dtype,
                                         config.cache.kv_cache_dtype, facts.hf)
        plans.append(stage_plan(config, facts, stage, itemsize, weights=held, graph_buffers=0, block_bytes=block_bytes,
                                budget=budget, process=process, refuse=refuse))
    return plans


def _problem(config: EngineConfig, facts: ModelFacts, plans: list[MemoryPlan]) -> NotEnoughMemory | None:
    min_blocks = min_kv_blocks(facts.max_len(config.scheduler.max_model_len), config.cache.block_size)
    found = [p for p in (shortfall(plan, config.cache.kv_cache_memory, min_blocks) for plan in plans) if p is not None]
    return max(found, key=lambda p: p.missing_bytes) if found else None


def _weights_of(config: EngineConfig, facts: ModelFacts, quantization: str | None = None,
                rank: int | None = None) -> ModelBytes:
    """One rank's bytes: `rank` of each stage's tensor-parallel group, by default the one holding the
    most heads (what every rank must fit)."""
    assert config.load.model is not None, "plans need the resolved model path"
    device = config.load.resolved_device
    dtype = resolve_dtype(config.load.dtype, facts.hf, device)
    tp = None
    if config.parallel.tp_size > 1:
        size = config.parallel.tp_size
        tp = (tensor_parallel.heaviest_rank(facts.heads, facts.kv_heads, size) if rank is None else rank, size)
    return ModelBytes.measure(config.load.model, dtype, quantization or config.load.quantization,
                              exact_mode(config.load.dtype, facts.hf), tp, device)


def _fewest_stages(config: EngineConfig, facts: ModelFacts, weights: ModelBytes,
                   node_bytes: int | None) -> tuple[int, ...] | None:
    """The partition over the fewest machines like this one (one stage each) whose every stage fits:
    the smallest stage count whose memory-balanced split fits (bisection), or None."""
    single = _plans(config, facts, weights, (len(weights.layers),), 1, node_bytes, refuse=False)[0]
    room = single.budget_bytes - single.activation_bytes
    kv_per_layer = min_kv_blocks(facts.max_len(config.scheduler.max_model_len),
                                 config.cache.block_size) * single.block_bytes // len(
        weights.layers)
    costs = [float(b + kv_per_layer) for b in weights.layers]

    def split(pp: int) -> tuple[int, ...] | None:
        sizes = balanced_partition(costs, pp, weights.first_extra, weights.last_extra)
        fixed = stage_costs(sizes, costs, weights.first_extra, weights.last_extra)
        return sizes if max(fixed) <= room else None
    low, high = 2, len(costs)
    if high < low or split(high) is None:
        return None
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if split(mid) is not None else (mid + 1, high)
    return split(low)


def _remedy(config: EngineConfig, facts: ModelFacts, node_bytes: int | None) -> str:
    """What would hold the model: the fewest machines like this one, and/or a quantization."""
    weights, options = _weights_of(config, facts), []
    sizes = _fewest_stages(config, facts, weights, node_bytes)
    if sizes is not None:
        pp = len(sizes)
        auto = resolve_partition(config.replace(pp_size=pp, nnodes=1, node_rank=0, pp_node_rates=None,
                                                pp_layer_partition="auto"), facts)
        fits = _problem(config, facts, _plans(config, facts, weights, auto, 1, node_bytes, refuse=False)) is None
        flags = f"--pp-size {pp}" + ("" if fits else f" --pp-layer-partition {','.join(map(str, sizes))}")
        options.append(f"with {flags} over {pp} machines like this one (--nnodes {pp})")
    if facts.gguf is None and config.load.quantization != "int4":
        for kind in ("int8", "int4")[1 if config.load.quantization == "int8" else 0:]:
            held = _weights_of(config, facts, kind)
            if _problem(config, facts, _plans(config, facts, held, resolve_partition(config, facts),
                                              config.stages_per_node,
                                           node_bytes, refuse=False)) is None:
                where = "on this machine" if config.parallel.pp_size == 1 else "with the same stages"
                options.append(f"{where} with --quantization {kind}")
                break
    if not options:
        return "No split over machines like this one holds it: use a machine with more memory or a smaller model."
    return f"It fits {', or '.join(options)}."


def node_budget(config: EngineConfig, facts: ModelFacts, partition: tuple[int, ...]) -> int | None:
    """This node's memory budget (CPU: the user's, else measured now; elsewhere the user's), after
    checking, before anything loads, that the planned stages (`partition`) fit it; refuses one that
    does not (one sentence)."""
    if config.load.resolved_device != "cpu":
        return config.cache.node_memory_bytes
    node_bytes = config.cache.node_memory_bytes if config.cache.node_memory_bytes is not None else measured_node_bytes()
    if config.cluster.nnodes > 1 and config.parallel.pp_node_fit != "off":
        return node_bytes    # the partition is chosen by each node's reported memory when the nodes are known
    problem = _problem(config, facts, _plans(config, facts, _weights_of(config, facts), partition,
                                             config.ranks_per_node, node_bytes, refuse=False))
    if problem is not None:
        raise ValueError(f"{config.load.model} does not fit this machine's memory: {problem} "
                         f"{_remedy(config, facts, node_bytes)}")
    return node_bytes


def plan_report(config: EngineConfig) -> str:
    model_dir = config.load.model
    assert model_dir is not None, "plan_report needs the resolved model path (cli.config_from_args)"
    facts = read_facts(model_dir)
    device = config.load.resolved_device
    dtype = resolve_dtype(config.load.dtype, facts.hf, device)
    tensor_parallel.check_model(facts.hf, get_model_class(_architecture(facts.hf, model_dir)), config.parallel.tp_size)
    node_bytes = config.cache.node_memory_bytes if config.cache.node_memory_bytes is not None else measured_node_bytes()
    plans, labels = _rank_plans(config, facts, node_bytes)
    problem = _problem(config, facts, plans) if device == "cpu" else None
    tokens = max(0, min(p.num_blocks for p in plans) - 1) * config.cache.block_size
    budget = "unknown (2 GiB per stage)" if node_bytes is None else size_text(node_bytes)
    verdict = (f"does not fit: {problem} {_remedy(config, facts, node_bytes)}" if problem is not None
               else f"KV capacity: {tokens} tokens "
                    f"({tokens // facts.max_len(config.scheduler.max_model_len)} full-length sequences)")
    ranks = (f" x {config.parallel.tp_size} tensor-parallel ranks (a row per rank, as stage/rank; a stage's ranks "
             f"hold the KV blocks of its smallest pool)") if config.parallel.tp_size > 1 else ""
    stages = config.parallel.pp_size
    return (f"model {model_dir}: {facts.num_layers} layers, {stages} stage(s){ranks}, {dtype}, {device}\n"
            f"{_weights_line(config, facts, dtype)}{_partition_text(config, facts)}"
            f"memory budget per node: {budget} (what this process may use, less a margin)\n"
            f"{format_memory_table(plans, labels)}\n{budget_line(config)}\n{kv_line(config, facts, dtype)}\n"
            f"{verdict}")


def kv_line(config: EngineConfig, facts: ModelFacts, dtype) -> str:
    """The KV cache's format and bytes per token over every layer, against bf16's (`--kv-cache-dtype`)."""
    name = config.cache.kv_cache_dtype
    whole = StageInfo.single(facts.num_layers)
    layers = kv_layers(facts.hf, whole)         # a hybrid model's linear-attention layers hold no KV
    per_token = 2 * facts.kv_heads * layers * kv_quant.row_bytes(name, facts.head_dim, dtype)
    bf16 = 2 * facts.kv_heads * layers * kv_quant.row_bytes("bf16", facts.head_dim, dtype)
    stored = str(dtype).removeprefix("torch.") if name == "auto" else name
    over = "all layers" if layers == facts.num_layers else f"its {layers} attention layers of {facts.num_layers}"
    line = (f"KV cache: {stored} (--kv-cache-dtype {name}), {per_token:,} bytes per token over {over}, "
            f"{per_token / bf16:.2f}x of bf16")
    state = recurrent_state_bytes(facts.hf, whole, dtype.itemsize)
    if state:
        line += (f"\nrecurrent state: {state:,} bytes ({size_text(state)}) per request over the "
                 f"{facts.num_layers - layers} linear-attention layers, whatever its length (one slot per "
                 f"running request); prefix caching is off for this model")
    return line


def _rank_plans(config: EngineConfig, facts: ModelFacts,
                node_bytes: int | None) -> tuple[list[MemoryPlan], list[str] | None]:
    """Every stage's plan; with tensor parallelism one per rank (ranks may hold different heads),
    labelled stage/rank, rank by rank within a stage."""
    sizes = resolve_partition(config, facts)
    if config.parallel.tp_size == 1:
        return (_plans(config, facts, _weights_of(config, facts), sizes, config.ranks_per_node, node_bytes,
                       refuse=False), None)
    heads, kv = facts.heads, facts.kv_heads
    measured: dict[tuple, ModelBytes] = {}       # ranks with the same head counts hold the same bytes
    per_rank = []
    for rank in range(config.parallel.tp_size):
        counts = tuple(n for _, n in tensor_parallel.head_ranges(heads, kv, rank, config.parallel.tp_size))
        if counts not in measured:
            measured[counts] = _weights_of(config, facts, rank=rank)
        per_rank.append(_plans(config, facts, measured[counts], sizes, config.ranks_per_node, node_bytes, refuse=False))
    plans, labels = [], []
    for stage in range(len(sizes)):
        blocks = min(ranks[stage].num_blocks for ranks in per_rank)      # what the stage's ranks agree on
        for rank, ranks in enumerate(per_rank):
            plans.append(replace(ranks[stage], num_blocks=blocks, kv_bytes=blocks * ranks[stage].block_bytes))
            labels.append(f"{stage}/{rank}")
    return plans, labels


def _weights_line(config: EngineConfig, facts: ModelFacts, dtype: torch.dtype) -> str:
    """How weights are held: a GGUF file's types (kept quantized or converted), or --quantization."""
    if facts.gguf is None:
        return f"weights quantized at load: {config.load.quantization}\n" if config.load.quantization else ""
    path = Path(facts.gguf)
    types = Counter(gguf_facts(path).types.values())
    listed = ", ".join(f"{n} {t}" for t, n in types.most_common())
    if config.load.resolved_device != "cpu":       # the quantized kernels are CPU kernels
        return (f"GGUF {path.name}: {listed} tensors, {path.stat().st_size / 2**20:.1f} MiB on disk; all held "
                f"as {dtype} on {config.load.resolved_device}; weights below are as held\n")
    kept = sum(n for t, n in types.items() if T.__members__[t] in SUPPORTED)
    mode = "exact" if exact_mode(config.load.dtype, facts.hf) else "fast"
    return (f"GGUF {path.name}: {listed} tensors, {path.stat().st_size / 2**20:.1f} MiB on disk; {kept} kept "
            f"quantized ({mode} mode), the rest held as {dtype}; weights below are as held\n")


def _partition_text(config: EngineConfig, facts: ModelFacts) -> str:
    return "".join(line + "\n" for line in partition_lines(config, facts)) if config.parallel.pp_size > 1 else ""


def budget_line(config) -> str:
    """What `stagewise plan` says about the disk tier."""
    if not config.cache.kv_cache_disk:
        return "KV disk tier: off (--kv-cache-disk SIZE keeps prefix-cache pages on disk across restarts)"
    if not disk_tier_on(config):
        why = ("the prefix cache is off" if not config.cache.enable_prefix_caching
               else "tensor parallelism is not paged yet")
        return f"KV disk tier: off ({why})"
    return (f"KV disk tier: {size_text(config.cache.kv_cache_disk)} in {kv_dir(config)}, split over the stages by "
            f"their layers (least recently used pages go first)")
