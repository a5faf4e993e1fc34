"""Tool calls read from constrained outputs: a `tool_choice="required"` output cut by max_tokens
keeps every complete call made so far (finish `length`, `tool_calls` holding them), never the raw
JSON as content."""
from __future__ import annotations

import json
from types import SimpleNamespace

from stagewise.request import CompletionOutput, RequestOutput
from stagewise.server.formatting import ChatShape
from stagewise.server.tools import constrained_calls, final_calls

CALLS = [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}},
         {"name": "get_time", "parameters": {"zone": "CET"}}]
WHOLE = json.dumps(CALLS)
CUT = WHOLE[:WHOLE.index('"zone"') + 4]          # inside the second call's arguments


def test_a_cut_array_keeps_its_complete_calls():
    calls = constrained_calls("required", CUT)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "unit": "C"})]
    assert [c.name for c in constrained_calls("required", " [ " + WHOLE[1:])] == ["get_weather", "get_time"]
    assert constrained_calls("required", '[{"name": "get_we') == []
    assert final_calls("required", "hermes", CUT)[0] is None          # no raw JSON as content
    assert final_calls("required", "hermes", "[")[0] is None


def test_a_cut_required_call_answers_length_with_the_complete_calls():
    serving = SimpleNamespace(tok=None, tool_call_parser="hermes")
    req = SimpleNamespace(n=1, stream_options=None, logprobs=None, echo=False, return_tokens_as_token_ids=None,
                          prompt_logprobs=None, skip_special_tokens=True)
    shape = ChatShape(serving, req, [{"role": "user", "content": "hi"}], "required")
    out = RequestOutput("r", None, [], [CompletionOutput(0, CUT, [1, 2], "length")], finished=True)
    msg, reason = shape.message(out)
    assert reason == "length" and msg["content"] is None
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]
    whole = RequestOutput("r", None, [], [CompletionOutput(0, WHOLE, [1, 2], "stop")], finished=True)
    msg, reason = shape.message(whole)
    assert reason == "tool_calls" and len(msg["tool_calls"]) == 2
