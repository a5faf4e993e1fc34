"""Where a multi-node pipeline's stages run (recovery/placement.py): planned over the nodes present
by their reported memory and speed, or spread evenly with --pp-node-fit off."""
from __future__ import annotations

import pytest

from stagewise.recovery.placement import layout_line, spread_stages


def test_off_spreads_the_stages_evenly_over_the_nodes_there_are():
    """--pp-node-fit off: the command line's partition, stages in contiguous runs, node 0 (which also
    runs the driver) taking the smaller share."""
    assert spread_stages(4, [0, 2]) == (0, 0, 2, 2)
    assert spread_stages(3, [0, 1]) == (0, 1, 1)
    assert spread_stages(2, [0, 1, 2]) == (1, 2)
    assert spread_stages(2, [0]) == (0, 0)
    assert layout_line((0, 0, 0, 0, 2, 2), (2, 2, 2, 2, 2, 2)) == "node 0: stage(s) 0, 1, 2, 3 (layers 0-7); " \
                                                                  "node 2: stage(s) 4, 5 (layers 8-11)"


def test_plan_over_nodes_re_partitions_by_memory_and_speed(llama_dir, caplog):
    from stagewise.checkpoint.facts import read_facts
    from stagewise.config import EngineConfig
    from stagewise.planning.cluster import NodeReport
    from stagewise.recovery.placement import plan_over_nodes
    facts = read_facts(llama_dir)
    config = EngineConfig.from_kwargs(model=str(llama_dir), dtype="float32", pp_size=2, nnodes=2, master_port=29999,
                          pp_layer_partition=(2, 2), pp_node_fit="speed")
    gib = 1 << 30
    # node 1 is gone; node 3 joined; node 2 is too small for any stage
    reports = {0: NodeReport(2 * gib, 1.0), 2: NodeReport(200 << 20, 1.0), 3: NodeReport(2 * gib, 1.0)}
    with caplog.at_level("INFO", logger="stagewise.partition"):
        plan = plan_over_nodes(config, facts, reports)
    assert plan.layout == (0, 3) and plan.left_out == (2,) and sum(plan.partition) == 4
    assert "node 2 (200.0 MiB available, speed 1) is left out" in caplog.text
    assert plan_over_nodes(config, facts, reports, keep_partition=True).partition == (2, 2)
    assert plan_over_nodes(config, facts, {0: NodeReport(4 * gib)}, num_stages=2).layout == (0, 0)
    with pytest.raises(ValueError, match="cannot hold the model: .* is missing"):
        plan_over_nodes(config, facts, {0: NodeReport(300 << 20), 2: NodeReport(200 << 20)})


def test_an_explicit_partition_is_kept_on_every_node(llama_dir):
    """`--pp-layer-partition 3,1` across nodes: the driver's plan over the nodes' reports keeps the
    counts (only the nodes are chosen), at the start and at every rebuild; `auto` is re-planned by
    memory (a 3,1 split is never what the planner picks for four equal layers on equal nodes)."""
    import socket

    from stagewise.cluster.node_reports import publish_report
    from stagewise.config import EngineConfig
    from stagewise.executor.generations import control_store, next_generation
    from stagewise.planning.cluster import NodeReport
    from stagewise.recovery.placement import plan_on
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    next_generation("127.0.0.1", port, b"facts-test-key")
    publish_report(control_store("127.0.0.1", port), 1, NodeReport(4 << 30, 1.0))
    config = EngineConfig.from_kwargs(model=str(llama_dir), dtype="float32", pp_size=2, nnodes=2, master_port=port,
                                      master_addr="127.0.0.1", pp_layer_partition=(3, 1))
    kept, layout = plan_on(config, str(llama_dir), [0, 1], keep_partition=True)
    assert kept.parallel.pp_layer_partition == (3, 1) and sorted(set(layout)) == [0, 1]
    replanned, _ = plan_on(config, str(llama_dir), [0, 1])
    assert replanned.parallel.pp_layer_partition != (3, 1)
