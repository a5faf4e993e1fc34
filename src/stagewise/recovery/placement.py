"""Where a multi-node pipeline's stages run: at its start and at every rebuild (a node joined,
left or was lost), over the nodes present.

`plan_on` reads what each node reported when it joined (its memory and speed), measures node 0,
and `plan_over_nodes` chooses the layer split and the node of each stage (planning/cluster.py,
planning/planner.py); with --pp-node-fit off the command line's split stays and the stages are
spread evenly (`spread_stages`).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from ..checkpoint.facts import ModelFacts, read_facts
from ..cluster.node_reports import read_reports
from ..config import EngineConfig
from ..executor.generations import control_store
from ..planning.cluster import NodeReport, cluster_needs, plan_cluster
from ..planning.memory import DRIVER_RUNTIME_BYTES
from ..planning.resolved import Resolved

_node0: list[NodeReport] = []      # node 0's report as measured with no stage of its running


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


def plan_over_nodes(config: EngineConfig, facts: ModelFacts, reports: dict[int, NodeReport],
                    num_stages: int | None = None,
                    keep_partition: bool = False) -> NodePlan:
    """The partition and layout for the nodes in `reports` (node rank -> what it reported; node 0,
    the driver's, must be there): `num_stages` stages (default --pp-size), each fitting its node's
    memory, the slowest as fast as possible (by speed with --pp-node-fit speed). `keep_partition`:
    the resolved --pp-layer-partition stays, only nodes are chosen. ValueError (one sentence, how
    much memory is missing) when the nodes cannot hold the model."""
    assert 0 in reports, "node 0 runs the driver: its own report is measured there"
    ranks = sorted(reports)
    given = config.parallel.pp_layer_partition
    partition = given if keep_partition and isinstance(given, tuple) else None
    listed = [reports[r] for r in ranks]
    if config.parallel.pp_node_rates is not None:        # given on the command line: they win over the probes
        listed = [NodeReport(rep.available_bytes, config.parallel.pp_node_rates[r]) for rep, r in zip(listed, ranks)]
    plan = plan_cluster(cluster_needs(config, facts), listed, num_stages or config.parallel.pp_size,
                        use_speed=config.parallel.pp_node_fit == "speed" or config.parallel.pp_node_rates is not None,
                        partition=partition, ranks=ranks)
    return NodePlan(plan.partition, tuple(ranks[j] for j in plan.layout), tuple(ranks[j] for j in plan.left_out),
                    plan.shares)


def plan_on(c: EngineConfig, model_dir: str, nodes: list[int], measure: bool = True,
            keep_partition: bool = False) -> tuple[EngineConfig, tuple[int, ...]]:
    """(the config with the layer partition, the node of each stage) for a pipeline on `nodes`: by
    the memory and speed each node reported (recovery/placement.py), or with --pp-node-fit off the
    command line's partition with the stages spread evenly. Node 0 is measured now (`measure`:
    before a start, no stage of it runs) or as it was then. `keep_partition` (the user gave the layer
    counts): the partition stays, on every rebuild, and only the nodes are chosen. ValueError (one sentence) when the
    nodes cannot hold the model."""
    if c.parallel.pp_node_fit == "off" or c.cluster.master_port is None:
        return c, spread_stages(c.parallel.pp_size, nodes)
    store = control_store(c.cluster.master_addr, c.cluster.master_port)
    if measure or not _node0:
        here = NodeReport.measure()
        # NOTE: the driver runs already, so its memory is in use, not available; the planner takes
        # it from node 0's budget once more, so it is given back here
        if here.available_bytes is not None:
            here = NodeReport(here.available_bytes + DRIVER_RUNTIME_BYTES, here.speed)
        _node0[:] = [here]
    reports = {**read_reports(store, [n for n in nodes if n]), 0: _node0[0]}
    plan = plan_over_nodes(c, read_facts(model_dir), reports, keep_partition=keep_partition)
    return Resolved(partition=plan.partition).launch_config(c), plan.layout


def spread_stages(pp_size: int, nodes: list[int]) -> tuple[int, ...]:
    """The node of each stage: contiguous runs over `nodes` in order, as even as possible, the
    driver's node (first) taking the smaller share when they cannot be equal."""
    base, extra = divmod(pp_size, len(nodes))
    counts = [base + (1 if i >= len(nodes) - extra else 0) for i in range(len(nodes))]
    return tuple(node for node, count in zip(nodes, counts) for _ in range(count))
