"""A burst of 2,000 completions from three tenants (--api-key a,b,c) against --max-waiting-requests
and --max-waiting-requests-per-key: refused early with 429 naming the limit that was met, every
tenant still served, /health answered throughout (in the HTTP protocol, ahead of the burst's
request tasks), the server's memory flat, the refusals in /metrics by limit and key, and no key left
counted as waiting afterwards. The burst clients run at nice 15, as remote clients would cost the
server nothing; `--long` (tests/battery) sends 5,000."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

try:
    import httpx2 as httpx
except ImportError:
    import httpx

from stagewise.server.options import ServerOptions

pytestmark = pytest.mark.slow          # a server of its own
BURST = Path(__file__).with_name("burst.py")
KEYS = ("key-a", "key-b", "key-c")


@pytest.fixture(scope="module")
def tenants(launch, llama_dir, tmp_path_factory):
    srv = launch(llama_dir, tmp_path_factory.mktemp("overload-keys"), "--max-waiting-requests", "8",
                 "--api-key", ",".join(KEYS), "--max-waiting-requests-per-key", "4")
    yield srv
    srv.stop()


def _rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) // 1024


def run_burst(url: str, total: int, keys: tuple[str, ...], concurrency: int) -> tuple[list[dict], list[float]]:
    """`total` requests split over `keys`, one nice-15 client process each, while a prober asks for
    /health every 20 ms: (each client's summary, the /health latencies)."""
    prober = subprocess.Popen([sys.executable, str(BURST), "--probe", url], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    clients = [subprocess.Popen(["nice", "-n", "15", sys.executable, str(BURST), url, str(total // len(keys)),
                                 str(concurrency), key], stdout=subprocess.PIPE, text=True) for key in keys]
    outs = [json.loads(c.communicate(timeout=600)[0]) for c in clients]
    health = [float(x) for x in prober.communicate("", timeout=60)[0].split()]
    return outs, health


def test_a_burst_from_three_tenants_is_refused_early(tenants):
    pid = tenants.proc.pid
    before = _rss_mb(pid)
    outs, health = run_burst(tenants.url, 2000, KEYS, 64)    # refusals take ~0.3 ms: 1,000 went by in 0.4 s
    statuses = [o["status"] for o in outs]
    assert all(set(s) <= {"200", "429"} for s in statuses), outs
    assert all(s.get("200", 0) >= 4 for s in statuses), statuses          # no tenant was starved
    refused = sum(s.get("429", 0) for s in statuses)
    assert refused >= 1200, statuses
    messages = {m for o in outs for m in o["messages"]}
    assert all("--max-waiting-requests" in m and "retry after 1 s" in m for m in messages), messages
    assert any("--max-waiting-requests-per-key" in m for m in messages), messages
    assert all(o["retry_after"] == ["1"] for o in outs)
    # NOTE: the release target (100 ms throughout) is for a quiet machine; this one is shared by other
    # jobs, so what is asserted is that the burst does not stall /health (it took 21 s before limits)
    assert len(health) >= 10 and statistics.median(health) < 0.1, sorted(health)[-5:]
    assert sum(h > 0.1 for h in health) <= len(health) // 3 and max(health) < 5.0, sorted(health)[-5:]
    assert _rss_mb(pid) < before + 50
    by_limit = {lim: sum(tenants.metric("stagewise_overloaded_requests_total", limit=lim, api_key=k)
                         for k in ("", "1", "2", "3")) for lim in ("server", "api_key")}
    assert sum(by_limit.values()) == refused == tenants.metric("stagewise_requests_total", status="overloaded")
    assert by_limit["api_key"] > 0
    deadline = time.monotonic() + 30       # every admitted request ends; then nobody waits
    while tenants.metric("stagewise_api_key_waiting_requests") and time.monotonic() < deadline:
        time.sleep(0.2)
    for place in ("1", "2", "3"):
        assert tenants.metric("stagewise_api_key_waiting_requests", api_key=place) == 0


def test_one_tenant_cannot_hold_the_queue(tenants):
    """While key a floods, key b's requests (one at a time) are never refused."""
    flood = subprocess.Popen(["nice", "-n", "15", sys.executable, str(BURST), tenants.url, "2000", "64", KEYS[0]],
                             stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    answers = []          # (a quiet machine refuses a short flood before the first of these is sent)
    while flood.poll() is None and len(answers) < 20:
        r = httpx.post(tenants.url + "/v1/completions", timeout=60, headers={"Authorization": f"Bearer {KEYS[1]}"},
                       json={"prompt": "hello", "max_tokens": 4})
        answers.append(r.status_code)
    out = json.loads(flood.communicate(timeout=600)[0])
    assert out["status"].get("429", 0) > 0 and any("per-key" in m for m in out["messages"]), out
    assert answers and set(answers) == {200}, answers


def test_the_per_key_limit_needs_keys():
    with pytest.raises(ValueError, match="max_waiting_requests_per_key limits each API key: give the keys"):
        ServerOptions(max_waiting_requests_per_key=2)
