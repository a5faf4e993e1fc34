"""The Grafana dashboard in docs/ against a real Prometheus (Debian's `prometheus` package): it
scrapes a live server under traffic, and every query of every panel returns data. `promtool check
metrics` passes on the server's /metrics. The test installs Prometheus when it is missing and it
can (root with apt-get), and skips, saying why, only when it cannot."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from stagewise.cluster.rendezvous import free_port

try:
    import httpx2 as httpx
except ImportError:
    import httpx

pytestmark = pytest.mark.slow
DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
RATE_WINDOW = "20s"            # $__rate_interval: several 1 s scrapes
AUTH = {"Authorization": "Bearer key-a"}            # one of the tenant server's keys


def _binary(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    apt = shutil.which("apt-get")
    if apt is None or os.geteuid() != 0:
        pytest.skip(f"{name} is not installed and this user cannot install it (apt-get install prometheus as "
                    f"root; .ci/run does)")
    env = {"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    cmd = [apt, "install", "-y", "-qq", "--no-install-recommends", "prometheus"]
    done = subprocess.run(cmd, env=env, capture_output=True, timeout=600)
    if done.returncode != 0:
        subprocess.run([apt, "update", "-qq"], env=env, capture_output=True, timeout=600)
        done = subprocess.run(cmd, env=env, capture_output=True, timeout=600)
    if shutil.which(name) is None:
        pytest.skip(f"{name} could not be installed (apt-get said: {done.stderr.decode()[-300:]!r})")
    return str(shutil.which(name))


@pytest.fixture(scope="module")
def prometheus(tenant_server, tmp_path_factory):
    binary = _binary("prometheus")
    work = tmp_path_factory.mktemp("prometheus")
    (work / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: stagewise\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{tenant_server.port}']\n")
    port = free_port()
    log = open(work / "prometheus.log", "w")
    proc = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not start:\n{(work / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def _traffic(url: str, stop: threading.Event) -> None:
    """Completions (a shared prefix: cache hits), chat, streams, a prompt longer than the largest
    graph (an eager step), and more requests at once than run (waiting)."""
    shared = [(7 * i) % 700 + 3 for i in range(40)]
    bodies = [("/v1/completions", {"prompt": shared, "max_tokens": 8, "ignore_eos": True}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}),
              ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 12, "stream": True, "ignore_eos": True}),
              ("/v1/completions", {"prompt": list(range(5, 105)), "max_tokens": 2})]   # above the graphs: eager

    def worker(k: int) -> None:
        with httpx.Client(headers=AUTH, timeout=60) as http:
            i = 0
            while not stop.is_set():
                path, body = bodies[(i + k) % len(bodies)]
                if body.get("prompt") is shared:            # a new tail each time: computed, then cached
                    body = dict(body, prompt=shared + [i % 50 + 1])
                http.post(url + path, json=body)
                i += 1
    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    found = []
    for panel in dash["panels"]:
        for target in panel["targets"]:
            found.append((panel["title"], target["expr"]))
    return found


def _concrete(expr: str, model: str) -> str:
    return expr.replace("$__rate_interval", RATE_WINDOW).replace("$model_name", model)


def test_every_dashboard_query_returns_data(tenant_server, prometheus):
    model = httpx.get(tenant_server.url + "/v1/models", headers=AUTH).json()["data"][0]["id"]
    queries = _queries()
    assert len(queries) >= 30 and all("stagewise_" in e for _, e in queries)
    stop = threading.Event()
    load = threading.Thread(target=_traffic, args=(tenant_server.url, stop), daemon=True)
    load.start()
    empty: list[str] = []
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            time.sleep(3)
            empty = []
            for title, expr in queries:
                r = httpx.get(prometheus + "/api/v1/query", params={"query": _concrete(expr, model)}, timeout=10)
                assert r.status_code == 200 and r.json()["status"] == "success", (title, expr, r.text)
                if not r.json()["data"]["result"]:
                    empty.append(f"{title}: {expr}")
            if not empty:
                break
    finally:
        stop.set()
        load.join(60)
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)


def test_promtool_accepts_the_metrics_and_the_dashboard_names_exist(tenant_server):
    _binary("prometheus")
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian ships it with prometheus)")
    text = httpx.get(tenant_server.url + "/metrics").text
    done = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=60)
    assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()
    exposed = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    used = {name for _, e in _queries() for name in re.findall(r"stagewise_[a-z0-9_]+", e)}
    assert used <= exposed, sorted(used - exposed)
