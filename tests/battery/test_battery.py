"""The hostile battery: requests that once killed, stalled or bloated the server, sent together while
/health and plain completions are timed. Every request gets its expected status (no 5xx), no plain
request fails, the engine process is the one that started, and its memory and the whole server's
stay within the budgets. CI sends each attack once with a 2 s compile budget (seconds in all);
`pytest tests/battery --long -s` is the release run: 16 clients for minutes, the heavy attacks
too, distinct schemas against the cache, the default budgets, and the latency targets (/health p99
under 100 ms, plain p99 within 2x of the quiet run's). (A stage killed under load is
tests/server/test_serve_recovery.py.)"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import launcher
import pytest
from attacks import (
    MIB,
    PLAIN,
    Attack,
    C,
    MemoryWatch,
    Probe,
    catalogue,
    distinct_schema,
    processes,
    pss_bytes,
    quantile,
    send,
    tree_pss_bytes,
)
from http_checks import assert_serving, httpx

pytestmark = pytest.mark.slow          # a server of its own

LONG_S = 180.0                   # the release run's attack time (then the clients finish what they sent)
LONG_CLIENTS = 16
ENGINE_GROWTH = 256 * MIB        # the most one engine process may grow for any request
GRAMMAR_MEMORY = 1024 * MIB      # --grammar-memory's default: every compile child together
CACHE_MEMORY = 256 * MIB         # --grammar-cache-memory's default: kept compiled grammars (the long run fills it)


def _warm_up(url: str, quiet_requests: int) -> list[float]:
    """Start the compile supervisor (its memory belongs to the baseline) and time quiet plain requests."""
    with httpx.Client(timeout=120) as client:
        r = client.post(url + C, json={"prompt": "hi", "max_tokens": 2, "structured_outputs": {"choice": ["x"]}})
        assert r.status_code == 200, r.text
        quiet = []
        for _ in range(quiet_requests):
            t0 = time.perf_counter()
            assert client.post(url + C, json=PLAIN).status_code == 200
            quiet.append(time.perf_counter() - t0)
    return quiet


def _short(url: str) -> list[tuple[Attack, int, float]]:
    attacks = [a for a in catalogue() if not a.long_only]
    with httpx.Client(timeout=120) as client, ThreadPoolExecutor(len(attacks)) as pool:
        answers = list(pool.map(lambda a: send(client, url, a), attacks))
    return [(a, status, s) for a, (status, s) in zip(attacks, answers)]


def _long(url: str) -> list[tuple[Attack, int, float]]:
    results: list[tuple[Attack, int, float]] = []
    deadline = time.monotonic() + LONG_S

    def client_loop(k: int) -> None:
        rng = random.Random(k)
        with httpx.Client(timeout=900) as client:
            round_ = 0
            while time.monotonic() < deadline:
                attacks = catalogue(salt=f"{k}.{round_}")
                attacks += [Attack("distinct schema", C, {"prompt": "hi", "max_tokens": 4, "structured_outputs": {
                    "json": distinct_schema(rng)}}, {200}) for _ in range(8)]
                rng.shuffle(attacks)
                for attack in attacks:
                    if time.monotonic() >= deadline:
                        break
                    results.append((attack, *send(client, url, attack)))
                round_ += 1

    threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(LONG_CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_no_request_kills_stalls_or_bloats_the_others(battery_server, long_run):
    url, server_pid = battery_server.url, battery_server.proc.pid
    quiet = _warm_up(url, 40 if long_run else 8)
    engine, supervisor, _ = processes(server_pid)
    assert engine is not None and supervisor is not None
    engine_before, tree_before = pss_bytes(engine), tree_pss_bytes(server_pid)
    memory, probe = MemoryWatch(server_pid).start(), Probe(url).start()
    t0 = time.perf_counter()
    try:
        results = _long(url) if long_run else _short(url)
    finally:
        probe.stop()
        memory.stop()
    wall = time.perf_counter() - t0

    wrong = [(a.name, status) for a, status, _ in results if status not in a.allowed]
    assert not wrong, wrong                                       # no 5xx, no lost request, each as expected
    assert not probe.failures, probe.failures[:5]
    assert processes(server_pid)[0] == engine                    # the engine never died (nor was replaced)
    assert_serving(url)
    _assert_all_requests_ended(url)
    health_p50, health_p99, health_max = (quantile(probe.health_s, q) for q in (0.5, 0.99, 1.0))
    plain_p50, plain_p99 = quantile(probe.plain_s, 0.5), quantile(probe.plain_s, 0.99)
    quiet_p99 = quantile(quiet, 0.99)
    engine_growth, tree_growth = memory.engine_peak - engine_before, memory.tree_peak - tree_before
    print(f"\nbattery: {len(results)} hostile requests in {wall:.1f} s; /health p50 {1e3 * health_p50:.1f} ms, "
          f"p99 {1e3 * health_p99:.1f} ms, max {1e3 * health_max:.1f} ms ({len(probe.health_s)} probes); plain p50 "
          f"{1e3 * plain_p50:.0f} ms, p99 {1e3 * plain_p99:.0f} ms vs quiet {1e3 * quiet_p99:.0f} ms "
          f"({len(probe.plain_s)} requests); engine PSS "
          f"+{engine_growth / MIB:.0f} MiB, server tree PSS +{tree_growth / MIB:.0f} MiB at peak")
    engine_budget = ENGINE_GROWTH + (CACHE_MEMORY if long_run else 0)     # CI: one request of each kind
    assert engine_growth <= engine_budget
    assert tree_growth <= GRAMMAR_MEMORY + engine_budget
    if long_run:          # NOTE: targets for a quiet machine (a shared box's neighbours are in the timings)
        assert health_p99 < 0.1 and plain_p99 <= 2 * quiet_p99
    else:
        # NOTE: CI shares its cores: a stall (the old failure: /health 13-33 s) is what this catches
        assert health_p50 < 0.1 and health_max < 2.0 and max(probe.plain_s) < 10.0


def _assert_all_requests_ended(url: str, timeout_s: float = 10.0) -> None:
    """Nothing runs or waits once every client is done (those that left included)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(url + "/metrics", timeout=10).text
        busy = [line for line in text.splitlines() if line.startswith(("stagewise_num_requests_running",
                                                                        "stagewise_num_requests_waiting"))
                and not line.endswith(" 0.0")]
        if not busy:
            return
        assert time.monotonic() < deadline, busy
        time.sleep(0.2)


def test_a_client_that_leaves_has_its_compile_killed(battery_server):
    """A stream whose grammar compiles for minutes; the client leaves: the compile child is killed
    at once, not when its CPU budget runs out."""
    server_pid = battery_server.proc.pid
    body = json.dumps({"prompt": "hi", "max_tokens": 8, "stream": True,
                       "structured_outputs": {"regex": "b*" * 1000}}).encode()
    with socket.create_connection((launcher.HOST, battery_server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 30
        while not processes(server_pid)[2]:                     # the compile child started
            assert time.monotonic() < deadline, "no compile started"
            time.sleep(0.05)
        compiling = processes(server_pid)[2]
    left = time.monotonic()                                     # before any byte of the answer came
    while set(compiling) & set(processes(server_pid)[2]):
        assert time.monotonic() - left < 1.5, "the compile outlived its request"
        time.sleep(0.05)
    assert_serving(battery_server.url)


def test_a_dead_compiler_is_a_503_and_the_next_grammar_starts_a_new_one(battery_server):
    url, server_pid = battery_server.url, battery_server.proc.pid
    body = {"prompt": "hi", "max_tokens": 4, "structured_outputs": {"regex": "c*" * 1000}}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, url + C, json=body, timeout=60)
        deadline = time.monotonic() + 30
        while not processes(server_pid)[2]:
            assert time.monotonic() < deadline, "no compile started"
            time.sleep(0.05)
        os.kill(processes(server_pid)[1], signal.SIGKILL)
        r = answer.result()
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable", r.text
    r = httpx.post(url + C, json={"prompt": "hi", "max_tokens": 2, "structured_outputs": {"choice": ["ok"]}},
                   timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok", r.text
    assert_serving(url)
