"""Every bad input is an HTTP 400 in the OpenAI error shape (never a 422 or 500), and the server
keeps answering everyone else."""
from __future__ import annotations

import pytest

try:
    import httpx2 as httpx
except ImportError:
    import httpx

C, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"
MSG = [{"role": "user", "content": "hi"}]

CASES = [
    # (endpoint, body, param named in the error, or None)
    (C, {"prompt": 5}, "prompt"),
    (C, {"prompt": "hi", "max_tokens": "8"}, "max_tokens"),
    (C, {"prompt": "hi", "temperature": "hot"}, "temperature"),
    (C, {"prompt": "hi", "stream": "yes"}, "stream"),
    (C, {"prompt": "hi", "max_tokens": 100000}, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    (C, {"prompt": "hi", "temperature": -0.5}, "temperature"),
    (C, {"prompt": "hi", "top_p": 1.5}, "top_p"),
    (C, {"prompt": "hi", "top_p": 0}, "top_p"),
    (C, {"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    (C, {"prompt": "hi", "logprobs": 50}, "logprobs"),
    (C, {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    (C, {"prompt": "word " * 600}, "prompt"),
    (C, {"prompt": list(range(3, 603))}, "prompt"),
    (C, {"prompt": [999999]}, "prompt"),              # which prompt, not an internal field name
    (C, {"prompt": ""}, "prompt"),
    (C, {"prompt": []}, "prompt"),
    (C, {"prompt": "hi", "best_of": 3}, "best_of"),
    (C, {"prompt": "hi", "logit_bias": {"five": 1.0}}, "logit_bias"),
    (C, {"prompt": "hi", "suffix": "end"}, "suffix"),
    (C, {"prompt": "hi", "echo": "yes"}, "echo"),
    (C, {"prompt": "hi", "echo": True, "max_tokens": -1}, "max_tokens"),
    (C, {"prompt": "hi", "echo": True, "logprobs": 21}, "logprobs"),
    (C, {"prompt": "hi", "n": 0}, "n"),
    (C, {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    (C, {"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
    (C, {"prompt": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    (C, {"prompt": "hi", "use_beam_search": True}, "use_beam_search"),
    (CHAT, {"max_tokens": 3}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools.0.function.name"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    (CHAT, {"messages": MSG, "tool_choice": "required"}, "tool_choice"),
    (CHAT, {"messages": MSG, "response_format": {"type": "xml"}}, "response_format.type"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}}, "response_format"),
    (CHAT, {"messages": MSG, "structured_outputs": {"regex": "[a-z"}}, "structured_outputs"),
    (CHAT, {"messages": MSG, "guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    (C, {"prompt": "hi", "guided_grammar": "root ::= foo"}, "guided_grammar"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 100000}, "max_tokens"),
    (CHAT, {"messages": MSG, "n": 100}, "n"),
    (CHAT, {"messages": MSG, "audio": {"voice": "alloy"}}, "audio"),
    (CHAT, {"messages": MSG, "spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    (GEN, {"text": "hi", "input_ids": [5]}, "input_ids"),
    (GEN, {"sampling_params": {}}, "text"),
    (GEN, {"input_embeds": [[0.1, 0.2]]}, "input_embeds"),
    (GEN, {"input_embeds": [[0.1] * 64, [0.1] * 63]}, "input_embeds"),
    (GEN, {"input_ids": []}, "input_ids"),
    (GEN, {"text": "hi", "sampling_params": {"max_new_tokens": 5}}, "sampling_params.max_new_tokens"),
    (GEN, {"text": "hi", "frobnicate": 1}, "frobnicate"),                # the native API stays strict
    (GEN, {"text": "hi", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    (GEN, {"text": "hi", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
    (GEN, {"text": "hi", "sampling_params": {"max_tokens": "5"}}, "sampling_params.max_tokens"),
    (GEN, {"text": "hi", "sampling_params": {"max_tokens": 100000}}, "sampling_params.max_tokens"),
    (GEN, {"text": "hi", "sampling_params": {"bad_words": [" "]}}, "sampling_params.bad_words"),
]


def check_400(response, param):
    assert response.status_code == 400, (response.status_code, response.text)
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"].endswith((".", ")"))
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize("endpoint,body,param", CASES, ids=[f"{e}:{list(b)[-1]}" for e, b, _ in CASES])
def test_bad_request_is_400(server, endpoint, body, param):
    if endpoint == CHAT and "messages" not in body and param != "messages":
        body = dict(body, messages=MSG)
    check_400(httpx.post(server.url + endpoint, json=body, timeout=30), param)


@pytest.mark.parametrize("raw", [b'{"prompt": "hi",', b"not json at all", b"[1, 2]", b'"just a string"',
                                 b'{"input_embeds": [[NaN]]}', b"\xff\xfe"])
def test_malformed_bodies_are_400(server, raw):
    endpoint = GEN if b"embeds" in raw else C
    r = httpx.post(server.url + endpoint, content=raw, headers={"content-type": "application/json"})
    check_400(r, None)


def test_unknown_routes_use_the_error_shape(server):
    for r in (httpx.get(server.url + "/v1/nothing"), httpx.get(server.url + C)):
        assert r.status_code in (404, 405) and "message" in r.json()["error"]


def test_openai_client_sees_bad_request_and_server_keeps_serving(server, client):
    import openai
    model = client.models.list().data[0].id
    rejected = server.metric("stagewise_requests_total", status="rejected")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=model, prompt="hi", temperature=-1)
    with pytest.raises(openai.NotFoundError, match="does not exist"):      # 404 model_not_found
        client.chat.completions.create(model="gpt-4o", messages=MSG)
    assert server.metric("stagewise_requests_total", status="rejected") == rejected + 2
    ok = client.completions.create(model=model, prompt="still there?", max_tokens=3, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")
    assert httpx.get(server.url + "/health").status_code == 200
