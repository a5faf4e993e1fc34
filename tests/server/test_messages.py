"""Messages that said the wrong thing (issue 42, item 7): an IPv4-mapped loopback Host is loopback,
an over-long stop string is named by its index and length, a function_call item whose name is not
a string says so."""
from __future__ import annotations

import json

import pytest

from stagewise.server.errors import APIError
from stagewise.server.guard import host_name, is_loopback_name
from stagewise.server.intake import parse_request
from stagewise.server.protocol import CompletionRequest
from stagewise.server.responses import ResponsesRequest, input_messages


@pytest.mark.parametrize("host", ["[::ffff:127.0.0.1]", "[::ffff:127.0.0.1]:8000", "[::1]", "127.0.0.2:80"])
def test_ipv4_mapped_loopback_hosts_are_loopback(host):
    assert is_loopback_name(host_name(host))


@pytest.mark.parametrize("host", ["[::ffff:10.0.0.1]", "[::ffff:127.0.0.1]evil.com", "evil.com"])
def test_other_hosts_are_not(host):
    assert not is_loopback_name(host_name(host))


@pytest.mark.parametrize("stop, index, length", [(["x" * 513], 0, 513), (["a", "b" * 600], 1, 600)])
def test_a_long_stop_string_is_named_by_its_index_and_length(stop, index, length):
    with pytest.raises(APIError) as info:
        parse_request(json.dumps({"prompt": "hi", "stop": stop}).encode(), CompletionRequest)
    message = info.value.message
    assert f"stop[{index}] has {length} characters" in message and "512" in message
    assert "items" not in message and "Value error" not in message and info.value.param == "stop"


def test_a_function_call_name_that_is_not_a_string_says_so():
    req = ResponsesRequest(input=[{"type": "function_call", "name": 5, "call_id": "c1", "arguments": "{}"}])
    with pytest.raises(APIError) as info:
        input_messages(req)
    assert "must be a string" in info.value.message and "without a name" not in info.value.message
    assert info.value.param == "input.0.name"


def _refusal(kind: str, text: str) -> str:
    from stagewise.grammar.limits import GrammarLimits, GrammarRefused, check_limits
    with pytest.raises(GrammarRefused) as info:
        check_limits(kind, text, GrammarLimits())
    assert info.value.status == 400
    return str(info.value)


def _nested(levels: int, obj: bool) -> str:
    text = "{}"
    for _ in range(levels):
        text = ('{"type": "object", "properties": {"a": %s}}' if obj else '{"type": "array", "items": %s}') % text
    return text


def test_a_schema_encoded_twice_says_so():
    message = _refusal("json", json.dumps('{"type": "object"}'))
    assert "JSON string, not an object" in message and "levels deep" not in message


def test_a_schema_too_deep_to_parse_names_a_true_depth():
    message = _refusal("json", '{"const": ' + "[" * 3000 + "]" * 3000 + "}")      # past json.loads' recursion
    assert "at least 1501 levels deep" in message and "1073741824" not in message


def test_depth_counts_schema_levels_not_json_brackets():
    from stagewise.grammar.limits import GrammarLimits, check_limits
    check_limits("json", _nested(60, obj=True), GrammarLimits())                  # 60 objects: 121 brackets
    message = _refusal("json", _nested(64, obj=True))
    assert "65 levels deep" in message and "properties" in message and "--grammar-max-depth" in message


@pytest.mark.parametrize("schema, keyword", [
    ({"not": {}}, "'not' (at the root)"),
    ({"type": "object", "properties": {"a": {"if": {"type": "integer"}, "then": {"minimum": 5}}}},
     "'if' (at /properties/a)"),
    ({"type": "array", "uniqueItems": True}, "'uniqueItems'"),
    ({"allOf": [{"type": "integer"}, {"minimum": 1}]}, "'allOf' with more than one schema"),
])
def test_keywords_the_compiler_ignores_are_named(schema, keyword):
    message = _refusal("json", json.dumps(schema))
    assert keyword in message and "does not enforce" in message and message.count(". ") == 0


def test_keyword_names_used_as_property_names_or_data_are_fine():
    from stagewise.grammar.limits import GrammarLimits, check_limits
    check_limits("json", json.dumps({"type": "object", "properties": {"not": {"type": "integer"}},
                                     "default": {"uniqueItems": True}}), GrammarLimits())
    check_limits("json", json.dumps({"allOf": [{"$ref": "#/$defs/A"}], "$defs": {"A": {"type": "integer"}}}),
                 GrammarLimits())


@pytest.mark.parametrize("kind, text", [("regex", "a{2147483648}"), ("regex", "a{0,3000000000}"),
                                        ("json", json.dumps({"type": "string", "pattern": "a{3000000000}"}))])
def test_a_repetition_count_past_32_bits_is_one_sentence(kind, text):
    message = _refusal(kind, text)
    assert "repetition count of" in message and "2147483647" in message and "Check failed" not in message


def test_the_compiler_s_internal_checks_become_one_sentence():
    from stagewise.grammar.compile_child import compiler_message
    raw = RuntimeError("[16:12:08] /project/cpp/grammar_functor.cc:2469: Check failed: (lower >= 0 && (upper == -1 "
                       "|| upper >= lower)) is false: Invalid repetition range {-2147483648, -2147483648}\n")
    message = compiler_message(raw)
    assert message.startswith("The constraint's repetition range {-2147483648, -2147483648} is invalid")
    assert "Check failed" not in message and "lower >= 0" not in message
    other = compiler_message(RuntimeError("[1:2:3] /x.cc:9: Check failed: (a) is false: something odd\n"))
    assert other == "The grammar compiler rejected the constraint: something odd."


def test_a_response_format_schema_as_json_text_is_parsed():
    from stagewise.server.protocol import ChatCompletionRequest
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": '{"type": "object"}'}})
    spec, _ = req.structured_spec(req.response_format)
    assert spec is not None and spec.key == ("json", '{"type": "object"}')
