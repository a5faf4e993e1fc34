"""Stops take as long as the drain needs: a `stagewise serve` at --pp-size 2 that compiled grammars,
had a stream aborted and has compiles in flight stops within seconds of SIGTERM, with no "did not
stop" line (two threads reaped the engine process and the loser reported it alive) and no
traceback (the compile supervisor hung up on mid-send)."""
from __future__ import annotations

import signal
import threading
import time

import launcher
import pytest

try:
    import httpx2 as httpx
except ImportError:
    import httpx

pytestmark = pytest.mark.slow          # servers of their own

STOP_WITHIN_S = 6.0                    # graceful timeout 1 s, the cut's flush, the engine's stop


def _schema(i: int) -> dict:
    return {"type": "object", "properties": {f"p{i}_{k}": {"type": "string", "maxLength": 5} for k in range(300)}}


def _busy(url: str) -> list[threading.Thread]:
    """A grammar compiled and used, a stream left after its first event, compiles in flight."""
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "prompt": "hi", "max_tokens": 8, "structured_outputs": {"json": {"type": "object"}}})
    assert r.status_code == 200, r.text
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
            "prompt": "hi", "max_tokens": 400, "ignore_eos": True, "stream": True}) as s:
        next(s.iter_lines())

    def compile_one(i: int) -> None:
        try:
            httpx.post(url + "/v1/completions", timeout=60, json={
                "prompt": "hi", "max_tokens": 4, "structured_outputs": {"json": _schema(i)}})
        except httpx.HTTPError:
            pass
    threads = [threading.Thread(target=compile_one, args=(i,), daemon=True) for i in range(12)]
    for t in threads:
        t.start()
    return threads


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_pp_server_stops_promptly_after_grammars_and_aborts(llama_dir, tmp_path, sig):
    srv = launcher.ServerProcess(llama_dir, tmp_path / "server.log", "--pp-size", "2", "--graceful-timeout", "1")
    try:
        srv.wait_healthy(180)
        threads = _busy(srv.url)
        time.sleep(1.5)
        t0 = time.monotonic()
        code = srv.stop(grace_s=30, sig=sig)
        took = time.monotonic() - t0
    finally:
        srv.stop()
    for t in threads:
        t.join(5)
    log = srv.log_path.read_text()
    assert code == 0, log[-2000:]
    assert "did not stop" not in log and "Traceback" not in log, log[-3000:]
    assert took < STOP_WITHIN_S, (took, log[-2000:])


def _exit_at_once() -> None:
    pass


def test_a_core_reaped_elsewhere_is_not_reported_alive(caplog):
    """Something else in the server process reaped the exited engine process (the stop at
    --pp-size 2 said "did not stop within 15 s; killing it" 0.1 s after the engine exited):
    multiprocessing's waitpid then fails with ECHILD, which it reports as alive."""
    import multiprocessing as mp
    import os

    from stagewise.core.core_runner import CorePipes, stop_core
    proc = mp.get_context("fork").Process(target=_exit_at_once)
    proc.start()
    os.waitpid(proc.pid, 0)                            # the other reaper
    with caplog.at_level("WARNING", logger="stagewise.engine"):
        t0 = time.monotonic()
        stop_core(CorePipes(proc, None, None), 5.0)    # type: ignore[arg-type]
    assert "did not stop" not in caplog.text and time.monotonic() - t0 < 1.0
