"""Overload: with --max-waiting-requests a burst is refused early (429 with Retry-After, counted
in /metrics as overloaded) while the admitted requests complete, /health keeps answering and the
server's memory stays flat."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

try:
    import httpx2 as httpx
except ImportError:
    import httpx

pytestmark = pytest.mark.slow          # a server of its own

LIMIT = 8
BURST_SIZE = 300
BURST = Path(__file__).with_name("burst.py")
PROMPT = " ".join(f"w{i}" for i in range(100))


@pytest.fixture(scope="module")
def limited(launch, llama_dir, tmp_path_factory):
    srv = launch(llama_dir, tmp_path_factory.mktemp("overload"), "--max-waiting-requests", str(LIMIT))
    yield srv
    srv.stop()


def _rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) // 1024


def _one(url: str) -> tuple[int, str | None, dict]:
    r = httpx.post(url + "/v1/completions", timeout=120, json={"prompt": PROMPT, "max_tokens": 16,
                                                               "ignore_eos": True})
    return r.status_code, r.headers.get("retry-after"), r.json()


# NOTE: a process of its own: in the test's process the burst's client threads would hold its GIL
PROBE = """
import sys, threading, time, urllib.request
stop, out = threading.Event(), []
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
while not stop.is_set():
    t = time.perf_counter()
    with urllib.request.urlopen(sys.argv[1] + "/health", timeout=30) as r:
        assert r.status == 200
    out.append(time.perf_counter() - t)
    time.sleep(0.02)
print(" ".join(f"{x:.4f}" for x in out))
"""


def test_a_burst_is_refused_early_and_admitted_requests_complete(limited):
    before = _rss_mb(limited.proc.pid)
    prober = subprocess.Popen([sys.executable, "-c", PROBE, limited.url], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    # NOTE: the client at nice 15 in a process of its own: remote clients cost the server nothing
    client = subprocess.run(["nice", "-n", "15", sys.executable, str(BURST), limited.url, str(BURST_SIZE), "64"],
                            capture_output=True, text=True, timeout=600, check=True)
    out = json.loads(client.stdout)
    health = [float(x) for x in prober.communicate("", timeout=60)[0].split()]
    refused = out["status"].get("429", 0)
    assert set(out["status"]) <= {"200", "429"} and 0 < refused < BURST_SIZE, out
    assert out["retry_after"] == ["1"] and all("--max-waiting-requests" in m for m in out["messages"]), out
    assert limited.metric("stagewise_requests_total", status="overloaded") == refused
    # NOTE: the release target (100 ms throughout) is for a quiet machine: what this catches on a
    # shared one is a stall (the old one: 21 s)
    assert statistics.median(health) < 0.5 and max(health) < 5.0, sorted(health)[-5:]
    assert _rss_mb(limited.proc.pid) < before + 100


def test_without_the_flag_nothing_is_refused(server):
    with ThreadPoolExecutor(16) as pool:
        statuses = {s for s, _, _ in pool.map(lambda _: _one(server.url), range(32))}
    assert statuses == {200}
