"""Two "hosts" for multi-node tests: Linux network namespaces joined by a veth pair.

Each namespace has only `lo` and its end of the veth (10.77.0.1/24 and 10.77.0.2/24), so
traffic stays inside them, and the host name resolves to 127.0.0.1 there as on many real
machines. Nodes run with a cluster token (STAGEWISE_CLUSTER_TOKEN) unless a scenario says
otherwise. Every scenario gets its own pair, so "no process left in either host" is exact.
The namespaces (and every process still inside them) are removed at teardown. `make_cluster`
gives larger clusters with link delays, rates and cgroup limits (benchmarks/harness/cluster.py).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

import pytest

ADDRS = ("10.77.0.1", "10.77.0.2")
# Variables that would hide the interface choice or make a node think torchrun started it.
SCRUBBED_PREFIXES = ("GLOO_", "NCCL_", "STAGEWISE_DIST_", "TORCHELASTIC_")
SCRUBBED = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"}


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


CLUSTER_TOKEN = "multinode-test-token"       # every node gets it unless a scenario says otherwise


def node_env(**overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED and not k.startswith(SCRUBBED_PREFIXES)}
    env["PYTHONUNBUFFERED"] = "1"
    env["STAGEWISE_CLUSTER_TOKEN"] = CLUSTER_TOKEN
    return {**env, **overrides}


@dataclass
class Host:
    netns: str
    veth: str
    addr: str

    def popen(self, args: list[str], stdout, stderr, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Run a command inside this host; `ip netns exec` execs it, so the pid is the command's.
        `env` overrides variables of the node's environment (an empty STAGEWISE_CLUSTER_TOKEN: none)."""
        return subprocess.Popen(["ip", "netns", "exec", self.netns, *args], env=node_env(**(env or {})),
                                stdout=stdout, stderr=stderr)

    def run(self, args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.netns, *args], env=node_env(), capture_output=True,
                              text=True, timeout=timeout)

    def pids(self) -> set[int]:
        out = _ip("netns", "pids", self.netns).stdout.split()
        return {int(p) for p in out}

    def wait_empty(self, timeout: float) -> set[int]:
        """Wait until no process is left in this host; the ones still there at the deadline."""
        deadline = time.monotonic() + timeout
        while (left := self.pids()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left

    def listeners(self) -> list[str]:
        """Local addresses of the listening TCP sockets in this host (`ss -ltn`)."""
        rows = self.run(["ss", "-Hltn"]).stdout.splitlines()
        return [row.split()[3] for row in rows if row.split()]


def _create(tag: str) -> tuple[Host, Host]:
    names = (f"sw{tag}a", f"sw{tag}b")
    veths = (f"swv{tag}a", f"swv{tag}b")
    for ns in names:
        if (res := _ip("netns", "add", ns)).returncode:
            pytest.skip(f"`ip netns add` was refused ({res.stderr.strip()}); multi-host tests need root on Linux")
    steps = [("link", "add", veths[0], "netns", names[0], "type", "veth", "peer", "name", veths[1], "netns", names[1])]
    for ns, veth, addr in zip(names, veths, ADDRS):
        steps += [("-n", ns, "addr", "add", f"{addr}/24", "dev", veth), ("-n", ns, "link", "set", veth, "up"),
                  ("-n", ns, "link", "set", "lo", "up")]
    for step in steps:
        if (res := _ip(*step)).returncode:
            raise RuntimeError(f"ip {' '.join(step)} failed: {res.stderr.strip()}")
    return Host(names[0], veths[0], ADDRS[0]), Host(names[1], veths[1], ADDRS[1])


def _remove(hosts: list[Host]) -> None:
    for host in hosts:
        for pid in host.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for host in hosts:
        host.wait_empty(5)
        _ip("netns", "del", host.netns)     # deleting a namespace deletes its veth end, and the pair


@pytest.fixture(scope="module")
def make_hosts():
    """Factory: a fresh (host A, host B) pair with unique names per call; all removed at the end."""
    if not sys.platform.startswith("linux"):
        pytest.skip("network namespaces need Linux")
    made: list[Host] = []

    def make() -> tuple[Host, Host]:
        tag = uuid.uuid4().hex[:6]
        made.extend([Host(f"sw{tag}a", "", ""), Host(f"sw{tag}b", "", "")])   # removed even if creation fails
        pair = _create(tag)
        made[-2:] = pair
        return pair

    try:
        yield make
    finally:
        _remove(made)


@pytest.fixture(scope="module")
def make_cluster():
    """Factory: a simulated cluster (benchmarks/harness/cluster.py) of the given NodeSpecs, whose
    processes get the cluster token; skips where the kernel lacks a feature; all closed at the end."""
    from benchmarks.harness.cgroups import Unsupported
    from benchmarks.harness.cluster import Cluster
    made: list[Cluster] = []

    def make(specs) -> Cluster:
        try:
            made.append(Cluster(specs, env={"STAGEWISE_CLUSTER_TOKEN": CLUSTER_TOKEN}))
        except Unsupported as exc:
            pytest.skip(str(exc))
        return made[-1]

    try:
        yield make
    finally:
        for cluster in made:
            cluster.close()
