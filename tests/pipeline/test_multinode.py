"""Multi-node pipelines across two real network hosts (namespaces joined by a veth pair, see
conftest.py): the README's commands and torchrun give the one-process tokens with no interface
variables set, the rendezvous store listens on --master-addr only, faults and signals stop
both nodes promptly and leave no process behind (recovery off), a server on node 0 answers
across hosts, and a pipeline over two hosts heals under load with no request lost: node 1's
stage SIGKILLed or SIGSTOPped (node 1's headless process respawns it into the driver's next
pipeline), node 1 gone for good (its stage moves to node 0 after --node-rejoin-timeout-s), and
node 1 started again (it gets its stage back). Every node runs with a cluster token: a node with
another token is refused by the driver's store, and so is a raw socket; a start without a token
says so in one warning line per node. A stopped stage is found by its missing heartbeats, well
before --dist-timeout-s.

Start-up (torch imports) dominates, so each wave of scenarios starts all its nodes at once,
every scenario in its own pair of hosts."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from stagewise import LLM, SamplingParams

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"
MAX_TOKENS = 8
MASTER = "10.77.0.1"
PORT = 29500
HTTP_PORT = 8000
DIST_TIMEOUT_S = 10
START_TIMEOUT_S = 300          # a node's start-up on a busy 2-core machine, with a wave starting at once
GENERATE = ["--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--no-chat"]
LONG_RUN = ["--max-tokens", "400", "--ignore-eos", "--no-chat"] + ["--prompt", "Once"] * 20
NO_RECOVERY = ["--max-pipeline-restarts", "0"]
NO_TOKEN = {"STAGEWISE_CLUSTER_TOKEN": ""}
OPEN_WARNING = "no --cluster-token (or STAGEWISE_CLUSTER_TOKEN) is set"


class Node:
    """One `python -m stagewise ...` (or torchrun) inside a host, its output in files."""

    def __init__(self, host, args: list[str], log_dir: Path, name: str, env: dict[str, str] | None = None):
        self.host, self.name = host, name
        self.out_path, self.err_path = log_dir / f"{name}.out", log_dir / f"{name}.err"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = host.popen(args, stdout=out, stderr=err, env=env)

    def stdout(self) -> str:
        return self.out_path.read_text()

    def stderr(self) -> str:
        return self.err_path.read_text()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"{self.name} did not exit within {timeout:.0f} s:\n{self.stderr()[-3000:]}") from None

    def wait_for(self, predicate, what: str, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert self.proc.poll() is None, f"{self.name} exited ({self.proc.returncode}) before {what}:\n" \
                                             f"{self.stderr()[-3000:]}"
            assert time.monotonic() < deadline, f"{self.name}: no {what} within {timeout:.0f} s"
            time.sleep(0.1)

    def stage_pids(self, comm: str | None = None) -> list[int]:
        """This node's stage processes (forked by its warm process stagewise-warm, or children
        started by multiprocessing's spawn); with `comm`, only those of that process name
        (stagewise-st1: stage 1)."""
        parents = {}
        for pid in self.host.pids():
            try:
                parents[pid] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except (OSError, ValueError, IndexError):
                parents.pop(pid, None)
                continue
            if b"spawn_main" not in cmd:      # forked stages keep their warm process's command line
                parents.pop(pid)
        warm = {pid for pid, ppid in parents.items() if ppid == self.proc.pid and _comm(pid) == "stagewise-warm"}
        return [pid for pid, ppid in parents.items() if (ppid == self.proc.pid or ppid in warm) and pid not in warm
                and (comm is None or _comm(pid) == comm)]

    def warm_pids(self) -> list[int]:
        """This node's warm process (stagewise-warm), if it has started one."""
        return [pid for pid in self.host.pids() if _comm(pid) == "stagewise-warm" and _ppid(pid) == self.proc.pid]

    def stop_hard(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def stagewise(command: str, model_dir, pp_size: int, node_rank: int, *extra: str, port: int = PORT,
              dist_timeout_s: float = DIST_TIMEOUT_S) -> list[str]:
    """The README's multi-node command for one node."""
    return [sys.executable, "-m", "stagewise", command, "--model", str(model_dir), "--pp-size", str(pp_size),
            "--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", MASTER, "--master-port", str(port),
            "--dist-timeout-s", str(dist_timeout_s), *extra]


def pair(make_hosts, log_dir: Path, tag: str, command: str, model_dir, pp_size: int, driver_extra=(),
         worker_extra=()) -> dict:
    a, b = make_hosts()
    return {"hosts": (a, b),
            "worker": Node(b, stagewise(command, model_dir, pp_size, 1, *worker_extra), log_dir, f"{tag}-node1"),
            "driver": Node(a, stagewise(command, model_dir, pp_size, 0, *driver_extra), log_dir, f"{tag}-node0")}


def torchrun_pair(make_hosts, log_dir: Path, model_dir) -> dict:
    """PP=2 under torchrun: host A runs ranks 0-1 (driver, stage 0), host B rank 2 (stage 1)."""
    hosts, nodes = make_hosts(), {}
    for node_rank, (host, nproc) in enumerate(zip(hosts, (2, 1))):
        args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
                "--nproc-per-node", str(nproc), "--master-addr", MASTER, "--master-port", str(PORT),
                "-m", "stagewise", "generate", "--model", str(model_dir), "--pp-size", "2",
                "--dist-timeout-s", str(DIST_TIMEOUT_S), *GENERATE]
        nodes["driver" if node_rank == 0 else "worker"] = Node(host, args, log_dir, f"torchrun-node{node_rank}")
    return {"hosts": hosts, **nodes}


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
out = client.completions.create(model=model, prompt=sys.argv[2], max_tokens=%d, temperature=0,
                                extra_body={"ignore_eos": True})
print(json.dumps(out.choices[0].text))
""" % MAX_TOKENS


def stop_all(scenarios: dict) -> None:
    for scenario in scenarios.values():
        for node in scenario.values():
            if isinstance(node, Node):
                node.stop_hard()


@pytest.fixture(scope="module")
def wave1(make_hosts, llama_dir, tmp_path_factory):
    """Runs that must finish cleanly: PP=2 and PP=4 over the README commands, torchrun, serving."""
    log_dir = tmp_path_factory.mktemp("multinode-wave1")
    runs = {"pp2": pair(make_hosts, log_dir, "pp2", "generate", llama_dir, 2, GENERATE),
            "pp4": pair(make_hosts, log_dir, "pp4", "generate", llama_dir, 4, GENERATE),
            "torchrun": torchrun_pair(make_hosts, log_dir, llama_dir),
            "bench": pair(make_hosts, log_dir, "bench", "bench", llama_dir, 2,
                          ["--num-requests", "4", "--prompt-len", "8", "--output-len", "4"]),
            "serve": pair(make_hosts, log_dir, "serve", "serve", llama_dir, 2, ["--host", MASTER, "--port",
                                                                                 str(HTTP_PORT)])}
    a, b = runs["serve"]["hosts"]    # the client runs on the other host
    runs["serve"]["client"] = Node(b, [sys.executable, "-c", CLIENT, f"http://{MASTER}:{HTTP_PORT}/v1", PROMPT,
                                       str(START_TIMEOUT_S)], log_dir, "serve-client")
    try:
        yield runs
    finally:
        stop_all(runs)


@pytest.fixture(scope="module")
def want_text(wave1, llama_dir) -> str:
    """What the one-process engine generates (greedy) for PROMPT (built while wave 1 starts)."""
    with LLM(model=str(llama_dir)) as llm:
        out = llm.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                           use_tqdm=False)
    return PROMPT + out[0].outputs[0].text


def assert_hosts_empty(hosts, timeout: float = 10) -> None:
    for host in hosts:
        left = host.wait_empty(timeout)
        assert not left, f"processes left in {host.netns}: {left}"


@pytest.mark.parametrize("run", ["pp2", "pp4", "torchrun"])
def test_launch_across_hosts_matches_one_process(wave1, want_text, run):
    driver, worker = wave1[run]["driver"], wave1[run]["worker"]
    assert driver.wait(START_TIMEOUT_S) == 0, driver.stderr()[-3000:]
    assert worker.wait(30) == 0, worker.stderr()[-3000:]
    assert driver.stdout().strip() == want_text.strip()
    for node, host in ((driver, wave1[run]["hosts"][0]), (worker, wave1[run]["hosts"][1])):
        assert node.stderr().count("distributed traffic uses interface") == 1, node.stderr()[-2000:]   # per node
        assert OPEN_WARNING not in node.stderr()                 # the nodes share a cluster token
        assert f"interface {host.veth}, address {host.addr}" in node.stderr()
    assert_hosts_empty(wave1[run]["hosts"])


def test_bench_across_hosts_takes_the_worker_role_on_node1(wave1):
    """`stagewise bench` with the multi-node flags: node 1 runs its stage (not a second driver)."""
    driver, worker = wave1["bench"]["driver"], wave1["bench"]["worker"]
    assert driver.wait(START_TIMEOUT_S) == 0, driver.stderr()[-3000:]
    assert worker.wait(30) == 0, worker.stderr()[-3000:]
    assert "4 requests, 16 output tokens" in driver.stdout(), driver.stdout()
    assert "node 1 runs stage(s) 1" in worker.stderr(), worker.stderr()[-2000:]


def test_server_on_node0_answers_an_openai_client_on_the_other_host(wave1, want_text):
    run = wave1["serve"]
    client, driver, worker = run["client"], run["driver"], run["worker"]
    assert client.wait(START_TIMEOUT_S + 30) == 0, client.stderr()[-3000:] + driver.stderr()[-3000:]
    assert PROMPT + json.loads(client.stdout()) == want_text
    health = run["hosts"][1].run([sys.executable, "-c", "import sys, urllib.request; print(urllib.request.urlopen("
                                  f"'http://{MASTER}:{HTTP_PORT}/health', timeout=10).read().decode())"])
    assert json.loads(health.stdout)["pipeline"] == {"nodes": [0, 1], "standby": [], "layout": [0, 1],
                                                     "partition": [2, 2], "moves": 0, "last_move": None}, health
    t0 = time.monotonic()
    driver.proc.send_signal(signal.SIGTERM)         # no open request: the drain ends at once
    assert driver.wait(15) == 0, driver.stderr()[-3000:]
    assert worker.wait(15) == 0, worker.stderr()[-3000:]
    assert time.monotonic() - t0 < 10
    assert_hosts_empty(run["hosts"])


@pytest.fixture(scope="module")
def wave2(make_hosts, llama_dir, tmp_path_factory):
    """Runs that get stopped: nodes whose peer never starts, a killed remote stage, a SIGTERMed driver."""
    log_dir = tmp_path_factory.mktemp("multinode-wave2")
    a, b = make_hosts()                  # two pipelines (two ports) whose other node is never started, no token
    c, d = make_hosts()                  # node 1 with another token than node 0's
    runs = {"lonely": {"hosts": (a, b),
                       "driver": Node(a, stagewise("generate", llama_dir, 2, 0, *GENERATE), log_dir, "lonely-node0",
                                      env=NO_TOKEN),
                       "worker": Node(b, stagewise("generate", llama_dir, 2, 1, port=PORT + 1), log_dir,
                                      "lonely-node1", env=NO_TOKEN)},
            "intruder": {"hosts": (c, d),
                         "driver": Node(c, stagewise("generate", llama_dir, 2, 0, *GENERATE), log_dir,
                                        "intruder-node0"),
                         "worker": Node(d, stagewise("generate", llama_dir, 2, 1), log_dir, "intruder-node1",
                                        env={"STAGEWISE_CLUSTER_TOKEN": "a-guess"})},
            "kill": pair(make_hosts, log_dir, "kill", "generate", llama_dir, 2, [*LONG_RUN, *NO_RECOVERY],
                         NO_RECOVERY),
            "term": pair(make_hosts, log_dir, "term", "generate", llama_dir, 2, LONG_RUN)}
    try:
        yield runs
    finally:
        stop_all(runs)


def test_store_binds_master_addr_and_sigterm_stops_nodes_waiting_for_peers(wave2):
    run = wave2["lonely"]
    driver, worker, (a, b) = run["driver"], run["worker"], run["hosts"]
    driver.wait_for(lambda: f"{MASTER}:{PORT}" in a.listeners(), what="rendezvous store listening")
    # a node whose driver never comes waits for the store with its warm process started (no stage yet)
    worker.wait_for(lambda: worker.warm_pids(), what="warm process")
    time.sleep(2.0)                           # inside the waits: the store is up, the remote node polls for it
    listeners = a.listeners()
    assert listeners == [f"{MASTER}:{PORT}"], listeners            # not 0.0.0.0 or *
    for node in (driver, worker):
        t0 = time.monotonic()
        node.proc.send_signal(signal.SIGTERM)
        code = node.wait(10)
        took = time.monotonic() - t0
        assert code == 143 and took < 3.0, (node.name, code, took, node.stderr()[-2000:])
    assert_hosts_empty((a, b), timeout=5)
    for node in (driver, worker):        # no token on a network interface: one warning line per node
        assert node.stderr().count(OPEN_WARNING) == 1, (node.name, node.stderr()[-2000:])


RAW_PROBE = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as s:
    greeting = s.recv(48, socket.MSG_WAITALL)
    s.sendall(b'["set", "stagewise/generation", "999"]'.rjust(77))
    try:
        answer = s.recv(4096)
    except ConnectionResetError:
        answer = b""
print(greeting[:16].decode(), len(answer))
"""


def test_a_node_with_another_token_and_a_raw_socket_are_refused(wave2):
    """Node 1 started with another token than node 0's stops with one sentence and joins nothing; a
    raw socket from its host that sends a store request gets the greeting and then a closed connection."""
    run = wave2["intruder"]
    driver, worker, (a, b) = run["driver"], run["worker"], run["hosts"]
    assert worker.wait(START_TIMEOUT_S) != 0
    error = worker.stderr().strip().splitlines()[-1]
    assert error == (f"error: The rendezvous at {MASTER}:{PORT} refused this node: its cluster token differs; give "
                     f"every node the same --cluster-token or STAGEWISE_CLUSTER_TOKEN."), worker.stderr()[-2000:]
    probe = b.run([sys.executable, "-c", RAW_PROBE, MASTER, str(PORT)])
    assert probe.returncode == 0 and probe.stdout.split() == ["stagewise-link/1", "0"], probe.stderr
    driver.wait_for(lambda: "refused a connection from 10.77.0.2: the peer did not prove the cluster token"
                    in driver.stderr(), what="the refusal in node 0's log", timeout=10)
    assert driver.proc.poll() is None and not driver.stdout()        # still waiting for its node 1
    for node in (driver, worker):
        assert OPEN_WARNING not in node.stderr()
    driver.proc.send_signal(signal.SIGTERM)
    assert driver.wait(10) == 143
    assert_hosts_empty((a, b), timeout=5)


def test_killed_remote_stage_is_reported_and_both_nodes_stop_with_recovery_off(wave2):
    run = wave2["kill"]
    driver, worker = run["driver"], run["worker"]
    driver.wait_for(lambda: driver.stdout().startswith("Once"), what="generation")
    (victim,) = worker.stage_pids()
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    assert driver.wait(DIST_TIMEOUT_S + 10) == 1
    took = time.monotonic() - t0
    assert worker.wait(10) != 0
    assert took < DIST_TIMEOUT_S, took
    error = driver.stderr().rsplit("error: ", 1)[-1]
    assert "stage 1 (node 1)" in error, error    # the killed stage, behind the link that closed
    assert_hosts_empty(run["hosts"])


def test_sigterm_to_driver_stops_both_nodes(wave2):
    run = wave2["term"]
    driver, worker = run["driver"], run["worker"]
    driver.wait_for(lambda: driver.stdout().startswith("Once"), what="generation")
    t0 = time.monotonic()
    driver.proc.send_signal(signal.SIGTERM)
    assert driver.wait(10) == 143
    took_driver = time.monotonic() - t0
    worker.wait(10)
    took_worker = time.monotonic() - t0
    assert took_driver < 2.5 and took_worker < 6.0, (took_driver, took_worker)
    assert_hosts_empty(run["hosts"], timeout=5)


NETIF_CHECKS = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
from stagewise.cluster.netif import choose_interface
assert "torch" not in sys.modules        # stdlib only: choosing an interface loads no torch
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


def test_interface_choice_overrides_and_errors(make_hosts, llama_dir):
    """In host A: the route picks the veth (also on the master itself); GLOO_SOCKET_IFNAME and
    --dist-ifname override it; a loopback interface toward a remote master, an unknown interface
    and an unreachable master are refused with one sentence, also by the CLI."""
    a, _ = make_hosts()
    cli = a.popen([sys.executable, "-m", "stagewise", "generate", "--model", str(llama_dir), "--pp-size", "2",
                   "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.99.0.1", "--master-port", str(PORT)],
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    import stagewise
    checks = a.run([sys.executable, "-c", NETIF_CHECKS % (a.veth, a.veth), str(Path(stagewise.__file__).parents[1])])
    assert checks.returncode == 0, checks.stderr
    got = json.loads(checks.stdout)
    route = [a.veth, "10.77.0.1", "the route to --master-addr"]
    assert got["route"] == route and got["self"] == route
    assert got["local"] == ["lo", "127.0.0.1", "the route to --master-addr"]
    assert got["flag"] == [a.veth, "", "--dist-ifname"]
    assert got["env"] == [a.veth, "", "GLOO_SOCKET_IFNAME"]
    assert "is loopback" in got["lo"] and "--dist-ifname" in got["lo"]
    assert got["no_route"].startswith("No local network interface can reach --master-addr 10.99.0.1")
    assert "'eth9' is not a network interface" in got["bad"]
    out, err = cli.communicate(timeout=120)
    assert cli.returncode == 2, err[-2000:]
    assert err.decode().strip().splitlines()[-1].startswith("error: No local network interface can reach")


def test_rendezvous_errors_are_one_sentence():
    """No store, missing ranks, a duplicate rank, and an address or port node 0 cannot serve on."""
    from stagewise.cluster.rendezvous import free_port, rendezvous, serve_store
    port = free_port()
    with pytest.raises(TimeoutError, match=r"Nothing answered at --master-addr 127\.0\.0\.1:\d+ within 1 s"):
        rendezvous(1, 3, "127.0.0.1", port, 1.0)
    store = serve_store("127.0.0.1", port, b"")
    with pytest.raises(TimeoutError, match=r"The driver, stage 1 did not join the rendezvous at 127\.0\.0\.1"):
        rendezvous(1, 3, "127.0.0.1", port, 1.0)
    with pytest.raises(ValueError, match="as rank 1; give every node its own --node-rank"):
        rendezvous(1, 3, "127.0.0.1", port, 1.0)
    with pytest.raises(ValueError, match=r"Address already in use.*choose a free --master-port"):
        rendezvous(0, 3, "127.0.0.1", port, 1.0)
    with pytest.raises(TimeoutError, match=r"Stage 0 did not join"):
        rendezvous(0, 2, "127.0.0.1", free_port(), 1.0)
    with pytest.raises(ValueError, match="is not an address of this host"):
        rendezvous(0, 2, "198.51.100.7", free_port(), 1.0)     # TEST-NET-2: never local
    store.close()


# The driver of the healing scenarios: an offline LLM on node 0 that generates PROMPTS once as the
# fault-free reference, then once per later phase, each when the test creates the file named after
# it in the gate folder ("end": stop); "decoding N" says that run N is well under way (the test's
# moment to kill).
HEAL_DRIVER = """
import json, os, sys, threading, time
from stagewise import LLM, SamplingParams
model, master, port, timeout, rejoin_s, gate = sys.argv[1:7]
options = dict(model=model, pp_size=2, nnodes=2, node_rank=0, master_addr=master, master_port=int(port),
               dist_timeout_s=float(timeout), node_rejoin_timeout_s=float(rejoin_s), pipeline_spares_delay_s=0)
options.update(json.loads(sys.argv[7]) if len(sys.argv) > 7 else {})
max_tokens = options.pop("max_tokens", 400)   # long enough for a leave (noticed within 1 s) to land mid-run
prompts = [[5 + i, 6, 7 + i, 8, 9 + 2 * i] for i in range(6)]
params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

def run(llm, phase):
    while not os.path.exists(os.path.join(gate, str(phase))):
        time.sleep(0.05)
    target = llm.engine.stats_.num_steps + 20
    def announce():
        while llm.engine.stats_.num_steps < target:
            time.sleep(0.002)
        print("decoding", phase, flush=True)
    threading.Thread(target=announce, daemon=True).start()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].finish_reason for o in outs]

with LLM(**options) as llm:
    ref, _ = run(llm, 0)
    deadline = time.monotonic() + 120
    while options.get("pipeline_spares", True) and llm.stats()["recovery"]["spares_ready"] < 1 \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    print(json.dumps({"phase": 0, "ids": ref, "recovery": llm.stats()["recovery"]}), flush=True)
    for phase in (1, 2, 3, 4):
        ids, reasons = run(llm, phase)
        print(json.dumps({"phase": phase, "equal": ids == ref, "reasons": reasons,
                          "recovery": llm.stats()["recovery"]}), flush=True)
    while not os.path.exists(os.path.join(gate, "end")):
        time.sleep(0.05)
"""
REJOIN_S = 8
HEAL_DIST_TIMEOUT_S = 60       # faults here must be found by closed links and heartbeats, never by this
HANG_FOUND_S = 30              # a stopped stage is declared lost after ~5 s of silence; generous on a busy box


def _phased_pair(make_hosts, llama_dir, tmp_path_factory, tag: str, options: dict | None = None,
                 start_worker: bool = True):
    """Two hosts: HEAL_DRIVER on the first (its reference run done), the README's worker command on
    the second (started now, or later by the test with `worker_args`)."""
    log_dir = tmp_path_factory.mktemp(f"multinode-{tag}")
    gate = log_dir / "gate"
    gate.mkdir()
    (gate / "0").touch()
    a, b = make_hosts()
    worker_args = stagewise("generate", llama_dir, 2, 1, "--pipeline-spares-delay-s", "0",
                            dist_timeout_s=HEAL_DIST_TIMEOUT_S)
    run = {"hosts": (a, b), "gate": gate, "log_dir": log_dir, "worker_args": worker_args}
    if start_worker:
        run["worker"] = Node(b, worker_args, log_dir, f"{tag}-node1")
    run["driver"] = Node(a, [sys.executable, "-c", HEAL_DRIVER, str(llama_dir), MASTER, str(PORT),
                             str(HEAL_DIST_TIMEOUT_S), str(REJOIN_S), str(gate), json.dumps(options or {})],
                         log_dir, f"{tag}-node0")
    try:
        run["driver"].wait_for(lambda: '{"phase": 0,' in run["driver"].stdout(), what="the reference run")
        yield run
    finally:
        stop_all({tag: run})


@pytest.fixture(scope="module")
def heal(make_hosts, llama_dir, tmp_path_factory):
    """A pipeline over two hosts that heals; the tests below run in order, one phase each."""
    yield from _phased_pair(make_hosts, llama_dir, tmp_path_factory, "heal")


def _phase(run: dict, phase: int, kill, num_rebuilds: int | None = None) -> dict:
    """Start run `phase`, call `kill` once it decodes, and return the driver's report of it (after
    `num_rebuilds` rebuilds in all, by default one per phase)."""
    driver = run["driver"]
    (run["gate"] / str(phase)).touch()
    driver.wait_for(lambda: f"decoding {phase}" in driver.stdout(), what=f"run {phase}'s decode")
    kill()
    mark = f'{{"phase": {phase},'
    driver.wait_for(lambda: mark in driver.stdout(), what=f"the end of run {phase}", timeout=60)
    got = json.loads(next(line for line in driver.stdout().splitlines() if line.startswith(mark)))
    assert got["reasons"] == ["length"] * 6 and got["equal"], got     # greedy: token for token the reference
    assert sum(got["recovery"]["rebuilds"].values()) == (phase if num_rebuilds is None else num_rebuilds), got
    assert got["recovery"]["last"]["live_requests"] == 6, got          # all were in flight
    return got


def test_remote_stage_killed_under_load_is_respawned_and_no_request_is_lost(heal):
    worker = heal["worker"]
    (victim,) = worker.stage_pids("stagewise-st1")
    got = _phase(heal, 1, lambda: os.kill(victim, signal.SIGKILL))
    assert got["recovery"]["last"]["why"].startswith("receiving from stage 1 (node 1)"), got
    # the same headless process respawned its stage into the driver's next pipeline
    assert worker.proc.poll() is None
    assert "node 1 joins the driver's pipeline 2 with stage(s) 1" in worker.stderr(), worker.stderr()[-3000:]
    assert worker.stage_pids("stagewise-st1") not in ([], [victim])


def test_node_gone_for_good_is_repartitioned_onto_node0_after_the_grace_period(heal):
    a, b = heal["hosts"]

    def kill_node1():
        for pid in b.pids():
            os.kill(pid, signal.SIGKILL)
    got = _phase(heal, 2, kill_node1)
    # its heartbeat stopped with it: the rebuild does not wait out --node-rejoin-timeout-s
    assert got["recovery"]["last"]["rejoin_s"] < REJOIN_S, got
    assert (f"node 1 did not rejoin within {REJOIN_S} s (or stopped beating); the pipeline runs on: "
            f"node 0: stage(s) 0, 1 (layers 0-3)") in heal["driver"].stderr(), heal["driver"].stderr()[-3000:]
    assert len(heal["driver"].stage_pids("stagewise-st1")) == 1 and not b.pids()


def test_node_started_again_gets_its_stages_back(heal):
    """Node 1, started again with the same command, says it is ready; the driver's next step
    stops the pipeline on purpose and the rebuild gives node 1 its stage back (no restart used)."""
    a, b = heal["hosts"]
    driver = heal["driver"]
    worker = heal["worker"] = Node(b, heal["worker_args"], heal["log_dir"], "heal-node1-again")
    worker.wait_for(lambda: "joins the next one" in worker.stderr(), what="node 1 waiting to join")
    got = _phase(heal, 3, lambda: None)
    assert got["recovery"]["rebuilds"].get("node_returned") == 1, got
    assert got["recovery"]["last"]["why"] == "node 1 is back.", got
    assert re.search(r"node 1 joins the driver's pipeline \d+ with stage\(s\) 1", worker.stderr()), \
        worker.stderr()[-3000:]
    assert not driver.stage_pids("stagewise-st1") and len(worker.stage_pids("stagewise-st1")) == 1


def test_remote_stage_that_hangs_is_replaced_after_the_timeout(heal):
    """SIGSTOP: the driver misses the stage's heartbeats for --heartbeat-timeout-s (well before
    --dist-timeout-s) and starts a new generation; node 1 kills its stopped stage and starts a new
    one; then both nodes stop in order."""
    driver, worker = heal["driver"], heal["worker"]
    (victim,) = worker.stage_pids("stagewise-st1")
    found = {}

    def stop():
        t0 = time.monotonic()
        os.kill(victim, signal.SIGSTOP)
        driver.wait_for(lambda: "stage 1 (node 1) stopped answering: no heartbeat for" in driver.stderr(),
                        what="the stopped stage found", timeout=HANG_FOUND_S)
        found["s"] = time.monotonic() - t0
    got = _phase(heal, 4, stop)
    assert found["s"] < HANG_FOUND_S < HEAL_DIST_TIMEOUT_S
    assert got["recovery"]["last"]["cause"] == "timeout", got
    assert "no heartbeat" in got["recovery"]["last"]["why"], got
    assert worker.stage_pids("stagewise-st1") not in ([], [victim])
    assert not Path(f"/proc/{victim}").exists() or _comm(victim) != "stagewise-st1"
    (heal["gate"] / "end").touch()
    assert driver.wait(30) == 0, driver.stderr()[-3000:]
    assert worker.wait(15) == 0, worker.stderr()[-3000:]
    assert_hosts_empty(heal["hosts"])


@pytest.fixture(scope="module")
def elastic(make_hosts, llama_dir, tmp_path_factory):
    """A pipeline that starts on node 0 alone (--min-nodes 1 of --nnodes 2): node 1 joins it later,
    then leaves it on SIGTERM. The tests below run in order, one phase each."""
    yield from _phased_pair(make_hosts, llama_dir, tmp_path_factory, "elastic", {"min_nodes": 1},
                            start_worker=False)


def test_pipeline_starts_on_the_nodes_present_with_min_nodes(elastic):
    driver = elastic["driver"]
    assert "the first pipeline runs on node(s) 0 of 2" in driver.stderr(), driver.stderr()[-3000:]
    got = json.loads(next(line for line in driver.stdout().splitlines() if line.startswith('{"phase": 0')))
    assert got["recovery"]["layout"] == [0, 0] and got["recovery"]["moves"] == 0, got
    assert len(driver.stage_pids("stagewise-st1")) == 1


def test_node_that_starts_later_joins_the_running_pipeline(elastic):
    """Started during a run, node 1 gets stage 1 at the next step boundary; no request is lost and
    the tokens equal the run on node 0 alone."""
    worker = elastic["worker"] = Node(elastic["hosts"][1], elastic["worker_args"], elastic["log_dir"],
                                      "elastic-node1")
    worker.wait_for(lambda: "joins the next one" in worker.stderr(), what="node 1 waiting to join")
    got = _phase(elastic, 1, lambda: None)
    assert got["recovery"]["rebuilds"] == {"node_returned": 1}, got
    assert got["recovery"]["layout"] == [0, 1] and got["recovery"]["last_move"]["why"] == "node 1 joined", got
    assert re.search(r"node 1 joins the driver's pipeline \d+ with stage\(s\) 1", worker.stderr())
    assert not elastic["driver"].stage_pids("stagewise-st1") and len(worker.stage_pids("stagewise-st1")) == 1


def test_node_sent_sigterm_leaves_in_order(elastic):
    """SIGTERM on node 1 during a run: it asks to leave, the driver rebuilds on node 0 alone (not
    counted as a failure, no waiting for node 1), node 1 exits 0; no request is lost."""
    worker, driver = elastic["worker"], elastic["driver"]
    got = _phase(elastic, 2, lambda: worker.proc.send_signal(signal.SIGTERM))
    assert got["recovery"]["rebuilds"] == {"node_returned": 1, "node_leaving": 1}, got
    assert got["recovery"]["layout"] == [0, 0] and got["recovery"]["last_move"]["why"] == "node 1 left", got
    assert got["recovery"]["last"]["rejoin_s"] < REJOIN_S, got
    assert worker.wait(30) == 0, worker.stderr()[-3000:]
    assert "it left the pipeline (SIGTERM)" in worker.stderr()
    assert len(driver.stage_pids("stagewise-st1")) == 1
    (elastic["gate"] / "end").touch()


# A three-node cluster on the simulated-cluster harness: links with delay and a limited rate,
# memory limits that no node can hold the model under alone (node 0 runs the driver too), and a
# model big enough for the limits to bite (13 layers of hidden 1024 in fp32, ~580 MB: the plan puts
# one node's need for it at ~1.2 GiB, and a share of it at well under the limits).
BIG = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 13, "num_attention_heads": 16,
       "num_key_value_heads": 4}
CLUSTER_LIMITS_MIB = (1100, 1050, 1050)     # each node's own processes (driver, headless) use ~250-300 MiB
# NOTE: nodes 1 and 2 must report alike (then node 2 waits as a standby). On tcmalloc (the command line's
# allocator where installed) node 1 reported 0.98 GiB available and node 2 1.06 (on glibc both 1.08), so the
# plan took node 2 for the bigger node and rebuilt; the cause is not found yet: these nodes run on glibc.
LIKE_NODES = {"STAGEWISE_MALLOC": "system"}
CLUSTER_OPTIONS = {"pp_size": 2, "nnodes": 3, "min_nodes": 2, "dtype": "float32", "pipeline_spares": False,
                   "max_tokens": 48}


@pytest.fixture(scope="module")
def big_llama_dir(tmp_path_factory, tiny_tokenizer_dir):
    import transformers as tf
    from tokenizers import Tokenizer
    path = tmp_path_factory.mktemp("big-llama")
    vocab = Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json")).get_vocab_size()
    config = tf.LlamaConfig(vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=False, **BIG)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():            # weights scaled by 1/sqrt(fan-in): logits far from ties, as a trained model's
        for param in model.parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if param.dim() == 1
                        else torch.randn_like(param) / param.shape[-1] ** 0.5)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tiny_tokenizer_dir / name, path / name)
    return path


def _cluster_node_args(model_dir, rank: int, master: str) -> list[str]:
    return [sys.executable, "-m", "stagewise", "generate", "--model", str(model_dir), "--pp-size", "2",
            "--nnodes", "3", "--node-rank", str(rank), "--min-nodes", "2", "--master-addr", master,
            "--master-port", str(PORT), "--dist-timeout-s", str(HEAL_DIST_TIMEOUT_S), "--dtype", "float32",
            "--no-pipeline-spares"]


@pytest.fixture(scope="module")
def cluster3(make_cluster, big_llama_dir, tmp_path_factory):
    from benchmarks.harness.cluster import NodeSpec
    specs = [NodeSpec(memory_bytes=CLUSTER_LIMITS_MIB[0] << 20),
             NodeSpec(delay_ms=1, rate_mbit=1000, memory_bytes=CLUSTER_LIMITS_MIB[1] << 20),
             NodeSpec(delay_ms=20, rate_mbit=100, memory_bytes=CLUSTER_LIMITS_MIB[2] << 20)]
    cluster = make_cluster(specs)
    log_dir = tmp_path_factory.mktemp("cluster3")
    gate = log_dir / "gate"
    gate.mkdir()
    (gate / "0").touch()
    n0, n1, n2 = cluster.nodes
    run = {"hosts": (n0, n1, n2), "gate": gate, "log_dir": log_dir,
           "worker": Node(n1, _cluster_node_args(big_llama_dir, 1, n0.address), log_dir, "cluster-node1",
                          env=LIKE_NODES),
           "driver": Node(n0, [sys.executable, "-c", HEAL_DRIVER, str(big_llama_dir), n0.address, str(PORT),
                               str(HEAL_DIST_TIMEOUT_S), str(REJOIN_S), str(gate), json.dumps(CLUSTER_OPTIONS)],
                          log_dir, "cluster-node0")}
    try:
        run["driver"].wait_for(lambda: '{"phase": 0' in run["driver"].stdout(), what="the reference run")
        yield run
    finally:
        stop_all({"cluster": run})


def test_cluster_splits_a_model_no_node_holds_by_memory_and_equals_one_process(cluster3, big_llama_dir):
    """Three memory-limited nodes: the driver's plan puts the stages where they fit; the pipeline's
    greedy tokens equal one fp32 process's."""
    for limit_mib in CLUSTER_LIMITS_MIB:            # no node could hold the model alone
        plan = subprocess.run([sys.executable, "-m", "stagewise", "plan", "--model", str(big_llama_dir), "--dtype",
                               "float32", "--pp-size", "1", "--cluster", f"{limit_mib}MiB"],
                              capture_output=True, text=True, timeout=120)
        assert plan.returncode != 0 and "cannot hold the model" in plan.stderr, plan.stderr[-2000:]
    driver = cluster3["driver"]
    got = json.loads(next(line for line in driver.stdout().splitlines() if line.startswith('{"phase": 0')))
    assert got["recovery"]["layout"] == [0, 1], got
    with LLM(model=str(big_llama_dir), dtype="float32") as llm:
        outs = llm.generate(prompt_token_ids=[[5 + i, 6, 7 + i, 8, 9 + 2 * i] for i in range(6)],
                            sampling_params=SamplingParams(max_tokens=CLUSTER_OPTIONS["max_tokens"], temperature=0,
                                                           ignore_eos=True), use_tqdm=False)
    assert got["ids"] == [o.outputs[0].token_ids for o in outs]


def test_cluster_node_that_joins_waits_as_standby(cluster3, big_llama_dir):
    """Node 2 joins under load; the plan with it is the plan without it, so it waits as a standby
    and the pipeline is not stopped."""
    n2 = cluster3["hosts"][2]
    standby = cluster3["standby"] = Node(n2, _cluster_node_args(big_llama_dir, 2, cluster3["hosts"][0].address),
                                         cluster3["log_dir"], "cluster-node2", env=LIKE_NODES)
    standby.wait_for(lambda: "joins the next one" in standby.stderr(), what="node 2 waiting to join")
    driver = cluster3["driver"]
    (cluster3["gate"] / "1").touch()
    driver.wait_for(lambda: '{"phase": 1,' in driver.stdout(), what="the end of run 1", timeout=120)
    got = json.loads(next(line for line in driver.stdout().splitlines() if line.startswith('{"phase": 1,')))
    assert got["equal"] and got["reasons"] == ["length"] * 6, got
    assert got["recovery"]["standby"] == [2] and not got["recovery"]["rebuilds"], got
    assert "node 2 joined as a standby" in driver.stderr()


def test_cluster_node_killed_under_load_heals_onto_the_standby(cluster3):
    """Every process of node 1 SIGKILLed mid-run: its heartbeat stops, the rebuild does not wait
    out --node-rejoin-timeout-s, the stages are planned over nodes 0 and 2, no request is lost and
    the tokens are the same."""
    worker = cluster3["worker"]
    got = _phase(cluster3, 2, lambda: cluster3["hosts"][1].kill_all(), num_rebuilds=1)
    assert got["recovery"]["layout"] == [0, 2], got
    assert got["recovery"]["last"]["rejoin_s"] < REJOIN_S, got
    assert "node 1 did not rejoin" in got["recovery"]["last_move"]["why"], got
    assert worker.proc.poll() is not None
    (cluster3["gate"] / "end").touch()
