"""The partition planner (planning/planner.py): every stage fits its node, the slowest stage is as
fast as possible, too-small nodes are left out, and what is missing is said in one sentence."""
from __future__ import annotations

import random

import pytest

from stagewise.parallel.partition import balanced_partition
from stagewise.planning.planner import ModelNeeds, Node, plan_partition

MIB = 1 << 20


def needs(num_layers: int = 12, layer_mib: int = 100, seed: int = 0) -> ModelNeeds:
    rng = random.Random(seed)
    return ModelNeeds(layer_costs=tuple(rng.uniform(1.0, 2.0) for _ in range(num_layers)),
                      layer_bytes=(layer_mib * MIB,) * num_layers, first_cost=0.5, last_cost=4.0,
                      first_bytes=200 * MIB, last_bytes=300 * MIB, stage_fixed_bytes=50 * MIB)


def test_equal_nodes_reproduce_the_cost_split():
    n = needs()
    for k in (1, 2, 3, 4):
        plan = plan_partition(n, [Node(100_000 * MIB)] * k, stages_per_node=[1] * k)
        assert plan.partition == balanced_partition(list(n.layer_costs), k, n.first_cost, n.last_cost)
        assert plan.layout == tuple(range(k)) and plan.left_out == ()
    two_each = plan_partition(n, [Node(100_000 * MIB)] * 2, stages_per_node=[2, 2])
    assert two_each.partition == balanced_partition(list(n.layer_costs), 4, n.first_cost, n.last_cost)
    assert two_each.layout == (0, 0, 1, 1)


def test_every_stage_fits_its_node_and_a_small_node_gets_fewer_layers():
    n = needs()
    plan = plan_partition(n, [Node(600 * MIB), Node(2000 * MIB)], stages_per_node=[1, 1])
    assert all(b <= budget for b, budget in zip(plan.stage_bytes, plan.stage_budget_bytes))
    assert plan.partition[0] <= 3            # 200 MiB embedding + 50 fixed + 3 x 100 MiB
    assert sum(plan.partition) == 12


def test_a_fast_node_gets_more_work():
    n = ModelNeeds((1.0,) * 12, (MIB,) * 12)
    plan = plan_partition(n, [Node(1 << 40, 2.0), Node(1 << 40, 1.0)], stages_per_node=[1, 1])
    assert plan.partition == (8, 4)
    assert plan.stage_times == pytest.approx((4.0, 4.0))


def test_a_node_too_small_is_left_out_with_one_line(caplog):
    from stagewise.planning.cluster import NodeReport, left_out_reason, nodes_of
    n = needs()
    nodes = [Node(2000 * MIB), Node(1500 * MIB), Node(100 * MIB)]
    plan = plan_partition(n, nodes)
    assert plan.left_out == (2,) and 2 not in plan.layout and sum(plan.partition) == 12
    assert "holds no stage" in left_out_reason(n, nodes, 2)
    assert nodes_of([NodeReport(None), NodeReport(4 << 30, 0.5)])[1].speed == 0.5


def test_a_model_no_single_node_holds_runs_over_several():
    n = needs()                       # 1.75 GiB in all
    nodes = [Node(800 * MIB), Node(800 * MIB), Node(800 * MIB)]
    plan = plan_partition(n, nodes)
    assert len(plan.partition) >= 2 and all(b <= 800 * MIB for b in plan.stage_bytes)


def test_too_little_memory_says_how_much_is_missing():
    with pytest.raises(ValueError, match=r"^The nodes together cannot hold the model: they have 1000\.0 MiB for it, "
                                         r"about \d+\.\d MiB is missing \(\d+\.\d MiB more on each of the 2 node"):
        plan_partition(needs(), [Node(500 * MIB), Node(500 * MIB)])


def test_several_stages_on_one_node_share_its_memory_and_speed():
    n = ModelNeeds((1.0,) * 8, (10 * MIB,) * 8, stage_fixed_bytes=10 * MIB)
    plan = plan_partition(n, [Node(1000 * MIB), Node(1000 * MIB)], num_stages=4)
    assert plan.layout == (0, 0, 1, 1) and plan.partition == (2, 2, 2, 2)
    assert plan.stage_budget_bytes == (500 * MIB,) * 4
    lone = plan_partition(n, [Node(1000 * MIB)], num_stages=3)
    assert lone.layout == (0, 0, 0) and lone.stage_times[0] == pytest.approx(3 * lone.partition[0])


def test_an_explicit_partition_is_kept():
    n = needs()
    plan = plan_partition(n, [Node(700 * MIB), Node(3000 * MIB), Node(3000 * MIB)], partition=(2, 5, 5))
    assert plan.partition == (2, 5, 5) and plan.layout == (0, 1, 2)
    moved = plan_partition(n, [Node(100 * MIB), Node(3000 * MIB), Node(3000 * MIB)], partition=(6, 6))
    assert moved.layout == (1, 2) and moved.left_out == (0,)
