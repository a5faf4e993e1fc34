"""`stagewise serve --distributed-executor-backend ray`: the leader places its pipeline's other
nodes on a running Ray cluster and starts one `stagewise serve --node-rank N` there per Ray node.
Ray only places and starts those processes (an actor pinned to its node by node affinity); they
rendezvous with the leader and carry activations over stagewise's own sealed links. Ray runs in a
helper process of its own (ray_helper.py), never in the server's.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import select
import subprocess
import sys
from dataclasses import dataclass

from ..config import EngineConfig
from .auth import cluster_token, new_token

log = logging.getLogger("stagewise.ray")
TOKEN_ENV = "STAGEWISE_CLUSTER_TOKEN"
# what the leader (or the helper) sets for each node itself
LEADER_OWN = frozenset({"nnodes", "node_rank", "min_nodes", "master_addr", "master_port", "cluster_token",
                        "dist_ifname"})
PLACE_TIMEOUT_S = 120.0     # connecting to Ray and starting the nodes' actors
STOP_TIMEOUT_S = 20.0       # the helper's own bound on stopping the nodes it started
NEEDS_RAY = ("--distributed-executor-backend ray needs Ray on this machine and on every Ray node: "
             "pip install 'stagewise[ray]'.")


@dataclass
class RayNodes:
    """The leader's handle on the helper process that started its Ray nodes; `close()` stops them."""
    proc: subprocess.Popen
    ips: list[str]

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.close()         # the helper's signal to stop the nodes and leave Ray
        try:
            self.proc.wait(STOP_TIMEOUT_S + 10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def has_ray() -> bool:
    """Whether Ray is installed here, without importing it (a second of imports and threads this
    process does not need: Ray runs in the helper)."""
    try:
        return importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):       # ValueError: sys.modules holds None for it (imports refused)
        return False


def ray_address(given: str | None) -> str:
    """--ray-address, else $RAY_ADDRESS, else `auto` (the cluster this machine's Ray node is part of;
    Ray itself would start a new one-machine cluster without an address)."""
    return given or os.environ.get("RAY_ADDRESS") or "auto"


def start_ray_nodes(config: EngineConfig, address: str | None, log_level: str = "INFO") -> tuple[EngineConfig,
                                                                                                   RayNodes]:
    """Connect to the Ray cluster at `address`, place the pipeline's nodes on its nodes and start
    them; returns the leader's config (node 0 of that many nodes, the rendezvous address, the
    cluster token) and the handle that stops them."""
    if not has_ray():
        raise ValueError(NEEDS_RAY)
    c = config.cluster
    if c.nnodes != 1 or c.node_rank != 0:
        raise ValueError("--distributed-executor-backend ray numbers the nodes itself; leave out --nnodes and "
                         "--node-rank (the leader is node 0).")
    token = cluster_token(c.cluster_token) or new_token()
    request = {"address": ray_address(address), "pp_size": config.parallel.pp_size, "min_nodes": c.min_nodes,
               "master_addr": c.master_addr if c.master_addr != "127.0.0.1" else None,
               "master_port": c.master_port, "argv": node_argv(config, log_level)}
    proc = subprocess.Popen([sys.executable, "-m", "stagewise.cluster.ray_helper"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, TOKEN_ENV: token},
                            start_new_session=True)     # a terminal's Ctrl-C reaches the leader only; it stops us
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(request) + "\n")
    proc.stdin.flush()
    if not select.select([proc.stdout], [], [], PLACE_TIMEOUT_S)[0]:
        proc.kill()
        proc.wait()
        raise ValueError(f"The Ray cluster at {request['address']} did not let this server place its nodes within "
                         f"{PLACE_TIMEOUT_S:.0f} s; check `ray status` there.")
    line = proc.stdout.readline()
    reply: dict = json.loads(line) if line.strip() else {"error": "The Ray helper process exited before it placed "
                                                         "the nodes (its log is above)."}
    if "error" in reply:
        proc.wait(STOP_TIMEOUT_S)
        raise ValueError(reply["error"])
    os.environ[TOKEN_ENV] = token          # the leader's own stage processes inherit it
    nnodes, ips = reply["nnodes"], reply["ips"]
    leader = config.replace(nnodes=nnodes, node_rank=0, min_nodes=reply["min_nodes"],
                            master_addr=reply["master_addr"], master_port=reply["master_port"], cluster_token=token)
    later = f"; {nnodes - len(ips)} more start on Ray nodes that join" if nnodes > len(ips) else ""
    log.info("Ray cluster at %s: the pipeline starts on %d node(s) (%s)%s; rendezvous at %s:%d", request["address"],
             len(ips), ", ".join(ips), later, reply["master_addr"], reply["master_port"])
    return leader, RayNodes(proc, reply["ips"])


def node_argv(config: EngineConfig, log_level: str) -> list[str]:
    """The command line of a node the helper starts, less its rank and the rendezvous: what is the
    node's own (model path, device, threads); the driver ships every engine option when it links
    the pipeline up (node_options.py)."""
    load, c = config.load, config.cluster
    argv = ["serve", "--model", str(load.model), "--device", load.device, "--pp-size", str(config.parallel.pp_size),
            "--tp-size", str(config.parallel.tp_size), "--log-level", log_level]
    own = {"--tokenizer": load.tokenizer, "--threads-per-stage": config.parallel.threads_per_stage,
           "--kv-cache-dir": config.cache.kv_cache_dir}
    argv += [str(x) for flag, value in own.items() if value is not None for x in (flag, value)]
    return argv + _changed_flags(c) + _changed_flags(config.recovery)


def _changed_flags(record) -> list[str]:
    """The flags of a cluster or recovery record that differ from their defaults (the timeouts, the
    spares), so a node's own command line agrees with the driver's options it runs with."""
    argv = []
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if f.name in LEADER_OWN or not f.metadata.get("cli", True) or value == f.default:
            continue
        name = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        if isinstance(value, bool):
            argv.append(name if value else "--no-" + name[2:])
        elif isinstance(value, (int, float, str)):
            argv += [name, str(value)]
    return argv
