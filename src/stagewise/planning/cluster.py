"""A model's needs and the nodes' reports, as the partition planner (planning/planner.py) takes
them: weights as held per layer (quantized as stored), the KV floor, activations and each
process's runtime per stage, the driver's process on node 0; node budgets from what each node
reported (MemAvailable and its cgroup's room, less the engine's margin). `stagewise plan
--cluster` prints the plan for a described cluster."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import torch

from ..checkpoint.facts import ModelFacts
from ..config import EngineConfig, parse_size
from ..model.loader import resolve_dtype
from ..parallel.partition import StageInfo
from .memory import (
    DRIVER_RUNTIME_BYTES,
    FALLBACK_CPU_BYTES,
    available_bytes,
    cap_blocks,
    cgroup_unknown,
    kv_bytes_per_block,
    min_kv_blocks,
    node_budget_bytes,
    process_bytes,
    size_text,
    stage_plan,
)
from .planner import ClusterPlan, ModelNeeds, Node, plan_partition, useful_nodes
from .report import ModelBytes, _weights_of
from .stage_cost import cost_model_for, measure_node_rate

log = logging.getLogger("stagewise.partition")
SPEED_PROBE_S = 0.05          # a node's speed report: this long of decode-shaped matmuls


@dataclass(frozen=True)
class NodeReport:
    """What a node publishes when it joins: the memory it may use now and its measured speed."""
    available_bytes: int | None      # MemAvailable and the cgroup's room (None: the OS says nothing)
    speed: float = 1.0               # GMAC/s of the probe, or any relative speed

    def to_json(self) -> str:
        return json.dumps({"available_bytes": self.available_bytes, "speed": self.speed})

    @classmethod
    def from_json(cls, text: str | bytes) -> NodeReport:
        data = json.loads(text)
        return cls(data.get("available_bytes"), float(data.get("speed", 1.0)))

    @classmethod
    def measure(cls, probe_s: float = SPEED_PROBE_S) -> NodeReport:
        unknown = cgroup_unknown()
        if unknown:
            log.warning("%s", unknown)
        return cls(available_bytes(), measure_node_rate(seconds=probe_s))


def parse_cluster(text: str) -> list[NodeReport]:
    """`16GiB:1.0,8GiB:0.6,4GiB` (available memory[:relative speed], node 0 first) as reports."""
    reports = []
    for item in (part.strip() for part in text.split(",")):
        size, _, speed = item.partition(":")
        try:
            rate = float(speed) if speed else 1.0
        except ValueError:
            raise ValueError(f"--cluster node {item!r} has speed {speed!r}; write memory:speed, e.g. 8GiB:0.5.") \
                from None
        if not rate > 0:
            raise ValueError(f"--cluster node {item!r} needs a positive speed, e.g. 8GiB:0.5.")
        reports.append(NodeReport(parse_size(size, f"--cluster node {item!r}: memory"), rate))
    return reports


def nodes_of(reports: list[NodeReport], use_speed: bool = True) -> list[Node]:
    """Each node's budget (node 0 also runs the driver's process) and speed."""
    nodes = []
    for i, r in enumerate(reports):
        budget = FALLBACK_CPU_BYTES if r.available_bytes is None else node_budget_bytes(r.available_bytes)
        driver = DRIVER_RUNTIME_BYTES if i == 0 else 0
        nodes.append(Node(max(0, budget - driver), r.speed if use_speed else 1.0, f"node {i}"))
    return nodes


@dataclass(frozen=True)
class ClusterNeeds:
    """The model's needs for the planner, with what the report shows per stage."""
    needs: ModelNeeds
    weights: ModelBytes
    kv_block_bytes_per_layer: int
    block_size: int
    cap_blocks: int             # KV blocks max_num_seqs full-length sequences use

    def kv_tokens(self, plan: ClusterPlan, stage: int) -> int:
        """Tokens of KV the stage's budget holds after its fixed bytes (at most the cap)."""
        a = sum(plan.partition[:stage])
        n = plan.partition[stage]
        block_bytes = self.kv_block_bytes_per_layer * n
        floor = sum(self.needs.layer_bytes[a:a + n]) - sum(self.weights.layers[a:a + n])
        room = plan.stage_budget_bytes[stage] - plan.stage_bytes[stage] + floor
        return max(0, min(room // block_bytes, self.cap_blocks) - 1) * self.block_size


def cluster_needs(config: EngineConfig, facts: ModelFacts) -> ClusterNeeds:
    """Costs from the cost model; bytes as held; per stage the activation peak and runtime (from the
    one-layer stage plan: the same arithmetic a stage sizes itself by)."""
    dtype = resolve_dtype(config.load.dtype, facts.hf, "cpu")
    weights, costs = _weights_of(config, facts), cost_model_for(config, facts)
    one = StageInfo(0, 1, 0, 1, 1)
    per_layer = kv_bytes_per_block(one, weights.kv_heads, weights.head_dim, config.cache.block_size, dtype,
                                   config.cache.kv_cache_dtype)
    plan = stage_plan(config, facts, one, torch.empty((), dtype=dtype).element_size(), weights=0, graph_buffers=0,
                      block_bytes=per_layer, budget=0, process=process_bytes(shares_driver=False), refuse=False)
    floor = min_kv_blocks(facts.max_len(config.scheduler.max_model_len), config.cache.block_size) * per_layer
    needs = ModelNeeds(costs.layer_costs, tuple(b + floor for b in weights.layers), costs.first_extra,
                       costs.last_extra, weights.first_extra, weights.last_extra,
                       plan.activation_bytes + plan.process_bytes,
                       weights.single + floor * len(weights.layers))
    return ClusterNeeds(needs, weights, per_layer, config.cache.block_size,
                        cap_blocks(config, facts.max_len(config.scheduler.max_model_len)))


def plan_cluster(facts: ClusterNeeds, reports: list[NodeReport], num_stages: int | None = None,
                 stages_per_node: list[int] | None = None, use_speed: bool = True,
                 partition: tuple[int, ...] | None = None, ranks: list[int] | None = None) -> ClusterPlan:
    """The planner's choice over `reports` (node 0 first; `ranks`: their node ranks, for the log);
    each node left out is logged once."""
    nodes = nodes_of(reports, use_speed)
    plan = plan_partition(facts.needs, nodes, num_stages, stages_per_node, partition)
    for j in plan.left_out:
        log.info("node %d (%s available, speed %g) is left out: %s", (ranks or list(range(len(nodes))))[j],
                 _available(reports[j]), reports[j].speed, left_out_reason(facts.needs, nodes, j))
    return plan


def left_out_reason(needs: ModelNeeds, nodes: list[Node], node: int) -> str:
    if node not in useful_nodes(needs, nodes):
        return (f"its budget of {size_text(nodes[node].budget_bytes)} holds no stage (one layer with its KV "
                f"floor, activations and a process need {size_text(min(needs.layer_bytes) + needs.stage_fixed_bytes)})")
    return "the plan is as fast without it (or needs no more stages)"


def _available(report: NodeReport) -> str:
    return "unknown" if report.available_bytes is None else size_text(report.available_bytes)


def cluster_report(config: EngineConfig, model: ModelFacts, reports: list[NodeReport]) -> str:
    """`stagewise plan --cluster`: one row per stage (node, layers, weights, KV, predicted share),
    then the nodes left out."""
    facts = cluster_needs(config, model)
    partition = config.parallel.pp_layer_partition if isinstance(config.parallel.pp_layer_partition, tuple) else None
    num_stages = len(partition) if partition else (config.parallel.pp_size if config.parallel.pp_size > 1 else None)
    plan = plan_partition(facts.needs, nodes_of(reports), num_stages, None, partition)    # left-out nodes: below
    rows = [["stage", "node", "node memory", "speed", "layers", "weights MiB", "KV tokens", "share"]]
    start = 0
    for s, (node, n) in enumerate(zip(plan.layout, plan.partition)):
        held = sum(facts.weights.layers[start:start + n]) + (facts.weights.first_extra if s == 0 else 0) + (
            facts.weights.last_extra if s == len(plan.partition) - 1 else 0)
        rows.append([str(s), str(node), _available(reports[node]), f"{reports[node].speed:g}",
                     f"[{start},{start + n})", f"{held / (1 << 20):.1f}", str(facts.kv_tokens(plan, s)),
                     f"{plan.shares[s]:.0%}"])
        start += n
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    nodes = nodes_of(reports)
    lines += [f"node {j} ({_available(reports[j])}, speed {reports[j].speed:g}) is left out: "
              f"{left_out_reason(facts.needs, nodes, j)}" for j in plan.left_out]
    head = (f"cluster plan: {len(reports)} node(s), {len(plan.partition)} stage(s), partition "
            f"{','.join(map(str, plan.partition))}, slowest/mean {max(plan.shares) * len(plan.shares):.2f}")
    return "\n".join([head, *lines])
