"""The Ray backend's helper process (`python -m stagewise.cluster.ray_helper`, started by
ray_nodes.py): it connects to the Ray cluster, picks the Ray nodes the pipeline runs on (those
with the most memory, then CPUs), starts one stagewise node on each as a Ray actor pinned there,
answers the leader with one JSON line, then watches the nodes until its stdin closes. A node whose
Ray node leaves (its raylet stops) loses its actor process and gets SIGTERM: the pipeline heals
without it, and the helper starts that rank again on a Ray node that is free (one that joined)."""
from __future__ import annotations

import ctypes
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
from typing import Any

from .. import envs
from .netif import master_ip, route_address

log = logging.getLogger("stagewise.ray")
TOKEN_ENV = "STAGEWISE_CLUSTER_TOKEN"
WATCH_S = 1.0              # how often the helper looks at its nodes and at the Ray cluster
ASK_TIMEOUT_S = 10.0       # an actor that does not answer within this is counted as gone
CONNECT_TIMEOUT_S = 5.0    # the head's port must answer within this
STOP_TIMEOUT_S = 15.0      # a node gets this long to leave in order after SIGTERM
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the node's process before it runs: SIGTERM when its actor's process ends (the raylet
    stopped, or the actor was killed), so the node leaves the pipeline in order."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class NodeProcess:
    """A Ray actor holding one `stagewise serve --node-rank N` on its Ray node."""

    def __init__(self, argv: list[str], token: str):
        env = dict(os.environ, **{TOKEN_ENV: token})
        env.pop("OMP_NUM_THREADS", None)         # Ray's default for a task of 0 CPUs; the node picks its threads
        if env.get("CUDA_VISIBLE_DEVICES") == "":  # Ray hides the GPUs from an actor that asked for none
            env.pop("CUDA_VISIBLE_DEVICES")
        self.proc = subprocess.Popen([sys.executable, "-m", "stagewise", *argv], env=env,
                                     preexec_fn=_die_with_parent)

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, timeout_s: float) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def own_ip(address: str) -> str | None:
    """This machine's address towards the Ray head at `address` (HOST:PORT): which Ray node the
    leader is. Ray's own guess routes towards the internet, or falls back to the host name, which
    resolves to 127.0.0.1 on many machines (the leader then attaches to another node's raylet)."""
    host, _, port = address.rpartition(":")
    if not host or "://" in address or not port.isdigit():
        return None                      # `auto`: the cluster this machine's raylet wrote down
    try:
        return route_address(master_ip(host.strip("[]")))
    except (OSError, ValueError):
        return None


def answers(address: str) -> None:
    """Raise ConnectionError unless something listens at HOST:PORT: Ray itself retries a head that
    is not there for minutes."""
    host, _, port = address.rpartition(":")
    if not host or "://" in address or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise ConnectionError(exc.strerror or "no answer") from None


def free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def free_ray_nodes(nodes: list[dict], leader_ip: str, used: set[str]) -> list[dict]:
    """Of `ray.nodes()`, the alive ones other than the leader's machine and those `used`, most
    memory first (Ray's `memory` resource: what its node may use), then most CPUs."""
    alive = [n for n in nodes if n["Alive"] and n["NodeManagerAddress"] != leader_ip and n["NodeID"] not in used]
    return sorted(alive, key=lambda n: (-n["Resources"].get("memory", 0), -n["Resources"].get("CPU", 0),
                                        n["NodeManagerAddress"]))


class Helper:
    """The nodes this helper started: rank -> (actor, Ray node id, IP)."""

    def __init__(self, ray: Any, request: dict, token: str):
        self.ray, self.request, self.token = ray, request, token
        own = ray.get_runtime_context().get_node_id()        # the Ray node this helper (the leader) runs on
        self.leader_ip = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == own),
                              ray.util.get_node_ip_address())
        self.addr = request["master_addr"] or self.leader_ip
        self.port = request["master_port"] or free_port(self.addr)
        self.nodes: dict[int, tuple[Any, str, str]] = {}
        self.failed: set[str] = set()         # Ray nodes whose stagewise node ended: not used again
        self.left: set[int] = set()           # ranks whose node left in order
        self.nnodes = self.min_nodes = 1

    def free_nodes(self) -> list[dict]:
        used = {node_id for _, node_id, _ in self.nodes.values()} | self.failed
        return free_ray_nodes(self.ray.nodes(), self.leader_ip, used)

    def place(self) -> dict:
        """Up to one node per stage: the leader, then one per free Ray node. The pipeline starts on
        the nodes there are (or --min-nodes); ranks with no Ray node yet start on the Ray nodes that
        join later (`watch`), and join the running pipeline as any late node does."""
        self.nnodes = self.request["pp_size"]
        chosen = self.free_nodes()[:self.nnodes - 1]
        self.min_nodes = min(self.request["min_nodes"] or 1 + len(chosen), self.nnodes)
        for rank, node in enumerate(chosen, start=1):
            self.start(rank, node)
        return {"nnodes": self.nnodes, "min_nodes": self.min_nodes, "master_addr": self.addr,
                "master_port": self.port, "ips": [self.leader_ip, *(ip for _, _, ip in self.nodes.values())]}

    def start(self, rank: int, node: dict) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        argv = [*self.request["argv"], "--nnodes", str(self.nnodes), "--node-rank", str(rank), "--min-nodes",
                str(self.min_nodes), "--master-addr", self.addr, "--master-port", str(self.port)]
        actor = self.ray.remote(num_cpus=0)(NodeProcess).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
            name=f"stagewise-node-{rank}-{os.getpid()}").remote(argv, self.token)
        ip = node["NodeManagerAddress"]
        self.nodes[rank] = (actor, node["NodeID"], ip)
        log.info("started node %d on the Ray node at %s (%.1f GiB, %g CPUs)", rank, ip,
                 node["Resources"].get("memory", 0) / (1 << 30), node["Resources"].get("CPU", 0))

    def watch(self) -> None:
        """Ask every node whether it runs; start a gone one's rank again on a free Ray node."""
        ray = self.ray
        for rank, (actor, node_id, ip) in list(self.nodes.items()):
            code = None
            try:
                code = ray.get(actor.poll.remote(), timeout=ASK_TIMEOUT_S)
            except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
                continue                    # a busy machine, or a node Ray has not yet found gone: ask again
            except ray.exceptions.RayError as exc:
                why = f"its Ray node left the cluster or its actor died ({type(exc).__name__})"
            else:
                if code is None:
                    continue
                why = f"it exited with status {code}"
            del self.nodes[rank]
            self.failed.add(node_id)
            ray.kill(actor)
            if code == 0:            # it left in order (the driver ended, or it was asked to): not started again
                self.left.add(rank)
                log.info("node %d (%s) left the pipeline", rank, ip)
                continue
            log.warning("node %d (%s) is gone: %s; the pipeline heals without it", rank, ip, why)
        missing = [r for r in range(1, self.nnodes) if r not in self.nodes and r not in self.left]
        for rank, node in zip(missing, self.free_nodes()):
            log.info("node %d starts again on the Ray node at %s, which is free", rank, node["NodeManagerAddress"])
            self.start(rank, node)

    def stop(self) -> None:
        ray = self.ray
        stops = [actor.stop.remote(STOP_TIMEOUT_S) for actor, _, _ in self.nodes.values()]
        try:
            ray.get(stops, timeout=STOP_TIMEOUT_S + 5)
        except ray.exceptions.RayError:
            pass                            # a node gone meanwhile: nothing to stop there
        for actor, _, _ in self.nodes.values():
            ray.kill(actor)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # stdout carries the one reply line; Ray's copies of the nodes' output go to stderr with the leader's
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    request = json.loads(sys.stdin.readline())

    def reply(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()
    # Ray's default of hiding the GPUs from a task that asked for none warns that it will change
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    try:
        import ray
    except ImportError:
        reply({"error": "--distributed-executor-backend ray needs Ray on this machine and on every Ray node: "
                        "pip install 'stagewise[ray]'."})
        return 2
    address = request["address"]
    try:
        answers(address)
        ray.init(address=address, logging_level=logging.WARNING, _node_ip_address=own_ip(address))
    except (ConnectionError, RuntimeError, ValueError) as exc:
        reply({"error": f"No Ray cluster answers at {address} ({str(exc).splitlines()[0].rstrip('.')}); start "
                        f"one with `ray start --head`, or pass --ray-address HOST:PORT of its head."})
        return 2
    try:
        helper = Helper(ray, request, envs.STAGEWISE_CLUSTER_TOKEN or "")
        placed = helper.place()
    except (OSError, ray.exceptions.RayError) as exc:
        reply({"error": f"Could not start the pipeline's nodes on the Ray cluster at {address} ({exc})."})
        ray.shutdown()
        return 2
    try:
        reply(placed)
        while not select.select([sys.stdin], [], [], WATCH_S)[0]:
            helper.watch()
        return 0                                 # the leader closed our stdin (or exited)
    finally:
        helper.stop()
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
