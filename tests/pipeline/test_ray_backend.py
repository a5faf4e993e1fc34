"""`stagewise serve --distributed-executor-backend ray` on a two-node Ray cluster formed in two
network namespaces (conftest.py's hosts): the Ray head on host A, where the server runs, a Ray
worker node on host B. The server places stage 1 on B through Ray and answers an OpenAI client with
the one-process run's greedy tokens; then B's raylet is killed (B leaves the Ray cluster): its
stagewise node ends, the server heals onto A alone and answers the same again; then B joins the
Ray cluster anew, the server starts node 1 there and the pipeline takes it back; and `LLM` leads a
pipeline of its own through the same Ray cluster. Every Ray node is
stopped by ending the processes of its namespace (`ray stop` would end every namespace's), and its
files are removed at the end."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from stagewise import LLM, SamplingParams
from tests.pipeline.conftest import node_env
from tests.pipeline.test_multinode import Node

pytestmark = pytest.mark.slow
RAY_PORT = 26379            # outside Ray's worker ports (10002-19999)
HTTP_PORT = 8000
# no usage reports; a node's registration may take longer than Ray's 30 s on a busy 2-core machine
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_raylet_start_wait_time_s": "120",
           # a node whose raylet died is found dead after 3 missed checks of 1 s (Ray's default: 5 of 3 s)
           "RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}
PROMPT = "The capital of France is"
MAX_TOKENS = 8
START_TIMEOUT_S = 240       # a busy 2-core machine: Ray's start and the server's
CLIENT = """
import json, sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=60)
model = client.models.list().data[0].id
out = client.completions.create(model=model, prompt=sys.argv[2], max_tokens=%d, temperature=0,
                                extra_body={"ignore_eos": True})
print(json.dumps(out.choices[0].text))
""" % MAX_TOKENS
LLM_SCRIPT = """
import json, logging, sys
from stagewise import LLM, SamplingParams
logging.basicConfig(level=logging.INFO)
with LLM(model=sys.argv[1], pp_size=2, distributed_executor_backend="ray", ray_address=sys.argv[2],
         master_port=int(sys.argv[3])) as llm:
    out = llm.generate(sys.argv[4], SamplingParams(max_tokens=%d, temperature=0, ignore_eos=True), use_tqdm=False)
print(json.dumps(out[0].outputs[0].text))
""" % MAX_TOKENS
HEALTH = "import urllib.request, sys; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"


def _ray(host, args: list[str]) -> subprocess.Popen:
    """Ray's command line inside `host`; its output in pipes."""
    ray_cli = shutil.which("ray")
    assert ray_cli, "Ray's command line is not on PATH"
    return subprocess.Popen(["ip", "netns", "exec", host.netns, ray_cli, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=node_env(**RAY_ENV))


def _ray_done(proc: subprocess.Popen, timeout: float = 120) -> None:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(proc.args)} failed:\n{out[-3000:]}"


def _stop_ray(host) -> None:
    """End every process in `host` (its Ray node's, and what it started). Not `ray stop`: it ends
    the Ray processes of every namespace, which share one process table."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in host.pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if not host.wait_empty(10):
            return


def _ray_node_args(host, temp_dir: str) -> list[str]:
    return ["--node-ip-address", host.addr, "--num-cpus", "1", "--object-store-memory", str(80 << 20),
            "--disable-usage-stats", "--temp-dir", temp_dir]


def _health(host) -> dict | None:
    out = host.run([sys.executable, "-c", HEALTH, f"http://{host.addr}:{HTTP_PORT}/health"], timeout=30)
    return json.loads(out.stdout) if out.returncode == 0 else None


def _complete(host, server_addr: str) -> str:
    """The greedy completion of PROMPT, asked by an OpenAI client on `host`."""
    out = host.run([sys.executable, "-c", CLIENT, f"http://{server_addr}:{HTTP_PORT}/v1", PROMPT], timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def _wait_health(server: Node, host, want_nodes: list[int], timeout: float) -> dict:
    deadline, got = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        assert server.proc.poll() is None, f"the server exited ({server.proc.returncode}):\n{server.stderr()[-3000:]}"
        got = _health(host)
        if got and got.get("status") == "ok" and got["pipeline"]["nodes"] == want_nodes:
            return got
        time.sleep(0.5)
    raise AssertionError(f"no healthy pipeline on nodes {want_nodes} within {timeout:.0f} s (last: {got}):\n"
                         f"{server.stderr()[-3000:]}")


@pytest.fixture(scope="module")
def ray_serve(make_hosts, llama_dir, tmp_path_factory):
    """The Ray cluster (head on A, worker on B) and the server on A, started at once."""
    pytest.importorskip("ray")
    a, b = make_hosts()
    log_dir = tmp_path_factory.mktemp("ray-backend")
    temp_dirs = [tempfile.mkdtemp(prefix="swray") for _ in range(3)]    # short: Ray's socket paths
    run: dict = {"hosts": (a, b), "log_dir": log_dir, "t0": time.monotonic(), "temp_dirs": temp_dirs}
    try:
        # one after the other (`ray start` returns once its node is registered): the server then finds both
        _ray_done(_ray(a, ["start", "--head", "--port", str(RAY_PORT), "--include-dashboard=false",
                           *_ray_node_args(a, temp_dirs[0])]))
        _ray_done(_ray(b, ["start", "--address", f"{a.addr}:{RAY_PORT}", *_ray_node_args(b, temp_dirs[1])]))
        run["server"] = Node(a, [sys.executable, "-m", "stagewise", "serve", "--model", str(llama_dir), "--pp-size",
                                 "2", "--distributed-executor-backend", "ray", "--ray-address",
                                 f"{a.addr}:{RAY_PORT}", "--host", a.addr, "--port", str(HTTP_PORT),
                                 "--node-rejoin-timeout-s", "3"], log_dir, "ray-server")
        yield run
    finally:
        if "server" in run:
            run["server"].proc.send_signal(signal.SIGTERM)
            try:
                run["server"].proc.wait(30)
            except subprocess.TimeoutExpired:
                run["server"].stop_hard()
        for host in (b, a):
            _stop_ray(host)
        for path in temp_dirs:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def want_text(ray_serve, llama_dir) -> str:
    """The one-process engine's greedy text (built while the cluster starts)."""
    with LLM(model=str(llama_dir)) as llm:
        out = llm.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                           use_tqdm=False)
    return out[0].outputs[0].text


def test_server_places_stage_1_on_the_ray_worker_node_and_matches_one_process(ray_serve, want_text):
    server, (a, b) = ray_serve["server"], ray_serve["hosts"]
    health = _wait_health(server, a, [0, 1], START_TIMEOUT_S)
    assert health["pipeline"]["layout"] == [0, 1], health
    assert _complete(b, a.addr) == want_text
    err = server.stderr()
    assert f"the pipeline starts on 2 node(s) ({a.addr}, {b.addr}); rendezvous at {a.addr}:" in err, err[-3000:]
    assert f"started node 1 on the Ray node at {b.addr}" in err, err[-3000:]
    # node 1 is a stagewise process under B's Ray actor, linked to A with the cluster's token
    assert any(b"stagewise" in _cmdline(pid) and b"--node-rank" in _cmdline(pid) for pid in b.pids())
    assert "no --cluster-token" not in err
    print(f"ray backend: serving {time.monotonic() - ray_serve['t0']:.0f} s after the Ray cluster's start")


def test_node_whose_raylet_dies_leaves_and_the_server_heals(ray_serve, want_text):
    server, (a, b) = ray_serve["server"], ray_serve["hosts"]
    (raylet,) = [pid for pid in b.pids() if _comm(pid) == "raylet"]
    t0 = time.monotonic()
    subprocess.run(["kill", "-KILL", str(raylet)], check=True)
    health = _wait_health(server, a, [0], 60)
    assert health["pipeline"]["layout"] == [0, 0], health
    assert _complete(a, a.addr) == want_text
    deadline = time.monotonic() + 30            # B's stagewise node left in order (SIGTERM), with all its stages
    while (left := [pid for pid in b.pids() if b"stagewise" in _cmdline(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, [_cmdline(pid) for pid in left]
    print(f"ray backend: healed {time.monotonic() - t0:.0f} s after the raylet's kill")


def test_a_ray_node_that_joins_gets_the_lost_rank_and_its_stage_back(ray_serve, want_text):
    """B joins the Ray cluster again (a new Ray node): the server starts node 1 there, and the
    pipeline takes it back at a step boundary."""
    server, (a, b) = ray_serve["server"], ray_serve["hosts"]
    t0 = time.monotonic()
    _stop_ray(b)                                      # what the killed raylet left behind
    _ray_done(_ray(b, ["start", "--address", f"{a.addr}:{RAY_PORT}", *_ray_node_args(b, ray_serve["temp_dirs"][2])]))
    server.wait_for(lambda: f"node 1 starts again on the Ray node at {b.addr}" in server.stderr(),
                    what="node 1 started again", timeout=120)
    assert "node 1 (10.77.0.2) is gone: its Ray node left the cluster" in server.stderr()
    deadline = time.monotonic() + 120
    while (_health(a) or {}).get("pipeline", {}).get("layout") != [0, 1]:
        assert time.monotonic() < deadline, f"node 1 never got its stage back:\n{server.stderr()[-3000:]}"
        assert _complete(a, a.addr) == want_text        # steps: the joining node is taken at a step boundary
    assert _complete(b, a.addr) == want_text
    print(f"ray backend: node 1 back {time.monotonic() - t0:.0f} s after B's Ray node started again")


def test_llm_places_its_second_stage_on_the_ray_worker_node(ray_serve, llama_dir, want_text):
    """The offline API as the leader (`LLM(distributed_executor_backend="ray")`, in host A beside the
    server): its node 1 starts on B through Ray, and it answers with the one-process tokens."""
    (a, b) = ray_serve["hosts"]
    out = a.run([sys.executable, "-c", LLM_SCRIPT, str(llama_dir), f"{a.addr}:{RAY_PORT}", "29611", PROMPT],
                timeout=START_TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == want_text
    assert f"the pipeline starts on 2 node(s) ({a.addr}, {b.addr})" in out.stderr, out.stderr[-3000:]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
