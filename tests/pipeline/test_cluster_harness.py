"""The simulated cluster (benchmarks/harness): three nodes whose links have the delay and rate asked
for, in order; whose processes see and are held to their memory limit, CPU set and CPU quota (as
the engine's own readers see them); links that change and cut; and nothing left after closing.
Bounds are loose where a loaded 2-core machine can only make things slower (delay's lower bound
and rate's upper bound are the exact ones)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.harness.cluster import PROBE, Cluster, NodeSpec, read_line, sweep_stale

pytestmark = pytest.mark.slow
MIB = 1 << 20
SPECS = [NodeSpec(delay_ms=1, rate_mbit=1000, memory_bytes=256 * MIB, cpus="0"),
         NodeSpec(delay_ms=20, rate_mbit=100, memory_bytes=256 * MIB, cpu_quota=0.5),
         NodeSpec(delay_ms=0, rate_mbit=50, memory_bytes=192 * MIB)]
PORT = 7000
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(make_cluster) -> Cluster:
    return make_cluster(SPECS)


@pytest.fixture(scope="module")
def probe_server(cluster: Cluster):
    """The probe's server on node 0 (stopped with the cluster)."""
    server = cluster.nodes[0].popen([sys.executable, str(PROBE), "serve", str(PORT)], stdout=subprocess.PIPE,
                                    text=True)
    assert read_line(server, timeout=30) == "ready"
    return server


def _python(cluster: Cluster, node: int, code: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return cluster.nodes[node].run([sys.executable, "-c", code], timeout=timeout)


def _measure(cluster: Cluster, node: int, seconds: float = 1.5) -> dict:
    res = cluster.nodes[node].run([sys.executable, str(PROBE), "measure", cluster.nodes[0].address, str(PORT),
                                   str(seconds)], timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.parametrize("node, rtt_ms, rate", [(1, 21, 100), (2, 1, 50)])
def test_links_have_their_delay_and_rate_and_keep_order(cluster, probe_server, node, rtt_ms, rate):
    """RTT to node 0 is at least the two nodes' delays (at most 15 ms more), TCP throughput at most
    the slower end's rate (+5% for tbf's burst) and above a third of it; UDP datagrams arrive in order."""
    got = _measure(cluster, node)
    assert rtt_ms <= min(got["rtt_ms"]) < rtt_ms + 15, got["rtt_ms"]
    assert rate / 3 < got["mbit_s"] <= rate * 1.05, got["mbit_s"]
    assert got["udp_in_order"] and got["udp_received"] > 0, got


def test_a_node_sees_its_memory_limit_and_is_held_to_it(cluster):
    code = ("from stagewise.planning.memory import available_bytes, cgroup_available; "
            "print(cgroup_available(), available_bytes())")
    res = _python(cluster, 1, code)
    assert res.returncode == 0, res.stderr
    room, available = map(int, res.stdout.split())
    # Two reads a moment apart: the process's own usage may move between them.
    assert 200 * MIB < room <= 256 * MIB and abs(available - room) < 8 * MIB, res.stdout
    fill = "b = b'x' * ({} << 20); print(len(b) >> 20)"
    assert _python(cluster, 2, fill.format(64)).stdout.strip() == "64"
    over = _python(cluster, 2, fill.format(400))
    assert over.returncode == -9, (over.returncode, over.stderr)     # the cgroup's OOM killer: SIGKILL


def test_a_node_sees_its_cpu_set_and_quota(cluster):
    assert _python(cluster, 0, "import os; print(sorted(os.sched_getaffinity(0)))").stdout.strip() == "[0]"
    assert _python(cluster, 2, "import os; print(len(os.sched_getaffinity(0)))").stdout.strip() == \
        str(len(os.sched_getaffinity(0)))
    busy = ("import time; from stagewise.runtime.threads import cgroup_quota_cpus\n"
            "start = time.monotonic()\nwhile time.monotonic() - start < 1.5: pass\n"
            "print(cgroup_quota_cpus(), time.process_time() / (time.monotonic() - start))")
    quota, share = map(float, _python(cluster, 1, busy).stdout.split())
    assert quota == 0.5 and 0.05 < share < 0.65, (quota, share)


def test_links_change_cut_and_restore(cluster, probe_server):
    node = cluster.nodes[2]
    cluster.set_link(node, delay_ms=10)          # a veth link becomes a relayed one
    assert node.relay is not None and min(_measure(cluster, 2, 0.2)["rtt_ms"]) >= 11
    cluster.set_link(cluster.nodes[1], delay_ms=5, rate_mbit=200)
    assert 6 <= min(_measure(cluster, 1, 0.2)["rtt_ms"]) < 20
    connect = f"import socket; socket.create_connection(('{cluster.nodes[0].address}', {PORT}), timeout=1)"
    cluster.cut(node)
    assert "timed out" in _python(cluster, 2, connect).stderr
    cluster.restore(node)
    assert _python(cluster, 2, connect).returncode == 0


def _cgroup_dirs(cluster: Cluster) -> list[Path]:
    nodes = [d for n in cluster.nodes if n.cgroup for d in n.cgroup.dirs.values()]
    return nodes + list(cluster.cgroup_bases.values())


def _alive(pid: int) -> bool:
    """Running or sleeping: not gone and not a zombie (dead, waiting for init to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_closing_leaves_no_namespace_cgroup_relay_or_process(make_cluster):
    cluster = make_cluster([NodeSpec(delay_ms=2, memory_bytes=128 * MIB, cpu_quota=0.5), NodeSpec(cpus="0")])
    # In each node a process, its child and a grandchild that left it (another session, reparented).
    procs = [n.popen(["sh", "-c", "sleep 300 & (setsid sleep 300 &); wait"]) for n in cluster.nodes]
    deadline = time.monotonic() + 10
    while any(len(n.pids()) < 3 for n in cluster.nodes) and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = set().union(*(n.pids() for n in cluster.nodes))
    relays = [n.relay for n in cluster.nodes if n.relay]
    dirs = _cgroup_dirs(cluster)
    assert len(pids) == 6 and len(relays) == 1 and all(d.is_dir() for d in dirs), (pids, dirs)
    cluster.close()
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    assert cluster.name not in names
    assert not [d for d in dirs if d.exists()]
    assert all(r.poll() is not None for r in relays)
    assert [p.wait(timeout=5) for p in procs] == [-9, -9]       # reaped here; the others by init
    assert not [p for p in pids if _alive(p)]


def test_what_a_killed_harness_left_is_swept(make_cluster):
    """A harness killed outright (no atexit) leaves namespaces and cgroups; its relays stop at the end
    of their input, and the next cluster's sweep removes the rest."""
    make_cluster([NodeSpec()])          # skips here where the kernel cannot make a cluster at all
    code = ("import time; from benchmarks.harness.cluster import Cluster, NodeSpec; "
            "c = Cluster([NodeSpec(delay_ms=1, memory_bytes=64 << 20)]); "
            "print(c.name, c.nodes[0].relay.pid, c.nodes[0].cgroup.dirs['memory'], flush=True); time.sleep(60)")
    harness = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO)
    line = read_line(harness, timeout=30)
    assert line, "the harness did not start"
    name, relay, cgroup = line.split()
    harness.kill()
    assert harness.wait(timeout=10) == -9 and Path(f"/run/netns/{name}-n0").exists() and Path(cgroup).is_dir()
    deadline = time.monotonic() + 10
    while _alive(int(relay)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(int(relay))
    sweep_stale()
    assert not Path(f"/run/netns/{name}-n0").exists() and not Path(f"/run/netns/{name}-s").exists()
    assert not Path(cgroup).exists() and not Path(cgroup).parent.exists()
