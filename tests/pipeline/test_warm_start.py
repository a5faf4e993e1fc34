"""Stages start without imports on any node (executor/zygote.py), on the simulated cluster
(benchmarks/harness): three nodes of 0.6 CPU each (CFS quota) run a PP=3 pipeline that starts on
node 0 alone (--min-nodes 1); node 1 joins (stages move to a node that never ran one), node 2 joins
(the same), then every process of node 1 is SIGKILLed (its stages move to nodes 0 and 2). After
each move no request is lost, the greedy tokens equal the run before any move, and every stage of
the rebuilt pipeline was forked from its node's warm process: the most CPU seconds a new stage
process used from its start until it was ready stays under half of what a fresh interpreter
spends importing torch, transformers and the engine, measured here (a stage spawned fresh would
spend all of that and more). CPU seconds, not wall time: on a loaded machine the wall time of a
start says little, and a CPU quota stretches both kinds of start alike."""
from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from test_multinode import HEAL_DIST_TIMEOUT_S, HEAL_DRIVER, PORT, REJOIN_S, Node, _comm, _phase, stop_all

pytestmark = pytest.mark.slow
QUOTA = 0.6                     # CPUs' worth per node, as in the elastic benchmark
OPTIONS = {"pp_size": 3, "nnodes": 3, "min_nodes": 1, "max_tokens": 200}
IMPORTS = "import torch, transformers; import stagewise.runtime.worker, stagewise.executor.stage_proc"


def _node_args(model_dir: Path, rank: int, master: str) -> list[str]:
    return [sys.executable, "-m", "stagewise", "generate", "--model", str(model_dir), "--pp-size", "3",
            "--nnodes", "3", "--node-rank", str(rank), "--min-nodes", "1", "--master-addr", master,
            "--master-port", str(PORT), "--dist-timeout-s", str(HEAL_DIST_TIMEOUT_S)]


@pytest.fixture(scope="module")
def fresh_import_cpu_s() -> float:
    """CPU seconds a fresh interpreter spends on the imports a spawned stage makes before any work."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", IMPORTS], check=True, timeout=600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


@pytest.fixture(scope="module")
def moving(make_cluster, llama_dir, tmp_path_factory):
    """The driver (HEAL_DRIVER) on node 0, its reference run done on node 0 alone; the tests below
    start nodes 1 and 2 and kill node 1, in order, one phase each."""
    from benchmarks.harness.cluster import NodeSpec
    cluster = make_cluster([NodeSpec(cpu_quota=QUOTA) for _ in range(3)])
    log_dir = tmp_path_factory.mktemp("warm-start")
    gate = log_dir / "gate"
    gate.mkdir()
    (gate / "0").touch()
    n0 = cluster.nodes[0]
    run = {"hosts": tuple(cluster.nodes), "gate": gate, "log_dir": log_dir, "model": llama_dir,
           "driver": Node(n0, [sys.executable, "-c", HEAL_DRIVER, str(llama_dir), n0.address, str(PORT),
                               str(HEAL_DIST_TIMEOUT_S), str(REJOIN_S), str(gate), json.dumps(OPTIONS)],
                          log_dir, "warm-node0")}
    try:
        run["driver"].wait_for(lambda: '{"phase": 0,' in run["driver"].stdout(), what="the reference run")
        yield run
    finally:
        stop_all({"warm": run})


def _start_node(run: dict, rank: int) -> Node:
    host = run["hosts"][rank]
    node = run[f"node{rank}"] = Node(host, _node_args(run["model"], rank, run["hosts"][0].address),
                                     run["log_dir"], f"warm-node{rank}")
    # NOTE: a node says it is ready only once its warm process can fork stages
    node.wait_for(lambda: "joins the next one" in node.stderr(), what=f"node {rank} waiting to join")
    return node


def _check_forked(got: dict, fresh_import_cpu_s: float, nodes: list[Node]) -> None:
    """Every stage of the rebuilt pipeline was ready after under half a fresh import's CPU seconds,
    and each stage process on `nodes` is a child of that node's warm process."""
    last = got["recovery"]["last"]
    assert 0 < last["stage_cpu_s"] < fresh_import_cpu_s / 2, (last, fresh_import_cpu_s)
    for node in nodes:
        pids = node.stage_pids()
        assert pids, node.stderr()[-3000:]
        for pid in pids:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            assert _comm(ppid) == "stagewise-warm", (pid, ppid, _comm(ppid))


def test_stages_move_to_a_node_that_joins_and_start_without_imports(moving, fresh_import_cpu_s):
    node1 = _start_node(moving, 1)
    got = _phase(moving, 1, lambda: None)
    assert got["recovery"]["rebuilds"] == {"node_returned": 1}, got
    assert 1 in got["recovery"]["layout"], got
    _check_forked(got, fresh_import_cpu_s, [moving["driver"], node1])


def test_stages_move_to_a_second_node_that_joins(moving, fresh_import_cpu_s):
    node2 = _start_node(moving, 2)
    got = _phase(moving, 2, lambda: None)
    assert got["recovery"]["rebuilds"] == {"node_returned": 2}, got
    assert got["recovery"]["layout"] == [0, 1, 2], got
    _check_forked(got, fresh_import_cpu_s, [moving["driver"], moving["node1"], node2])


def test_stages_of_a_killed_node_start_without_imports_on_the_others(moving, fresh_import_cpu_s):
    """Every process of node 1 SIGKILLed mid-run: its stage moves to nodes 0 and 2 (node 2 never ran
    that layer range), forked there; nothing is lost."""
    got = _phase(moving, 3, lambda: moving["hosts"][1].kill_all())
    assert 1 not in got["recovery"]["layout"] and 2 in got["recovery"]["layout"], got
    assert got["recovery"]["last"]["rejoin_s"] < REJOIN_S, got
    _check_forked(got, fresh_import_cpu_s, [moving["driver"], moving["node2"]])
    (moving["gate"] / "end").touch()
