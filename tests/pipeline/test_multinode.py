"""Multi-node pipelines across two real network hosts (namespaces joined by a veth pair, see
conftest.py): the README's commands and torchrun give the one-process tokens with no interface
variables set, the rendezvous store listens on --master-addr only, faults and signals stop
both nodes promptly and leave no process behind, and a server on node 0 answers across hosts."""
from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from stagewise import LLM, SamplingParams

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"
MAX_TOKENS = 8
MASTER = "10.77.0.1"
DIST_TIMEOUT_S = 10
PORTS = itertools.count(29500)
START_TIMEOUT_S = 240          # a node's start-up on a busy 2-core machine


@pytest.fixture(scope="module")
def want_text(llama_dir) -> str:
    """What the one-process engine generates (greedy) for PROMPT."""
    with LLM(model=str(llama_dir)) as llm:
        out = llm.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                           use_tqdm=False)
    return PROMPT + out[0].outputs[0].text


class Node:
    """One `python -m stagewise ...` (or torchrun) inside a host, its output in files."""

    def __init__(self, host, args: list[str], log_dir: Path, name: str):
        self.host, self.name = host, name
        self.out_path, self.err_path = log_dir / f"{name}.out", log_dir / f"{name}.err"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = host.popen(args, stdout=out, stderr=err)

    def stdout(self) -> str:
        return self.out_path.read_text()

    def stderr(self) -> str:
        return self.err_path.read_text()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except Exception:
            self.proc.kill()
            raise AssertionError(f"{self.name} did not exit within {timeout:.0f} s:\n{self.stderr()[-3000:]}")

    def wait_for(self, predicate, timeout: float = START_TIMEOUT_S, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert self.proc.poll() is None, f"{self.name} exited ({self.proc.returncode}) before {what}:\n" \
                                             f"{self.stderr()[-3000:]}"
            assert time.monotonic() < deadline, f"{self.name}: no {what} within {timeout:.0f} s"
            time.sleep(0.1)

    def stage_pids(self) -> list[int]:
        """This node's stage processes (multiprocessing-spawned children)."""
        pids = []
        for pid in self.host.pids():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == self.proc.pid and b"spawn_main" in cmd:
                pids.append(pid)
        return pids

    def stop_hard(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def stagewise(command: str, model_dir, pp_size: int, node_rank: int, port: int, *extra: str) -> list[str]:
    """The README's multi-node command for one node."""
    return [sys.executable, "-m", "stagewise", command, "--model", str(model_dir), "--pp-size", str(pp_size),
            "--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", MASTER, "--master-port", str(port),
            "--dist-timeout-s", str(DIST_TIMEOUT_S), *extra]


def start_pair(two_hosts, tmp_path, command: str, model_dir, pp_size: int, driver_extra=(), tag: str = "") -> tuple:
    port = next(PORTS)
    a, b = two_hosts
    worker = Node(b, stagewise(command, model_dir, pp_size, 1, port), tmp_path, f"{tag}node1")
    driver = Node(a, stagewise(command, model_dir, pp_size, 0, port, *driver_extra), tmp_path, f"{tag}node0")
    return driver, worker


def assert_hosts_empty(two_hosts, timeout: float = 10) -> None:
    for host in two_hosts:
        left = host.wait_empty(timeout)
        assert not left, f"processes left in {host.netns}: {left}"


GENERATE = ["--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--no-chat"]
LONG_RUN = ["--max-tokens", "400", "--ignore-eos", "--no-chat"] + ["--prompt", "Once"] * 6


@pytest.mark.parametrize("pp_size", [2, 4])
def test_readme_commands_across_hosts_match_one_process(two_hosts, tmp_path, llama_dir, want_text, pp_size):
    driver, worker = start_pair(two_hosts, tmp_path, "generate", llama_dir, pp_size, GENERATE)
    try:
        assert driver.wait(START_TIMEOUT_S) == 0, driver.stderr()[-3000:]
        assert worker.wait(30) == 0, worker.stderr()[-3000:]
    finally:
        driver.stop_hard()
        worker.stop_hard()
    assert driver.stdout().strip() == want_text.strip()
    for node, host in ((driver, two_hosts[0]), (worker, two_hosts[1])):
        assert f"interface {host.veth}, address {host.addr}" in node.stderr()
    assert_hosts_empty(two_hosts)


def test_torchrun_across_hosts_matches_one_process(two_hosts, tmp_path, llama_dir, want_text):
    port = next(PORTS)
    nodes = []
    for node_rank, (host, nproc) in enumerate(zip(two_hosts, (2, 1))):   # driver + stage 0 | stage 1
        args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
                "--nproc-per-node", str(nproc), "--master-addr", MASTER, "--master-port", str(port),
                "-m", "stagewise", "generate", "--model", str(llama_dir), "--pp-size", "2",
                "--dist-timeout-s", str(DIST_TIMEOUT_S), *GENERATE]
        nodes.append(Node(host, args, tmp_path, f"torchrun{node_rank}"))
    try:
        for node in nodes:
            assert node.wait(START_TIMEOUT_S) == 0, node.stderr()[-3000:]
    finally:
        for node in nodes:
            node.stop_hard()
    assert nodes[0].stdout().strip() == want_text.strip()
    assert_hosts_empty(two_hosts)


def test_store_binds_master_addr_and_sigterm_stops_nodes_waiting_for_peers(two_hosts, tmp_path, llama_dir):
    """Each node's peer never starts (different ports): both wait in the rendezvous."""
    a, b = two_hosts
    port_a, port_b = next(PORTS), next(PORTS)
    driver = Node(a, stagewise("generate", llama_dir, 2, 0, port_a, *GENERATE), tmp_path, "lonely0")
    worker = Node(b, stagewise("generate", llama_dir, 2, 1, port_b), tmp_path, "lonely1")
    try:
        driver.wait_for(lambda: f"{MASTER}:{port_a}" in a.listeners(), what="rendezvous store listening")
        worker.wait_for(lambda: worker.stage_pids(), what="stage process")
        time.sleep(2.0)                       # well inside the waits (the store is up, the stage is polling)
        listeners = a.listeners()
        assert all(addr.startswith(f"{MASTER}:") for addr in listeners), listeners   # nothing on 0.0.0.0 / *
        for node in (driver, worker):
            t0 = time.monotonic()
            node.proc.send_signal(signal.SIGTERM)
            code = node.wait(10)
            took = time.monotonic() - t0
            assert code == 143 and took < 3.0, (node.name, code, took, node.stderr()[-2000:])
    finally:
        driver.stop_hard()
        worker.stop_hard()
    assert_hosts_empty(two_hosts)


def test_killed_remote_stage_is_reported_and_both_nodes_stop(two_hosts, tmp_path, llama_dir):
    driver, worker = start_pair(two_hosts, tmp_path, "generate", llama_dir, 2, LONG_RUN, "kill")
    try:
        driver.wait_for(lambda: driver.stdout().startswith("Once"), what="generation")
        (victim,) = worker.stage_pids()
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        assert driver.wait(DIST_TIMEOUT_S + 5) != 0
        took = time.monotonic() - t0
        assert worker.wait(10) != 0
    finally:
        driver.stop_hard()
        worker.stop_hard()
    assert took < DIST_TIMEOUT_S, took
    assert "EngineDeadError" in driver.stderr() and "stage" in driver.stderr().split("EngineDeadError")[-1]
    assert_hosts_empty(two_hosts)


def test_sigterm_to_driver_stops_both_nodes(two_hosts, tmp_path, llama_dir):
    driver, worker = start_pair(two_hosts, tmp_path, "generate", llama_dir, 2, LONG_RUN, "term")
    try:
        driver.wait_for(lambda: driver.stdout().startswith("Once"), what="generation")
        t0 = time.monotonic()
        driver.proc.send_signal(signal.SIGTERM)
        assert driver.wait(10) == 143
        worker.wait(10)
        took = time.monotonic() - t0
    finally:
        driver.stop_hard()
        worker.stop_hard()
    assert took < 4.0, took
    assert_hosts_empty(two_hosts, timeout=5)


CLIENT = """
import json, sys, time
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=30)
deadline = time.monotonic() + float(sys.argv[3])
while True:
    try:
        model = client.models.list().data[0].id
        break
    except Exception:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.3)
out = client.completions.create(model=model, prompt=sys.argv[2], max_tokens=%d, temperature=0, extra_body={"ignore_eos": True})
print(json.dumps(out.choices[0].text))
""" % MAX_TOKENS


def test_server_on_node0_answers_an_openai_client_on_the_other_host(two_hosts, tmp_path, llama_dir, want_text):
    a, b = two_hosts
    http = ["--host", MASTER, "--port", "8000"]
    driver, worker = start_pair(two_hosts, tmp_path, "serve", llama_dir, 2, http, "serve")
    try:
        client = b.run([sys.executable, "-c", CLIENT, f"http://{MASTER}:8000/v1", PROMPT, str(START_TIMEOUT_S)],
                       timeout=START_TIMEOUT_S + 30)
        assert client.returncode == 0, client.stderr[-3000:] + driver.stderr()[-3000:]
        assert PROMPT + json.loads(client.stdout) == want_text
        driver.proc.send_signal(signal.SIGTERM)
        assert driver.wait(15) == 0, driver.stderr()[-3000:]
        assert worker.wait(10) == 0, worker.stderr()[-3000:]
    finally:
        driver.stop_hard()
        worker.stop_hard()
    assert_hosts_empty(two_hosts)


def test_interface_choice_overrides_and_errors(two_hosts):
    """In host A: the route picks the veth; the variables and --dist-ifname override it; a loopback
    interface toward a remote master and an unreachable master are refused with one sentence."""
    script = """
import json, os
from stagewise.executor.netif import choose_interface
def pick(addr, ifname=None, env=None):
    os.environ.pop("GLOO_SOCKET_IFNAME", None)
    os.environ.update(env or {})
    try:
        c = choose_interface(addr, ifname)
        return [c.ifname, c.address, c.source]
    except ValueError as exc:
        return str(exc)
print(json.dumps({"route": pick("10.77.0.2"), "self": pick("10.77.0.1"), "local": pick("127.0.0.1"),
                  "flag": pick("10.77.0.2", "%s"), "env": pick("10.77.0.2", "lo", {"GLOO_SOCKET_IFNAME": "%s"}),
                  "lo": pick("10.77.0.2", "lo"), "no_route": pick("10.99.0.1"), "bad": pick("10.77.0.2", "eth9")}))
"""
    a, b = two_hosts
    veth = a.veth
    got = json.loads(a.run([sys.executable, "-c", script % (veth, veth)]).stdout)
    assert got["route"] == [veth, "10.77.0.1", "the route to --master-addr"]
    assert got["self"] == [veth, "10.77.0.1", "the route to --master-addr"]     # the master owns the address
    assert got["local"] == ["lo", "127.0.0.1", "the route to --master-addr"]
    assert got["flag"] == [veth, "", "--dist-ifname"]
    assert got["env"] == [veth, "", "GLOO_SOCKET_IFNAME"]
    assert "loopback" in got["lo"] and "--dist-ifname" in got["lo"]
    assert got["no_route"].startswith("No local network interface can reach --master-addr 10.99.0.1")
    assert "'eth9' is not a network interface" in got["bad"]
