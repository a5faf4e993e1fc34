"""Engine death behind a live server, with the engine core in its own process (what `stagewise
serve` runs) and in a thread of the server (the same core and client over the same pipes):
in-flight requests get errors (streaming and not), new ones get 503, /health turns 503, and
nothing hangs. Uses a scripted fake engine (no model) served by uvicorn in a thread, so the
failure is deterministic and fast; a test also kills the engine process outright."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from stagewise.cluster.rendezvous import free_port
from stagewise.config import EngineConfig
from stagewise.engine.outputs import StepOutputs
from stagewise.errors import EngineDeadError
from stagewise.request import CompletionOutput, RequestOutput

try:
    import httpx2 as httpx
except ImportError:
    import httpx


class FakeTok:
    eos_token_ids = ()
    hidden_size = 4
    vocab_size = 100
    tokenizer = None

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 100 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)

    def chat_prompt(self, messages) -> str:
        return "".join(m["content"] for m in messages)


class FakeExecutor:
    """`dead` turns into a stage's death message once the file `dead_flag` exists (any process can
    create it), as the real executor's monitor flags a stage that died while the engine idles."""

    num_blocks = 257

    def __init__(self, dead_flag: str):
        self.dead_flag = dead_flag

    @property
    def dead(self) -> str | None:
        return Path(self.dead_flag).read_text() if os.path.exists(self.dead_flag) else None


class FakeEngine:
    """One token per request per step; from step `die_at_step` on, the first step with two requests
    running raises EngineDeadError (a plain RuntimeError when `bug`: an engine bug)."""

    recovering = None          # its pipeline never heals

    def __init__(self, die_at_step: int, bug: bool = False, dead_flag: str = "/nonexistent"):
        self.tok, self.max_model_len, self.model_dir = FakeTok(), 4096, "/fake"
        self.config = EngineConfig.from_kwargs(model="fake")
        self.kv_capacity_tokens = (FakeExecutor.num_blocks - 1) * 16
        self.executor = FakeExecutor(dead_flag)
        self.requests: dict[str, list] = {}
        self.inbox: list = []
        self.lock = threading.Lock()
        self.steps, self.die_at_step, self.bug, self.shut_down = 0, die_at_step, bug, False

    def add_request(self, prompt=None, params=None, *, prompt_token_ids=None, input_embeds=None, request_id=None,
                    tenant=None):
        with self.lock:
            self.inbox.append(("add", (request_id, prompt_token_ids, params)))

    def abort(self, request_id):
        with self.lock:
            self.inbox.append(("abort", request_id))

    def has_unfinished(self) -> bool:
        return bool(self.requests or self.inbox)

    def fault(self) -> str | None:
        return self.executor.dead

    def step(self) -> StepOutputs:
        return StepOutputs(self._step(), progressed=True)

    def _step(self) -> list[RequestOutput]:
        with self.lock:
            inbox, self.inbox = self.inbox, []
        for kind, item in inbox:
            if kind == "add":
                self.requests[item[0]] = [item[1], [], item[2]]
            else:
                self.requests.pop(item, None)
        if not self.requests:
            return []
        time.sleep(0.02)
        self.steps += 1
        if self.steps >= self.die_at_step and len(self.requests) >= 2:
            if self.bug:
                raise RuntimeError("stage 1 died of a bug")
            outs = [_out(rid, r[1], "error", "stage 1 died") for rid, r in self.requests.items()]
            self.requests.clear()
            raise EngineDeadError("stage 1 died", outs)
        outs = []
        for rid, r in list(self.requests.items()):
            r[1].append(len(r[1]) + 1)
            done = len(r[1]) >= r[2].max_tokens
            outs.append(_out(rid, r[1], "length" if done else None))
            if done:
                del self.requests[rid]
        return outs

    def stats(self) -> dict:
        return {"running": len(self.requests), "waiting": 0, "kv_usage": 0.0, "num_kv_blocks": 257}

    def shutdown(self) -> None:
        self.shut_down = True


def _out(rid, ids, reason, error=None) -> RequestOutput:
    text = FakeTok().decode(ids)
    return RequestOutput(rid, None, [1], [CompletionOutput(0, text, list(ids), reason, None, error)],
                         finished=reason is not None, metrics={"arrival_time": time.monotonic()})


def fake_engine(spec) -> FakeEngine:
    """The engine factory the engine process calls (`spec` stands in for the EngineConfig)."""
    return FakeEngine(spec.die_at_step, spec.bug, spec.dead_flag)


@pytest.fixture(params=[("dead", "process"), ("bug", "process"), ("dead", "inproc"), ("bug", "inproc")],
                ids=lambda p: "-".join(p))
def fake_server(request, tmp_path):
    """(url, bridge, spec): a server on a fake engine whose core runs where the param names; the
    engine dies of a stage failure ("dead") or of a bug at step 4, or when `spec.dead_flag` is written."""
    import uvicorn

    from stagewise.core.client import EngineClient
    from stagewise.server.app import build_app
    from stagewise.server.options import ServerOptions
    failure, layout = request.param
    spec = SimpleNamespace(die_at_step=4, bug=failure == "bug", dead_flag=str(tmp_path / "stage-died"))
    bridge = EngineClient(spec, engine_factory=fake_engine, tokenizer=FakeTok(), in_process=layout == "inproc")
    app = build_app(bridge, ServerOptions(served_model_name="fake"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not server.started:
        time.sleep(0.05)
    yield url, bridge, spec
    server.should_exit = True
    thread.join(10)
    bridge._proc.join(5)
    assert bridge._proc.exitcode is not None          # the engine core was stopped (or died)


def test_engine_death_fails_requests_and_health(fake_server):
    url, bridge, spec = fake_server
    ok = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "abc", "max_tokens": 3}, timeout=10)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "bcd"
    results = {}

    def non_streaming():
        results["plain"] = httpx.post(url + "/v1/completions", json={"prompt": "abc", "max_tokens": 2000}, timeout=30)

    thread = threading.Thread(target=non_streaming)
    thread.start()
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=10, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000, "stream": True}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    thread.join(10)
    # a dead stage is news for the client; an engine bug's exception stays in the server log
    why = "internal error" if spec.bug else "stage 1 died"
    assert events[-1] == "data: [DONE]" and '"error"' in events[-2] and why in events[-2], events[-3:]
    plain = results["plain"]
    assert plain.status_code == 503 and why in plain.json()["error"]["message"], plain.text
    health = httpx.get(url + "/health")
    assert health.status_code == 503 and why in health.json()["error"]["message"]
    assert "of a bug" not in events[-2] + plain.text + health.text
    again = httpx.post(url + "/v1/completions", json={"prompt": "abc", "max_tokens": 3}, timeout=10)
    assert again.status_code == 503 and again.json()["error"]["type"] == "service_unavailable"


@pytest.mark.parametrize("fake_server", [("dead", "process"), ("dead", "inproc")], indirect=True,
                         ids=["process", "inproc"])
def test_stage_death_while_idle_turns_health_503(fake_server):
    url, bridge, spec = fake_server
    assert httpx.get(url + "/health").status_code == 200
    Path(spec.dead_flag).write_text("stagewise-stage-1 (pid 123) died unexpectedly with exit code -9.")
    deadline = time.monotonic() + 5
    while httpx.get(url + "/health").status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    health = httpx.get(url + "/health")
    assert health.status_code == 503 and "stage-1" in health.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"prompt": "abc", "max_tokens": 3}, timeout=10)
    assert r.status_code == 503 and "stage-1" in r.json()["error"]["message"]


@pytest.mark.parametrize("fake_server", [("dead", "process"), ("dead", "inproc")], indirect=True,
                         ids=["process", "inproc"])
def test_server_fault_is_a_generic_500_and_the_details_go_to_the_log(fake_server, caplog):
    url, bridge, spec = fake_server

    def broken_encode(text: str):
        raise RuntimeError("secret detail at /srv/models/private")
    bridge.info.tok.encode = broken_encode
    with caplog.at_level("ERROR", logger="stagewise.server"):
        r = httpx.post(url + "/v1/completions", json={"prompt": "abc", "max_tokens": 2}, timeout=10)
    assert r.status_code == 500 and set(r.json()) == {"error"}, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error" and "logged" in err["message"]
    assert "RuntimeError" not in r.text and "secret" not in r.text and "/srv" not in r.text
    assert "secret detail" in caplog.text                      # the details are in the server log
    ok = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}, timeout=10)
    assert ok.status_code == 200, ok.text
    assert httpx.get(url + "/health").status_code == 200


@pytest.mark.parametrize("fake_server", [("dead", "process")], indirect=True, ids=["process"])
def test_killed_engine_process_fails_open_requests_and_health(fake_server):
    """SIGKILL the engine process mid-stream: the stream ends with an error event, /health and new
    requests answer 503 naming the engine process, and the server stays up."""
    url, bridge, spec = fake_server
    with httpx.stream("POST", url + "/v1/completions", timeout=10, json={
            "prompt": "abc", "max_tokens": 2000, "stream": True}) as r:
        events = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line)
                if len(events) == 2:
                    os.kill(bridge._proc.pid, signal.SIGKILL)
    assert events[-1] == "data: [DONE]" and '"error"' in events[-2] and "engine process" in events[-2], events[-3:]
    health = httpx.get(url + "/health")
    assert health.status_code == 503 and "exit code -9" in health.json()["error"]["message"]
    again = httpx.post(url + "/v1/completions", json={"prompt": "abc", "max_tokens": 3}, timeout=10)
    assert again.status_code == 503 and "engine process" in again.json()["error"]["message"]
