"""Hostile requests against the shared server: each gets its exact 4xx in the OpenAI error shape,
and the server answers a normal request right after. Unchecked sampling types, lone surrogates,
deep nesting, oversized bodies (by Content-Length and chunked), prompts too long to tokenize,
non-JSON content types."""
from __future__ import annotations

import json

import pytest
from http_checks import JSON, NORMAL, assert_error, assert_serving, health_latencies_while, httpx

from stagewise.request import SamplingParams
from stagewise.server.protocol import ChatCompletionRequest, CompletionRequest, NativeSampling, SamplingFields

C, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"
MSG = [{"role": "user", "content": "hi"}]


def post_raw(server, path: str, body: bytes, **headers):
    return httpx.post(server.url + path, content=body, headers={**JSON, **headers}, timeout=60)


def test_one_sampling_schema_for_every_route():
    # embed: /v1/embeddings sets it; lora: the request's model names the adapter (tests/test_sampling_fields.py)
    assert set(NativeSampling.model_fields) == set(SamplingParams.__dataclass_fields__) - {"embed", "lora"}
    assert issubclass(CompletionRequest, SamplingFields) and issubclass(ChatCompletionRequest, SamplingFields)


@pytest.mark.parametrize("field,value", [("skip_special_tokens", "no"), ("stop", 5), ("stop_token_ids", 5),
                                         ("ignore_eos", "yes"), ("stop", ["ok", 5]), ("seed", 2**70),
                                         ("temperature", True), ("min_tokens", 1.5)])
def test_generate_sampling_params_are_type_checked(server, field, value):
    r = httpx.post(server.url + GEN, json={"text": "Hi", "sampling_params": {field: value}}, timeout=30)
    err = assert_error(r, 400, code="invalid_type")
    assert err["param"].startswith(f"sampling_params.{field}")
    for path, body in ((C, {"prompt": "Hi"}), (CHAT, {"messages": MSG})):     # the same fields, the same rule
        assert_error(httpx.post(server.url + path, json={**body, field: value}, timeout=30), 400, code="invalid_type")
    assert_serving(server.url)


LONE = "\\ud800abc"          # a JSON escape of a lone UTF-16 surrogate (not text)


@pytest.mark.parametrize("path,body", [
    (C, '{"prompt": "%s"}' % LONE),
    (CHAT, '{"messages": [{"role": "user", "content": "%s"}]}' % LONE),
    (CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "%s"}]}]}' % LONE),
    (GEN, '{"text": "%s"}' % LONE),
    (GEN, '{"text": "hi", "sampling_params": {"%s": 1}}' % LONE),
    (C, '{"prompt": "hi", "stop": ["%s"]}' % LONE),
    (C, '{"prompt": "hi", "\\udc00": 1}'),
    (C, '{"prompt": ' + "[" * 5000 + "]" * 5000 + "}"),
    (GEN, '{"text": "hi", "sampling_params": {"stop": ' + "[" * 5000 + "]" * 5000 + "}}"),
    (C, '{"prompt": "hi", "max_tokens": 1' + "0" * 5000 + "}"),
], ids=["prompt", "chat", "chat-part", "generate", "sampling-key", "stop", "top-key", "deep", "deep-sampling",
        "huge-int"])
def test_unparseable_text_is_400_not_500(server, path, body):
    assert_error(post_raw(server, path, body.encode()), 400, code="invalid_json")
    assert_serving(server.url)


def test_raw_utf8_surrogate_bytes_are_400(server):
    assert_error(post_raw(server, C, b'{"prompt": "\xed\xa0\x80"}'), 400, code="invalid_json")


def test_valid_surrogate_pair_is_text(server):
    r = post_raw(server, C, b'{"prompt": "emoji \\ud83d\\ude00", "max_tokens": 2}')
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None, "application/jsonx"])
def test_non_json_content_type_is_415(server, content_type):
    headers = {"content-type": content_type} if content_type else {}
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    rejected = server.metric("stagewise_requests_total", status="rejected")
    for path in (C, CHAT, GEN):
        r = httpx.post(server.url + path, content=body, headers=headers, timeout=30)
        assert_error(r, 415, code="unsupported_media_type")
    assert server.metric("stagewise_requests_total", status="rejected") == rejected + 3
    ok = post_raw(server, C, body, **{"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


def test_body_over_the_limit_is_413_by_content_length_and_chunked(server):
    big = json.dumps({"prompt": "word " * (1 << 20)}).encode()           # 5 MiB > the 2 MiB default
    assert_error(post_raw(server, C, big), 413, code="request_too_large")

    def chunks():                                  # no Content-Length: counted while reading
        for i in range(0, len(big), 1 << 16):
            yield big[i:i + (1 << 16)]
    r = httpx.post(server.url + GEN, content=chunks(), headers=JSON, timeout=60)
    assert "content-length" not in {k.lower() for k in r.request.headers}
    assert_error(r, 413, code="request_too_large")
    assert_serving(server.url)


def test_prompt_longer_than_any_fitting_prompt_is_refused_untokenized(server):
    info = httpx.get(server.url + "/v1/models").json()["data"][0]
    too_many = info["max_model_len"] * 64 + 1          # the characters-per-token bound is at least 64
    for path, body in ((C, {"prompt": "a" * too_many}), (GEN, {"text": "a" * too_many}),
                       (CHAT, {"messages": [{"role": "user", "content": "a" * too_many}]})):
        err = assert_error(httpx.post(server.url + path, json=body, timeout=30), 400, code="context_length_exceeded")
        assert "characters" in err["message"]
    assert_serving(server.url)


def test_health_stays_fast_while_a_10mb_prompt_is_refused(server):
    """Refused by size (413) before anything is parsed; the event loop never stalls. The
    tokenize-free refusal of a 10 MB prompt that passes the size check is in test_guarded."""
    big = json.dumps({"prompt": "a" * 10_000_000}).encode()
    latencies = health_latencies_while(server.url, lambda: [post_raw(server, C, big) for _ in range(3)],
                                       lambda r: [assert_error(x, 413) for x in r])
    assert len(latencies) >= 3 and sorted(latencies)[len(latencies) // 2] < 0.1 and max(latencies) < 1.0, latencies


def test_too_many_choices_is_refused_before_tokenizing(server):
    r = httpx.post(server.url + C, json={"prompt": ["x"] * 65, "max_tokens": 1}, timeout=30)
    assert_error(r, 400, "n")
    r = httpx.post(server.url + C, json={"prompt": ["x"] * 5, "n": 16, "max_tokens": 1}, timeout=30)
    assert_error(r, 400, "n")


def test_errors_never_show_the_model_path(server, llama_dir):
    r = httpx.post(server.url + C, json={"model": "nope", "prompt": "hi"}, timeout=30)
    err = assert_error(r, 404, "model", "model_not_found")
    assert str(llama_dir) not in r.text and llama_dir.name in err["message"]
    ok = httpx.post(server.url + C, json={**NORMAL, "model": llama_dir.name}, timeout=30)
    assert ok.status_code == 200 and ok.json()["model"] == llama_dir.name
    assert str(llama_dir) not in httpx.get(server.url + "/metrics").text
