"""A request's grammar can only fail that request: a grammar that is complete ends its output (with
`ignore_eos` or not, on every route, streamed or not), a grammar error is a 4xx naming the field,
and bystander requests in flight meanwhile finish untouched."""
from __future__ import annotations

import json
import threading

import pytest
from http_checks import assert_error, assert_serving, httpx

C, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"
MSG = [{"role": "user", "content": "hi"}]
FINISHED_GRAMMARS = [
    (C, {"prompt": "hello", "max_tokens": 20, "ignore_eos": True, "structured_outputs": {"choice": ["a"]}}),
    (C, {"prompt": "hello", "max_tokens": 20, "ignore_eos": True, "n": 3, "structured_outputs": {"choice": ["a"]}}),
    (C, {"prompt": "hello", "max_tokens": 40, "ignore_eos": True, "structured_outputs": {"json_object": True}}),
    (C, {"prompt": "hello", "max_tokens": 20, "ignore_eos": True, "stream": True,
         "structured_outputs": {"regex": "[0-9]{2}"}}),
    (CHAT, {"messages": MSG, "max_tokens": 20, "ignore_eos": True, "stream": True,
            "structured_outputs": {"choice": ["yes", "no"]}}),
    (CHAT, {"messages": MSG, "max_tokens": 40, "ignore_eos": True, "response_format": {"type": "json_object"}}),
    (GEN, {"text": "hello", "sampling_params": {"max_tokens": 20, "ignore_eos": True,
                                                 "structured_outputs": {"grammar": 'root ::= "(" [a-c] ")"'}}}),
]


def _post(url: str, path: str, body: dict) -> tuple[int, list]:
    """(status, the finish reasons seen) of a request, streamed or not."""
    if body.get("stream"):
        reasons = []
        with httpx.stream("POST", url + path, json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    reasons += [c["finish_reason"] for c in event["choices"] if c.get("finish_reason")]
            return r.status_code, reasons
    r = httpx.post(url + path, json=body, timeout=60)
    if r.status_code != 200:
        return r.status_code, [r.text]
    data = r.json()
    return 200, [c["finish_reason"] for c in data["choices"]] if "choices" in data else [data["finish_reason"]]


def test_a_finished_grammar_finishes_its_request_and_bystanders_are_not_lost(server):
    bystanders: list = []

    def plain():
        bystanders.append(_post(server.url, C, {"prompt": "The quick brown fox", "max_tokens": 48,
                                                "temperature": 0, "ignore_eos": True, "stream": True}))
    threads = [threading.Thread(target=plain) for _ in range(4)]
    for t in threads:
        t.start()
    for path, body in FINISHED_GRAMMARS:
        status, reasons = _post(server.url, path, body)
        assert status == 200 and reasons and set(reasons) <= {"stop", "length"}, (path, body, status, reasons)
        if body.get("structured_outputs", {}).get("choice") == ["a"]:
            assert set(reasons) == {"stop"}
    for t in threads:
        t.join()
    assert bystanders == [(200, ["length"])] * 4
    assert_serving(server.url)


@pytest.mark.parametrize("path, body, param", [
    (C, {"prompt": "hi", "structured_outputs": {"json": {"type": "string", "minLength": "x"}}}, "structured_outputs"),
    (CHAT, {"messages": MSG, "stream": True, "structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs"),
])
def test_a_bad_grammar_is_a_400_naming_the_field(server, path, body, param):
    assert_error(httpx.post(server.url + path, json=body, timeout=60), 400, param)
    assert_serving(server.url)
