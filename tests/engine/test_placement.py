"""Where a multi-node pipeline's stages go when a node does not rejoin (recovery/placement.py): its
stages move to node 0, and the fit check against node 0's memory names what is missing."""
from __future__ import annotations

import pytest

from stagewise.recovery.placement import fit_problem, layout_line, place_stages
from stagewise.runtime.memory import MemoryPlan

MIB = 1 << 20


def plan(stage: int, weights_mib: int) -> MemoryPlan:
    return MemoryPlan(stage, (2 * stage, 2 * stage + 2), 2048 * MIB, weights_mib * MIB, 0, 0, 10 * MIB,
                      100 * MIB, 100, MIB)


def test_a_missing_node_hands_its_stages_to_node0():
    p = place_stages((0, 0, 1, 1, 2, 2), present=[2])
    assert p.layout == (0, 0, 0, 0, 2, 2) and p.moved == (2, 3) and p.gone == (1,)
    assert place_stages((0, 1), present=[1]).moved == ()
    assert layout_line(p.layout, (2, 2, 2, 2, 2, 2)) == "node 0: stage(s) 0, 1, 2, 3 (layers 0-7); " \
                                                        "node 2: stage(s) 4, 5 (layers 8-11)"


def test_fit_counts_the_moved_stages_and_the_live_kv():
    p = place_stages((0, 1), present=[])
    plans = [plan(0, 500), plan(1, 1000)]
    # stage 1: 1000 MiB weights + 10 MiB activations + 1 MiB per block
    assert fit_problem(p, plans, live_blocks=50, num_live=3, available=1100 * MIB, rejoin_timeout_s=30) is None
    assert fit_problem(p, plans, live_blocks=50, num_live=3, available=None, rejoin_timeout_s=30) is None
    why = fit_problem(p, plans, live_blocks=200, num_live=3, available=1100 * MIB, rejoin_timeout_s=30)
    assert why == ("Node 1 did not rejoin within 30 s and node 0 cannot take over its stage(s) 1: they need 1.18 "
                   "GiB (weights, graphs and activations 0.99 GiB, KV for the 3 live request(s) 0.20 GiB) but node 0 "
                   "has 1.07 GiB available; start node 1 again with the same command.")


def test_plan_over_nodes_re_partitions_by_memory_and_speed(llama_dir, caplog):
    from stagewise.checkpoint import load_hf_config
    from stagewise.config import EngineConfig
    from stagewise.recovery.placement import plan_over_nodes
    from stagewise.runtime.cluster_plan import NodeReport
    hf = load_hf_config(llama_dir)
    config = EngineConfig(model=str(llama_dir), dtype="float32", pp_size=2, nnodes=2, master_port=29999,
                          pp_layer_partition=(2, 2), pp_node_fit="speed")
    gib = 1 << 30
    # node 1 is gone; node 3 joined; node 2 is too small for any stage
    reports = {0: NodeReport(2 * gib, 1.0), 2: NodeReport(600 << 20, 1.0), 3: NodeReport(2 * gib, 1.0)}
    with caplog.at_level("INFO", logger="stagewise.partition"):
        plan = plan_over_nodes(config, hf, reports)
    assert plan.layout == (0, 3) and plan.left_out == (2,) and sum(plan.partition) == 4
    assert "node 2 (600.0 MiB available, speed 1) is left out" in caplog.text
    assert plan_over_nodes(config, hf, reports, keep_partition=True).partition == (2, 2)
    assert plan_over_nodes(config, hf, {0: NodeReport(4 * gib)}, num_stages=2).layout == (0, 0)
    with pytest.raises(ValueError, match="cannot hold the model: .* is missing"):
        plan_over_nodes(config, hf, {0: NodeReport(700 << 20), 2: NodeReport(600 << 20)})
    # the older rule keeps working until the supervisor switches over
    assert place_stages((0, 1), present=[]).layout == (0, 0)
