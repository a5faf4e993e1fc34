"""Assertions the server tests share: the OpenAI error shape with an exact status, "still
serving" (health 200 and a normal greedy request answered), and /health latency under load."""
from __future__ import annotations

import threading
import time

try:
    import httpx2 as httpx
except ImportError:          # the openai client ships httpx2 here; plain httpx elsewhere
    import httpx

JSON = {"content-type": "application/json"}
NORMAL = {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def assert_error(response, status: int, param: str | None = None, code: str | None = None) -> dict:
    """`response` is HTTP `status` with exactly {"error": {message, type, param, code}}; returns the error."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    body = response.json()
    assert list(body) == ["error"], body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"].rstrip().endswith((".", ")")), err
    kinds = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
             415: "invalid_request_error", 500: "server_error", 503: "service_unavailable"}
    assert err["type"] == kinds[status], err
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def assert_serving(url: str, headers: dict | None = None) -> list[int]:
    """/health is 200 and a normal greedy request is answered; returns its token ids."""
    health = httpx.get(url + "/health", timeout=10)
    assert health.status_code == 200, health.text
    r = httpx.post(url + "/generate", json={"text": NORMAL["prompt"], "sampling_params": {
        "max_tokens": 4, "temperature": 0, "ignore_eos": True}}, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["token_ids"]) == 4
    return r.json()["token_ids"]


def health_latencies_while(url: str, work, check) -> list[float]:
    """Seconds of each /health call made while `work()` runs in another thread; `check(result)` after."""
    result, done = {}, threading.Event()

    def run():
        try:
            result["r"] = work()
        finally:
            done.set()
    thread = threading.Thread(target=run)
    latencies = []
    with httpx.Client(timeout=10) as client:
        client.get(url + "/health")                  # connect first: time only the answer
        thread.start()
        while not done.is_set():
            t0 = time.perf_counter()
            assert client.get(url + "/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.005)
    thread.join()
    check(result["r"])
    return latencies


# Sampling values at the edge of float range, sent as raw JSON text. Each must get a 4xx, or an
# answer equal to greedy where the value means greedy (a temperature under 1e-5, a top_p keeping
# one token), and the engine must stay alive.
EXTREME_SAMPLING = [
    ('"temperature": 1e-300', True), ('"temperature": 5e-324', True), ('"temperature": 1e-45', True),
    ('"temperature": 1.0, "top_p": 1e-300', True), ('"repetition_penalty": 1e-300', False),
    ('"temperature": 1e999, "min_tokens": 2', False), ('"temperature": Infinity, "min_tokens": 2', False),
]


def assert_extreme_sampling_is_safe(url: str, case: str, means_greedy: bool) -> None:
    greedy = assert_serving(url)
    body = '{"text": "The quick brown fox", "sampling_params": {"max_tokens": 4, "ignore_eos": true, %s}}' % case
    r = httpx.post(url + "/generate", content=body.encode(), headers=JSON, timeout=60)
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text)
    if r.status_code == 200 and means_greedy:
        assert r.json()["token_ids"] == greedy, r.text
    elif r.status_code != 200:
        assert_error(r, r.status_code)
    assert assert_serving(url) == greedy
