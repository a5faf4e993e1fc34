"""A server started with an API key, a 12 MiB body limit, a served model name holding U+2028,
U+2029 and U+0085, and a 1 s graceful timeout: 401 without the key (/health and /metrics stay
open), a 10 MB prompt refused without tokenizing while /health stays fast, SSE lines that line
splitters cannot cut, and (last, it stops the server) the SIGTERM drain."""
from __future__ import annotations

import json
import signal
import threading
import time

import pytest
from http_checks import JSON, NORMAL, assert_error, assert_serving, health_latencies_while, httpx

KEY = "sk-test-0123456789"
NAME = "tiny\u2028llama\u2029x\u0085y"
AUTH = {"authorization": f"Bearer {KEY}"}
LIMIT = 12 << 20


@pytest.fixture(scope="module")
def guarded(launch, llama_dir, tmp_path_factory):
    srv = launch(llama_dir, tmp_path_factory.mktemp("guarded"), "--api-key", KEY, "--max-request-bytes", "12MiB",
                 "--served-model-name", NAME, "--graceful-timeout", "1")
    yield srv
    srv.stop()


def test_api_key_flag_defaults_to_the_environment(monkeypatch):
    from stagewise.cli import build_parser
    monkeypatch.setenv("STAGEWISE_API_KEY", "from-env")
    assert build_parser().parse_args(["serve"]).api_key == "from-env"
    assert build_parser().parse_args(["serve", "--api-key", "flag"]).api_key == "flag"
    monkeypatch.delenv("STAGEWISE_API_KEY")
    assert build_parser().parse_args(["serve"]).api_key is None


@pytest.mark.slow
@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {KEY}"},
                                     {"authorization": KEY}, {"authorization": f"Bearer {KEY}x"}],
                         ids=["none", "wrong", "basic", "bare", "longer"])
def test_routes_need_the_key(guarded, headers):
    for method, path in (("GET", "/v1/models"), ("GET", "/v1/models/x"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions"), ("POST", "/generate"), ("GET", "/v1/nothing")):
        r = httpx.request(method, guarded.url + path, json=NORMAL, headers=headers, timeout=30)
        assert_error(r, 401, code="invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer"
    # the key is checked first: an unauthenticated text/plain body is 401, not 415
    assert httpx.post(guarded.url + "/generate", content=b"x", headers={**headers, "content-type": "text/plain"},
                      timeout=30).status_code == 401
    assert httpx.get(guarded.url + "/health").status_code == 200
    assert httpx.get(guarded.url + "/metrics").status_code == 200
    assert_serving(guarded.url, AUTH)


@pytest.mark.slow
def test_openai_client_with_the_key(guarded):
    import openai
    from openai import OpenAI
    with OpenAI(base_url=guarded.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        assert [m.id for m in client.models.list().data] == [NAME]
        assert client.models.retrieve(NAME).id == NAME           # the name travels percent-encoded
        out = client.completions.create(model=NAME, prompt="Hello", max_tokens=3, temperature=0)
        assert out.model == NAME and out.choices[0].finish_reason in ("stop", "length")
    with OpenAI(base_url=guarded.url + "/v1", api_key="wrong", max_retries=0, timeout=60) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
        with pytest.raises(openai.AuthenticationError):
            client.models.retrieve(NAME)


@pytest.mark.slow
def test_served_name_everywhere_and_no_path(guarded, llama_dir):
    card = httpx.get(guarded.url + "/v1/models", headers=AUTH).json()["data"][0]
    assert card["id"] == card["root"] == NAME
    assert guarded.metric("stagewise_num_requests_running", model_name=NAME) == 0      # the label is the name
    r = httpx.post(guarded.url + "/v1/completions", json={**NORMAL, "model": "nope"}, headers=AUTH)
    assert str(llama_dir) not in r.text and str(llama_dir) not in httpx.get(guarded.url + "/metrics").text


@pytest.mark.slow
def test_sse_events_survive_line_splitters(guarded):
    """The model name in every chunk holds U+2028, U+2029 and U+0085: escaped, each event stays one line."""
    body = {**NORMAL, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", guarded.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        raw = r.read().decode()
    for ch in ("\u2028", "\u2029", "\u0085"):
        assert ch not in raw
    lines = [line for line in raw.splitlines() if line]       # splitlines breaks at all three
    assert lines[-1] == "data: [DONE]" and len(lines) >= 3
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert all(c["model"] == NAME for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 4


@pytest.mark.slow
def test_10mb_prompt_is_refused_without_tokenizing_while_health_stays_fast(guarded):
    big = json.dumps({"prompt": "a" * 10_000_000}).encode()          # under the 12 MiB limit
    url = guarded.url + "/v1/completions"

    def refuse_three():
        return [httpx.post(url, content=big, headers={**JSON, **AUTH}, timeout=60) for _ in range(3)]

    def check(responses):
        for r in responses:
            err = assert_error(r, 400, code="context_length_exceeded")
            assert "characters" in err["message"]
    latencies = health_latencies_while(guarded.url, refuse_three, check)
    assert len(latencies) >= 3 and sorted(latencies)[len(latencies) // 2] < 0.1 and max(latencies) < 1.0, latencies
    over = json.dumps({"prompt": "a" * (LIMIT + 10)}).encode()
    assert_error(httpx.post(url, content=over, headers={**JSON, **AUTH}, timeout=60), 413, code="request_too_large")
    assert_serving(guarded.url, AUTH)


@pytest.mark.slow
def test_sigterm_drains_then_cuts_open_requests_with_an_error(guarded):
    """Keep this last in the module: it stops the server."""
    # 64 sequences of 480 tokens: ~3 s of work on a quiet machine, well past the 1 s grace (16 took 1.1 s)
    long = {"prompt": "A long answer", "max_tokens": 480, "temperature": 0, "ignore_eos": True, "n": 16}
    got: dict = {"plain": []}
    first_chunk = threading.Event()

    def stream():
        with httpx.stream("POST", guarded.url + "/v1/completions", json={**long, "stream": True}, headers=AUTH,
                          timeout=60) as r:
            lines = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[len("data: "):])
                    first_chunk.set()
            got["stream"] = lines

    def plain():
        got["plain"].append(httpx.post(guarded.url + "/v1/completions", json=long, headers=AUTH, timeout=60))

    threads = [threading.Thread(target=stream)] + [threading.Thread(target=plain) for _ in range(3)]
    for t in threads:
        t.start()
    assert first_chunk.wait(30)
    deadline = time.monotonic() + 30
    while guarded.metric("stagewise_num_requests_running") + guarded.metric("stagewise_num_requests_waiting") < 16:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    guarded.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    assert_error(httpx.get(guarded.url + "/health", timeout=5), 503)              # answered, not refused
    assert_error(httpx.post(guarded.url + "/generate", json={"text": "hi"}, headers=AUTH, timeout=5), 503)
    for t in threads:
        t.join(30)
    events = got["stream"]
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])
    assert set(error) == {"error"} and error["error"]["type"] == "service_unavailable", error
    assert "shut down" in error["error"]["message"]
    assert len(got["plain"]) == 3
    for answer in got["plain"]:
        assert_error(answer, 503)
    assert guarded.proc.wait(30) == 0
    log = guarded.log_path.read_text()
    assert "Traceback" not in log and "cutting" in log, log[-3000:]
