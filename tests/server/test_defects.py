"""The smaller defects the hostile battery found, each answered as it should be: constraints the
request itself makes impossible are a 400 naming the field (not a 500), unknown models a 404, a
POST to /health a 405, a Host that only starts like a loopback address a 421, logit_bias keys that
are not token ids a 400 naming logit_bias, bad Responses API input a 400; plus the metrics after
the engine died, the graph-replay labels, the max_tokens options and a quiet shutdown."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from http_checks import JSON, assert_error, assert_serving, httpx

from stagewise.engine.stats import EngineStats
from stagewise.graph.policy import GraphVerdict
from stagewise.server.metrics import ServerMetrics
from stagewise.server.serving import Serving

C, CHAT, GEN, RESP = "/v1/completions", "/v1/chat/completions", "/generate", "/v1/responses"
MSG = [{"role": "user", "content": "hi"}]
EMPTY_LANGUAGE = "root ::= [^\\x00-\\U0010FFFF]"


@pytest.mark.parametrize("path, body, param", [
    (C, {"prompt": "hi", "structured_outputs": {"json": {"type": "array", "minItems": -1}}}, "structured_outputs"),
    (C, {"prompt": "hi", "structured_outputs": {"json": {"type": "string", "minLength": -1}}}, "structured_outputs"),
    (C, {"prompt": "hi", "structured_outputs": {"grammar": EMPTY_LANGUAGE}}, "structured_outputs"),
    (C, {"prompt": "hi", "stream": True, "structured_outputs": {"grammar": EMPTY_LANGUAGE}}, "structured_outputs"),
    (CHAT, {"messages": MSG, "stream": True, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "maxItems": -2}}}}, "response_format"),
    (C, {"prompt": "hi", "min_tokens": 3, "structured_outputs": {"choice": ["a"]}}, "min_tokens"),
    (C, {"prompt": "hi", "min_tokens": 3, "stream": True, "structured_outputs": {"choice": ["a", "b"]}},
     "min_tokens"),
    (C, {"prompt": "hi", "logit_bias": {"²": 1}}, "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    (RESP, {"input": ""}, "input"),
    (RESP, {"input": []}, "input"),
    (RESP, {"input": [{"type": "function_call", "call_id": "c1", "arguments": "{}"}]}, "input.0.name"),
    (RESP, {"input": [{"type": "function_call", "call_id": "c1", "name": 5, "arguments": "{}"}]}, "input.0.name"),
])
def test_impossible_or_malformed_requests_are_400_naming_the_field(server, path, body, param):
    r = httpx.post(server.url + path, json=body, timeout=60)
    err = assert_error(r, 400, param)
    assert "set_int_max_str_digits" not in err["message"] and "invalid literal" not in err["message"]


@pytest.mark.parametrize("body", [
    {"prompt": "hi", "max_tokens": 8, "allowed_token_ids": [5], "structured_outputs": {"choice": ["zzzz"]}},
    {"prompt": "hi", "max_tokens": 8, "min_tokens": 4, "structured_outputs": {"regex": "[0-9]"}},
])
def test_constraints_that_leave_no_token_are_400_not_500(server, body):
    """Found only while generating: the grammar together with the request's other constraints allows
    nothing (a stream says so in an error event)."""
    err = assert_error(httpx.post(server.url + C, json=body, timeout=60), 400, "structured_outputs")
    assert "min_tokens" in err["message"] or "allowed_token_ids" in err["message"]
    assert_serving(server.url)


def test_unknown_model_is_404_model_not_found(server):
    for path, body in ((C, {"model": "no-such-model", "prompt": "hi"}), (CHAT, {"model": "gpt-4", "messages": MSG})):
        assert_error(httpx.post(server.url + path, json=body, timeout=30), 404, "model", "model_not_found")


def test_post_to_health_is_405(server):
    assert_error(httpx.post(server.url + "/health", content=b"{}", headers=JSON), 405)
    assert_error(httpx.post(server.url + "/health", content=b"x", headers={"content-type": "text/plain"}), 405)


def test_a_host_that_only_starts_like_loopback_is_421(server):
    for host in ("[::1]evil.com", f"[::1]evil.com:{server.port}", "127.0.0.1:80evil.com"):
        r = httpx.get(server.url + "/health", headers={"Host": host})
        assert r.status_code == 421, (host, r.status_code)
    assert httpx.get(server.url + "/health", headers={"Host": f"[::1]:{server.port}"}).status_code == 200


def test_gauges_read_zero_once_the_engine_died():
    snapshot = {"running": 3, "waiting": 2, "kv_usage": 0.5, "num_steps": 40,
                "recovery": {"recovering": "stage 1 died", "spares_ready": 1, "rebuilds": {"stage_died": 2}}}
    up = [True]
    text = lambda m: m.render().decode()           # noqa: E731
    metrics = ServerMetrics(lambda: snapshot, "m", 64, lambda: up[0])
    assert 'stagewise_num_requests_running{model_name="m"} 3.0' in text(metrics)
    up[0] = False
    dead = text(metrics)
    for series in ('stagewise_engine_up{model_name="m"} 0.0', 'stagewise_num_requests_running{model_name="m"} 0.0',
                   'stagewise_kv_cache_usage_ratio{model_name="m"} 0.0',
                   'stagewise_pipeline_recovering{model_name="m"} 0.0',
                   'stagewise_engine_steps_total{model_name="m"} 40.0',           # counters keep their totals
                   'stagewise_pipeline_rebuilds_total{cause="stage_died",model_name="m"} 2.0'):
        assert series in dead, series


def test_graph_replays_have_few_bucket_series_labelled_by_the_graph():
    policy = type("Policy", (), {"backend": "compiled", "buckets": (8,), "decode_backend": "off",
                                 "decode_buckets": ()})()
    stats = EngineStats(policy, [1.0], [])
    for n in range(1, 513):                        # dynamic rows: every token count is its own bucket
        stats.record_verdict(GraphVerdict("prefill", n, None), n)
    stats.record_verdict(GraphVerdict("decode", 3, None), 3)
    snapshot = {"prefill_graph": stats.prefill.snapshot(), "decode_graph": stats.decode.snapshot()}
    lines = [line for line in ServerMetrics(lambda: snapshot, "m", 64).render().decode().splitlines()
             if line.startswith("stagewise_graph_replays_total")]
    assert len(lines) <= 12, lines
    assert sum(float(line.rsplit(" ", 1)[1]) for line in lines if 'phase="prefill"' in line) == 512
    assert 'stagewise_graph_replays_total{bucket="512",model_name="m",phase="prefill"} 256.0' in lines
    assert [line for line in lines if 'phase="decode"' in line] == [
        'stagewise_graph_replays_total{bucket="4",model_name="m",phase="decode"} 1.0']


def test_server_default_and_largest_max_tokens():
    serving = object.__new__(Serving)
    serving.max_model_len, serving.kv_capacity_tokens = 512, 10_000
    serving.default_max_tokens, serving.max_tokens_limit = None, None
    assert serving.max_tokens_for(12, None, None) == 500                 # chat: the rest of the context
    serving.default_max_tokens, serving.max_tokens_limit = 64, 100
    assert serving.max_tokens_for(12, None, None) == 64
    assert serving.max_tokens_for(12, None, 16) == 64
    assert serving.max_tokens_for(12, 100, None) == 100
    with pytest.raises(Exception, match="--max-tokens-limit") as info:
        serving.max_tokens_for(12, 101, None)
    assert info.value.status == 400 and info.value.param == "max_tokens"
    serving.default_max_tokens = None
    assert serving.max_tokens_for(12, None, None) == 100                 # no default above the limit


@pytest.mark.slow
def test_an_engine_process_leaves_no_semaphore_behind(tmp_path):
    """tqdm's process lock in a spawned engine process (which exits without finalizers) made the resource
    tracker warn of a leaked semaphore at every shutdown."""
    script = tmp_path / "engine_like.py"
    script.write_text(textwrap.dedent("""
        import multiprocessing as mp, os
        def child():
            from stagewise.core.core import _thread_lock_for_progress_bars
            _thread_lock_for_progress_bars()
            from tqdm import tqdm
            for _ in tqdm(range(2)):
                pass
            os._exit(0)
        if __name__ == "__main__":
            p = mp.get_context("spawn").Process(target=child)
            p.start()
            p.join()
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "leaked semaphore" not in done.stderr, done.stderr


def test_the_cut_call_json_is_not_content_over_http(server):
    """tool_choice required cut by max_tokens: no raw JSON as content."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string"}}, "required": ["x"]}}}
    r = httpx.post(server.url + CHAT, json={"messages": MSG, "tools": [tool], "tool_choice": "required",
                                            "max_tokens": 3, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None, choice
    assert not choice["message"].get("tool_calls")                      # no call was complete
