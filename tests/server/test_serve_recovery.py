"""`stagewise serve --pp-size 2` heals (one server for the module, a tiny fp32 model): 32 streaming
clients mid-decode lose nothing when stage 1 is SIGKILLed, when it is SIGSTOPped (it stops
answering: found by its missing heartbeats, long before --dist-timeout-s) and when stage 0 is
SIGKILLed: every request ends with its normal finish reason, the streamed text equals the fault-free
run (nothing repeated or changed), /health is 503 `recovering` during the rebuild and 200 after, and
/metrics counts the rebuilds by cause. A request that crashes the pipeline each time it runs (the
stage test hook STAGEWISE_TEST_CRASH_TOKEN) fails alone after two crashes; the others finish. Real
processes and signals; stage processes are found by name (stagewise-st0, stagewise-st1, and
stagewise-warm: the warm process they fork from)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from launcher import wait_gone

try:
    import httpx2 as httpx
except ImportError:          # the openai client ships httpx2 here; plain httpx elsewhere
    import httpx

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process names need Linux /proc")]

CRASH_TOKEN = 997
MAX_TOKENS = 96                 # long enough that no stream ends before every one has begun
PROMPTS = [[10 + i, 20 + i % 7, 30 + i % 5, 40 + 3 * i] for i in range(32)]
DIST_TIMEOUT_S = 60           # no fault here may wait for it: deaths close links, hangs miss heartbeats
HANG_FOUND_S = 30             # a stopped stage is declared lost after ~5 s of silence; generous on a busy box


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory, launch):
    old = os.environ.get("STAGEWISE_TEST_CRASH_TOKEN")
    os.environ["STAGEWISE_TEST_CRASH_TOKEN"] = str(CRASH_TOKEN)     # the server's processes inherit it
    try:
        srv = launch(llama_dir, tmp_path_factory.mktemp("healing"), "--pp-size", "2", "--dist-timeout-s",
                     str(DIST_TIMEOUT_S), "--max-pipeline-restarts", "20")
    finally:
        if old is None:
            del os.environ["STAGEWISE_TEST_CRASH_TOKEN"]
        else:
            os.environ["STAGEWISE_TEST_CRASH_TOKEN"] = old
    try:
        yield srv
    finally:
        pids = srv.descendants()
        srv.stop()
        assert not wait_gone(pids), "a stage or warm process outlived the server"


@pytest.fixture(scope="module")
def reference(server) -> list[str]:
    """The fault-free texts, from the same server before any fault."""
    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            rs = await asyncio.gather(*(client.post(server.url + "/v1/completions", json=_body(p)) for p in PROMPTS))
        return [r.json()["choices"][0]["text"] for r in rs]
    return asyncio.run(main())


def _body(prompt: list[int], stream: bool = False) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream}


def _stage_pids(server) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for pid in server.descendants():
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name.startswith("stagewise-"):
            found.setdefault(name, []).append(pid)
    return found


def _wait(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _health(server) -> tuple[int, dict]:
    try:
        r = httpx.get(server.url + "/health", timeout=2)
        return r.status_code, r.json()
    except (httpx.HTTPError, ValueError):
        return 0, {}


def _ready_for_a_fault(server) -> None:
    """Healthy, with the warm process the stages fork from (it forked them, so it is warm)."""
    _wait(lambda: _health(server)[0] == 200, 60, "/health 200")
    _wait(lambda: len(_stage_pids(server).get("stagewise-warm", [])) == 1, 60, "the warm process")


async def _stream(client, url: str, prompt: list[int], progress: list[int], i: int):
    chunks, reason, error = [], None, None
    async with client.stream("POST", url + "/v1/completions", json=_body(prompt, stream=True)) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]["message"]
                continue
            choice = event["choices"][0]
            chunks.append(choice["text"])
            reason = choice.get("finish_reason") or reason
            progress[i] += 1
    return chunks, reason, error


def _clients_with_fault(server, prompts: list[list[int]], fault, late: list[int] | None = None):
    """Stream every prompt; once each has 3 chunks, run `fault()` (in a thread), then (optionally)
    stream `late` too. Returns ([(chunks, reason, error)], fault's result, the late result)."""
    async def main():
        progress = [0] * (len(prompts) + 1)
        async with httpx.AsyncClient(timeout=180, limits=httpx.Limits(max_connections=100)) as client:
            tasks = [asyncio.create_task(_stream(client, server.url, p, progress, i)) for i, p in enumerate(prompts)]
            deadline = time.monotonic() + 60
            while min(progress[:-1]) < 3 and time.monotonic() < deadline:
                assert not any(t.done() for t in tasks), "a client finished before the fault"
                await asyncio.sleep(0.01)
            fault_result = await asyncio.to_thread(fault)
            late_result = await _stream(client, server.url, late, progress, -1) if late else None
            return await asyncio.gather(*tasks), fault_result, late_result
    return asyncio.run(main())


def _check_all_recovered(results, reference: list[str]) -> None:
    assert [reason for _, reason, _ in results] == ["length"] * len(results), [r[2] for r in results if r[2]]
    assert all(error is None for _, _, error in results)
    # what each client saw, concatenated, is the fault-free text: nothing repeated or changed
    texts = ["".join(chunks) for chunks, _, _ in results]
    assert texts == reference[:len(results)]


def _rebuilds(server, cause: str) -> float:
    return server.metric("stagewise_pipeline_rebuilds_total", cause=cause)


def test_sigkill_of_stage_1_mid_decode_loses_no_request(server, reference):
    _ready_for_a_fault(server)
    before = _rebuilds(server, "stage_died")
    recovered = server.metric("stagewise_pipeline_recovered_requests_total")
    victim = _stage_pids(server)["stagewise-st1"][0]
    t0 = time.monotonic()
    results, _, _ = _clients_with_fault(server, PROMPTS, lambda: os.kill(victim, signal.SIGKILL))
    _check_all_recovered(results, reference)
    assert _health(server)[0] == 200
    assert _rebuilds(server, "stage_died") == before + 1
    assert server.metric("stagewise_pipeline_recovered_requests_total") - recovered == len(PROMPTS)
    assert 0 < server.metric("stagewise_pipeline_recovery_seconds_total") < time.monotonic() - t0
    assert victim not in _stage_pids(server).get("stagewise-st1", [])


def test_a_stopped_stage_is_replaced_after_the_timeout(server, reference):
    """SIGSTOP: the missing heartbeats find it in seconds; /health says `recovering` while the rebuild
    waits (for the warm process, held here), and names the silent stage."""
    _ready_for_a_fault(server)
    before = _rebuilds(server, "timeout")
    pids = _stage_pids(server)
    warm, victim = pids["stagewise-warm"], pids["stagewise-st1"][0]
    seen = {}

    def fault():
        t0 = time.monotonic()
        for pid in warm:
            os.kill(pid, signal.SIGSTOP)
        os.kill(victim, signal.SIGSTOP)
        try:
            seen["health"] = _wait(lambda: (h := _health(server))[0] == 503 and h, HANG_FOUND_S, "/health 503")
            seen["found_s"] = time.monotonic() - t0
            time.sleep(0.5)
        finally:
            for pid in warm:
                os.kill(pid, signal.SIGCONT)

    results, _, _ = _clients_with_fault(server, PROMPTS[:8], fault)
    _check_all_recovered(results, reference)
    status, body = seen["health"]
    assert seen["found_s"] < HANG_FOUND_S < DIST_TIMEOUT_S
    assert body.get("status") == "recovering" and "no heartbeat" in body["error"]["message"], body
    assert _rebuilds(server, "timeout") == before + 1
    assert victim not in server.descendants() or not wait_gone([victim])     # SIGKILLed in the teardown
    _wait(lambda: _health(server)[0] == 200, 30, "/health 200 after the rebuild")


def test_sigkill_of_stage_0_reports_recovering_until_rebuilt(server, reference):
    """The warm process is held (SIGSTOP) so the rebuild waits, and /health must say `recovering`."""
    _ready_for_a_fault(server)
    pids = _stage_pids(server)
    warm, victim = pids["stagewise-warm"], pids["stagewise-st0"][0]
    seen = {}

    def fault():
        for pid in warm:
            os.kill(pid, signal.SIGSTOP)
        os.kill(victim, signal.SIGKILL)
        try:
            seen["health"] = _wait(lambda: (h := _health(server))[0] == 503 and h, 20, "/health 503")
            time.sleep(0.5)
        finally:
            for pid in warm:
                os.kill(pid, signal.SIGCONT)

    results, _, _ = _clients_with_fault(server, PROMPTS[:16], fault)
    status, body = seen["health"]
    assert body.get("status") == "recovering", body
    assert "Recovering" in body["error"]["message"] and "stage 0" in body["error"]["message"], body
    _check_all_recovered(results, reference)
    _wait(lambda: _health(server)[0] == 200, 30, "/health 200 after the rebuild")


def test_a_request_that_crashes_the_pipeline_twice_fails_alone(server, reference):
    _ready_for_a_fault(server)
    poisoned_before = server.metric("stagewise_pipeline_poisoned_requests_total")
    before = _rebuilds(server, "stage_died")
    results, _, late = _clients_with_fault(server, PROMPTS[:8], lambda: None, late=[3, 4, CRASH_TOKEN, 5])
    _check_all_recovered(results, reference)
    chunks, reason, error = late
    assert error is not None and "crashed the pipeline twice" in error, late
    assert server.metric("stagewise_pipeline_poisoned_requests_total") == poisoned_before + 1
    assert _rebuilds(server, "stage_died") == before + 2
    _wait(lambda: _health(server)[0] == 200, 30, "/health 200")


def test_a_stage_killed_while_idle_is_replaced(server, reference):
    """No request open: the monitor flags the death, the idle engine rebuilds at once."""
    _wait(lambda: _health(server)[0] == 200, 60, "/health 200")
    before = _rebuilds(server, "stage_died")
    victim = _stage_pids(server)["stagewise-st1"][0]
    os.kill(victim, signal.SIGKILL)
    _wait(lambda: _rebuilds(server, "stage_died") == before + 1, 60, "the rebuild")
    _wait(lambda: _health(server)[0] == 200, 60, "/health 200")
    r = httpx.post(server.url + "/v1/completions", json=_body(PROMPTS[0]), timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference[0]
