"""Where a multi-node pipeline's stages run after a rebuild, when a node has not come back.

`plan_over_nodes` re-partitions over the nodes present, by the memory and speed each reported
(runtime/cluster_plan.py, parallel/planner.py): a new layer split and the node of each stage.
`place_stages` (the older rule) keeps the partition and hands a missing node's stages to node 0
if node 0's memory holds them: the per-stage memory plan the stages report at start-up plus KV
blocks for every live request.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from ..config import EngineConfig
from ..runtime.cluster_plan import NodeReport, model_facts, plan_cluster

GIB = float(1 << 30)


@dataclass(frozen=True)
class Placement:
    layout: tuple[int, ...]        # the node of each stage
    moved: tuple[int, ...]         # stages that left their command-line node
    gone: tuple[int, ...]          # nodes left out


def place_stages(layout: tuple[int, ...], present: list[int]) -> Placement:
    """`layout` (the command line's) with every stage of a node not in `present` on node 0."""
    gone = tuple(sorted({n for n in layout if n != 0 and n not in present}))
    moved = tuple(s for s, n in enumerate(layout) if n in gone)
    return Placement(tuple(0 if n in gone else n for n in layout), moved, gone)


def needed_bytes(plans: list, stages: tuple[int, ...], live_blocks: int) -> tuple[int, int]:
    """(fixed, kv) bytes `stages` need: weights, graphs and activations; KV for `live_blocks` blocks."""
    fixed = sum(plans[s].weights_bytes + plans[s].graph_buffer_bytes + plans[s].graph_pool_bytes
                + plans[s].activation_bytes for s in stages)
    return fixed, sum(plans[s].block_bytes for s in stages) * live_blocks


def fit_problem(placement: Placement, plans: list, live_blocks: int, num_live: int, available: int | None,
                rejoin_timeout_s: float) -> str | None:
    """One sentence saying what is missing when node 0 cannot take the moved stages; None if it can
    (or `available` is unknown: the stages' own memory plan is the check then)."""
    fixed, kv = needed_bytes(plans, placement.moved, live_blocks)
    if available is None or fixed + kv <= available:
        return None
    nodes = ", ".join(map(str, placement.gone))
    return (f"Node {nodes} did not rejoin within {rejoin_timeout_s:.0f} s and node 0 cannot take over its stage(s) "
            f"{', '.join(map(str, placement.moved))}: they need {(fixed + kv) / GIB:.2f} GiB (weights, graphs and "
            f"activations {fixed / GIB:.2f} GiB, KV for the {num_live} live request(s) {kv / GIB:.2f} GiB) but node 0 "
            f"has {available / GIB:.2f} GiB available; start node {nodes} again with the same command.")


def available_bytes() -> int | None:
    """MemAvailable of this host (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def layout_line(layout: tuple[int, ...], partition: tuple[int, ...]) -> str:
    """e.g. "node 0: stages 0-1 (layers 0-7)" per node."""
    ends = list(accumulate(partition))
    parts = []
    for node in sorted(set(layout)):
        stages = [s for s, n in enumerate(layout) if n == node]
        first, last = ends[stages[0]] - partition[stages[0]], ends[stages[-1]] - 1
        parts.append(f"node {node}: stage(s) {', '.join(map(str, stages))} (layers {first}-{last})")
    return "; ".join(parts)


@dataclass(frozen=True)
class NodePlan:
    """A re-partition over the nodes present: layers per stage, the node (rank) of each stage."""
    partition: tuple[int, ...]
    layout: tuple[int, ...]
    left_out: tuple[int, ...]      # present nodes given no stage (too small, or not needed)
    shares: tuple[float, ...]      # each stage's predicted share of a step


def plan_over_nodes(config: EngineConfig, hf_config, reports: dict[int, NodeReport], num_stages: int | None = None,
                    keep_partition: bool = False) -> NodePlan:
    """The partition and layout for the nodes in `reports` (node rank -> what it reported; node 0,
    the driver's, must be there): `num_stages` stages (default --pp-size), each fitting its node's
    memory, the slowest as fast as possible (by speed with --pp-node-fit speed). `keep_partition`:
    the resolved --pp-layer-partition stays, only nodes are chosen. ValueError (one sentence, how
    much memory is missing) when the nodes cannot hold the model."""
    assert 0 in reports, "node 0 runs the driver: its own report is measured there"
    ranks = sorted(reports)
    partition = config.pp_layer_partition if keep_partition and isinstance(config.pp_layer_partition, tuple) else None
    listed = [reports[r] for r in ranks]
    if config.pp_node_rates is not None:        # given on the command line: they win over the probes
        listed = [NodeReport(rep.available_bytes, config.pp_node_rates[r]) for rep, r in zip(listed, ranks)]
    plan = plan_cluster(model_facts(config, hf_config), listed, num_stages or config.pp_size,
                        use_speed=config.pp_node_fit == "speed" or config.pp_node_rates is not None,
                        partition=partition, ranks=ranks)
    return NodePlan(plan.partition, tuple(ranks[j] for j in plan.layout), tuple(ranks[j] for j in plan.left_out),
                    plan.shares)
