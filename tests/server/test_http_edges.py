"""HTTP edges a real client hits, on a server whose engine core runs a scripted fake engine in a
thread (fast, no model): clients that leave or trickle while sending the body, paths with a
trailing slash, requests uvicorn cannot parse, and the wording of some 400s."""
from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import pytest
from test_engine_failure import FakeTok, fake_engine

from stagewise.cluster.rendezvous import free_port

try:
    import httpx2 as httpx
except ImportError:
    import httpx


@pytest.fixture(scope="module")
def fake_url(tmp_path_factory):
    import uvicorn

    from stagewise.core.client import EngineClient
    from stagewise.server.app import build_app, uvicorn_config
    from stagewise.server.options import ServerOptions
    spec = SimpleNamespace(die_at_step=10**9, bug=False, dead_flag=str(tmp_path_factory.mktemp("fake") / "never"))
    engine = EngineClient(spec, engine_factory=fake_engine, tokenizer=FakeTok(), in_process=True)
    # NOTE: evil.example is an allowed Host here (as a reverse proxy's name would be), so the requests
    # below reach the routes; the paths must still never echo it back
    app = build_app(engine, ServerOptions(served_model_name="fake", api_key="k", body_timeout_s=1.0,
                                          allowed_hosts=("evil.example",)))
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, "warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


AUTH = {"Authorization": "Bearer k"}


def _raw(url: str, data: bytes, close_after: bool = False) -> bytes:
    """Send raw bytes on one connection; returns what the server answered (until it closes)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(data)
        if close_after:
            return b""
        data = b""
        while not _complete(data) and (chunk := sock.recv(65536)):
            data += chunk
        return data


def _complete(response: bytes) -> bool:
    head, sep, body = response.partition(b"\r\n\r\n")
    lengths = [line.split(b":")[1] for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")]
    return bool(sep) and bool(lengths) and len(body) >= int(lengths[0])


def _head(path: str, length: str, body: bytes = b"") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: evil.example\r\nAuthorization: Bearer k\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode() + body


def test_a_client_leaving_mid_body_is_no_server_error(fake_url, caplog):
    with caplog.at_level("DEBUG", logger="stagewise"):
        _raw(fake_url, _head("/v1/completions", "100", b'{"prompt": '), close_after=True)
        time.sleep(0.5)
    assert "Traceback" not in caplog.text and not [r for r in caplog.records if r.levelname in ("ERROR", "WARNING")]
    assert httpx.get(fake_url + "/health").status_code == 200


def test_a_trickling_body_times_out_with_408(fake_url):
    t0 = time.monotonic()
    answer = _raw(fake_url, _head("/v1/completions", "100", b'{"prompt": '))
    assert time.monotonic() - t0 < 5
    assert answer.startswith(b"HTTP/1.1 408") and b'"error"' in answer and b"did not arrive within 1 s" in answer


def test_a_trailing_slash_is_404_not_a_redirect(fake_url):
    r = httpx.post(fake_url + "/generate/", json={"text": "hi"}, headers={"Host": "evil.example", **AUTH})
    assert r.status_code == 404 and "location" not in r.headers and r.json()["error"]["type"] == "not_found_error"
    assert "evil.example" not in r.text


def test_an_unparsable_request_gets_the_openai_error_shape(fake_url):
    answer = _raw(fake_url, _head("/v1/completions", "abc", b"{}"))
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    assert b'"error"' in body and b"Content-Length" in body


@pytest.mark.parametrize("body,param,says,not_says", [
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text",
     "messages[0].content[0] is a text part without a 'text' string", "accepts only text parts"),
    ({"prompt": [[1, 2], [3, 500]]}, "prompt", "prompt[1] holds the token id 500", "prompt_token_ids"),
    ({"prompt": "hi", "stream": True, "stream_options": 3}, "stream_options", "a JSON object", "StreamOptions"),
    ({"prompt": [7], "max_tokens": 5000}, "max_tokens", "The prompt has 1 token and", "1 tokens"),
])
def test_error_wording(fake_url, body, param, says, not_says):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(fake_url + path, json=body, headers=AUTH)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and says in err["message"], err
    assert not_says not in err["message"]


def test_generate_sampling_params_type_error_names_no_schema_class(fake_url):
    r = httpx.post(fake_url + "/generate", json={"text": "hi", "sampling_params": []}, headers=AUTH)
    assert r.status_code == 400 and "NativeSampling" not in r.text and "a JSON object" in r.text, r.text
