"""After the engine process reports a dead stage and exits, the server reaps it at once: it must
not stay <defunct> under a server that keeps running (answering 503)."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

from test_engine_failure import FakeTok, fake_engine

from stagewise.cluster.rendezvous import free_port

try:
    import httpx2 as httpx
except ImportError:
    import httpx


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None            # gone: reaped


def test_engine_process_is_reaped_after_a_stage_death(tmp_path):
    import uvicorn

    from stagewise.core.client import EngineClient
    from stagewise.server.app import build_app, uvicorn_config
    from stagewise.server.options import ServerOptions
    spec = SimpleNamespace(die_at_step=10**9, bug=False, dead_flag=str(tmp_path / "stage-died"))
    engine = EngineClient(spec, engine_factory=fake_engine, tokenizer=FakeTok())
    server = uvicorn.Server(uvicorn_config(build_app(engine, ServerOptions(served_model_name="fake")), "127.0.0.1",
                                           port := free_port(), "warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        pid = engine._proc.pid
        Path(spec.dead_flag).write_text("stagewise-stage-1 (pid 123) died unexpectedly.")
        deadline = time.monotonic() + 10
        while _state(pid) not in (None,) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _state(pid) is None, f"engine process state {_state(pid)!r} (Z: never reaped)"
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 503
    finally:
        server.should_exit = True
        thread.join(10)
