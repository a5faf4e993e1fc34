"""A PP=2 server (two stage processes) answers like the one-stage offline engine, survives
edge-of-range sampling values, and its SIGINT shutdown finishes open requests and stops the
stage processes."""
from __future__ import annotations

import json

import pytest
from http_checks import EXTREME_SAMPLING, assert_extreme_sampling_is_safe

from stagewise import SamplingParams

try:
    import httpx2 as httpx
except ImportError:
    import httpx


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pp_server(early_pp_server):
    """The PP=2 server that conftest started in the background at session start."""
    try:
        early_pp_server.wait_healthy()
    except BaseException:
        early_pp_server.stop()
        raise
    yield early_pp_server
    early_pp_server.stop()


def test_pp2_server_matches_offline(pp_server, offline):
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI
    prompts = ["The quick brown fox", "Once upon a time there was", "A B C D", "Numbers: 1 2 3"]
    with OpenAI(base_url=pp_server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        model = client.models.list().data[0].id
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: client.completions.create(
                model=model, prompt=p, max_tokens=12, temperature=0).choices[0].text, prompts))
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=8, temperature=0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in chat)
    ref = offline.generate(prompts, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    assert got == [r.outputs[0].text for r in ref]
    assert streamed == offline.chat([{"role": "user", "content": "hi"}],
                                    SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
    metrics = pp_server.metrics()
    assert len([k for k in metrics if k.startswith("stagewise_stage_busy_fraction{")]) == 2
    for family in ("stagewise_stage_bubble_fraction{", "stagewise_stage_predicted_share{",
                   "stagewise_stage_measured_share{"):       # pipeline balance, per stage
        assert len([k for k in metrics if k.startswith(family)]) == 2, family
    assert httpx.get(pp_server.url + "/health").status_code == 200


def test_pp2_structured_outputs_and_streaming(pp_server):
    """A JSON schema under PP=2 (the last stage applies the driver's bitmask), n > 1 and streaming."""
    from openai import OpenAI
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
    with OpenAI(base_url=pp_server.url + "/v1", api_key="unused", max_retries=0, timeout=60.0) as c:
        name = c.models.list().data[0].id
        r = c.chat.completions.create(model=name, messages=ask, response_format=fmt, n=4, seed=1, temperature=1.0,
                                      max_tokens=40)
        for choice in r.choices:
            obj = json.loads(choice.message.content)
            assert set(obj) == {"a", "b"} and isinstance(obj["a"], int) and obj["b"] in ("x", "y")
        streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model=name, messages=ask, response_format=fmt, temperature=0, max_tokens=40, stream=True))
        whole = c.chat.completions.create(model=name, messages=ask, response_format=fmt, temperature=0, max_tokens=40)
        assert streamed == whole.choices[0].message.content
        json.loads(streamed)



def test_pp2_extreme_sampling_values(pp_server):
    """The sampler runs on the last stage at PP=2: edge-of-range values still get a 4xx or a correct answer."""
    for case, means_greedy in EXTREME_SAMPLING:
        assert_extreme_sampling_is_safe(pp_server.url, case, means_greedy)


def test_sigint_finishes_in_flight_requests_then_exits(pp_server):
    import threading
    import time
    result = {}
    body = {"prompt": "A long answer", "max_tokens": 150, "temperature": 0, "ignore_eos": True}
    thread = threading.Thread(target=lambda: result.setdefault(
        "r", httpx.post(pp_server.url + "/v1/completions", json=body, timeout=60)))
    thread.start()
    deadline = time.monotonic() + 10
    while pp_server.metric("stagewise_num_requests_running") < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pp_server.stop() == 0            # SIGINT: stop accepting, finish the open request, stop stages
    thread.join(30)
    assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] == 150
