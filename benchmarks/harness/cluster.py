"""A cluster on one machine: N nodes, each a network namespace linked to a bridge in a "switch"
namespace (nothing touches the host's network), with a link of chosen delay and rate and cgroups
for memory, CPU set and CPU quota. Owns their creation, the processes run in them, and removing
all of it (context manager, atexit, and a sweep of what a killed harness left behind).
"""
from __future__ import annotations

import atexit
import os
import re
import select
import shlex
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from benchmarks.harness.cgroups import (
    Limits,
    NodeCgroup,
    Unsupported,
    cluster_bases,
    kill,
    remove_stale,
    rmdir_retrying,
)

RELAY = Path(__file__).with_name("relay.py")
PROBE = Path(__file__).with_name("probe.py")   # link measurements from inside nodes (see its docstring)
NODE_DEV = "eth0"                  # the node's side of its link (each namespace has its own names)
PREFIX = "swc"                     # namespace names: swc-<owner pid>-<tag>-s (switch) / -n<i> (node)
# Variables that would hide the interface choice or make a node think torchrun started it.
SCRUBBED_PREFIXES = ("GLOO_", "NCCL_", "STAGEWISE_DIST_", "TORCHELASTIC_")
SCRUBBED = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"}

_live: set[Cluster] = set()


def scrubbed_env(**overrides: str) -> dict[str, str]:
    """This process's environment without launcher variables, unbuffered, plus `overrides`."""
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED and not k.startswith(SCRUBBED_PREFIXES)}
    return {**env, "PYTHONUNBUFFERED": "1", **overrides}


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and res.returncode:
        raise RuntimeError(f"ip {' '.join(args)} failed: {res.stderr.strip()}")
    return res


def tc(netns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["tc", "-n", netns, *args], capture_output=True, text=True, timeout=30)
    if check and res.returncode:
        raise RuntimeError(f"tc -n {netns} {' '.join(args)} failed: {res.stderr.strip()}")
    return res


def read_line(proc: subprocess.Popen, timeout: float) -> str | None:
    """The next line of a text-mode `proc.stdout` (stripped), or None if none comes in `timeout` s
    (e.g. a server's "ready"); the process is not stopped."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline().strip() if ready else None


@dataclass(frozen=True)
class NodeSpec:
    """One node: its link (delay added to every frame it sends, as netem on its interface would, so
    two nodes of delays a and b see an RTT of a + b; rate in both directions; 0 is unlimited) and
    its limits (memory in bytes, a cpuset list such as "0", CPUs' worth of quota such as 0.5)."""
    delay_ms: float = 0.0
    rate_mbit: float = 0.0
    memory_bytes: int | None = None
    cpus: str | None = None
    cpu_quota: float | None = None

    def limits(self) -> Limits:
        return Limits(self.memory_bytes, self.cpus, self.cpu_quota)


@dataclass(eq=False)
class Node:
    """One node of a Cluster: its namespace, address (on the cluster's /24), spec, cgroups and relay."""
    index: int
    netns: str
    address: str
    spec: NodeSpec
    cgroup: NodeCgroup | None = None
    relay: subprocess.Popen | None = field(default=None, repr=False)
    env: dict[str, str] = field(default_factory=dict)     # what every process of the node gets

    def command(self, args: Sequence[str]) -> list[str]:
        """`args` run in this node: its pid joins the node's cgroups before anything is exec'd, and
        nsenter execs the command, so the pid returned by Popen is the command's. Not `ip netns
        exec`: it mounts a fresh /sys, which hides /sys/fs/cgroup (the engine reads its limits there)."""
        joins = [f"echo $$ > {shlex.quote(str(p))}" for p in (self.cgroup.procs_files() if self.cgroup else [])]
        script = " && ".join([*joins, f'exec nsenter --net={shlex.quote(f"/run/netns/{self.netns}")} "$@"'])
        return ["sh", "-c", script, "sh", *args]

    def popen(self, args: Sequence[str], stdout: Any = None, stderr: Any = None,
              env: dict[str, str] | None = None, **kwargs: Any) -> subprocess.Popen:
        """Starts `args` in this node; `env` overrides variables of the node's scrubbed environment."""
        return subprocess.Popen(self.command(args), stdout=stdout, stderr=stderr,
                                env=self._env(env), **kwargs)

    def run(self, args: Sequence[str], timeout: float = 60, env: dict[str, str] | None = None,
            input: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(args), env=self._env(env), capture_output=True,
                              text=True, timeout=timeout, input=input)

    def _env(self, overrides: dict[str, str] | None) -> dict[str, str]:
        return scrubbed_env(**{**self.env, **(overrides or {})})

    def pids(self) -> set[int]:
        """Every process in this node's namespace or cgroups."""
        found = {int(p) for p in ip("netns", "pids", self.netns, check=False).stdout.split()}
        return found | (self.cgroup.pids() if self.cgroup else set())

    def kill_all(self, timeout: float = 5.0) -> None:
        """SIGKILL every process of the node, until none is left; raises if some survive `timeout`."""
        deadline = time.monotonic() + timeout
        while left := self.pids():
            if time.monotonic() >= deadline:
                raise RuntimeError(f"processes {sorted(left)} are still in node {self.index} after {timeout} s")
            for pid in left:
                kill(pid)
            time.sleep(0.05)


class Cluster:
    """N nodes on one bridge: `with Cluster([NodeSpec(...), ...]) as c: c.nodes[1].popen([...])`.

    `env`: variables every node's processes get (over this process's environment less launcher
    variables). Raises Unsupported (one sentence) where the kernel lacks namespaces, TAP devices or
    a cgroup controller; anything else that fails raises RuntimeError."""

    def __init__(self, specs: Sequence[NodeSpec], env: dict[str, str] | None = None) -> None:
        if not 1 <= len(specs) <= 250:
            raise ValueError("a cluster has 1 to 250 nodes")
        self.tag = uuid.uuid4().hex[:6]
        self.name = f"{PREFIX}-{os.getpid()}-{self.tag}"
        self.switch = f"{self.name}-s"
        # Each cluster's bridge is private, so addresses never clash; a distinct /24 per cluster
        # still keeps logs of parallel clusters apart.
        self.subnet = f"10.78.{int(self.tag, 16) % 250 + 1}"
        self.nodes = [Node(i, f"{self.name}-n{i}", f"{self.subnet}.{i + 1}", spec, env=dict(env or {}))
                      for i, spec in enumerate(specs)]
        self.cgroup_bases: dict[str, Path] = {}
        self._closed = False
        _live.add(self)
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        sweep_stale()
        self._netns_add(self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        controllers = sorted({c for n in self.nodes for c in n.spec.limits().controllers()})
        if controllers:
            self.cgroup_bases = cluster_bases(self.name, controllers)
        for node in self.nodes:
            self._netns_add(node.netns)
            ip("-n", node.netns, "link", "set", "lo", "up")
            self._link(node, node.spec.delay_ms)
            self._shape(node, node.spec.rate_mbit)
            if controllers:
                bases = {c: b for c, b in self.cgroup_bases.items() if c in node.spec.limits().controllers()}
                node.cgroup = NodeCgroup(bases, f"n{node.index}", node.spec.limits())

    def _netns_add(self, name: str) -> None:
        if (res := ip("netns", "add", name, check=False)).returncode:
            raise Unsupported(f"`ip netns add` was refused ({res.stderr.strip()}); the cluster needs root on Linux")

    def _link(self, node: Node, delay_ms: float) -> None:
        """The node's link to the bridge: a veth pair, or (with a delay) two TAPs and a relay."""
        port = f"p{node.index}"
        if delay_ms > 0:
            node.relay = self._start_relay(node, port, delay_ms)
        else:
            ip("link", "add", NODE_DEV, "netns", node.netns, "type", "veth", "peer", "name", port,
               "netns", self.switch)
        ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        ip("-n", node.netns, "addr", "add", f"{node.address}/24", "dev", NODE_DEV)
        ip("-n", node.netns, "link", "set", NODE_DEV, "up")

    def _start_relay(self, node: Node, port: str, delay_ms: float) -> subprocess.Popen:
        if not os.path.exists("/dev/net/tun"):
            raise Unsupported("the kernel has no TAP device (/dev/net/tun), which a delayed link needs")
        ip("-n", node.netns, "tuntap", "add", "dev", NODE_DEV, "mode", "tap")
        ip("-n", self.switch, "tuntap", "add", "dev", port, "mode", "tap")
        relay = subprocess.Popen([sys.executable, str(RELAY), node.netns, self.switch, NODE_DEV, port,
                                  str(delay_ms)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        if read_line(relay, timeout=10) != "ready":
            relay.kill()
            raise RuntimeError(f"the relay of node {node.index} did not start: {relay.communicate(timeout=5)[1]}")
        return relay

    def _shape(self, node: Node, rate_mbit: float) -> None:
        """tbf at `rate_mbit` on both ends of the link (node egress, and the switch port's egress,
        which is the node's ingress); 0 removes it."""
        for netns, dev in ((node.netns, NODE_DEV), (self.switch, f"p{node.index}")):
            if rate_mbit <= 0:
                tc(netns, "qdisc", "del", "dev", dev, "root", check=False)
                continue
            # A burst of 2 ms at the rate (at least 16 KiB), a queue of 50 ms: TCP reaches the rate
            # without the queue adding much delay of its own.
            burst = max(16384, int(rate_mbit * 1e6 / 8 * 0.002))
            tc(netns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit",
               "burst", str(burst), "latency", "50ms")

    def set_link(self, node: Node, delay_ms: float | None = None, rate_mbit: float | None = None) -> None:
        """Changes a node's link (None keeps a value); a veth link given a delay becomes a relayed one."""
        if delay_ms is not None and node.relay is not None:
            assert node.relay.stdin is not None
            node.relay.stdin.write(f"{delay_ms}\n")
            node.relay.stdin.flush()
        elif delay_ms:
            ip("-n", node.netns, "link", "del", NODE_DEV)      # deletes the veth pair
            self._link(node, delay_ms)
            rate_mbit = node.spec.rate_mbit if rate_mbit is None else rate_mbit
        if rate_mbit is not None:
            self._shape(node, rate_mbit)
        node.spec = replace(node.spec, delay_ms=node.spec.delay_ms if delay_ms is None else delay_ms,
                            rate_mbit=node.spec.rate_mbit if rate_mbit is None else rate_mbit)

    def cut(self, node: Node) -> None:
        """The node's cable pulled at the switch: its frames go nowhere, its interface stays up."""
        ip("-n", self.switch, "link", "set", f"p{node.index}", "down")

    def restore(self, node: Node) -> None:
        ip("-n", self.switch, "link", "set", f"p{node.index}", "up")

    def close(self) -> None:
        """Removes everything, in order: processes, relays, namespaces, cgroups. Raises at the end
        if something could not be removed (after trying the rest)."""
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        errors = _attempt([lambda n=n: n.kill_all() for n in self.nodes])
        errors += _attempt([lambda n=n: _stop_relay(n) for n in self.nodes])
        errors += _attempt([lambda ns=ns: _netns_del(ns) for ns in [n.netns for n in self.nodes] + [self.switch]])
        errors += _attempt([lambda n=n: n.cgroup.remove() for n in self.nodes if n.cgroup])
        deadline = time.monotonic() + 5
        errors += _attempt([lambda b=b: rmdir_retrying(b, deadline) for b in set(self.cgroup_bases.values())])
        if errors:
            raise RuntimeError(f"cluster {self.name} was not removed completely: {'; '.join(errors)}")


def _attempt(steps: list) -> list[str]:
    errors = []
    for step in steps:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - every step is tried; the errors are raised together
            errors.append(str(exc))
    return errors


def _stop_relay(node: Node) -> None:
    if node.relay is None:
        return
    if node.relay.stdin:
        node.relay.stdin.close()        # the relay stops at the end of its input
    try:
        node.relay.wait(timeout=5)
    except subprocess.TimeoutExpired:
        node.relay.kill()
        node.relay.wait(timeout=5)
    for pipe in (node.relay.stdout, node.relay.stderr):
        if pipe:
            pipe.close()


def _netns_del(name: str) -> None:
    """Deletes a namespace (its devices go with it) once no process holds it; the node's processes
    are already gone, so a process left here is an error."""
    if not Path("/run/netns", name).exists():
        return
    if left := ip("netns", "pids", name, check=False).stdout.split():
        raise RuntimeError(f"processes {left} are still in namespace {name}")
    ip("netns", "del", name)


def _stale(name: str) -> bool:
    """A cluster's name whose harness process (the pid in the name) is gone."""
    match = re.fullmatch(rf"{PREFIX}-(\d+)-[0-9a-f]{{6}}(-s|-n\d+)?", name)
    return match is not None and not Path(f"/proc/{match.group(1)}").exists()


def sweep_stale() -> None:
    """Removes the namespaces and cgroups of clusters whose harness process died without closing them."""
    netns_dir = Path("/run/netns")
    for entry in netns_dir.glob(f"{PREFIX}-*") if netns_dir.is_dir() else []:
        if _stale(entry.name):
            for pid in ip("netns", "pids", entry.name, check=False).stdout.split():
                kill(int(pid))
            ip("netns", "del", entry.name, check=False)
    remove_stale(f"{PREFIX}-*", _stale)


@atexit.register
def _close_live() -> None:
    for cluster in list(_live):
        try:
            cluster.close()
        except RuntimeError as exc:
            print(f"cluster harness: {exc}", file=sys.stderr)
