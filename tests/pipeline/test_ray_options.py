"""`--distributed-executor-backend ray` before any Ray cluster is involved: the command line a
Ray node runs parses into the leader's own node, cluster and recovery options; a machine without
Ray, a rank given by hand and an unknown backend are each one sentence. (The backend across a real
two-node Ray cluster: test_ray_backend.py.)"""
from __future__ import annotations

import dataclasses
import sys

import pytest

from stagewise.cli import build_parser, engine_config_of, main
from stagewise.cli_flags import values_of
from stagewise.cluster.ray_helper import free_ray_nodes
from stagewise.cluster.ray_nodes import LEADER_OWN, node_argv, start_ray_nodes
from stagewise.cluster.rendezvous import free_port
from stagewise.config import EngineConfig
from stagewise.server.options import ServerOptions


def test_a_ray_nodes_command_line_carries_the_leaders_own_options():
    leader = EngineConfig.from_kwargs(model="/models/m", tokenizer="/models/tok", device="cpu", pp_size=4,
                                      threads_per_stage=3, kv_cache_dir="/var/kv", dist_timeout_s=20.0,
                                      heartbeat_timeout_s=2.5, node_rejoin_timeout_s=7.0, pipeline_spares=False,
                                      max_pipeline_restarts=5)
    argv = [*node_argv(leader, "DEBUG"), "--nnodes", "3", "--node-rank", "2", "--min-nodes", "3",
            "--master-addr", "10.0.0.1", "--master-port", "29500"]
    args = build_parser().parse_args(argv)
    assert args.command == "serve" and args.log_level == "DEBUG"
    node = engine_config_of(args)
    assert (node.load.model, node.load.tokenizer, node.load.device) == ("/models/m", "/models/tok", "cpu")
    assert (node.parallel.pp_size, node.parallel.threads_per_stage, node.cache.kv_cache_dir) == (4, 3, "/var/kv")
    assert node.recovery == leader.recovery
    for f in dataclasses.fields(node.cluster):
        if f.name not in LEADER_OWN and f.name != "local_stages":
            assert getattr(node.cluster, f.name) == getattr(leader.cluster, f.name), f.name
    assert (node.cluster.nnodes, node.cluster.node_rank, node.cluster.master_addr) == (3, 2, "10.0.0.1")
    assert "--distributed-executor-backend" not in argv       # a node never launches nodes of its own


def _ray_node(node_id: str, ip: str, memory_gib: float, cpus: int, alive: bool = True) -> dict:
    """One entry of `ray.nodes()`, as Ray 2.52 gives it (the fields the placement reads)."""
    return {"NodeID": node_id, "NodeManagerAddress": ip, "Alive": alive,
            "Resources": {"memory": memory_gib * (1 << 30), "CPU": float(cpus), f"node:{ip}": 1.0}}


def test_the_ray_nodes_with_most_memory_then_cpus_come_first_and_the_leaders_machine_never():
    nodes = [_ray_node("head", "10.0.0.1", 64, 32), _ray_node("small", "10.0.0.2", 8, 16),
             _ray_node("big", "10.0.0.3", 32, 4), _ray_node("big-more-cpus", "10.0.0.4", 32, 8),
             _ray_node("dead", "10.0.0.5", 128, 64, alive=False), _ray_node("busy", "10.0.0.6", 48, 8)]
    order = [n["NodeID"] for n in free_ray_nodes(nodes, "10.0.0.1", used={"busy"})]
    assert order == ["big-more-cpus", "big", "small"]


def test_without_ray_the_backend_is_one_sentence_naming_the_extra(monkeypatch, llama_dir, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)           # how Python refuses an import: as if not installed
    with pytest.raises(ValueError, match=r"pip install 'stagewise\[ray\]'\.$"):
        start_ray_nodes(EngineConfig.from_kwargs(model=str(llama_dir), pp_size=2), None)
    assert main(["serve", "--model", str(llama_dir), "--pp-size", "2", "--port", "0",
                 "--distributed-executor-backend", "ray"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("error: --distributed-executor-backend ray needs Ray on this machine and on every Ray node: "
                       "pip install 'stagewise[ray]'.")


def test_a_ray_address_where_nothing_answers_is_one_sentence(llama_dir, monkeypatch):
    """Ray alone would retry such an address for minutes."""
    pytest.importorskip("ray")
    monkeypatch.setenv("STAGEWISE_CLUSTER_TOKEN", "ray-options-test")     # restored after the test
    port = free_port()
    config = EngineConfig.from_kwargs(model=str(llama_dir), pp_size=2)
    with pytest.raises(ValueError, match=rf"^No Ray cluster answers at 127\.0\.0\.1:{port} \(Connection refused\); "
                                         r"start one with `ray start --head`, or pass --ray-address HOST:PORT of its "
                                         r"head\.$"):
        start_ray_nodes(config, f"127.0.0.1:{port}")


def test_the_ray_backend_refuses_a_rank_given_by_hand(llama_dir):
    pytest.importorskip("ray")
    config = EngineConfig.from_kwargs(model=str(llama_dir), pp_size=2, nnodes=2, master_port=29500)
    with pytest.raises(ValueError, match="numbers the nodes itself; leave out --nnodes and --node-rank"):
        start_ray_nodes(config, None)


def test_an_unknown_backend_is_refused():
    args = build_parser().parse_args(["serve", "--distributed-executor-backend", "slurm"])
    with pytest.raises(ValueError, match="distributed_executor_backend must be mp or ray, got 'slurm'"):
        ServerOptions(**values_of(ServerOptions, args))
